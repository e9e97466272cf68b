"""ditscale.diffusers.apply_fused_adaln for CogVideoXTransformer3DModel (CPU, fp32).

A small random-weight CogVideoX (2 heads of 8, two blocks, LayerNorms with weight and bias at
eps 1e-5), batch 2, a 2-frame 4 x 6 latent with 2 x 2 patches (12 video tokens) and 5 text
tokens, with sin-cos positional embeddings and with rotary tables. The patched model against
the stock one: output and every gradient in training, inference, the one-rank
sequence-parallel integration, no stock AdaLN norm module running, torch.compile (fullgraph) of
a block and of norm_out, the state_dict, remove(), and the refusals.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from ditscale import ops  # noqa: E402

if not ops.is_available():
    pytest.skip(f"ditscale ops unavailable: {ops.load_error()}", allow_module_level=True)

from test_diffusers_adaln_flux import (assert_not_called, assert_same_state_dict,  # noqa: E402
                                       check_compiled, check_training, leaf, randomize,
                                       stock_norms)

BATCH, FRAMES, HEIGHT, WIDTH, TEXT, DIM, TEMB = 2, 2, 4, 6, 5, 16, 8
VIDEO = FRAMES * (HEIGHT // 2) * (WIDTH // 2)


def make_model(rotary=False):
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        time_embed_dim=TEMB, text_embed_dim=16, num_layers=2, sample_width=WIDTH,
        sample_height=HEIGHT, sample_frames=5, patch_size=2, max_text_seq_length=TEXT,
        use_rotary_positional_embeddings=rotary)
    return randomize(model, scale=0.2)


def make_inputs(rotary=False):
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(BATCH, FRAMES, 4, HEIGHT, WIDTH, generator=g),
                  encoder_hidden_states=torch.randn(BATCH, TEXT, 16, generator=g),
                  timestep=torch.tensor([250, 750]))
    if rotary:
        angles = torch.randn(VIDEO, 8, generator=g)
        inputs["image_rotary_emb"] = (angles.cos(), angles.sin())
    return inputs


def sample(out):
    return out.sample


def ada_norms():
    from diffusers.models.normalization import AdaLayerNorm, CogVideoXLayerNormZero

    return (AdaLayerNorm, CogVideoXLayerNormZero, torch.nn.LayerNorm)


@pytest.mark.parametrize("rotary", [False, True])
def test_training_output_and_every_gradient_match_stock(rotary):
    stock = make_model(rotary)
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    norms = [(n, m) for n, m in stock_norms(patched, ada_norms())
             if n.startswith(("transformer_blocks.", "norm_out."))]
    # per block norm1, norm1.norm, norm2, norm2.norm (the attention's q/k norms are LayerNorms
    # too, and stay: "attn1.norm_q" / "norm_k"); norm_out.norm
    norms = [(n, m) for n, m in norms if ".attn1." not in n]
    assert len(norms) == 2 * 4 + 1
    assert_not_called(norms, lambda: check_training(stock, patched, make_inputs(rotary), sample))


def test_inference_matches_stock():
    stock = make_model()
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    with torch.inference_mode():
        want, got = stock(**make_inputs()).sample, patched(**make_inputs()).sample
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-4, err


def test_one_rank_sequence_parallel_composes():
    stock = make_model(rotary=True)
    both = dd.apply_fused_adaln(dd.parallelize(copy.deepcopy(stock), strategy="ulysses"))
    check_training(stock, both, make_inputs(rotary=True), sample)


def test_state_dict_unchanged_and_remove_restores():
    from ditscale.diffusers import adaln_cogvideox

    stock = make_model()
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    assert_same_state_dict(stock.state_dict(), patched.state_dict())
    adaln_cogvideox.remove(patched)
    assert not any("forward" in m.__dict__ for m in patched.modules())
    with torch.no_grad():
        assert torch.equal(patched(**make_inputs()).sample, stock(**make_inputs()).sample)


def test_compiled_block_and_norm_out_fullgraph():
    patched = dd.apply_fused_adaln(make_model(rotary=True))
    angles = torch.randn(VIDEO, 8, generator=torch.Generator().manual_seed(9))
    rotary = (angles.cos(), angles.sin())
    check_compiled(patched.transformer_blocks[0],
                   lambda: (leaf(BATCH, VIDEO, DIM, seed=5), leaf(BATCH, TEXT, DIM, seed=6),
                            leaf(BATCH, TEMB, seed=4), rotary))
    check_compiled(patched.norm_out, lambda: (leaf(BATCH, VIDEO, DIM, seed=5), None,
                                              leaf(BATCH, TEMB, seed=4)))


def test_refusals():
    model = make_model()
    model.norm_out.chunk_dim = 0
    with pytest.raises(ValueError, match="norm_out is an AdaLayerNorm with chunk_dim=0"):
        dd.apply_fused_adaln(model)
    model = make_model()
    model.transformer_blocks[1].norm2.norm = torch.nn.GroupNorm(1, DIM)
    with pytest.raises(ValueError, match=r"transformer_blocks\.1\.norm2\.norm is GroupNorm"):
        dd.apply_fused_adaln(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
