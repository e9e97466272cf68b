"""ditscale.diffusers.apply_fused_adaln for WanTransformer3DModel (CPU).

Small random-weight Wan transformers (2 heads of 8, two blocks, ffn 32), batch 2, a latent of
2 x 4 x 4 (8 video tokens after the 1 x 2 x 2 patch), 5 text tokens, in three forms: Wan 2.1
T2V (one timestep per sample: temb [B, 6, D]), Wan 2.1 I2V without the cross-attention norm
(norm2 = Identity, CLIP image tokens through added K/V) and Wan 2.2 TI2V (one timestep per
token: temb [B, S, 6, D]). The patched model against the stock one on the same weights and
inputs, fp32: the output and every parameter's and input's gradient in training (no block norm
runs once patched), the output in inference, with gradient checkpointing and under the one-rank
sequence-parallel integration; in bf16 (diffusers' fp32 modules kept) the patched output is as
close to the fp32 model as the stock bf16 one; torch.compile(fullgraph=True) of a patched block
per modulation form (and diffusers' own forward compiled for a block within
COMPILED_STOCK_MAX_ROWS); the state_dict unchanged; remove() restores diffusers' forwards; the
refusals.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from ditscale import ops  # noqa: E402

if not ops.is_available():
    pytest.skip(f"ditscale ops unavailable: {ops.load_error()}", allow_module_level=True)

from test_diffusers_adaln_flux import (assert_close, assert_not_called,  # noqa: E402
                                       assert_same_state_dict, check_compiled, check_training,
                                       leaf, randomize)

BATCH, DIM, TEXT, IMAGE_TOKENS, FRAMES, SIDE = 2, 16, 5, 3, 2, 4
TOKENS = FRAMES * (SIDE // 2) ** 2  # 8 video tokens
FORMS = ("wan21_t2v", "wan21_i2v", "wan22_ti2v")


def make_model(form: str):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    i2v = form == "wan21_i2v"
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=12, freq_dim=8, ffn_dim=32, num_layers=2,
        cross_attn_norm=not i2v, image_dim=8 if i2v else None,
        added_kv_proj_dim=DIM if i2v else None, rope_max_seq_len=32)
    return randomize(model)


def make_inputs(form: str):
    g = torch.Generator().manual_seed(1)
    if form == "wan22_ti2v":  # per token, the first frame's tokens at t = 0 as TI2V's pipeline
        timestep = torch.rand(BATCH, TOKENS, generator=g) * 1000
        timestep[:, :TOKENS // FRAMES] = 0
    else:
        timestep = torch.tensor([250.0, 750.0])
    kw = dict(hidden_states=torch.randn(BATCH, 4, FRAMES, SIDE, SIDE, generator=g),
              timestep=timestep, encoder_hidden_states=torch.randn(BATCH, TEXT, 12, generator=g))
    if form == "wan21_i2v":
        kw["encoder_hidden_states_image"] = torch.randn(BATCH, IMAGE_TOKENS, 8, generator=g)
    return kw


def sample(out):
    return out.sample


def block_norms(model):
    """The blocks' FP32LayerNorms (norm_out and the image embedder's norms stay stock)."""
    return [(f"blocks.{i}.{n}", getattr(b, n)) for i, b in enumerate(model.blocks)
            for n in ("norm1", "norm2", "norm3")
            if isinstance(getattr(b, n), torch.nn.LayerNorm)]


def patched_pair(form: str):
    stock = make_model(form)
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    return stock, patched


@pytest.mark.parametrize("form", FORMS)
def test_training_output_and_every_gradient_match_stock(form):
    stock, patched = patched_pair(form)
    norms = block_norms(patched)
    assert len(norms) == (4 if form == "wan21_i2v" else 6)
    assert_not_called(norms, lambda: check_training(stock, patched, make_inputs(form), sample))


@pytest.mark.parametrize("form", FORMS)
def test_inference_matches_stock(form):
    stock, patched = patched_pair(form)
    stock.eval(), patched.eval()
    with torch.no_grad():
        assert_close(patched(**make_inputs(form)).sample, stock(**make_inputs(form)).sample,
                     "no_grad")
    with torch.inference_mode():
        assert_close(patched(**make_inputs(form)).sample, stock(**make_inputs(form)).sample,
                     "inference_mode")


def test_gradient_checkpointing_matches_stock():
    stock, patched = patched_pair("wan22_ti2v")
    stock.enable_gradient_checkpointing()
    patched.enable_gradient_checkpointing()
    check_training(stock, patched, make_inputs("wan22_ti2v"), sample)


@pytest.mark.parametrize("form", ("wan21_t2v", "wan22_ti2v"))
@pytest.mark.parametrize("order", ("parallelize_first", "fused_first"))
def test_one_rank_sequence_parallel_composes(form, order):
    from ditscale.diffusers.rotary_wan import RotaryWanAttnProcessor

    stock = make_model(form)
    if order == "parallelize_first":
        both = dd.apply_fused_adaln(dd.parallelize(copy.deepcopy(stock), strategy="ulysses"))
    else:  # the sequence-parallel processor wraps (and on one rank runs) the rotary one
        both = dd.parallelize(dd.apply_fused_adaln(copy.deepcopy(stock)), strategy="ulysses")
        assert all(type(b.attn1.processor.stock) is RotaryWanAttnProcessor for b in both.blocks)
    check_training(stock, both, make_inputs(form), sample)


def test_self_attention_rotates_with_the_op_and_remove_restores_the_processors(monkeypatch):
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from ditscale.diffusers import rotary_wan

    stock = make_model("wan21_t2v")
    patched = copy.deepcopy(stock)
    originals = [b.attn1.processor for b in patched.blocks]
    patched.set_attention_backend("native")  # a backend set before apply is carried over
    dd.apply_fused_adaln(patched)
    assert all(type(b.attn1.processor) is rotary_wan.RotaryWanAttnProcessor and
               type(b.attn2.processor) is WanAttnProcessor for b in patched.blocks)
    assert all(b.attn1.processor._attention_backend == "native" for b in patched.blocks)
    calls = []
    real = ops.rotary
    monkeypatch.setattr(ops, "rotary", lambda *a: calls.append(a[0].shape) or real(*a))
    check_training(stock, patched, make_inputs("wan21_t2v"), sample)
    assert len(calls) == 2 * len(patched.blocks)  # q and k of every block, once each
    dd.apply_fused_adaln(patched)  # twice = once: not wrapped again
    assert all(b.attn1.processor.stock is o for b, o in zip(patched.blocks, originals))
    dd.remove_fused_adaln(patched)
    assert all(b.attn1.processor is o and o._attention_backend == "native"
               for b, o in zip(patched.blocks, originals))


def test_self_attention_falls_back_to_stock_for_frequencies_the_op_does_not_take():
    from ditscale.diffusers import rotary_wan

    stock, patched = patched_pair("wan21_t2v")
    block = patched.blocks[0]
    x = torch.randn(BATCH, TOKENS, DIM)
    angles = torch.rand(1, TOKENS, 1, 8)
    for cos, sin in ((angles.cos().double(), angles.sin().double()),  # not float32
                     (angles.cos().requires_grad_(), angles.sin())):  # trainable
        assert not rotary_wan.op_applies(x, (cos, sin))
        assert torch.equal(block.attn1(x, rotary_emb=(cos, sin)),
                           stock.blocks[0].attn1(x, rotary_emb=(cos, sin)))
    cos, sin = angles.cos(), angles.sin()
    assert rotary_wan.op_applies(x, (cos, sin))
    assert torch.equal(block.attn1(x, rotary_emb=(cos, sin)),  # the op's path: the same bits
                       stock.blocks[0].attn1(x, rotary_emb=(cos, sin)))


def bf16_like_diffusers(model):
    """bf16 but for the modules diffusers keeps in fp32 (``_keep_in_fp32_modules``)."""
    dtypes = {n: t.dtype for n, t in model.state_dict(keep_vars=True).items()}
    model = model.to(torch.bfloat16)
    keep = model._keep_in_fp32_modules
    for name, t in model.state_dict(keep_vars=True).items():
        if any(k in name.split(".") for k in keep):
            t.data = t.data.to(dtypes[name])
    return model


@pytest.mark.parametrize("form", ("wan21_t2v", "wan22_ti2v"))
def test_bf16_as_close_to_fp32_as_stock(form):
    ref_model = make_model(form)
    stock = bf16_like_diffusers(copy.deepcopy(ref_model))
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    assert patched.blocks[0].norm2.weight.dtype == torch.float32
    assert patched.blocks[0].scale_shift_table.dtype == torch.float32
    kw = make_inputs(form)
    kw16 = {k: (v.bfloat16() if k != "timestep" else v) for k, v in kw.items()}
    with torch.no_grad():
        ref = ref_model(**kw).sample
        out_s, out_p = stock(**kw16).sample, patched(**kw16).sample
    assert out_p.dtype == out_s.dtype == torch.bfloat16
    err_s = float((out_s.float() - ref).norm() / ref.norm())
    err_p = float((out_p.float() - ref).norm() / ref.norm())
    assert 0 < err_s < 0.05 and err_p <= 1.25 * err_s, (err_p, err_s)


def block_args(patched, form):
    context = TEXT + (IMAGE_TOKENS if form == "wan21_i2v" else 0)
    rotary = patched.rope(torch.randn(BATCH, 4, FRAMES, SIDE, SIDE))
    temb_shape = (BATCH, TOKENS, 6, DIM) if form == "wan22_ti2v" else (BATCH, 6, DIM)
    return lambda: (leaf(BATCH, TOKENS, DIM, seed=5), leaf(BATCH, context, DIM, seed=6),
                    leaf(*temb_shape, seed=4), rotary)


@pytest.mark.parametrize("form", ("wan21_t2v", "wan22_ti2v"))
def test_compiled_block_fullgraph(form, monkeypatch):
    from ditscale.diffusers import _adaln_common

    monkeypatch.setattr(_adaln_common, "COMPILED_STOCK_MAX_ROWS", 0)  # the fused ops, compiled
    _, patched = patched_pair(form)
    check_compiled(patched.blocks[0], block_args(patched, form))


def test_compiled_small_block_runs_the_stock_forward(monkeypatch):
    """At most COMPILED_STOCK_MAX_ROWS rows: the compiled graph is diffusers' block (no fused op
    in it), above: the fused ops; eager always the fused ops."""
    from ditscale.diffusers import _adaln_common

    _, patched = patched_pair("wan21_t2v")
    block = patched.blocks[0]
    make_args = block_args(patched, "wan21_t2v")
    seen = []

    def backend(gm, example_inputs):
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    for limit, fused_in_graph in ((BATCH * TOKENS, False), (BATCH * TOKENS - 1, True)):
        monkeypatch.setattr(_adaln_common, "COMPILED_STOCK_MAX_ROWS", limit)
        torch._dynamo.reset()
        seen.clear()
        compiled = torch.compile(block, fullgraph=True, backend=backend)
        args = make_args()
        assert_close(compiled(*args), block(*args), f"limit {limit}", 1e-4)
        assert len(seen) == 1
        assert any("ditscale" in t for t in seen[0]) == fused_in_graph, sorted(seen[0])
    torch._dynamo.reset()
    check_compiled(block, make_args)  # the stock path compiled (default limit), with gradients


def test_state_dict_unchanged_and_remove_restores():
    from ditscale.diffusers import adaln_wan

    stock, patched = patched_pair("wan21_t2v")
    before = stock.state_dict()
    assert_same_state_dict(before, patched.state_dict())
    assert [n for n, _ in patched.named_modules()] == [n for n, _ in stock.named_modules()]
    patched.load_state_dict(before)  # checkpoints load either way
    dd.apply_fused_adaln(patched)  # twice = once
    adaln_wan.remove(patched)
    adaln_wan.remove(patched)  # a no-op when nothing is patched
    assert not any("forward" in m.__dict__ for m in patched.modules())
    kw = make_inputs("wan21_t2v")
    with torch.no_grad():
        assert torch.equal(patched(**kw).sample, stock(**kw).sample)


def test_refusals():
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    from ditscale.diffusers import adaln_wan
    from ditscale.diffusers._adaln_common import is_patched

    with pytest.raises(ValueError, match=r"transformer class 'Linear' is not supported; "
                                         r"supported: CogVideoX"):
        dd.apply_fused_adaln(torch.nn.Linear(2, 2))

    class Custom(WanTransformerBlock):
        pass

    model = make_model("wan21_t2v")
    model.blocks[1].__class__ = Custom
    with pytest.raises(ValueError, match=r"blocks\.1 is Custom; only diffusers' "
                                         r"WanTransformerBlock"):
        dd.apply_fused_adaln(model)
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing patched

    model = make_model("wan21_t2v")
    model.blocks[0].forward = model.blocks[0].forward  # what a forward-wrapping hook leaves
    with pytest.raises(ValueError, match=r"blocks\.0\.forward is already replaced"):
        dd.apply_fused_adaln(model)

    model = make_model("wan21_t2v")
    model.blocks[1].norm3 = torch.nn.GroupNorm(1, DIM)
    with pytest.raises(ValueError, match=r"blocks\.1\.norm3 is GroupNorm"):
        dd.apply_fused_adaln(model)
    assert not any("forward" in m.__dict__ for m in model.modules())

    model = dd.apply_fused_adaln(make_model("wan21_t2v"))
    wrapped = model.blocks[1].forward
    model.blocks[1].forward = lambda *a: wrapped(*a)
    with pytest.raises(ValueError, match=r"blocks\.1\.forward was replaced after"):
        adaln_wan.remove(model)
    assert is_patched(model.blocks[0])  # nothing removed
