"""ditscale.diffusers.apply_fused_adaln for SD3Transformer2DModel (CPU, fp32).

A small random-weight SD3 (2 heads of 8, two blocks, RMS q/k norms), batch 2, an 8 x 6 latent
with 2 x 2 patches (12 image tokens) and 5 text tokens. The second (last) block is
``context_pre_only``; the SD 3.5 dual attention on block 0 or on block 1, so every combination
of the two forms is covered. The patched model against the stock one: output and every gradient
in training (also with feed-forward chunking), inference, the one-rank sequence-parallel
integration, no stock AdaLN norm module running, torch.compile (fullgraph) of both block forms,
the state_dict, remove(), and the refusals.
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

BATCH, IMAGE, TEXT, DIM = 2, 12, 5, 16
DUAL = [(0,), (1,)]


def make_model(dual=(0,)):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=DIM,
        pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8,
        dual_attention_layers=dual, qk_norm="rms_norm")
    return randomize(model, scale=0.2)


def make_inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(BATCH, 4, 8, 6, generator=g),
                encoder_hidden_states=torch.randn(BATCH, TEXT, 16, generator=g),
                pooled_projections=torch.randn(BATCH, 8, generator=g),
                timestep=torch.tensor([250, 750]))


def sample(out):
    return out.sample


def ada_norms():
    from diffusers.models.normalization import (AdaLayerNormContinuous, AdaLayerNormZero,
                                                SD35AdaLayerNormZeroX)

    return (AdaLayerNormZero, SD35AdaLayerNormZeroX, AdaLayerNormContinuous, torch.nn.LayerNorm)


@pytest.mark.parametrize("dual", DUAL)
def test_training_output_and_every_gradient_match_stock(dual):
    stock = make_model(dual)
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    norms = stock_norms(patched, ada_norms())
    # block 0: norm1 (+ .norm), norm1_context (+ .norm), norm2, norm2_context; block 1 (context
    # pre-only): norm1 (+ .norm), norm1_context (+ .norm), norm2; norm_out.norm
    assert len(norms) == 6 + 5 + 1, [n for n, _ in norms]
    assert_not_called(norms, lambda: check_training(stock, patched, make_inputs(), sample))


def test_feed_forward_chunking_matches_stock():
    stock = make_model()
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    for model in (stock, patched):
        model.enable_forward_chunking(chunk_size=1, dim=1)
    check_training(stock, patched, make_inputs(), sample)


def test_inference_matches_stock():
    stock = make_model()
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    with torch.inference_mode():
        want, got = stock(**make_inputs()).sample, patched(**make_inputs()).sample
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-4, err


def test_one_rank_sequence_parallel_composes():
    stock = make_model()
    both = dd.apply_fused_adaln(dd.parallelize(copy.deepcopy(stock), strategy="ulysses"))
    check_training(stock, both, make_inputs(), sample)


def test_state_dict_unchanged_and_remove_restores():
    from ditscale.diffusers import adaln_sd3

    stock = make_model()
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    assert_same_state_dict(stock.state_dict(), patched.state_dict())
    adaln_sd3.remove(patched)
    assert not any("forward" in m.__dict__ for m in patched.modules())
    with torch.no_grad():
        assert torch.equal(patched(**make_inputs()).sample, stock(**make_inputs()).sample)


def test_compiled_blocks_fullgraph():
    patched = dd.apply_fused_adaln(make_model())

    def args():
        return (leaf(BATCH, IMAGE, DIM, seed=5), leaf(BATCH, TEXT, DIM, seed=6),
                leaf(BATCH, DIM, seed=4))

    check_compiled(patched.transformer_blocks[0], args)  # dual attention, both streams
    check_compiled(patched.transformer_blocks[1], args)  # context_pre_only
    # norm_out's fused forward is Flux's (test_diffusers_adaln_flux compiles it)


def test_refusals():
    from diffusers.models.normalization import AdaLayerNormZero

    model = make_model()
    model.transformer_blocks[1].norm1_context = AdaLayerNormZero(DIM)
    with pytest.raises(ValueError, match=r"transformer_blocks\.1\.norm1_context is "
                                         r"AdaLayerNormZero; expected diffusers' "
                                         r"AdaLayerNormContinuous"):
        dd.apply_fused_adaln(model)
    model = make_model()
    model.norm_out.norm = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"norm_out\.norm is Identity"):
        dd.apply_fused_adaln(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
