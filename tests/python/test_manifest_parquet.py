"""Parquet manifests and Arrow tables (issue 22 item 3): the hostile rows of the CSV tests give the
same messages, with the row as the line; schema and file errors name the column (and its Arrow
type) or the file; the same rows as CSV, JSONL, Parquet, a pyarrow.Table or a datasets.Dataset
give the same `ditscale plan --json` (minus timing and the manifest's name) and the same sampler
batches. Files are written with pyarrow; the CLI tests skip without a built CLI."""
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ditscale
from ditscale import _core

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
from cli_util import find_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MIXED = REPO / "examples/manifests/mixed_2k.csv"
PARQUET = _core._parquet_supported()
needs_parquet = pytest.mark.skipif(not PARQUET, reason="ditscale built without Parquet support")
COLUMNS = ("path", "num_frames", "height", "width", "fps")
DIM = " is out of range \\[1, 2147483647\\]"
VIDEO = " is out of range \\[0\\.001, 1e\\+06\\] for a video"


def table(rows, types=None, names=COLUMNS):
    """A pyarrow.Table of `rows` (tuples in `names` order); types default to string, int64 x3,
    float64."""
    types = types or (pa.string(), pa.int64(), pa.int64(), pa.int64(), pa.float64())
    cols = [pa.array([r[i] for r in rows], type=t) for i, t in enumerate(types)]
    return pa.Table.from_arrays(cols, names=list(names))


def write(tmp_path, t, name="m.parquet", **kw):
    path = tmp_path / name
    pq.write_table(t, path, **kw)
    return str(path)


# (column index, Arrow type of that column, the bad value, expected message): the cases of
# ditscale/balance/manifest_test.cc and test_manifest_hostile.py that a typed column can hold.
BAD = [
    (0, pa.string(), "", r"column 'path': missing value"),
    (0, pa.string(), None, r"column 'path': missing value"),
    (1, pa.int64(), None, r"column 'num_frames': missing value"),
    (1, pa.int64(), 0, r"column 'num_frames': '0'" + DIM),
    (2, pa.int64(), -480, r"column 'height': '-480'" + DIM),
    (1, pa.float64(), 81.5, r"column 'num_frames': not an integer: '81\.5'"),
    (3, pa.float64(), float("nan"), r"column 'width': 'nan'" + DIM),
    (4, pa.float64(), float("inf"), r"column 'fps': 'inf'" + VIDEO),
    (4, pa.float64(), None, r"column 'fps': missing fps for a video \(num_frames > 1\)"),
    (4, pa.float64(), 0.0, r"column 'fps': '0'" + VIDEO),
    (4, pa.float64(), 1e39, r"column 'fps': '1e\+39'" + VIDEO),
    (4, pa.float64(), 1e-50, r"column 'fps': '1e-50'" + VIDEO),
    (1, pa.int64(), 99999999999, r"column 'num_frames': '99999999999'" + DIM),
    (1, pa.int64(), 2147483648, r"column 'num_frames': '2147483648'" + DIM),
    (2, pa.uint64(), 9223372036854775808, r"column 'height': '9223372036854775808'" + DIM),
    (4, pa.float32(), -5.0, r"column 'fps': '-5'" + VIDEO),
]


@needs_parquet
@pytest.mark.parametrize("col,typ,value,message", BAD)
def test_hostile_rows_name_the_row_and_column(tmp_path, col, typ, value, message):
    rows = [["a.mp4", 81, 8, 8, 16.0], ["b.mp4", 81, 8, 8, 16.0]]
    rows[1][col] = value
    types = [pa.string(), pa.int64(), pa.int64(), pa.int64(), pa.float64()]
    types[col] = typ
    t = table(rows, types)
    path = write(tmp_path, t)
    with pytest.raises(ditscale.Error, match="^" + re.escape(path) + ":2: " + message):
        ditscale.read_manifest(path)
    m = ditscale.read_manifest(path, skip_bad_rows=True)
    assert (m.rows_total, m.rows_skipped, list(m.ids)) == (2, 1, [0])
    assert m.skipped_examples[0].startswith(path + ":2: ")
    # The same table handed to the sampler's reader directly.
    with pytest.raises(ditscale.Error, match=r"^<pyarrow\.Table>:2: " + message):
        ditscale.sampler.read_arrow_manifest(t)


@needs_parquet
def test_an_image_may_have_no_fps_and_numbers_are_read_as_csv_reads_them(tmp_path):
    t = table([("a", 81.0, 8, 8, 23.976), ("b", 1, 8, 8, None), ("c", 1, 8, 8, 0.0)],
              (pa.large_string(), pa.float64(), pa.int8(), pa.uint16(), pa.float32()))
    m = ditscale.read_manifest(write(tmp_path, t, "m.pq"))
    assert list(m.num_frames) == [81, 1, 1]
    assert list(m.fps) == pytest.approx([23.976, 0, 0], rel=1e-6)
    d = pa.table({"path": pa.array(["a", "b"]).dictionary_encode(), "num_frames": [1, 1],
                  "height": [8, 8], "width": [8, 8], "fps": pa.array([None, None], pa.float64())})
    assert len(ditscale.read_manifest(write(tmp_path, d))) == 2


