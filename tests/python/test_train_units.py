"""Units of ``ditscale.train``: the objective's shift and per-sample seeding, the schedule, the
re-plan of an epoch's rest on another world size (exactly once), checkpoint listing past a
crashed save, the step's gradient (accumulation over uneven micro-batches, two gloo ranks)
against the dense single-process gradient, and a PNG validation sample."""

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from ditscale.train import checkpoint, config as tc  # noqa: E402
from ditscale.train.objective import Objective  # noqa: E402
from ditscale.train.optim import lr_factor  # noqa: E402
from ditscale.train.segment import Segment  # noqa: E402
from gloo_util import run_gloo  # noqa: E402
from train_util import make_toy_store  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_toy_store(tmp_path_factory.mktemp("units") / "store", n=24)


def test_objective_shift_and_seeding():
    x0 = torch.randn(4, 2, 3, 5)
    for sampling in ("uniform", "logit-normal"):
        a, b = Objective(7, 3.0, sampling), Objective(7, 1.0, sampling)
        xt, sigma, target = a.noised(x0, 5, 0)
        _, u, _ = b.noised(x0, 5, 0)  # shift 1: the unshifted draw
        assert 0 < float(u) < 1
        assert float(sigma) == pytest.approx(3 * float(u) / (1 + 2 * float(u)), rel=1e-6)
        noise = target + x0
        assert torch.allclose(xt, (1 - sigma) * x0 + sigma * noise, atol=1e-6)
        again = a.noised(x0, 5, 0)
        assert torch.equal(again[0], xt) and torch.equal(again[2], target)
        assert not torch.equal(a.noised(x0, 6, 0)[2], target)  # another sample id
        assert not torch.equal(a.noised(x0, 5, 1)[2], target)  # another epoch
    mb = Objective(7).micro_batch(x0[None].repeat(2, 1, 1, 1, 1), torch.zeros(2, 8, 16),
                                  [3, 9], 0, (1, 2, 2))
    assert mb.tokens == 2 * 2 * 1 * 2 and mb.t.shape == (2,) and float(mb.t.max()) <= 1000


