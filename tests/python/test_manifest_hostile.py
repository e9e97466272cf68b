"""Hostile manifests through the Python API: the same file:line errors as the C++ readers and the
CLI (field rules and limits of ditscale/balance/manifest.h), never a hang or a raw exception."""
import json

import pytest

import ditscale

HEADER = "path,num_frames,height,width,fps\n"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_bytes(text.encode())
    return str(p)


@pytest.mark.parametrize("fps, frames, message", [
    ("1e39", 81, r"column 'fps': '1e39' is out of range \[0\.001, 1e\+06\] for a video"),
    ("1e-50", 81, r"column 'fps': '1e-50' is out of range"),
    ("-5", 1, r"column 'fps': '-5' is out of range \[0, 1e\+06\]"),
])
def test_fps_rules_are_the_same_in_csv_and_jsonl(tmp_path, fps, frames, message):
    csv = write(tmp_path, "m.csv", HEADER + f"a,{frames},8,8,{fps}\n")
    with pytest.raises(ditscale.Error, match=r"m\.csv:2: " + message):
        ditscale.read_manifest(csv)
    row = f'{{"path":"a","num_frames":{frames},"height":8,"width":8,"fps":{fps}}}\n'
    jsonl = write(tmp_path, "m.jsonl", row)
    with pytest.raises(ditscale.Error, match=r"m\.jsonl:1: " + message):
        ditscale.read_manifest(jsonl)


def test_jsonl_types_duplicates_and_huge_numbers(tmp_path):
    ok = json.dumps({"path": "a", "num_frames": 1, "height": 8, "width": 8}) + "\n"
    cases = [
        ('{"path":"a","num_frames":"1","height":8,"width":8}',
         r"m\.jsonl:2: column 'num_frames': expected a number, got the string '1'"),
        ('{"path":"a","num_frames":1,"height":8,"width":8,"width":9}',
         r"m\.jsonl:2: duplicate key 'width'"),
        ('{"path":"a","num_frames":2,"height":8,"width":8,"fps":1e400}', r"m\.jsonl:2: .*1e400"),
    ]
    for row, message in cases:
        path = write(tmp_path, "m.jsonl", ok + row + "\n")
        with pytest.raises(ditscale.Error, match=message):
            ditscale.read_manifest(path)
        m = ditscale.read_manifest(path, skip_bad_rows=True)
        assert (m.rows_total, m.rows_skipped) == (2, 1)


def test_limits(tmp_path):
    for fmt in ("csv", "jsonl"):
        with pytest.raises(ditscale.Error,
                           match=r"^/dev/zero:1: line longer than the 1048576-byte limit$"):
            ditscale.read_manifest("/dev/zero", skip_bad_rows=True, format=fmt)
    with pytest.raises(ditscale.Error, match="is a directory"):
        ditscale.read_manifest(str(tmp_path))
    long_row = HEADER + "a,1,8,8,\n" + "b," + "9" * (1 << 20) + ",8,8,\n"
    with pytest.raises(ditscale.Error, match=r"m\.csv:3: line longer than"):
        ditscale.read_manifest(write(tmp_path, "m.csv", long_row), skip_bad_rows=True)
