"""``python -m ditscale.train`` on CPU ranks (gloo) with a tiny Wan transformer on a learnable
toy store: the loss falls on 2 ranks, the metrics and TensorBoard logs, the validation video,
checkpoints (kept K); SIGKILL then resume gives the uninterrupted losses bit for bit; resume on
1 rank of a 2-rank checkpoint trains every sample of the epoch exactly once; SIGTERM saves a
checkpoint and stops."""

import os
import signal
import subprocess
import time
from collections import Counter

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

from ditscale import ops  # noqa: E402
from train_util import (check_ok, env, make_toy_store, metrics_lines, run_train,  # noqa: E402
                        train_cmd)

STEPS = 16
N = 24


def _args(store, out, **extra):
    a = {"store": store, "out": out, "model": "tiny", "num-layers": 2, "device": "cpu",
         "steps": STEPS,
         "lr": 5e-3, "warmup-steps": 1, "m-mem-tokens": 96, "checkpoint-every": 3,
         "keep-checkpoints": 3, "num-workers": 1, "ema-decay": 0.9,
         "activation-checkpointing": "every", "validate-every": STEPS,
         "validation-samples": 1, "validation-steps": 2, "validation-frames": 5,
         "validation-height": 32, "validation-width": 32, "shift": 3.0}
    a.update(extra)
    flags = [f"--{k}" if v is True else f"--no-{k}" if v is False else f"--{k}={v}"
             for k, v in a.items()]
    return flags + ["--no-progress"] + ([] if ops.is_available() else ["--no-fused-adaln"])


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    store = make_toy_store(root / "store", n=N)
    out = str(root / "full")
    check_ok(run_train(2, _args(store, out)))
    return {"root": root, "store": store, "out": out, "lines": metrics_lines(out)}


def test_two_ranks_learn_and_log(toy):
    lines, out = toy["lines"], toy["out"]
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    for x in lines:
        assert {"epoch", "loss", "lr", "tokens", "samples", "grad_norm", "tokens_per_s",
                "step_time_s", "wait_s", "compute_s", "shapes"} <= set(x)
        assert len(x["wait_s"]) == 2 and x["tokens"] > 0 and x["samples"]
        assert len(set(x["samples"])) == len(x["samples"])
        assert sum(b[0] for r in x["shapes"] for b in r) == len(x["samples"])
    loss = [x["loss"] for x in lines]
    assert sum(loss[-8:]) / 8 < 0.8 * sum(loss[:4]) / 4, loss
    assert lines[0]["lr"] == pytest.approx(5e-3)  # warm-up of one step
    assert lines[-1]["lr"] < lines[2]["lr"] < lines[1]["lr"] == 5e-3  # cosine
    assert max(x["epoch"] for x in lines) >= 1
    kept = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert kept == ["step-000000012", "step-000000015", "step-000000016"]
    video = os.path.join(out, "validation", f"step-{STEPS:09d}", "sample-0.mp4")
    assert os.path.getsize(video) > 100 and open(video, "rb").read(12)[4:8] == b"ftyp"
    assert lines[-1]["validation"] == [os.path.relpath(video, out)]
    assert any(n.startswith("events.out.tfevents") for n in
               os.listdir(os.path.join(out, "tensorboard")))


def _wait_for_step(out, step, proc, timeout_s=200):
    deadline = time.monotonic() + timeout_s
    path = os.path.join(out, "metrics.jsonl")
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it was killed"
        if os.path.isfile(path) and sum(1 for _ in open(path)) >= step:
            return
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached")


def test_sigkill_then_resume_is_bit_identical(toy):
    out = str(toy["root"] / "killed")
    proc = subprocess.Popen(train_cmd(2, _args(toy["store"], out)), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        _wait_for_step(out, 5, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # the checkpoint of step 3 is there; the kill may have left one of step 6 half-written
    assert os.path.isdir(os.path.join(out, "checkpoints", "step-000000003"))
    check_ok(run_train(2, _args(toy["store"], out)))
    got, want = metrics_lines(out), toy["lines"]
    assert [x["step"] for x in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert (a["loss"], a["grad_norm"], a["samples"], a["lr"]) == \
            (b["loss"], b["grad_norm"], b["samples"], b["lr"]), a["step"]


def test_resume_on_one_rank_trains_the_epoch_once(toy):
    """From the 2-rank checkpoint of step 12, in the middle of an epoch, on 1 rank."""
    first = [x for x in toy["lines"] if x["step"] <= 12]
    epoch = first[-1]["epoch"]
    assert toy["lines"][12]["epoch"] == epoch  # step 13 too: 12 is mid-epoch
    out = str(toy["root"] / "one")
    ck = os.path.join(toy["out"], "checkpoints", "step-000000012")
    proc = run_train(1, _args(toy["store"], out, resume=ck, steps=24, **{"validate-every": 0}))
    check_ok(proc)
    later = metrics_lines(out)
    assert later[0]["step"] == 13 and all(x["world_size"] == 1 for x in later)
    assert "world size 2 -> 1" in proc.stdout + proc.stderr
    seen = Counter(i for x in first + later if x["epoch"] == epoch for i in x["samples"])
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}, seen
    assert any(x["epoch"] == epoch + 1 for x in later)  # then a plain epoch on one rank


def test_sigterm_saves_and_stops(toy):
    out = str(toy["root"] / "term")
    proc = subprocess.Popen(train_cmd(1, _args(toy["store"], out, steps=1000,
                                               **{"checkpoint-every": 0, "validate-every": 0})),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        _wait_for_step(out, 2, proc)
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, text[-3000:]
    step = metrics_lines(out)[-1]["step"]
    assert os.listdir(os.path.join(out, "checkpoints")) == [f"step-{step:09d}"]
    assert "SIGTERM" in text
