"""tools/gpu_multi.sh in its CPU dry run (DRY_RUN=1: 2 gloo ranks, the tiny cases of every part):
each step of the printed table ok and the result files of each part written with their rows.
Two calls, as the lead splits a lent machine's calls: the VAE part at N = 2; sp-train and
degrees (predicted where the ditscale CLI is found, "-" without it)."""

import os
import re
import subprocess
import sys

import pytest

from bench_util import PACKAGE_PARENT, REPO

pytest.importorskip("diffusers")
SCRIPT = REPO / "tools" / "gpu_multi.sh"


def _run(tmp_path, parts, **env):
    full = dict(os.environ, OMP_NUM_THREADS="1", DRY_RUN="1", PARTS=parts,
                OUT=str(tmp_path / "out"), LOGS=str(tmp_path / "logs"),
                WORK=str(tmp_path / "work"), PYTHON=sys.executable,
                PYTHONPATH=os.pathsep.join([PACKAGE_PARENT, str(REPO),
                                            os.environ.get("PYTHONPATH", "")]), **env)
    r = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=full, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout.split("== gpu_multi", 1)[1].split("\n== ", 1)[0]  # the steps' table
    steps = dict(re.findall(r"^\| (\S+) +\| (\S+) +\|", table, re.M))
    steps.pop("step", None)
    return steps, tmp_path / "out", r.stdout


def test_the_vae_part(tmp_path):
    steps, out, stdout = _run(tmp_path, "vae", VAE_NS="2")
    assert steps == {"vae-decode-2": "ok", "vae-summary": "ok", "vae-generate-on": "ok",
                     "vae-generate-off": "ok"}, stdout[-3000:]
    summary = (out / "vae-multi-summary.md").read_text()
    assert "| tiny-wan (stock at N=2) | 2 |" in summary
    for v in ("on", "off"):
        assert "vae decode" in (out / f"generate-vae-{v}.txt").read_text()
    logs = tmp_path / "logs"
    assert "VAE decode banded over 2 ranks" in (logs / "vae-generate-on.log").read_text()
    assert "VAE decode: stock on every rank" in (logs / "vae-generate-off.log").read_text()


def test_the_sp_train_and_degrees_parts(tmp_path):
    from bench.common import find_cli
    predicted = find_cli() is not None  # the report's prediction needs the ditscale CLI
    steps, out, stdout = _run(tmp_path, "sp-train degrees")
    assert steps == {"sp-train": "ok", "degrees-corpus": "ok", "degrees-mixed": "ok",
                     "degrees-fixed-2": "ok", "degrees-report": "ok"}, stdout[-3000:]
    text = (out / "sp-step-2.md").read_text()
    assert "| 2 | 1 x 2 | 8 |" in text and "| 1 | 2 x 1 | 8 |" in text
    assert "out of memory at 9 frames (12 tokens)" in text  # degree 1 over 8 tokens per rank
    report = (out / "sp-degrees-train-2.md").read_text()
    rows = [ln for ln in report.splitlines() if ln.startswith(("| mixed |", "| fixed-2 |"))]
    assert len(rows) == 2, report
    assert all((ln.split("|")[8].strip() != "-") == predicted for ln in rows), report
