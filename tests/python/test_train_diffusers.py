"""Training diffusers' WanTransformer3DModel with ditscale's loop (--model-impl diffusers) on CPU:
the config gives ditscale's WanDiT (the same parameters, the same function with WanDiT's weights
mapped onto it), the forward adapter is the model's own call, the float32 modules stay float32 under bf16 FSDP2, bench/train/policies.py runs
and learns, two gloo ranks take the same sampler batches as the ditscale path and get the
dense model's gradient (unequal micro-batch counts, replicated float32 parameters included),
and --weights loads a local checkpoint or says clearly why it cannot."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from gloo_util import run_gloo  # noqa: E402

from ditscale.models import WanDiT, diffusers_wan, make_config  # noqa: E402
from ditscale.models.training import (  # noqa: E402
    StepRunner,
    SyntheticData,
    build_model,
    init_distributed,
    per_sample_loss,
    predict,
)

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "bench" / "train" / "policies.py"
MANIFEST = REPO / "examples" / "manifests" / "mixed_2k.csv"
CPU = torch.device("cpu")


def load_train_module():
    spec = importlib.util.spec_from_file_location("train_dit", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fused_available() -> bool:
    try:
        from ditscale import ops

        diffusers_wan.fused_adaln_function()
    except Exception:  # noqa: BLE001
        return False
    return ops.is_available()


@pytest.fixture(scope="module")
def shape_model(tmp_path_factory):
    """A ditscale model file mapping mixed_2k's rows to tiny training shapes (<= 96 tokens)."""
    p = tmp_path_factory.mktemp("shapes") / "tiny_model.json"
    p.write_text('{"base": "wan2.1-1.3b", "max_frames": 9, "target_fps": 16, '
                 '"buckets": [[64, 64], [64, 128], [128, 64]]}')
    return str(p)