@needs_parquet
def test_schema_errors_name_the_column_and_its_arrow_type(tmp_path):
    good = [("a", 1, 8, 8, None)]
    cases = [
        (table(good, names=("path", "num_frames", "height", "width", "fps_")),
         r"m\.parquet: column 'fps': schema lacks required column"),
        (pa.Table.from_arrays([pa.array(["a"]), pa.array([1]), pa.array([8]), pa.array([8]),
                               pa.array([None], pa.float64()), pa.array([8])],
                              names=[*COLUMNS, "height"]),
         r"m\.parquet: column 'height': duplicate column in the schema"),
        (table([("a", "1", 8, 8, None)], (pa.string(), pa.string(), pa.int64(), pa.int64(),
                                          pa.float64())),
         r"m\.parquet: column 'num_frames': Arrow type string is not allowed \(expected an "
         r"integer or floating-point type"),
        (table([(b"a", 1, 8, 8, None)], (pa.binary(), pa.int64(), pa.int64(), pa.int64(),
                                         pa.float64())),
         r"m\.parquet: column 'path': Arrow type binary is not allowed"),
        (table([("a", 1, 8, 8, True)], (pa.string(), pa.int64(), pa.int64(), pa.int64(),
                                        pa.bool_())),
         r"m\.parquet: column 'fps': Arrow type bool is not allowed"),
    ]
    for t, message in cases:
        path = write(tmp_path, t)
        for skip in (False, True):  # a column's type is the file's error, skipping or not
            with pytest.raises(ditscale.Error, match=message):
                ditscale.read_manifest(path, skip_bad_rows=skip)


