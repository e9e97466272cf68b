"""bench/diffusers/compare_peers.py on CPU: tiny Flux and Wan, 2 steps, gloo.

World size 1 (in this process: a one-rank group on a file store) makes the stock rows and their
outputs; world size 2 (torchrun, 127.0.0.1, a free port, 2 emulated machines) takes them as the
baseline, and its ditscale rows (auto, ulysses, ring, torus) and diffusers' Ulysses row must give
the 1-rank output within fp32 tolerance. The rows that cannot run on CPU say why; bad options
and a baseline of other weights are refused by name.
"""

import json
import os
import signal
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from bench.diffusers import compare_peers as cp  # noqa: E402
from bench.diffusers.compare_rows import mesh_skip  # noqa: E402
from gloo_util import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = "flux-2048,wan-480p"
COMMON = ["--device", "cpu", "--size", "tiny", "--steps", "2", "--warmup-steps", "1",
          "--cases", CASES, "--timeout-s", "60"]
TOLERANCE = 1e-5  # relative L2 of fp32 latents after 3 steps


def rows_of(path):
    with open(path) as f:
        doc = json.load(f)
    assert doc["meta"]["complete"] is True
    return {(r["case"], r["row"]): r for r in doc["rows"]}


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    out = tmp_path_factory.mktemp("w1")
    assert cp.main(COMMON + ["--strategies", "auto,ulysses", "--out-dir", str(out)]) == 0
    return out, rows_of(out / "compare-peers-1gpu.json")


def test_world1_rows(world1):
    out, rows = world1
    for case in CASES.split(","):
        stock = rows[(case, "stock")]
        assert stock["status"] == "ok" and stock["speedup"] == 1.0 and stock["rel_l2"] == 0.0
        assert (out / stock["output_file"]).is_file()
        for s in ("auto", "ulysses"):
            r = rows[(case, f"ditscale {s}")]
            assert r["status"] == "ok" and r["rel_l2"] < TOLERANCE and r["ms"] > 0
        assert rows[(case, "ditscale auto")]["auto_choice"]
        assert "ulysses_degree or ring_degree > 1" in rows[(case, "diffusers-ulysses")]["reason"]
        assert "needs a GPU" in rows[(case, "xfuser")]["reason"]
        assert rows[(case, "stock")]["peak_gib"] is None  # not measured on CPU
    md = (out / "compare-peers-1gpu.md").read_text()
    assert md.startswith("# ditscale against diffusers' context parallelism and xDiT, 1 rank(s)")
    assert "\n- command: `" in md and "\n| case | ranks | row |" in md  # the reporter's header


def _package_parent() -> str:
    """The folder this process imports ditscale from (the installed package in CI, the source
    tree with its built extensions in a developer's run): the children import the same one."""
    import ditscale
    return os.path.dirname(os.path.dirname(os.path.abspath(ditscale.__file__)))


def test_world2_emulated_matches_one_rank(world1, tmp_path):
    base, _ = world1
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "bench.diffusers.compare_peers"] + COMMON + [
        "--strategies", "auto,ulysses,ring,usp,torus", "--emulate-machines", "2",
        "--baseline-json", str(base / "compare-peers-1gpu.json"), "--out-dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([_package_parent(), ROOT,
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the 2-rank run did not finish within 150 s (killed)")
    assert proc.returncode == 0, log[-4000:]
    rows = rows_of(tmp_path / "compare-peers-2gpu-emulated2.json")
    for case in CASES.split(","):
        for row in ("ditscale auto", "ditscale ulysses", "ditscale ring", "ditscale torus",
                    "diffusers-ulysses"):
            r = rows[(case, row)]
            assert r["status"] == "ok", r
            assert r["world"] == 2 and r["machines"] == 2
            assert r["rel_l2"] < TOLERANCE and r["speedup"] > 0, r
        assert "the row 'ring'" in rows[(case, "ditscale usp")]["reason"]
        assert "return_lse" in rows[(case, "diffusers-ring")]["reason"]
        assert rows[(case, "xfuser-ulysses")]["status"] == "skipped"
    last = log.rstrip().splitlines()
    assert last[-1].startswith("| wan-480p | 2 (2 machines) | xfuser-ring | skipped")


def test_mesh_skips():
    one_machine = types.SimpleNamespace(machines=1, gpus_per_machine=2)
    two_machines = types.SimpleNamespace(machines=2, gpus_per_machine=1)
    assert "the row 'ulysses'" in mesh_skip("usp", one_machine)
    assert "the row 'ring'" in mesh_skip("swiftfusion-tas", one_machine)
    assert "on one machine" in mesh_skip("torus", one_machine)
    assert "the row 'ring'" in mesh_skip("usp", two_machines)
    assert "the row 'ulysses'" in mesh_skip("swiftfusion-tas", two_machines)
    assert mesh_skip("torus", two_machines) is None
    square = types.SimpleNamespace(machines=2, gpus_per_machine=2)
    assert all(mesh_skip(s, square) is None for s in cp.STRATEGIES)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: 0 is out of range [1, 1000]"),
    (["--blocks", "65"], "--blocks: 65 is out of range [0, 64]"),
    (["--warmup-steps", "-1"], "--warmup-steps: -1 is out of range [0, 100]"),
    (["--timeout-s", "5"], "--timeout-s: 5 is out of range [10, 3600]"),
    (["--seed", "-3"], "--seed: -3 is out of range"),
    (["--emulate-machines", "1"], "--emulate-machines: 1 is not an emulation"),
    (["--cases", "flux-8192"], "--cases: flux-8192 not in flux-2048"),
    (["--cases", ","], "--cases: empty"),
    (["--strategies", "auto,bogus"], "--strategies: bogus not in auto, ulysses"),
    (["--peers", "xdit"], "--peers: xdit not in diffusers, xfuser"),
    (["--tag", "a/b"], "--tag: 'a/b' is not of [A-Za-z0-9._-]+"),
    (["--size", "huge"], "--size: invalid choice: 'huge'"),
])
def test_bad_options(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        cp.parse(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_world_options(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        cp.parse(["--device", "cpu"])
    assert "--baseline-json: needed at world size 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cp.parse(["--device", "cpu", "--baseline-json", "x.json", "--emulate-machines", "4"])
    assert "--emulate-machines: 4 does not divide world size 2" in capsys.readouterr().err


def test_bad_baseline(tmp_path, world1):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(SystemExit, match="--baseline-json .*cannot read it as JSON"):
        cp.load_baseline(str(bad))
    (tmp_path / "rows.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="no ok 'stock' row"):
        cp.load_baseline(str(tmp_path / "rows.json"))
    base, _ = world1
    baseline = cp.load_baseline(str(base / "compare-peers-1gpu.json"))
    row = dict(baseline["flux-2048"], row="ditscale ulysses", weights_sum=1.5,
               _out=baseline["flux-2048"]["out"])
    row.pop("out")
    with pytest.raises(SystemExit, match="case flux-2048 has weights_sum .* not the same weights"):
        cp.finish_case([row], "flux-2048", types.SimpleNamespace(tag="t"), baseline)