@pytest.fixture
def single_process(monkeypatch):
    """The single-process path of init_distributed (no torchrun variables), undone after."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---- the model ----------------------------------------------------------------------------------

# WanDiT name -> WanTransformer3DModel name (substrings; the attention projections after).
RENAMES = [("head_modulation", "scale_shift_table"),
           ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
           ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
           ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
           ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
           ("time_projection.1.", "condition_embedder.time_proj."),
           (".modulation", ".scale_shift_table"), (".self_attn.", ".attn1."),
           (".cross_attn.", ".attn2."), (".norm3.", ".norm2."), (".ffn.0.", ".ffn.net.0.proj."),
           (".ffn.2.", ".ffn.net.2."), ("head.", "proj_out.")]
PROJECTIONS = [(".q.", ".to_q."), (".k.", ".to_k."), (".v.", ".to_v."), (".o.", ".to_out.0.")]


def wandit_to_diffusers(state, cfg):
    """WanDiT's state_dict under diffusers' names; the Linear patch embedding over (pt, ph, pw,
    C)-ordered patches becomes the Conv3d weight [D, C, pt, ph, pw]."""
    out = {}
    for name, t in state.items():
        for a, b in RENAMES:
            name = name.replace(a, b)
        if ".attn" in name:
            for a, b in PROJECTIONS:
                name = name.replace(a, b)
        if name == "patch_embedding.weight":
            t = t.view(t.shape[0], *cfg.patch, -1).permute(0, 4, 1, 2, 3)
        out[name] = t
    return out


def test_config_gives_wandits_model():
    """The diffusers model of a config has WanDiT's parameters one to one (at tiny and Wan 2.1
    1.3B dimensions) and, with WanDiT's weights mapped onto it, computes the same velocity to
    fp32 rounding (rotary split, timestep sinusoid, norms, patch order: all the same)."""
    from diffusers import WanTransformer3DModel

    for name in ("tiny", "wan2.1-1.3b"):
        cfg = make_config(name, num_layers=2)
        with torch.device("meta"):
            ours = WanDiT(cfg)
            theirs = WanTransformer3DModel(**diffusers_wan.diffusers_config(cfg))
        mapped = wandit_to_diffusers(ours.state_dict(), cfg)
        assert {k: tuple(v.shape) for k, v in mapped.items()} == \
            {k: tuple(v.shape) for k, v in theirs.state_dict().items()}, name
    cfg = make_config("tiny", num_layers=2, head_init_std=0.05)  # a non-zero output head
    torch.manual_seed(0)
    ours = WanDiT(cfg)
    theirs = diffusers_wan.build(cfg, CPU, seed=1)
    theirs.load_state_dict(wandit_to_diffusers(ours.state_dict(), cfg), strict=True)
    mb = SyntheticData(cfg, CPU, torch.float32, seed=1).micro_batch([4, 7], (3, 4, 6))
    with torch.no_grad():
        want, got = predict(ours, mb), predict(theirs, mb)
    assert want.norm() > 1 and (got - want).norm() / want.norm() < 1e-5


def test_forward_on_a_micro_batch_is_the_models_own_call():
    cfg = make_config("tiny", num_layers=2)
    model = diffusers_wan.build(cfg, CPU, seed=3)
    again = diffusers_wan.build(cfg, CPU, seed=3)
    for (n, p), q in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), f"seed 3 gave different {n}"  # same seed, same bits
    mb = SyntheticData(cfg, CPU, torch.float32, seed=1).micro_batch([4, 7], (3, 4, 6))
    with torch.no_grad():
        got = predict(model, mb)
        want = model(hidden_states=mb.x_t, timestep=mb.t, encoder_hidden_states=mb.text).sample
        loss = per_sample_loss(model, mb)
    assert got.shape == mb.target.shape == (2, cfg.in_channels, 3, 4, 6)
    assert torch.equal(got, want)
    assert torch.allclose(loss, (want - mb.target).pow(2).mean(dim=(1, 2, 3, 4)))
    with pytest.raises(ValueError, match="impl: 'flax' is not one of ditscale, diffusers"):
        build_model(cfg, CPU, fused_adaln=False, impl="flax")
    with pytest.raises(ValueError, match="needs impl 'diffusers'"):
        build_model(cfg, CPU, fused_adaln=False, weights="/tmp")


# from_pretrained(torch_dtype=bf16) keeps these float32 (a name component in
# WanTransformer3DModel._keep_in_fp32_modules), written out for the tiny 2-block model.
FP32_NAMES = {"scale_shift_table"} | {
    f"condition_embedder.time_embedder.linear_{i}.{w}" for i in (1, 2) for w in ("weight", "bias")
} | {f"blocks.{b}.{n}" for b in (0, 1)
     for n in ("scale_shift_table", "norm2.weight", "norm2.bias")}


def test_bf16_fsdp_keeps_the_fp32_modules_fp32(single_process):
    env = init_distributed("cpu", 60)
    cfg = make_config("tiny", num_layers=2)
    model, opt = build_model(cfg, env.device, fused_adaln=_fused_available(),
                             dtype=torch.bfloat16, impl="diffusers", lr=1e-3)
    runner = StepRunner(model, opt, env.device, cfg=cfg, dtype=torch.bfloat16)
    assert {id(p) for p in runner.replicated} == {
        id(p) for n, p in model.named_parameters() if "scale_shift_table" in n or "norm2" in n}
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.update(
        {n: p.dtype for n, p in model.named_parameters()}, temb=args[2].dtype))
    model.condition_embedder.time_embedder.register_forward_hook(
        lambda mod, args, out: seen.update(time_mlp=out.dtype))
    data = SyntheticData(cfg, env.device, torch.bfloat16, seed=0)
    mbs = [data.micro_batch([0, 1], (1, 4, 4)), data.micro_batch([2], (3, 2, 2))]
    losses = []
    for _ in range(4):  # the same 3 samples each step (2 micro-batches): AdamW must fit them
        st = runner.step(mbs, 1 / 3)
        assert not st.oom and st.micro_batches == 2 and math.isfinite(st.loss_sum)
        losses.append(st.loss_sum / 3)
    fp32 = {n for n, d in seen.items() if d == torch.float32}
    assert fp32 == FP32_NAMES | {"time_mlp"}
    assert seen["blocks.0.attn1.to_q.weight"] == torch.bfloat16 == seen["temb"]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    assert all(p.grad is None for p in model.parameters())  # the step's zero_grad
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


# ---- bench/train/policies.py ----------------------------------------------------------------------

def test_train_dit_diffusers_learns(shape_model, tmp_path, single_process, capsys):
    train = load_train_module()
    log = tmp_path / "log.jsonl"
    fused = [] if _fused_available() else ["--no-fused-adaln"]
    rc = train.main(["--manifest", str(MANIFEST), "--model", "tiny", "--num-layers", "2",
                     "--model-impl", "diffusers", "--shape-model", shape_model, "--device", "cpu",
                     "--dtype", "fp32", "--policy", "balanced", "--m-mem", "256", "--steps", "3",
                     "--warmup-steps", "1", "--lr", "1e-3", "--seed", "2", "--log-json", str(log),
                     *fused])
    assert rc == 0
    out = capsys.readouterr().out
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    summary = [x for x in lines if x["type"] == "summary"]
    assert len(summary) == 1 and len([x for x in lines if x["type"] == "rank_step"]) == 3
    s = summary[0]
    assert s["model_impl"] == "diffusers" and s["fused_adaln"] == (not fused)
    assert s["num_layers"] == 2 and s["timed_steps"] == 2 and s["measured"]["tokens_per_s"] > 0
    loss = s["loss"]  # other samples each step: stable, not necessarily lower (the bf16 test
    assert len(loss) == 3 and all(math.isfinite(v) and 0.5 < v < 10 for v in loss)  # fits)
    assert max(loss) < 1.2 * loss[0], loss
    assert "== summary: policy balanced, diffusers tiny x2 layers" in out


def test_shape_bench_sweeps_the_diffusers_model(tmp_path, single_process, capsys):
    """Two shapes; micro-batches over 31 tokens fail as out of memory, so the sweep also
    rebuilds the diffusers model (twice) after an abandoned step."""
    from ditscale import shape_bench

    out = tmp_path / "bench.csv"
    fused = [] if _fused_available() else ["--no-fused-adaln"]
    assert shape_bench.main(["--model", "tiny", "--num-layers", "1", "--model-impl", "diffusers",
                             "--device", "cpu", "--shapes", "1x64x64,5x64x64", "--max-tokens",
                             "32", "--points-per-shape", "2", "--accum-points", "1",
                             "--fail-above-tokens", "31", "--warmup", "1", "--steps", "1",
                             "--out", str(out), *fused]) == 0
    text = out.read_text()
    assert text.startswith("# ditscale shape benchmark: model tiny layers 1 dim 64 heads 2 ffn "
                           "128 impl diffusers\n")
    rows = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert rows[0].startswith("batch_size,seq_len,step_time_s")
    assert [r.split(",")[:2] for r in rows[1:]] == [["1", "16"]]
    assert "# infeasible,1,32,5,64,64,out-of-memory" in text
    assert "# infeasible,2,16,1,64,64,out-of-memory" in text
    assert "shape_bench: diffusers tiny" in capsys.readouterr().out


def test_fused_adaln_missing_is_said(monkeypatch, shape_model):
    monkeypatch.setitem(sys.modules, "ditscale.diffusers.adaln_wan", None)  # import fails
    with pytest.raises(RuntimeError, match="apply_fused_adaln.*--no-fused-adaln"):
        diffusers_wan.fused_adaln_function()
    train = load_train_module()
    if _ops_available():
        with pytest.raises(SystemExit, match="adaln_wan.py"):
            train.main(["--manifest", str(MANIFEST), "--model", "tiny", "--model-impl",
                        "diffusers", "--shape-model", shape_model, "--device", "cpu"])


def _ops_available() -> bool:
    from ditscale import ops

    return ops.is_available()


# ---- two gloo ranks -----------------------------------------------------------------------------

CELLS = {0: [[0, 1]], 1: [[2], [3, 4]]}  # rank -> micro-batches: 1 vs 2 micro-batches
SHAPES = {0: (2, 4, 4), 1: (2, 4, 4), 2: (2, 4, 4), 3: (1, 4, 6), 4: (1, 4, 6)}


def _params(model):
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _two_ranks(rank, world, shape_model, fused):
    """Per impl, the sampler batches train_dit's loop trained (2 steps); then, per sync mode,
    the parameters after one SGD (lr 1) step of 1 vs 2 micro-batches on the ranks."""
    train = load_train_module()
    env = init_distributed("cpu", 60)
    batches = {}
    runner_cls = train.StepRunner
    for impl in ("ditscale", "diffusers"):

        class Recording(runner_cls):
            def step(self, mbs, loss_scale, seen=batches.setdefault(impl, []), **kw):
                seen.append([list(m.sample_ids) for m in mbs])
                return super().step(mbs, loss_scale, **kw)

        train.StepRunner = Recording
        args = train.parse_args(["--manifest", str(MANIFEST), "--model", "tiny", "--num-layers",
                                 "1", "--model-impl", impl, "--shape-model", shape_model,
                                 "--device", "cpu", "--dtype", "fp32", "--m-mem", "256",
                                 "--steps", "2", "--warmup-steps", "0", "--seed", "4",
                                 *([] if fused and impl == "diffusers" else ["--no-fused-adaln"])])
        train.train(args, env, train.model_config(args))
    cfg = make_config("tiny", num_layers=2)
    data = SyntheticData(cfg, CPU, torch.float32, seed=5)
    mbs = [data.micro_batch(ids, SHAPES[ids[0]]) for ids in CELLS[rank]]
    after = {}
    for mode, fz in [("timed", False), ("native", False)] + ([("timed", True)] if fused else []):
        model, _ = build_model(cfg, CPU, fused_adaln=fz, dtype=torch.float32, seed=11,
                               impl="diffusers")
        sgd = torch.optim.SGD(model.parameters(), lr=1.0, foreach=False)
        st = StepRunner(model, sgd, CPU, sync_mode=mode, cfg=cfg).step(mbs, world / 5)
        assert not st.oom and st.micro_batches == len(CELLS[rank])
        after[(mode, fz)] = _params(model)
    return batches, after


def test_two_ranks_same_batches_and_the_dense_gradient(shape_model):
    fused = _fused_available()
    results = run_gloo(_two_ranks, 2, shape_model, fused, timeout_s=240)
    for rank, (batches, _) in enumerate(results):
        assert len(batches["ditscale"]) == 2, rank
        assert batches["diffusers"] == batches["ditscale"], rank
        assert all(ids for step in batches["ditscale"] for ids in step)
    assert results[0][0] != results[1][0]  # the ranks got different samples
    # The dense single-process reference: the gradient of the mean loss over all 5 samples.
    cfg = make_config("tiny", num_layers=2)
    ref = diffusers_wan.build(cfg, CPU, seed=11)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    data = SyntheticData(cfg, CPU, torch.float32, seed=5)
    loss = sum(per_sample_loss(ref, data.micro_batch(ids, SHAPES[ids[0]])).sum()
               for cells in CELLS.values() for ids in cells) / 5
    loss.backward()
    runs = results[0][1]
    assert set(runs) == {("timed", False), ("native", False)} | ({("timed", True)} if fused
                                                                 else set())
    for (mode, fz), params in runs.items():
        assert all(torch.equal(params[n], results[1][1][(mode, fz)][n]) for n in params)
        rtol, atol = (2e-3, 1e-6) if fz else (1e-4, 1e-7)
        for n, p in ref.named_parameters():
            delta = before[n] - params[n]  # SGD, lr 1: the gradient
            assert torch.allclose(delta, p.grad, rtol=rtol, atol=atol), \
                f"{mode} fused={fz} {n}: {(delta - p.grad).abs().max()}"
            assert delta.abs().max() > 0, f"{mode} fused={fz} {n}: no gradient"


# ---- --weights ----------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["safetensors", "sharded", "bin"])
def test_weights_load_a_local_checkpoint(tmp_path, form):
    cfg = make_config("tiny", num_layers=2)
    saved = diffusers_wan.build(cfg, CPU, seed=9)
    kw = {"sharded": dict(max_shard_size="200KB"), "bin": dict(safe_serialization=False)}
    saved.save_pretrained(tmp_path, **kw.get(form, {}))
    if form == "sharded":
        assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").is_file()
    got_cfg = diffusers_wan.checkpoint_config(str(tmp_path), make_config("tiny"))
    assert (got_cfg.dim, got_cfg.num_heads, got_cfg.ffn_dim, got_cfg.num_layers,
            got_cfg.text_dim, got_cfg.text_len) == (64, 2, 128, 2, 32, 8)
    loaded = diffusers_wan.build(got_cfg, CPU, seed=0, weights=str(tmp_path))
    assert loaded.training
    sd = saved.state_dict()
    for n, p in loaded.state_dict().items():
        assert p.dtype == sd[n].dtype and torch.equal(p, sd[n]), n


def _error(argv):
    train = load_train_module()
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    return str(e.value)


def test_weights_errors(tmp_path, shape_model):
    base = ["--manifest", str(MANIFEST), "--model", "tiny", "--shape-model", shape_model,
            "--device", "cpu", "--no-fused-adaln", "--model-impl", "diffusers", "--weights"]
    missing = tmp_path / "nowhere"
    assert "does not exist or is not a folder" in _error(base + [str(missing)])
    assert str(missing) in _error(base + [str(missing)])
    flux = tmp_path / "flux"
    flux.mkdir()
    (flux / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    assert "holds a 'FluxTransformer2DModel', not a WanTransformer3DModel" in \
        _error(base + [str(flux)])
    pipe = tmp_path / "pipe"
    (pipe / "transformer").mkdir(parents=True)
    (pipe / "transformer" / "config.json").write_text('{"_class_name": "WanTransformer3DModel"}')
    msg = _error(base + [str(pipe)])
    assert "has no config.json" in msg and "its transformer is in" in msg
    msg = _error(base + [str(pipe / "transformer")])
    assert "has no weights file: expected diffusion_pytorch_model.safetensors" in msg
    i2v = tmp_path / "i2v"
    i2v.mkdir()
    (i2v / "config.json").write_text('{"_class_name": "WanTransformer3DModel", "in_channels": '
                                     '36, "out_channels": 16, "image_dim": 1280}')
    (i2v / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    assert "out_channels 16 != in_channels 36" in _error(base + [str(i2v)])
    cfg = make_config("tiny", num_layers=2)
    good = tmp_path / "good"
    diffusers_wan.build(cfg, CPU, seed=0).save_pretrained(good)
    assert "has 2 blocks; --num-layers 3 differs" in \
        _error(base + [str(good), "--num-layers", "3"])
    with pytest.raises(SystemExit):  # argparse: --weights without --model-impl diffusers
        load_train_module().parse_args(["--manifest", "m.csv", "--weights", str(good)])
    (good / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read .*diffusion_pytorch_model.safetensors"):
        diffusers_wan.load(str(good), cfg, CPU)
