"""bench.train.bench_train dry-run on CPU at tiny size: corpus -> prepare -> three train runs ->
the report's tables and the loss plot; the synthetic dataset matches the store's ids and shapes;
bad options are refused with their name and range."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ditscale

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
ARGS = ["--model", "tiny", "--scale", "small", "--videos-480p", "3", "--videos-720p", "2",
        "--images", "3", "--frames", "9", "--jobs", "1", "--steps", str(STEPS),
        "--warmup-steps", "1", "--device", "cpu", "--hw", "cpu",
        "--train-args", "--no-fused-adaln --num-workers 1"]


# The ditscale this test imported (the installed one in CI: the source tree's python/ lacks the
# compiled modules there) and the repository root for the package `bench`. Never REPO/python: a
# rank forked later would import the source tree's ditscale.
PACKAGE_PARENT = str(Path(ditscale.__file__).resolve().parents[1])


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([PACKAGE_PARENT, str(REPO),
                                            os.environ.get("PYTHONPATH", "")]))


def _bench(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "bench.train.bench_train", *args], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench-train")
    out = work / "results"
    r = _bench([*ARGS, "--work", str(work), "--out-dir", str(out)])
    assert r.returncode == 0, r.stderr[-4000:]
    return work, out


def _table(text: str, heading: str):
    """The rows (lists of cells) of the markdown table under ``## heading``."""
    part = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in part.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def test_the_report_has_every_table(dry_run):
    work, out = dry_run
    names = sorted(p.name for p in out.iterdir())
    tag = names[0].split("_", 1)[1].rsplit(".", 1)[0]
    assert re.fullmatch(r"cpu_20\d\d-\d\d", tag), names
    assert names == [f"train-real-loss_{tag}.png", f"train-real_{tag}.md"]
    assert (out / f"train-real-loss_{tag}.png").read_bytes()[:4] == b"\x89PNG"
    text = (out / f"train-real_{tag}.md").read_text()
    assert text.startswith("# Training from real media") and "- commit: " in text
    (prep,) = _table(text, "prepare")
    assert prep[:5] == ["8", "8", "0", "1", "8"] and float(prep[6]) > 0   # clips/s
    runs = _table(text, "train throughput")
    assert [r[:4] for r in runs] == [["store-first", "store", "balanced", str(STEPS - 1)],
                                     ["store", "store", "balanced", str(STEPS - 1)],
                                     ["synthetic", "in memory", "balanced", str(STEPS - 1)],
                                     ["store-equal-token", "store", "equal-token",
                                      str(STEPS - 1)]]
    assert all(float(r[4]) > 0 and r[-1] == "-" for r in runs)   # tokens/s; no GPU memory
    assert "trained the same ids in every step: yes" in text
    ratio = float(re.search(r"store / synthetic tokens/s: \*\*([0-9.]+)%", text).group(1))
    assert ratio == pytest.approx(100 * float(runs[1][4]) / float(runs[2][4]), rel=1e-2)
    loss = _table(text, "loss: balanced vs equal-token (same seed)")
    assert [r[0] for r in loss] == [str(s) for s in range(1, STEPS + 1)]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in loss)
    assert not (work / "runs" / "store" / "checkpoints").exists()


def test_the_synthetic_data_has_the_store_ids_and_shapes(dry_run):
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench.train.synthetic import SyntheticDataset
    from ditscale.latent_store import LatentStore
    from ditscale.train.data import StoreDataset

    store = LatentStore(str(dry_run[0] / "store"))
    real = StoreDataset(store, store.meta.max_text_tokens)
    synth = SyntheticDataset(store, store.meta.max_text_tokens, seed=1)
    assert len(synth) == len(real) == 8
    for i in range(len(real)):
        a, b = real[i], synth[i]
        assert a["id"] == b["id"] == i
        for key in ("latent", "text"):
            assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype
        assert not b["text"][int((a["text"] != 0).any(1).sum()):].any()   # zero padding


@pytest.mark.parametrize("args, message", [
    (["--steps", "4", "--warmup-steps", "4"], "--warmup-steps: 4 is out of range [0, 3]"),
    (["--frames", "1"], "--frames: 1 is out of range [2, 1025]"),
    (["--videos-480p", "0", "--videos-720p", "0", "--images", "0"], "at least 1"),
])
def test_bad_options_are_refused(tmp_path, capsys, args, message):
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench.train.bench_train import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--work", str(tmp_path), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
