"""bench.diffusers.vae_decode_multi on 2 CPU ranks (torchrun, gloo) and on one rank: a row per
mode, the parallel decode equal to the stock one within float32 rounding, refused options."""

import os
import subprocess
import sys

import pytest

from bench_util import PACKAGE_PARENT, REPO, run_bench


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [PACKAGE_PARENT, str(REPO), os.environ.get("PYTHONPATH", "")]))


def _rows(path, case):
    return [[c.strip() for c in ln.split("|")] for ln in path.read_text().splitlines()
            if ln.startswith(f"| {case} |")]


def test_two_ranks_write_every_mode(tmp_path):
    pytest.importorskip("diffusers")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", "29531", "-m", "bench.diffusers.vae_decode_multi", "--cases",
           "tiny-wan", "--reps", "1", "--dtype", "fp32", "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path / "vae-decode-multi-2.md", "tiny-wan")
    assert [c[2] for c in rows] == ["stock", "tiling", "parallel"]
    assert all(c[3] == "2" for c in rows)
    assert rows[0][11] == "0.0e+00" and float(rows[2][11]) < 1e-5  # rel. error
    assert "target >= 1.8x" in rows[2][12]


def test_one_rank_without_torchrun(tmp_path):
    pytest.importorskip("diffusers")
    r = run_bench("bench.diffusers.vae_decode_multi", ["--cases", "tiny-kl", "--modes",
                  "stock,parallel", "--reps", "1", "--dtype", "fp32"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path / "vae-decode-multi-1.md", "tiny-kl")
    assert [c[2] for c in rows] == ["stock", "parallel"]
    assert rows[1][11] == "0.0e+00"  # one rank: the stock decode


@pytest.mark.parametrize("args, message", [
    (["--cases", "nope"], "--cases: 'nope' is not one of"),
    (["--modes", "fast"], "--modes: 'fast' is not one of"),
    (["--reps", "0"], "--reps: 0 is out of range [1, 100]"),
    (["--timeout-s", "5"], "--timeout-s: 5 is out of range [10, 3600]"),
])
def test_bad_options_are_refused(tmp_path, args, message):
    r = run_bench("bench.diffusers.vae_decode_multi", args, tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
