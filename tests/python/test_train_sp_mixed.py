"""A sequence-parallel degree per micro-batch in ``python -m ditscale.train`` (``sp_degrees``) on 4
CPU ranks (gloo): the toy store with M_mem 48 tokens, so that its 64- and 96-token samples need
degree 2 and the plan mixes degrees (step 1: a micro-batch on ranks {0, 1} together, several on
ranks 2 and 3 alone). Checked against a dense computation in this process: each step's logged
loss is the mean per-sample loss of the step's samples, and its gradient norm that of the mean
loss's gradient, at the weights before the step (fresh for step 1, the previous checkpoint
after): a wrong loss scale changes the norm, a wrong group the loss. Also an exact resume, a
resume on 2 ranks (the rest of the epoch re-planned, every sample once) and the refusals.
See docs/train.md ("Sequence parallelism per micro-batch").
"""

import os
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from ditscale import ops  # noqa: E402
from ditscale.train import parallel_mixed  # noqa: E402
from ditscale.train.config import load_config  # noqa: E402
from test_train_sp import _params  # noqa: E402
from train_util import check_ok, make_toy_store, metrics_lines, run_train  # noqa: E402

N, STEPS, SEED, SHIFT = 24, 3, 0, 3.0
TOLERANCE = 1e-5  # relative, losses and gradient norms (fp32; summation orders differ)


