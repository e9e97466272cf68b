"""The files rank 0 writes once every shard is done: manifest.csv, report.json, bad_files.csv,
and the run's summary line. Every file is written to a tmp name and renamed; none holds a time
or a rank count, so stores made by 1 and N ranks are byte-identical. Formats:
[docs/prepare.md](../../../docs/prepare.md#the-latent-store).
"""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Sequence

from ..latent_store import MANIFEST_CSV
from .discover import Bad
from .plan import Sample

REPORT_JSON = "report.json"
BAD_FILES_CSV = "bad_files.csv"


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _csv(header: Sequence[str], rows) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def write_manifest(store: str, samples: Sequence[Sample]) -> None:
    """Row i is sample id i: the probed raw values and the caption."""
    rows = ([s.item.path, s.probe.num_frames, s.probe.height, s.probe.width, s.fps_text,
             s.item.caption] for s in samples)
    _write_text(os.path.join(store, MANIFEST_CSV),
                _csv(("path", "num_frames", "height", "width", "fps", "caption"), rows))


def write_report(store: str, num_inputs: int, num_good: int, bad: Sequence[Bad]) -> dict:
    report = {"inputs": num_inputs, "good": num_good, "bad": len(bad),
              "bad_files": [{"path": b.path, "reason": b.reason} for b in bad]}
    _write_text(os.path.join(store, REPORT_JSON), json.dumps(report, indent=1) + "\n")
    _write_text(os.path.join(store, BAD_FILES_CSV),
                _csv(("path", "reason"), ((b.path, b.reason) for b in bad)))
    return report


def summary(r: dict) -> str:
    """One line of a run's result (run.prepare's dict): good/bad counts, shards (and how many
    an earlier run had finished), clips encoded and their rate (clips / the longest time a rank
    spent encoding, the encoders' loading excluded), the whole run's time."""
    rate = r["encoded"] / r["encode_seconds"] if r["encode_seconds"] > 0 else 0.0
    bad = f" (see {os.path.join(r['store'], BAD_FILES_CSV)})" if r["bad"] else ""
    return (f"prepare: {r['good']} good, {r['bad']} bad{bad}; {r['shards']} shards "
            f"({r['reused']} finished before); {r['encoded']} clips encoded in "
            f"{r['encode_seconds']:.1f} s ({rate:.2f} clips/s); {r['seconds']:.1f} s in all "
            f"-> {r['store']}")
