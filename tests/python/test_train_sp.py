"""Sequence-parallel training in ``python -m ditscale.train`` (``sp_degree``) on CPU ranks (gloo):
4 ranks with sp_degree 2 (2 data-parallel groups) against 2 ranks with sp_degree 1 on the same
toy store and seed: the same samples per step, losses and gradient norms (which a wrong loss
scale would change) and final parameters within fp32 tolerance; an exact resume of the
sp_degree-2 run; a resume on 2 ranks with sp_degree 2 (1 data-parallel rank: the rest of the
epoch re-planned, strategy ring) that trains every sample of the epoch once; the refusals (range,
a degree that does not divide the world size, a device without a backward, samples of fewer
tokens than ranks).
See docs/train.md ("Sequence parallelism").
"""

import os
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from ditscale import ops  # noqa: E402
from ditscale.latent_store import LatentStore  # noqa: E402
from ditscale.train import parallel  # noqa: E402
from ditscale.train.config import load_config  # noqa: E402
from train_util import check_ok, make_toy_store, metrics_lines, run_train  # noqa: E402

N, STEPS = 24, 4
TOLERANCE = 1e-5  # relative, losses and gradient norms (fp32; summation orders differ)
# The sp run also validates at its last step (after the step's training: the comparisons hold).
VALIDATE = {"validate-every": 4, "validation-samples": 1, "validation-steps": 2,
            "validation-frames": 5, "validation-height": 32, "validation-width": 32}
PARAM_TOLERANCE = 2e-5  # absolute, parameters after STEPS AdamW steps of lr 5e-3


def _args(store, out, **extra):
    a = {"store": store, "out": out, "model": "tiny", "num-layers": 2, "device": "cpu",
         "steps": STEPS, "lr": 5e-3, "warmup-steps": 1, "m-mem-tokens": 96,
         "checkpoint-every": 2, "keep-checkpoints": 5, "num-workers": 0, "shift": 3.0,
         "activation-checkpointing": "every"}
    a.update(extra)
    flags = [f"--{k}={v}" for k, v in a.items()]
    return flags + ["--no-progress", "--no-tensorboard"] + (
        [] if ops.is_available() else ["--no-fused-adaln"])


