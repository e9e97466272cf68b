"""The whole path on CPU: a generated media corpus (media_util) -> ``python -m ditscale.prepare``
(tiny preset: its random VAE and UMT5) -> ``python -m ditscale.train`` (tiny preset) with
validation through the store's VAE: the store fits the model, the loss is finite, the
validation video is an MP4 decodable to the asked frames."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")
av = pytest.importorskip("av")

from ditscale import ops  # noqa: E402
from media_util import make_corpus  # noqa: E402
from train_util import env, run_train  # noqa: E402


def test_prepare_then_train_with_validation(tmp_path):
    corpus = make_corpus(tmp_path / "media", videos=6, images=3, bad=True)
    store = str(tmp_path / "store")
    proc = subprocess.run([sys.executable, "-m", "ditscale.prepare", "--input", corpus.root,
                           "--out", store, "--model", "tiny", "--shard-size", "4"],
                          env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = str(tmp_path / "run")
    args = ["--store", store, "--out", out, "--model", "tiny", "--device", "cpu", "--steps", "3",
            "--lr", "1e-3", "--warmup-steps", "0", "--checkpoint-every", "0",
            "--num-workers", "0", "--validate-every", "3", "--validation-samples", "1",
            "--validation-steps", "2", "--validation-frames", "5", "--validation-height", "32",
            "--validation-width", "48", "--no-progress",
            *([] if ops.is_available() else ["--no-fused-adaln"])]
    proc = run_train(1, args)
    assert proc.returncode == 0, proc.stderr[-5000:]
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(0 < x["loss"] < 100 for x in lines)
    video = os.path.join(out, lines[-1]["validation"][0])
    with av.open(video) as f:
        frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 48, 3)
    assert os.listdir(os.path.join(out, "checkpoints")) == ["step-000000003"]
