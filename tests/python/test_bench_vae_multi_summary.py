"""bench.diffusers.vae_multi_summary: the vae-decode-multi-N.md files (bench/reporter.py's format,
vae_decode_multi's columns) into one table across N: the speed-up against the stock decode at
N = 1, the targets at 2 and 8, the per-rank peak ratio; the refusals."""

import pytest

from bench import reporter
from bench.diffusers import vae_decode_multi as vdm
from bench.diffusers import vae_multi_summary as vms
from bench_util import run_bench

# (mode, median ms, peak MiB) per N of the case "wan2.1-720p".
RUNS = {1: [("stock", 8000.0, 40000.0), ("tiling", 9000.0, 9000.0), ("parallel", 8100.0,
                                                                       40100.0)],
        2: [("stock", 8010.0, 40000.0), ("parallel", 4000.0, 20500.0)],
        8: [("stock", 7990.0, 40000.0), ("parallel", 1600.0, 5600.0)]}


def _write(folder, n, runs, case="wan2.1-720p"):
    rows = [[case, mode, n, ms, ms, ms, 2, "-", peak, "-", "1.0e-06", "-"]
            for mode, ms, peak in runs]
    (folder / f"vae-decode-multi-{n}.md").write_text(
        reporter.report("Parallel VAE decode", vdm.COLUMNS, rows))


def test_speed_up_against_stock_at_one_rank(tmp_path):
    for n, runs in RUNS.items():
        _write(tmp_path, n, runs)
    r = run_bench("bench.diffusers.vae_multi_summary", ["--dir", str(tmp_path)], tmp_path)
    assert r.returncode == 0, r.stderr
    found = vms.read_rows(str(tmp_path / "vae-multi-summary.md"))
    assert found == []  # the summary has no "mode" column: not a decode file
    rows = vms.case_rows("wan2.1-720p", vms.collect(str(tmp_path)))
    assert [(r[1], r[4], r[5]) for r in rows] == [
        (1, "0.99x", "-"), (2, "2.00x", ">= 1.8x: met"), (8, "5.00x", ">= 6.0x: not met")]
    assert rows[2][8] == "0.14" and rows[0][9] == "9000.000"  # 5600 / 40000; tiling at N = 1
    text = (tmp_path / "vae-multi-summary.md").read_text()
    assert "| wan2.1-720p | 8 | 8000.000 | 1600.000 | 5.00x | >= 6.0x: not met |" in text


def test_without_one_rank_the_smallest_n_is_the_base(tmp_path):
    _write(tmp_path, 2, RUNS[2])
    rows = vms.case_rows("wan2.1-720p", vms.collect(str(tmp_path)))
    assert rows[0][0] == "wan2.1-720p (stock at N=2)" and rows[0][4] == "2.00x"


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "has no vae-decode-multi-N.md"),
    (lambda d: (_write(d, 2, RUNS[2]), (d / "vae-decode-multi-2.md").rename(
        d / "vae-decode-multi-4.md")), "vae-decode-multi-4.md: a row of 2 ranks in the file of 4"),
])
def test_refusals(tmp_path, setup, message):
    setup(tmp_path)
    r = run_bench("bench.diffusers.vae_multi_summary", ["--dir", str(tmp_path)], tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr
