"""python -m ditscale.shape_bench on CPU (tiny model): the grid, the CSV that `ditscale fit` reads,
and the out-of-memory path."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_util import find_cli

torch = pytest.importorskip("torch")

from ditscale import shape_bench  # noqa: E402
from ditscale.models.wan_dit import seq_len_of  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_parse_shapes():
    assert shape_bench.parse_shapes("1x256x256, 17X480x832") == [(1, 256, 256), (17, 480, 832)]
    for bad in ["2x64x64", "1x64", "1x65x64", "axbxc", ""]:
        with pytest.raises(SystemExit):
            shape_bench.parse_shapes(bad)


def test_batch_grid():
    assert shape_bench.batch_grid(1000, 16000, 10, 1024) == [1, 2, 4, 8, 16]
    g = shape_bench.batch_grid(256, 131072, 3, 1024)
    assert g[0] == 1 and g[-1] == 512 and len(g) == 3
    assert all(b * 256 <= 131072 for b in g)
    assert shape_bench.batch_grid(256, 131072, 4, 8) == [1, 2, 4, 8]
    assert shape_bench.batch_grid(100000, 1000, 3, 1024) == [1]  # over the cap: still B = 1
    assert all(b * 75600 <= 131072 for b in shape_bench.batch_grid(75600, 131072, 3, 1024))


def test_default_shapes_are_sorted_wan_shapes():
    s = [seq_len_of(*x) for x in shape_bench.DEFAULT_SHAPES]
    assert s == sorted(s) and s[0] == 256 and s[-1] == 75600


def read_bench(path):
    """The reader rules of ditscale/balance/fit.cc: '#' and blank lines skipped, a header naming
    batch_size, seq_len, step_time_s (+ optional peak_mem_bytes, micro_batches), every row with all
    fields."""
    lines = [ln for ln in Path(path).read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    rows = list(csv.reader(lines))
    header, data = rows[0], rows[1:]
    for col in ("batch_size", "seq_len", "step_time_s", "peak_mem_bytes"):
        assert col in header
    out = []
    for r in data:
        assert len(r) == len(header)
        d = dict(zip(header, r))
        assert int(d["batch_size"]) >= 1 and int(d["seq_len"]) >= 1
        assert float(d["step_time_s"]) > 0
        assert d["peak_mem_bytes"] == "" or float(d["peak_mem_bytes"]) > 0
        assert int(d.get("micro_batches", "1")) >= 1
        out.append(d)
    return out


def run_bench(tmp_path, *extra):
    out = tmp_path / "bench.csv"
    cmd = [sys.executable, "-m", "ditscale.shape_bench", "--model", "tiny", "--num-layers", "1",
           "--device", "cpu", "--no-fused-adaln", "--warmup", "1", "--steps", "1",
           "--out", str(out), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r.stdout


def fit_json(csv_path):
    """`ditscale fit CSV --json` (the test skips without a CLI binary); its stdout."""
    cli = find_cli(["fit"], "--accept-poor-fit")
    if cli is None:
        pytest.skip("no ditscale CLI binary with `fit` to read the CSV")
    r = subprocess.run([cli, "fit", str(csv_path), "--json", "--accept-poor-fit"],
                       capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_sweep_csv_oom_and_ditscale_fit(tmp_path):
    out, stdout = run_bench(tmp_path, "--shapes", "1x64x64,5x64x64,9x64x64,9x128x128",
                            "--max-tokens", "256", "--points-per-shape", "3",
                            "--fail-above-tokens", "130", "--accum-points", "0")
    rows = read_bench(out)
    got = sorted((int(r["seq_len"]), int(r["batch_size"])) for r in rows)
    got = [(b, s) for s, b in got]
    # Passes: every shape's B = 1 first (S ascending), then the second B of each shape, ...
    assert [int(r["batch_size"]) for r in rows[:3]] == [1, 1, 1]
    # S = 16: B in {1, 4, 16}, 16*16 > 130 fails; S = 32: {1, 4, 8}, 8 fails; S = 48: {1, 2, 4},
    # 4 fails; S = 192: B = 1 fails.
    assert got == [(1, 16), (4, 16), (1, 32), (4, 32), (1, 48), (2, 48)]
    text = out.read_text()
    for b, s, f, h, w in [(16, 16, 1, 64, 64), (8, 32, 5, 64, 64), (4, 48, 9, 64, 64),
                          (1, 192, 9, 128, 128)]:
        assert f"# infeasible,{b},{s},{f},{h},{w},out-of-memory" in text
    for r in rows:
        assert int(r["world_size"]) == 1 and r["peak_mem_bytes"] == ""  # CPU: not measured
        assert r["micro_batches"] == "1"  # --accum-points 0
        assert float(r["compute_s"]) > 0 and float(r["tokens_per_s"]) > 0
        assert int(r["seq_len"]) == seq_len_of(int(r["frames"]), int(r["height"]),
                                               int(r["width"]))
    assert "[ 10/10]" in stdout and "ETA" in stdout and "out of memory" in stdout
    fit = fit_json(out)
    assert '"rows": 6' in fit


def test_manifest_shapes(tmp_path):
    model = tmp_path / "m.json"
    model.write_text('{"base": "wan2.1-1.3b", "max_frames": 9, "buckets": [[64, 64], [64, 128]]}')
    man = tmp_path / "m.csv"
    man.write_text("path,num_frames,height,width,fps\na,1,64,64,\nb,9,64,128,16\nc,33,64,64,16\n"
                   "d,1,60,64,\n")
    shapes = shape_bench.manifest_shapes(str(man), str(model), 8)
    assert shapes == [(1, 64, 64), (9, 64, 64), (9, 64, 128)]
    assert shape_bench.manifest_shapes(str(man), str(model), 2) == [(1, 64, 64), (9, 64, 128)]


def test_sweep_plan_accumulation_points():
    shapes = [(1, 64, 64), (5, 64, 64), (9, 64, 64), (9, 128, 128)]
    grids = [[1, 4, 16], [1, 4], [1], [1, 2]]
    plan = shape_bench.sweep_plan(shapes, grids, 2)
    # First pass (B = 1 of every shape), then k = 2 at the smallest and largest S, then the rest.
    assert plan[:4] == [(s, 1, 1) for s in shapes]
    assert plan[4:6] == [((1, 64, 64), 1, 2), ((9, 128, 128), 1, 2)]
    assert plan[6:] == [((1, 64, 64), 4, 1), ((5, 64, 64), 4, 1), ((9, 128, 128), 2, 1),
                        ((1, 64, 64), 16, 1)]
    assert shape_bench.sweep_plan(shapes, grids, 0) == [x for x in plan if x[2] == 1]
    assert shape_bench.accum_shapes(shapes, 1) == [(9, 64, 64)]
    assert shape_bench.accum_shapes(shapes, 9) == shapes


def test_sweep_accumulation_rows_and_fit(tmp_path):
    """Default --accum-points 2: rows with micro_batches=2 (two passes, one optimizer step) at the
    smallest and the largest S; `ditscale fit` reads the column and reports a_mb."""
    out, stdout = run_bench(tmp_path, "--shapes", "1x64x64,5x64x64,9x64x64",
                            "--max-tokens", "256", "--points-per-shape", "2")
    rows = read_bench(out)
    header = [ln for ln in out.read_text().splitlines() if not ln.startswith("#")][0]
    assert header.split(",")[:5] == ["batch_size", "seq_len", "step_time_s", "peak_mem_bytes",
                                     "micro_batches"]
    acc = [r for r in rows if r["micro_batches"] == "2"]
    assert sorted((int(r["seq_len"]), int(r["batch_size"])) for r in acc) == [(16, 1), (48, 1)]
    assert len(rows) - len(acc) == 6 and all(r["micro_batches"] in ("1", "2") for r in rows)
    for r in acc:  # tokens/s counts both micro-batches
        tps = 2 * int(r["batch_size"]) * int(r["seq_len"]) / float(r["step_time_s"])
        assert float(r["tokens_per_s"]) == pytest.approx(tps, rel=1e-3)
    assert "x2 micro-batches" in stdout and "[  8/8]" in stdout
    fit = fit_json(out)
    import json
    j = json.loads(fit)
    assert j["rows"] == 8 and j["accumulation_rows"] == 2 and j["a_mb_fitted"] is True
    assert j["power"]["a_mb"] >= 0 and j["quadratic"]["a_mb"] >= 0
