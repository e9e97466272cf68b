"""bench.diffusers.vae_bands dry run on the CPU (tiny VAEs): the stock row, the world-size-1 row
(equal to the stock decode), a band row per N, and the refused options."""

import pytest

from bench_util import run_bench


def _run(args, tmp_path):
    return run_bench("bench.diffusers.vae_bands", args, tmp_path)


def test_dry_run_writes_every_row(tmp_path):
    pytest.importorskip("diffusers")
    r = _run(["--device", "cpu", "--cases", "tiny-wan,tiny-kl", "--ranks", "2,3",
              "--band-ranks", "0,2", "--reps", "1", "--dtype", "fp32"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    text = (tmp_path / "vae-bands.md").read_text()
    for case in ("tiny-wan", "tiny-kl"):
        rows = [ln.split("|") for ln in text.splitlines() if ln.startswith(f"| {case} |")]
        assert [c[2].strip() for c in rows] == [
            "stock", "parallelize_vae, N=1", "band at N=2", "band at N=3"]
        assert rows[1][-2].strip() == "rel. error 0.0e+00"  # one rank: the stock decode
        assert rows[2][3].strip() == "0" and rows[3][3].strip() in ("0", "2")
        assert all("of stock/N" in c[8] and "speed-up" in c[11] for c in rows[2:])


@pytest.mark.parametrize("args, message", [
    (["--cases", "nope"], "--cases: 'nope' is not one of"),
    (["--ranks", "1"], "--ranks: 1 is out of range [2, 64]"),
    (["--band-ranks", "64"], "--band-ranks: 64 is out of range [0, 63]"),
    (["--reps", "0"], "--reps: 0 is out of range [1, 100]"),
])
def test_bad_options_are_refused(tmp_path, args, message):
    r = _run(args, tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