def _args(store, out, **extra):
    a = {"store": store, "out": out, "model": "tiny", "num-layers": 2, "device": "cpu",
         "steps": STEPS, "lr": 5e-3, "warmup-steps": 1, "m-mem-tokens": 48,
         "sp-degrees": "1,2", "checkpoint-every": 1, "keep-checkpoints": 5, "num-workers": 0,
         "shift": SHIFT, "seed": SEED, "activation-checkpointing": "every"}
    a.update(extra)
    return [f"--{k}={v}" for k, v in a.items()] + ["--no-progress", "--no-tensorboard"] + (
        [] if ops.is_available() else ["--no-fused-adaln"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_sp_mixed")
    store = make_toy_store(root / "store", n=N)
    out = str(root / "mixed")
    check_ok(run_train(4, _args(store, out)))
    return {"root": root, "store": store, "out": out}


def _dense(store, weights, ids, epoch):
    """(mean per-sample loss, norm of its gradient) over store samples ``ids`` at ``weights``
    (None: the run's initial weights), one process, each sample alone."""
    from ditscale.latent_store import LatentStore
    from ditscale.models import diffusers_wan
    from ditscale.models.training import MicroBatch, per_sample_loss
    from ditscale.train import model as model_mod
    from ditscale.train.data import StoreDataset, collate
    from ditscale.train.objective import Objective, to_device

    st = LatentStore(store)
    cfg = model_mod.model_config("tiny", 2, st.meta.max_text_tokens)
    model = diffusers_wan.build(cfg, torch.device("cpu"), seed=SEED,
                                fused_adaln=ops.is_available())
    if weights is not None:
        model.load_state_dict(weights)
    data, objective = StoreDataset(st, st.meta.max_text_tokens), Objective(SEED, SHIFT)
    losses = []
    for i in ids:
        b = collate([data[i]], objective, epoch, cfg.patch)
        mb = to_device(MicroBatch(b["x_t"], b["t"], b["text"], b["target"], b["ids"],
                                  b["tokens"]), torch.device("cpu"), torch.float32)
        losses.append(per_sample_loss(model, mb)[0])
    loss = torch.stack(losses).mean()
    loss.backward()
    norm = torch.stack([p.grad.double().pow(2).sum() for p in model.parameters()
                        if p.grad is not None]).sum().sqrt()
    return float(loss.detach()), float(norm)


def _close(a, b, tol=TOLERANCE):
    return abs(a - b) <= tol * max(abs(a), abs(b))


def test_mixed_degrees_train_the_dense_mean_loss(runs):
    lines = metrics_lines(runs["out"])
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    first = lines[0]["sp_degrees"]  # per rank, the degrees of the micro-batches it leads
    assert 2 in first[0] and first[1] == [] and set(first[2] + first[3]) == {1}, first
    for x in lines:
        led = sum(shape[0] for rank in x["shapes"] for shape in rank)  # B of each micro-batch
        assert len(x["samples"]) == len(set(x["samples"])) == led, x["step"]
        weights = None if x["step"] == 1 else _params(runs["out"], x["step"] - 1)
        loss, norm = _dense(runs["store"], weights, x["samples"], x["epoch"])
        assert _close(x["loss"], loss), (x["step"], x["loss"], loss)
        assert _close(x["grad_norm"], norm), (x["step"], x["grad_norm"], norm)


def test_mixed_resume_is_exact(runs):
    out = str(runs["root"] / "resumed")
    ck = os.path.join(runs["out"], "checkpoints", "step-000000001")
    check_ok(run_train(4, _args(runs["store"], out, resume=ck)))
    got, want = metrics_lines(out), metrics_lines(runs["out"])[1:]
    assert [x["step"] for x in got] == [2, 3]
    for a, b in zip(got, want):
        assert (a["loss"], a["grad_norm"], a["samples"], a["sp_degrees"]) == \
            (b["loss"], b["grad_norm"], b["samples"], b["sp_degrees"]), a["step"]


def test_mixed_resume_on_two_ranks_trains_the_epoch_once(runs):
    first = [x for x in metrics_lines(runs["out"]) if x["step"] <= 1]
    epoch = first[-1]["epoch"]
    out = str(runs["root"] / "two")
    ck = os.path.join(runs["out"], "checkpoints", "step-000000001")
    proc = run_train(2, _args(runs["store"], out, resume=ck, steps=20,
                              **{"checkpoint-every": 0}))
    check_ok(proc)
    assert "data-parallel world size 4 -> 2" in proc.stdout + proc.stderr
    later = metrics_lines(out)
    seen = Counter(i for x in first + later if x["epoch"] == epoch for i in x["samples"])
    assert set(seen.values()) == {1}, seen
    assert any(x["epoch"] == epoch + 1 for x in later)


def test_sp_degrees_refusals(tmp_path):
    base = ["--store", "s", "--out", "o"]
    cases = [("1,3", "sp_degrees: 3 is not a power of two in \\[1, 8\\]"),
             ("1,16", "sp_degrees: 16 is out of range \\[1, 8\\]"),
             ("1,x", "sp_degrees: 'x' is not an integer"),
             ("2,2", "sp_degrees: 2 is given twice")]
    for text, match in cases:
        with pytest.raises(ValueError, match=match):
            load_config(base + ["--sp-degrees", text])
    with pytest.raises(ValueError, match="sp_degrees and sp_degree: give one of them"):
        load_config(base + ["--sp-degrees", "1,2", "--sp-degree", "2"])
    with pytest.raises(ValueError, match="sp_degrees: needs policy 'balanced' \\(got "
                                         "'adaptive'\\)"):
        load_config(base + ["--sp-degrees", "1,2", "--policy", "adaptive"])
    assert load_config(base + ["--sp-degrees", "2,1"]).sp_degrees == "2,1"
    assert parallel_mixed.parse_degrees("2,1") == [1, 2]
    with pytest.raises(ValueError, match="sp_degrees: 4 must be at most the world size 6 and "
                                         "divide it"):
        parallel_mixed.check([1, 4], "ulysses", 6, torch.device("cpu"))
    with pytest.raises(ValueError, match="sp_degrees: 2 > 1 needs .* device meta"):
        parallel_mixed.check([1, 2], "ulysses", 4, torch.device("meta"))
    store = make_toy_store(tmp_path / "store", n=4)
    proc = run_train(1, _args(store, str(tmp_path / "out")))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("ditscale.train: error: sp_degrees: 2 must be at most the world size 1 and divide "
            "it") in proc.stderr
