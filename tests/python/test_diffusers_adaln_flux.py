"""ditscale.diffusers.apply_fused_adaln for FluxTransformer2DModel (CPU, fp32).

A small random-weight Flux (2 heads of 8, two double- and two single-stream blocks, guidance
embedding), batch 2, 12 image and 5 text tokens. The patched model against the stock one on the
same weights and inputs: the output and every parameter's and input's gradient in training, the
output in inference, with gradient checkpointing and under the one-rank sequence-parallel
integration, and on two gloo ranks under FSDP2 (training) and 2-rank Ulysses (inference); no
stock norm module runs once patched; torch.compile(fullgraph=True) of each
patched block kind and of norm_out; the state_dict unchanged; remove() restores diffusers'
forwards; the refusals.

The helpers of the first section are shared by the tests of the other model families
(test_diffusers_adaln_{sd3,hunyuan,cogvideox}.py import them).
"""

import copy
import itertools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from ditscale import ops  # noqa: E402

if not ops.is_available():
    pytest.skip(f"ditscale ops unavailable: {ops.load_error()}", allow_module_level=True)

TOLERANCE = 1e-4  # max |patched - stock| / max |stock| per tensor, fp32 against the fp64 CPU ops


# ---- shared helpers ------------------------------------------------------------------------------

def relative_error(out, ref, floor: float = 1e-30) -> float:
    """max |out - ref| / max(max |ref|, floor)."""
    return float((out - ref).abs().max()) / max(float(ref.abs().max()), floor)


def assert_close(out, ref, what: str, tol: float = TOLERANCE, floor: float = 1e-30) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, ref.shape)
    err = relative_error(out, ref, floor)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def randomize(model, seed: int = 0, scale: float = 0.3):
    """Every parameter drawn from N(0, scale^2) (the zero-initialised ones too), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def run_training(model, inputs, out_fn):
    """Output and gradients (by parameter name, and ``grad:<input>`` for every floating-point
    input tensor) of ``sum(out * w)`` for a fixed random w."""
    model.zero_grad(set_to_none=True)
    inputs = {k: (v.detach().clone().requires_grad_()
                  if torch.is_tensor(v) and v.is_floating_point() else v)
              for k, v in inputs.items()}
    out = out_fn(model(**inputs))
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * w).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads.update({f"grad:{k}": v.grad for k, v in inputs.items()
                  if torch.is_tensor(v) and v.requires_grad})
    return out.detach(), grads


def check_training(stock, patched, inputs, out_fn, tol: float = TOLERANCE) -> None:
    """Output and every gradient of the patched model within ``tol`` of the stock one's; a
    gradient's error is relative to its own largest entry or, for gradients that are zero but
    for rounding (attention key biases: softmax is shift-invariant), to 1e-4 of the largest
    gradient of the model."""
    out_s, grads_s = run_training(stock, inputs, out_fn)
    out_p, grads_p = run_training(patched, inputs, out_fn)
    assert_close(out_p, out_s, "output", tol)
    assert list(grads_p) == list(grads_s)
    floor = 1e-4 * max(float(g.abs().max()) for g in grads_s.values() if g is not None)
    for name, ref in grads_s.items():
        got = grads_p[name]
        if ref is None:
            assert got is None, f"{name}: stock has no gradient, patched has one"
            continue
        assert got is not None, f"{name}: no gradient in the patched model"
        assert_close(got, ref, name, tol, floor)


def stock_norms(model, classes):
    """The modules of ``model`` whose class is one of ``classes`` and whose forward is diffusers'
    own (the stock norms, which must not run once patched)."""
    return [(n, m) for n, m in model.named_modules()
            if type(m) in classes and "forward" not in m.__dict__]


def assert_not_called(modules, fn) -> None:
    """Runs ``fn()`` and fails if any (name, module) of ``modules`` was called."""
    called = []
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: called.append(n))
               for n, m in modules]
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    assert not called, f"stock modules still called: {sorted(set(called))}"


def assert_same_state_dict(before, after) -> None:
    assert list(after) == list(before)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key


def check_compiled(module, make_args, tol: float = 1e-5) -> None:
    """torch.compile(module, fullgraph=True) (aot_eager: dynamo's graph capture, the ops' fake
    kernels and their autograd) against the eager module: the outputs and the gradients of the
    module's parameters and of the floating-point inputs."""
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    results = []
    for f in (module, compiled):
        module.zero_grad(set_to_none=True)
        args = make_args()
        outs = f(*args)
        outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None]
        g = torch.Generator().manual_seed(3)
        sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        grads += [a.grad for a in args if torch.is_tensor(a) and a.requires_grad]
        results.append(([o.detach() for o in outs], grads))
    (out_e, grad_e), (out_c, grad_c) = results
    assert len(out_c) == len(out_e) and len(grad_c) == len(grad_e) and grad_e
    for i, (a, b) in enumerate(zip(out_c, out_e)):
        assert_close(a, b, f"compiled output {i}", tol)
    for i, (a, b) in enumerate(zip(grad_c, grad_e)):
        assert_close(a, b, f"compiled gradient {i}", tol)