@needs_parquet
def test_files_that_are_not_parquet_name_the_file(tmp_path):
    good = write(tmp_path, table([("a", 1, 8, 8, None)] * 50))
    data = Path(good).read_bytes()
    for name, content in [("csv.parquet", b"path,num_frames,height,width,fps\na,1,8,8,\n"),
                          ("empty.parquet", b""), ("half.parquet", data[: len(data) // 2]),
                          ("cut.parquet", data[:-1])]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ditscale.Error, match=f"{name}: not a Parquet file, or truncated"):
            ditscale.read_manifest(str(tmp_path / name), skip_bad_rows=True)
    with pytest.raises(ditscale.Error, match="is a directory"):
        ditscale.read_manifest(str(tmp_path), format="parquet")
    with pytest.raises(ditscale.Error, match="^/dev/zero: not a regular file: a Parquet manifest "
                                             "is read from its footer"):
        ditscale.read_manifest("/dev/zero", format="parquet", skip_bad_rows=True)
    # The format option reads any name as Parquet.
    (tmp_path / "m.bin").write_bytes(data)
    assert len(ditscale.read_manifest(str(tmp_path / "m.bin"), format="parquet")) == 50


@pytest.mark.skipif(PARQUET, reason="this build reads Parquet")
def test_a_build_without_parquet_says_so(tmp_path):
    path = write(tmp_path, table([("a", 1, 8, 8, None)]))
    with pytest.raises(ditscale.Error, match="m.parquet: built without Parquet support"):
        ditscale.read_manifest(path)


# ---- the same rows in every format: the same plan and the same batches -----------------------

def mixed_rows(n=600):
    with open(MIXED, newline="") as f:
        rows = list(csv.DictReader(f))[:n]
    return [(r["path"], int(r["num_frames"]), int(r["height"]), int(r["width"]),
             float(r["fps"]) if r["fps"] else None) for r in rows]


@pytest.fixture(scope="module")
def three_formats(tmp_path_factory):
    """The first 600 rows of mixed_2k.csv (and one bad row) as CSV, JSONL and Parquet."""
    d = tmp_path_factory.mktemp("formats")
    rows = mixed_rows() + [("bad.mp4", 0, 8, 8, 30.0)]
    with open(d / "m.csv", "w") as f:
        f.write("path,num_frames,height,width,fps\n")
        for r in rows:
            f.write(f"{r[0]},{r[1]},{r[2]},{r[3]},{'' if r[4] is None else repr(r[4])}\n")
    with open(d / "m.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(dict(zip(COLUMNS, r))) + "\n")
    t = table(rows, (pa.string(), pa.int32(), pa.int32(), pa.int32(), pa.float64()))
    pq.write_table(t, d / "m.parquet", row_group_size=128)
    return {"csv": str(d / "m.csv"), "jsonl": str(d / "m.jsonl"), "parquet": str(d / "m.parquet"),
            "table": t}


CLI = find_cli(["plan"], "--skip-bad-rows")


# What differs between two runs of the same plan: the measured times and the manifest's name.
TIMING = {"timing_s", "timing_cpu_s", "plan_time_s", "plan_cpu_s", "simulate_time_s", "manifest"}


def untimed(j):
    if isinstance(j, dict):
        return {k: untimed(v) for k, v in j.items() if k not in TIMING}
    return [untimed(v) for v in j] if isinstance(j, list) else j


def plan_json(cli, manifest, batches_file):
    """`ditscale plan --json` of `manifest` without its times, and the --emit-batches bytes."""
    r = subprocess.run([cli, "plan", "--manifest", manifest, "--model", "wan2.1-1.3b",
                        "--world-size", "4", "--seed", "3", "--skip-bad-rows", "--compare",
                        "--json", "--quiet", "--emit-batches", str(batches_file)],
                       capture_output=True, text=True, timeout=120)
    if "built without Parquet support" in r.stderr and not os.environ.get("DITSCALE_CLI"):
        pytest.skip(f"{cli} was built without Parquet support")
    assert r.returncode == 0, r.stderr
    return untimed(json.loads(r.stdout)), Path(batches_file).read_bytes()


@pytest.mark.skipif(CLI is None, reason="no ditscale CLI binary of this version")
def test_cli_plans_the_same_from_csv_jsonl_and_parquet(three_formats, tmp_path):
    plans = {f: plan_json(CLI, three_formats[f], tmp_path / f"{f}.jsonl")
             for f in ("csv", "jsonl", "parquet")}
    j, emitted = plans["csv"]
    assert j["samples"] == 600 and j["skipped_rows"] == 1 and len(emitted) > 1000
    assert "epoch_time_s" in j["policies"]["balanced"]  # a prediction, kept in the comparison
    assert plans["jsonl"] == plans["csv"]
    assert plans["parquet"] == plans["csv"]


def batches(manifest, world_size=3, **kw):
    """Every rank's micro-batches of epochs 0 and 1, and the plan summary minus the source."""
    out = []
    for rank in range(world_size):
        s = ditscale.BalancedBatchSampler(manifest, rank, world_size, seed=5, skip_bad_rows=True,
                                          m_mem_tokens=200_000, **kw)
        for epoch in (0, 1):
            s.set_epoch(epoch)
            out.append([list(b) for b in s])
        summary = s.plan_summary
        summary.pop("manifest")
        # The skip reasons without "file:line: " (a CSV line counts the header, a row does not).
        summary["skipped_examples"] = [e.split(": ", 1)[1] for e in summary["skipped_examples"]]
        out.append(summary)
    return out


@needs_parquet
def test_sampler_batches_are_the_same_from_every_format(three_formats):
    want = batches(three_formats["csv"])
    assert want[0] and want[-1]["rows_skipped"] == 1
    t = three_formats["table"]
    manifest = ditscale.sampler.read_arrow_manifest(t, skip_bad_rows=True)
    for source in (three_formats["jsonl"], three_formats["parquet"], t, manifest):
        assert batches(source) == want
    # Extra columns of a table are neither read nor a problem; a RecordBatchReader (read once)
    # gives the table's rows, numbered across its batches.
    wide = t.append_column("caption", pa.array(["x"] * len(t)))
    assert batches(wide) == want
    m = ditscale.sampler.read_arrow_manifest(t.to_reader(max_chunksize=100), skip_bad_rows=True)
    assert list(m.ids) == list(manifest.ids)
    assert m.skipped_examples == ["<pyarrow.RecordBatchReader>:601: column 'num_frames': "
                                  "'0' is out of range [1, 2147483647]"]


def test_sampler_argument_errors(three_formats):
    with pytest.raises(TypeError, match="manifest: expected a path, a pyarrow.Table"):
        ditscale.BalancedBatchSampler([1, 2], 0, 1)
    with pytest.raises(ValueError, match="format='csv' applies to a manifest path"):
        ditscale.BalancedBatchSampler(three_formats["table"], 0, 1, format="csv")


def test_datasets_is_imported_only_for_a_dataset():
    code = ("import sys, pyarrow as pa, ditscale\n"
            "t = pa.table({'path': ['a'], 'num_frames': [1], 'height': [8], 'width': [8],"
            " 'fps': pa.array([None], pa.float64())})\n"
            "try:\n    ditscale.sampler.read_arrow_manifest(t)\nexcept ditscale.Error:\n    pass\n"
            "assert 'datasets' not in sys.modules, 'datasets imported'\n")
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0, r.stderr


@needs_parquet
def test_datasets_dataset_in_its_row_order(three_formats):
    datasets = pytest.importorskip("datasets")
    t = three_formats["table"]
    ds = datasets.Dataset.from_dict(t.to_pydict())
    assert batches(ds) == batches(t)
    # A shuffled view (an index mapping over the same table): rows in the view's order.
    view = ds.shuffle(seed=1)
    m = ditscale.sampler.read_arrow_manifest(view, skip_bad_rows=True)
    order = view["num_frames"]
    assert list(m.num_frames) == [f for f in order if f != 0]
    with pytest.raises(ditscale.Error, match=r"<datasets\.Dataset>:\d+: column 'num_frames'"):
        ditscale.sampler.read_arrow_manifest(view)