def _params(out, step):
    """{name: tensor} of the model of the checkpoint of ``step`` (DCP read in this process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(out, f"params-{step}.pt")
    dcp_to_torch_save(os.path.join(out, "checkpoints", f"step-{step:09d}", "dcp"), path)
    return torch.load(path, weights_only=False)["model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_sp")
    store = make_toy_store(root / "store", n=N)
    dp, sp = str(root / "dp"), str(root / "sp")
    check_ok(run_train(2, _args(store, dp)))
    check_ok(run_train(4, _args(store, sp, **{"sp-degree": 2}, **VALIDATE)))
    return {"root": root, "store": store, "dp": dp, "sp": sp}


def test_sp_run_writes_its_validation_video(runs):
    """Validation generates through the parallelized transformer on every rank of a group."""
    video = os.path.join(runs["sp"], "validation", f"step-{STEPS:09d}", "sample-0.mp4")
    assert os.path.getsize(video) > 100 and open(video, "rb").read(12)[4:8] == b"ftyp"
    assert metrics_lines(runs["sp"])[-1]["validation"] == [os.path.relpath(video, runs["sp"])]


def _close(a, b, tol=TOLERANCE):
    return abs(a - b) <= tol * max(abs(a), abs(b))


def test_sp_gives_the_data_parallel_result(runs):
    dp, sp = metrics_lines(runs["dp"]), metrics_lines(runs["sp"])
    assert [x["step"] for x in sp] == list(range(1, STEPS + 1))
    for a, b in zip(sp, dp):
        assert a["samples"] == b["samples"] and a["tokens"] == b["tokens"], a["step"]
        assert (a["world_size"], a["sp_degree"], b["sp_degree"]) == (4, 2, 1)
        assert len(a["compute_s"]) == 4 and len(a["shapes"]) == len(b["shapes"]) == 2
        assert a["shapes"] == b["shapes"] and a["micro_batches"] == b["micro_batches"]
        assert _close(a["loss"], b["loss"]), (a["step"], a["loss"], b["loss"])
        assert _close(a["grad_norm"], b["grad_norm"]), (a["step"], a["grad_norm"],
                                                        b["grad_norm"])
    got, want = _params(runs["sp"], STEPS), _params(runs["dp"], STEPS)
    assert got.keys() == want.keys() and len(got) > 20
    before = _params(runs["dp"], 2)
    moved = max(float((want[k] - before[k]).abs().max()) for k in want)
    assert moved > 100 * PARAM_TOLERANCE  # the steps between do change the weights
    for k in want:
        err = float((got[k] - want[k]).abs().max())
        assert err <= PARAM_TOLERANCE, (k, err)


def test_sp_resume_is_exact(runs):
    out = str(runs["root"] / "sp-resumed")
    ck = os.path.join(runs["sp"], "checkpoints", "step-000000002")
    check_ok(run_train(4, _args(runs["store"], out, resume=ck, **{"sp-degree": 2})))
    got, want = metrics_lines(out), metrics_lines(runs["sp"])[2:]
    assert [x["step"] for x in got] == [3, 4]
    for a, b in zip(got, want):
        assert (a["loss"], a["grad_norm"], a["samples"]) == \
            (b["loss"], b["grad_norm"], b["samples"]), a["step"]


def test_resume_on_one_sp_group_trains_the_epoch_once(runs):
    """The 4-rank sp_degree-2 checkpoint of step 2 (2 data-parallel ranks) on 2 ranks with
    sp_degree 2 (1 data-parallel rank) and strategy ring: the rest of the epoch is re-planned."""
    first = [x for x in metrics_lines(runs["sp"]) if x["step"] <= 2]
    epoch = first[-1]["epoch"]
    out = str(runs["root"] / "one-group")
    ck = os.path.join(runs["sp"], "checkpoints", "step-000000002")
    proc = run_train(2, _args(runs["store"], out, resume=ck, steps=40,
                              **{"sp-degree": 2, "checkpoint-every": 0,
                                 "sp-strategy": "ring"}))
    check_ok(proc)
    assert "data-parallel world size 2 -> 1" in proc.stdout + proc.stderr
    later = metrics_lines(out)
    assert later[0]["step"] == 3 and all(len(x["shapes"]) == 1 for x in later)
    seen = Counter(i for x in first + later if x["epoch"] == epoch for i in x["samples"])
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}, seen
    assert any(x["epoch"] == epoch + 1 for x in later)


def test_sp_degree_refusals(tmp_path):
    base = ["--store", "s", "--out", "o"]
    for bad in ("0", "65"):
        with pytest.raises(ValueError, match=f"sp_degree: {bad} is out of range \\[1, 64\\]"):
            load_config(base + ["--sp-degree", bad])
    with pytest.raises(ValueError, match="sp_strategy: 'rings' is not one of ulysses"):
        load_config(base + ["--sp-strategy", "rings"])
    assert load_config(base + ["--sp-strategy", "torus"]).sp_strategy == "torus"
    with pytest.raises(ValueError, match="sp_degree: 2 does not divide the world size 3"):
        parallel.check(2, "ulysses", 3, torch.device("cpu"))
    with pytest.raises(ValueError, match="sp_degree: 2 > 1 needs .* on CPU \\(gloo\\) and "
                                         "CUDA \\(NCCL\\) tensors \\(sp_strategy 'ulysses', "
                                         "device meta\\)"):
        parallel.check(2, "ulysses", 4, torch.device("meta"))
    parallel.check(1, "ulysses", 3, torch.device("cuda"))  # no sequence parallelism: any device
    store = make_toy_store(tmp_path / "store", n=4)
    parallel.check_tokens(LatentStore(store), 16)  # the smallest sample: an image of 4 x 4 x 1
    with pytest.raises(ValueError, match="sp_degree: 17 > the 16 tokens of store sample 0 "
                                         "\\(num_frames 1, 64x64\\)"):
        parallel.check_tokens(LatentStore(store), 17)
    proc = run_train(1, _args(store, str(tmp_path / "out"), **{"sp-degree": 2}))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "ditscale.train: error: sp_degree: 2 does not divide the world size 1" in proc.stderr