def leaf(*shape, seed: int):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


# ---- Flux ----------------------------------------------------------------------------------------

IMAGE, TEXT, BATCH, DIM = 12, 5, 2, 16


def make_model():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
        guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    return randomize(model)


def make_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.zeros(IMAGE), torch.arange(IMAGE) // 4, torch.arange(IMAGE) % 4], 1)
    return dict(hidden_states=torch.randn(BATCH, IMAGE, 4, generator=g),
                encoder_hidden_states=torch.randn(BATCH, TEXT, 16, generator=g),
                pooled_projections=torch.randn(BATCH, 8, generator=g),
                timestep=torch.tensor([0.25, 0.75]), img_ids=ids, txt_ids=torch.zeros(TEXT, 3),
                guidance=torch.tensor([2.0, 4.0]))


def sample(out):
    return out.sample


def flux_norms():
    from diffusers.models.normalization import (AdaLayerNormContinuous, AdaLayerNormZero,
                                                AdaLayerNormZeroSingle)

    return (AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous,
            torch.nn.LayerNorm)


def patched_pair():
    stock = make_model()
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    return stock, patched


def test_training_output_and_every_gradient_match_stock():
    stock, patched = patched_pair()
    # the attention's q/k RMSNorms are diffusers' RMSNorm, not in flux_norms(): they stay
    assert_not_called(stock_norms(patched, flux_norms()),
                      lambda: check_training(stock, patched, make_inputs(), sample))


def test_inference_matches_stock():
    stock, patched = patched_pair()
    stock.eval(), patched.eval()
    with torch.no_grad():
        assert_close(patched(**make_inputs()).sample, stock(**make_inputs()).sample, "no_grad")
    with torch.inference_mode():
        assert_close(patched(**make_inputs()).sample, stock(**make_inputs()).sample,
                     "inference_mode")


def test_gradient_checkpointing_matches_stock():
    stock, patched = patched_pair()
    stock.enable_gradient_checkpointing()
    patched.enable_gradient_checkpointing()
    check_training(stock, patched, make_inputs(), sample)


@pytest.mark.parametrize("order", ("parallelize_first", "fused_first"))
def test_one_rank_sequence_parallel_composes(order):
    from ditscale.diffusers.rotary_flux import RotaryFluxAttnProcessor

    stock = make_model()
    if order == "parallelize_first":
        both = dd.apply_fused_adaln(dd.parallelize(copy.deepcopy(stock), strategy="ulysses"))
    else:  # the sequence-parallel processors wrap (and on one rank run) the rotary ones
        both = dd.parallelize(dd.apply_fused_adaln(copy.deepcopy(stock)), strategy="ulysses")
        blocks = list(both.transformer_blocks) + list(both.single_transformer_blocks)
        assert all(type(b.attn.processor.stock) is RotaryFluxAttnProcessor for b in blocks)
    check_training(stock, both, make_inputs(), sample)


def test_attention_rotates_with_the_op_bit_for_bit_and_remove_restores(monkeypatch):
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from ditscale.diffusers.rotary_flux import RotaryFluxAttnProcessor

    stock, patched = patched_pair()
    blocks = list(patched.transformer_blocks) + list(patched.single_transformer_blocks)
    originals = [b.attn.processor.stock for b in blocks]
    assert all(type(p) is FluxAttnProcessor for p in originals)
    assert all(type(b.attn.processor) is RotaryFluxAttnProcessor for b in blocks)
    calls = []
    real = ops.rotary
    monkeypatch.setattr(ops, "rotary", lambda *a: calls.append(a[0].shape) or real(*a))
    # each attention alone, stock vs patched processor, on the model's own rotary tables: the
    # same bits (FluxPosEmbed's tables hold each value twice, see rotary_flux)
    tables = stock.pos_embed(torch.cat([make_inputs()["txt_ids"], make_inputs()["img_ids"]]))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(BATCH, IMAGE, DIM, generator=g)
    c = torch.randn(BATCH, TEXT, DIM, generator=g)
    for mine, theirs in ((patched.transformer_blocks[0].attn, stock.transformer_blocks[0].attn),):
        a, b = mine(x, c, image_rotary_emb=tables), theirs(x, c, image_rotary_emb=tables)
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    joint = torch.cat([c, x], dim=1)
    mine, theirs = patched.single_transformer_blocks[0].attn, stock.single_transformer_blocks[0].attn
    assert torch.equal(mine(joint, image_rotary_emb=tables), theirs(joint, image_rotary_emb=tables))
    assert len(calls) == 4  # q and k of each attention
    check_training(stock, patched, make_inputs(), sample)
    dd.remove_fused_adaln(patched)
    assert all(b.attn.processor is p for b, p in zip(blocks, originals))


