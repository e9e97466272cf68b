"""bench.train.sp_step with the tiny model on 2 CPU ranks (torchrun, gloo) and on one rank: a row
per degree (dp x sp meshes), the prediction anchored at the smallest degree, ``--longest`` stopped
by the simulated out-of-memory at each degree's own limit; the prediction's formula; refused
options."""

import os
import subprocess
import sys

import pytest

from bench_util import PACKAGE_PARENT, REPO, run_bench

pytest.importorskip("diffusers")

TINY = ["--model", "tiny", "--num-layers", "2", "--device", "cpu", "--frames", "5", "--height",
        "32", "--width", "32", "--text-tokens", "8", "--reps", "2", "--timeout-s", "60"]
LONGEST = ["--longest", "--frames-step", "4", "--max-frames", "29", "--oom-above-tokens", "12"]


def _tables(path):
    """Every markdown table of the report, each as its rows of cells (header and rule left out)."""
    tables, rows = [], None
    for ln in path.read_text().splitlines() + [""]:
        if ln.startswith("|") and rows is None:
            rows = []
        elif ln.startswith("|") and not ln.startswith("|---"):
            rows.append([c.strip() for c in ln.strip("|").split("|")])
        elif not ln.startswith("|") and rows is not None:
            tables.append(rows)
            rows = None
    return tables


def test_two_ranks_every_degree_and_the_longest(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [PACKAGE_PARENT, str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "bench.train.sp_step", *TINY, *LONGEST, "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    steps, longest = _tables(tmp_path / "sp-step-2.md")
    assert [(c[0], c[1], c[2]) for c in steps] == [("2", "1 x 2", "8"), ("1", "2 x 1", "8")]
    for c in steps:
        assert float(c[3]) > 0 and int(c[6]) == 2 and float(c[7]) > 0  # median, reps, fwd+bwd
        assert c[8] == "-" and float(c[10]) > 0  # no peak on the CPU; predicted
    assert steps[1][11] == "1.00"  # the anchor: degree 1 predicts itself
    # 12 tokens per rank: degree 1 fits 3 latent frames (12 tokens), degree 2 twice as many.
    assert [(c[0], c[1], c[3]) for c in longest] == [("2", "21", "24"), ("1", "9", "12")]
    assert longest[0][5] == "out of memory at 25 frames (28 tokens)"
    assert longest[1][5] == "out of memory at 13 frames (16 tokens)"


def test_one_rank_without_torchrun(tmp_path):
    r = run_bench("bench.train.sp_step", TINY, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (rows,) = _tables(tmp_path / "sp-step-1.md")
    assert [(c[0], c[1], c[11]) for c in rows] == [("1", "1 x 1", "1.00")]


def test_the_prediction_is_the_planner_cost():
    from bench.train import sp_predict
    comm = {1: 0.0, 2: 0.1, 4: 0.2}
    pred = sp_predict.predict({2: 1.1, 4: 0.9}, [1, 2, 4], comm, {2: 0.5})
    work = (1.1 - 0.1) * 2 * 0.5  # anchored at degree 2 with eff(2) = 0.5
    assert pred == pytest.approx({1: work, 2: 1.1, 4: work / 4 + 0.2})
    assert sp_predict.predict({}, [1, 2], comm, {}) == {}
    assert sp_predict.comm_s(1, 75600, 12, 128, 30) == 0.0
    assert 0 < sp_predict.comm_s(2, 75600, 12, 128, 30) < sp_predict.comm_s(8, 75600, 12, 128, 30)


@pytest.mark.parametrize("args, message", [
    (["--degrees", "3"], "--degrees: 3 does not divide the world size 1"),
    (["--degrees", "0"], "--degrees: 0 is out of range [1, 64]"),
    (["--frames", "6"], "--frames: 6 is not 4k + 1"),
    (["--height", "40"], "--height: 40 is not a multiple of 16"),
    (["--frames-step", "6"], "--frames-step: 6 is not a multiple of 4"),
    (["--reps", "0"], "--reps: 0 is out of range [1, 100]"),
    (["--model", "big"], "invalid choice: 'big'"),
])
def test_bad_options_are_refused(tmp_path, args, message):
    r = run_bench("bench.train.sp_step", [*TINY, *args], tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]


def test_a_degree_that_does_not_fit_is_reported_and_the_next_one_anchors(tmp_path):
    """6 tokens per rank: the 8-token clip fits at degree 2 only; degree 1 is out of memory on
    both ranks in its first step (no hang), its --longest not searched."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [PACKAGE_PARENT, str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "bench.train.sp_step", *TINY, "--longest", "--max-frames", "9",
           "--frames-step", "4", "--oom-above-tokens", "6", "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    steps, longest = _tables(tmp_path / "sp-step-2.md")
    assert [(c[0], c[3], c[11], c[12]) for c in steps] == [
        ("2", steps[0][3], "1.00", "-"), ("1", "-", "-", "out of memory")]
    assert float(steps[1][10]) > 0  # predicted from degree 2
    assert longest[1] == ["1", "none", "-", "-", "-", "out of memory at 5 frames", "0"]
    assert (longest[0][:2], longest[0][5]) == (["2", "9"], "--max-frames 9")  # 12 tokens: 6 a rank


def test_eff_is_read_at_the_nearest_token_count(tmp_path):
    from bench.train import sp_predict
    path = tmp_path / "eff.json"
    path.write_text('{"wan2.1-1.3b": {"2": {"32760": 0.9, "75600": 1.01}, "4": {"8190": 0.4}}}')
    assert sp_predict.read_eff(str(path), "wan2.1-1.3b", 70000) == {2: 1.01, 4: 0.4}
    assert sp_predict.read_eff(str(path), "wan2.1-14b", 70000) == {}
    assert sp_predict.read_eff(None, "wan2.1-1.3b", 70000) == {}
    path.write_text('{"wan2.1-1.3b": {"2": {"75600": 7}}}')
    with pytest.raises(ValueError, match=r"eff\(2\) = 7.0 of wan2.1-1.3b is outside"):
        sp_predict.read_eff(str(path), "wan2.1-1.3b", 75600)
