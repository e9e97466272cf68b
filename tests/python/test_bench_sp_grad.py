"""bench.sp.grad_share dry run on the CPU (tiny shapes): the report's rows (degree 1: the op and
SDPA; per degree, one rank's recomputing backward share and its own backward's, Ulysses and
ring) and the refused options."""

import re

import pytest

from bench_util import run_bench


def _run(args, tmp_path):
    return run_bench("bench.sp.grad_share", args, tmp_path)


def test_dry_run_writes_every_row(tmp_path):
    pytest.importorskip("torch")
    r = _run(["--device", "cpu", "--shapes", "tiny:129", "--degrees", "2,4", "--reps", "2"],
             tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    text = (tmp_path / "sp-grad-share.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| tiny |")]
    assert [ln.split("|")[3].strip() for ln in rows] == [
        "sp.attention fwd+bwd", "SDPA fwd+bwd",
        "backward share, d=2 (2 heads)", "own backward share, d=2, ulysses",
        "own backward share, d=2, ring",
        "backward share, d=4 (1 heads)", "own backward share, d=4, ulysses",
        "own backward share, d=4, ring"]
    assert re.search(r"[+-]\d+\.\d\d% \(paired rounds\)", rows[0])
    assert all(re.search(r"\d+\.\d\dx ideal", ln) for ln in (rows[2], rows[5]))
    assert all(re.search(r"\d+\.\d\dx recompute share", ln)
               for ln in rows[3:5] + rows[6:])


@pytest.mark.parametrize("args, message", [
    (["--shapes", "nope:10"], "--shapes: 'nope' is not one of"),
    (["--shapes", "tiny:0"], "--shapes tokens: 0 is out of range [1, 1048576]"),
    (["--degrees", "1"], "--degrees: 1 is out of range [2, 64]"),
])
def test_bad_options_are_refused(tmp_path, args, message):
    r = _run(args, tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