def test_state_dict_unchanged_and_remove_restores():
    from ditscale.diffusers import adaln_flux

    stock, patched = patched_pair()
    before = stock.state_dict()
    assert_same_state_dict(before, patched.state_dict())
    assert [n for n, _ in patched.named_modules()] == [n for n, _ in stock.named_modules()]
    patched.load_state_dict(before)  # checkpoints load either way
    dd.apply_fused_adaln(patched)  # twice = once
    adaln_flux.remove(patched)
    adaln_flux.remove(patched)  # a no-op when nothing is patched
    assert not any("forward" in m.__dict__ for m in patched.modules())
    with torch.no_grad():
        assert torch.equal(patched(**make_inputs()).sample, stock(**make_inputs()).sample)


def test_compiled_blocks_fullgraph():
    _, patched = patched_pair()
    temb = lambda: leaf(BATCH, DIM, seed=4)  # noqa: E731
    rotary = patched.pos_embed(torch.randn(TEXT + IMAGE, 3))
    double, single = patched.transformer_blocks[0], patched.single_transformer_blocks[0]
    check_compiled(double, lambda: (leaf(BATCH, IMAGE, DIM, seed=5), leaf(BATCH, TEXT, DIM, seed=6),
                                    temb(), rotary))
    check_compiled(single, lambda: (leaf(BATCH, IMAGE, DIM, seed=5), leaf(BATCH, TEXT, DIM, seed=6),
                                    temb(), rotary))
    check_compiled(patched.norm_out, lambda: (leaf(BATCH, IMAGE, DIM, seed=5), temb()))


def test_refusals():
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    from ditscale.diffusers import adaln_flux
    from ditscale.diffusers._adaln_common import is_patched

    class Custom(FluxTransformerBlock):
        pass

    model = make_model()
    model.transformer_blocks[1].__class__ = Custom
    with pytest.raises(ValueError, match=r"transformer_blocks\.1 is Custom"):
        dd.apply_fused_adaln(model)
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing patched

    model = make_model()
    block = model.single_transformer_blocks[0]
    block.forward = block.forward  # what a forward-wrapping hook leaves on the instance
    with pytest.raises(ValueError, match=r"single_transformer_blocks\.0\.forward is already"):
        dd.apply_fused_adaln(model)

    model = make_model()
    model.transformer_blocks[0].norm2 = torch.nn.GroupNorm(1, DIM)
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.norm2 is GroupNorm"):
        dd.apply_fused_adaln(model)

    model = dd.apply_fused_adaln(make_model())
    wrapped = model.norm_out.forward
    model.norm_out.forward = lambda *a: wrapped(*a)
    with pytest.raises(ValueError, match=r"norm_out\.forward was replaced after"):
        adaln_flux.remove(model)
    assert all(is_patched(b) for b in itertools.chain(
        model.transformer_blocks, model.single_transformer_blocks))  # nothing removed


def _two_rank_errors(rank, world):
    """On each rank, the largest relative error against the stock model: of the output and of
    every gradient for the patched model under FSDP2 (every block and the root sharded; the same
    inputs on both ranks, so the averaged gradients are the single-process ones), and of the
    output of the patched model under 2-rank Ulysses sequence parallelism (inference: the
    integration's output gather is not differentiable)."""
    from torch.distributed.fsdp import fully_shard

    from ditscale import sp

    stock = make_model()
    out_s, grads_s = run_training(stock, make_inputs(), sample)
    floor = 1e-4 * max(float(g.abs().max()) for g in grads_s.values())
    fsdp = dd.apply_fused_adaln(copy.deepcopy(stock))
    for block in list(fsdp.transformer_blocks) + list(fsdp.single_transformer_blocks):
        fully_shard(block)
    fully_shard(fsdp)
    out, grads = run_training(fsdp, make_inputs(), sample)
    errors = {"fsdp2": relative_error(out, out_s)}
    for name, ref in grads_s.items():
        got = grads[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        errors["fsdp2"] = max(errors["fsdp2"], relative_error(got, ref, floor))
    sp_model = dd.apply_fused_adaln(dd.parallelize(copy.deepcopy(stock), mesh=sp.Mesh(1, world),
                                                   strategy="ulysses"))
    with torch.no_grad():
        errors["sp"] = relative_error(sp_model(**make_inputs()).sample, out_s)
    return errors


def test_fsdp2_and_sequence_parallel_on_two_ranks():
    gloo_util = pytest.importorskip("gloo_util")
    for rank, errors in enumerate(gloo_util.run_gloo(_two_rank_errors, 2, timeout_s=240)):
        assert all(e <= TOLERANCE for e in errors.values()), (rank, errors)