def test_schedule():
    assert [lr_factor(s, 4, 20, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 4, 20, 0.1) == 1.0
    assert lr_factor(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert lr_factor(12, 4, 20, 0.0) == pytest.approx(0.5)
    assert lr_factor(0, 0, 10, 0.0) == 1.0


def test_replan_on_another_world_size_is_exactly_once(store):
    from ditscale.latent_store import LatentStore

    s = LatentStore(store)
    kw = dict(model=s.shape_model, policy="balanced", seed=3, m_mem_tokens=96, tail="keep")
    two = Segment(s.manifest_path, len(s), 2, 0, 2, **kw)
    k = two.num_steps // 2
    consumed = two.consumed(k)
    trained = [i for step in range(k) for i in two.step_ids(step)]
    assert sorted(trained) == consumed.tolist()
    rest = [Segment(s.manifest_path, len(s), 2, r, 3, consumed, **kw) for r in range(3)]
    assert rest[0].num_steps == rest[2].num_steps
    later = [i for step in range(rest[0].num_steps) for i in rest[0].step_ids(step)]
    assert sorted(trained + later) == list(range(len(s)))
    for step in range(rest[0].num_steps):  # each rank's own cell is the shared plan's
        assert [rest[r].my_cell(step) for r in range(3)] == \
            [rest[0].cell(step, r) for r in range(3)]
    assert set(later).isdisjoint(consumed.tolist())
    same = Segment(s.manifest_path, len(s), 2, 1, 3, consumed, **kw)
    assert same.load_state_dict(rest[0].state_dict(1)) == 1  # the plan's fingerprint agrees
    # a rest smaller than the world size still plans (tail drop becomes keep for a rest)
    tiny = Segment(s.manifest_path, len(s), 2, 0, 2, np.arange(len(s) - 1),
                   **dict(kw, tail="drop"))
    assert tiny.num_steps == 1 and tiny.step_ids(0) == [len(s) - 1]


def test_checkpoints_past_a_crashed_save(tmp_path):
    root = tmp_path / "checkpoints"
    for name, meta in [("step-000000004", True), ("step-000000008", True),
                       (".tmp-step-000000012", True), ("step-000000010", False)]:
        (root / name).mkdir(parents=True)
        if meta:
            (root / name / "meta.json").write_text("{}")
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == \
        ["step-000000004", "step-000000008"]
    assert checkpoint.latest(str(tmp_path)).endswith("step-000000008")
    assert checkpoint.latest(str(tmp_path / "none")) is None


def _cfg(store, out, **kw):
    values = {f.name: f.default for f in tc.FIELDS}
    values.update(store=store, out=out, model="tiny", num_layers=2, device="cpu",
                  fused_adaln=False, **kw)
    return tc.finish(values)


SHAPES = {0: [(2, 2, 4, 4)], 1: [(1, 1, 2, 4), (1, 2, 4, 2)]}  # rank -> [(B, F, H, W)]


def _micro_batches(rank):
    g = torch.Generator().manual_seed(11)
    out, first = {}, 0
    for r in (0, 1):
        for b, f, h, w in SHAPES[r]:
            x0 = torch.randn(b, 4, f, h, w, generator=g)
            text = torch.randn(b, 8, 16, generator=g)
            ids = list(range(first, first + b))
            first += b
            out.setdefault(r, []).append(Objective(5).micro_batch(x0, text, ids, 0, (1, 2, 2)))
    return out if rank is None else out[rank]


def _step_on_ranks(rank, world, store, out):
    from ditscale.latent_store import LatentStore
    from ditscale.train import model as model_mod
    from ditscale.train.optim import adamw, scheduler
    from ditscale.train.step import Stepper

    cfg = _cfg(store, out, grad_clip=0.5)
    wan = model_mod.model_config("tiny", 2, LatentStore(store).meta.max_text_tokens)
    model = model_mod.build(wan, cfg, torch.device("cpu"), torch.float32)
    opt = adamw(model, cfg)
    stepper = Stepper(model, opt, scheduler(opt, cfg), None, torch.device("cpu"), wan,
                      torch.float32, cfg.grad_clip)
    res = stepper.step(_micro_batches(rank), world / 4, stop=rank == 1)
    return res.grad_norm, res.loss_sum, res.stop, len(res.shapes)


def test_step_gradient_is_the_dense_one(store, tmp_path):
    from ditscale.models import diffusers_wan
    from ditscale.models.training import per_sample_loss
    from ditscale.train import model as model_mod

    got = run_gloo(_step_on_ranks, 2, store, str(tmp_path), timeout_s=180)
    wan = model_mod.model_config("tiny", 2, 8)
    ref = diffusers_wan.build(wan, torch.device("cpu"), seed=0)
    mbs = _micro_batches(None)
    losses = [per_sample_loss(ref, mb) for r in (0, 1) for mb in mbs[r]]
    (sum(x.sum() for x in losses) / 4).backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in ref.parameters()))
    assert got[0][0] == pytest.approx(norm, rel=1e-4) and got[1][0] == got[0][0]
    assert got[0][1] == pytest.approx(float(losses[0].detach().sum()), rel=1e-5)
    assert got[0][2] and got[1][2]  # rank 1's stop request reached both ranks
    assert (got[0][3], got[1][3]) == (1, 2)


def _validate_png(rank, world, store, out):
    from ditscale.latent_store import LatentStore
    from ditscale.train import model as model_mod
    from ditscale.train.data import StoreDataset
    from ditscale.train.logs import RunLog
    from ditscale.train.validation import Validator

    cfg = _cfg(store, out, validation_frames=1, validation_height=32, validation_width=48,
               validation_steps=2, validation_samples=2, validate_every=1)
    s = LatentStore(store)
    wan = model_mod.model_config("tiny", 2, s.meta.max_text_tokens)
    model = model_mod.build(wan, cfg, torch.device("cpu"), torch.float32)
    log = RunLog(out, rank, 1, 0, True, False)
    v = Validator(cfg, s, StoreDataset(s, s.meta.max_text_tokens), torch.device("cpu"),
                  torch.float32, out)
    paths = v.run(model, 5, rank, log)
    log.close()
    return paths


def test_validation_image_is_a_png(store, tmp_path):
    from PIL import Image

    paths = run_gloo(_validate_png, 1, store, str(tmp_path), timeout_s=180)[0]
    assert paths == [f"validation/step-000000005/sample-{i}.png" for i in range(2)]
    with Image.open(tmp_path / paths[0]) as im:
        assert im.size == (48, 32)
        assert np.asarray(im).std() > 0
