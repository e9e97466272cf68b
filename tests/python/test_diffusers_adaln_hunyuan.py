"""ditscale.diffusers.apply_fused_adaln for HunyuanVideoTransformer3DModel (CPU, fp32).

A small random-weight HunyuanVideo (2 heads of 8, two double- and two single-stream blocks, one
token-refiner block, guidance embedding), batch 2, a 3-frame 2 x 3 latent (18 video tokens, the
first frame 6) and 5 text tokens of which sample 1 has 3 valid (the attention mask), for the T2V
model and the ``token_replace`` I2V model (first-frame tokens modulated apart). The patched
model against the stock one: output and every gradient in training, inference, the one-rank
sequence-parallel integration (T2V), no stock AdaLN norm module running, torch.compile
(fullgraph) of each patched block kind, the state_dict, remove(), and the refusals.
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

BATCH, FRAMES, HEIGHT, WIDTH, TEXT, DIM = 2, 3, 2, 3, 5, 16
VIDEO = FRAMES * HEIGHT * WIDTH
CONDITIONS = [None, "token_replace"]


def make_model(condition=None):
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, patch_size=1, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4),
        image_condition_type=condition)
    return randomize(model, scale=0.2)


def make_inputs():
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(BATCH, TEXT, dtype=torch.long)
    mask[1, 3:] = 0
    return dict(hidden_states=torch.randn(BATCH, 4, FRAMES, HEIGHT, WIDTH, generator=g),
                timestep=torch.tensor([250.0, 750.0]),
                encoder_hidden_states=torch.randn(BATCH, TEXT, 16, generator=g),
                encoder_attention_mask=mask,
                pooled_projections=torch.randn(BATCH, 8, generator=g),
                guidance=torch.tensor([2000.0, 4000.0]))


def sample(out):
    return out.sample


def ada_norms():
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
    from diffusers.models.transformers import transformer_hunyuan_video as hv

    return (AdaLayerNormZero, AdaLayerNormZeroSingle, hv.HunyuanVideoTokenReplaceAdaLayerNormZero,
            hv.HunyuanVideoTokenReplaceAdaLayerNormZeroSingle)


def block_norms(model):
    """The stock norms the patch replaces: the blocks' AdaLN modules and plain LayerNorms (not
    the token refiner's, which stay) and norm_out's."""
    names = ("transformer_blocks.", "single_transformer_blocks.", "norm_out.")
    return [(n, m) for n, m in stock_norms(model, ada_norms() + (torch.nn.LayerNorm,))
            if n.startswith(names)]


@pytest.mark.parametrize("condition", CONDITIONS)
def test_training_output_and_every_gradient_match_stock(condition):
    stock = make_model(condition)
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    norms = block_norms(patched)
    # per double block 2 AdaLN modules, their 2 LayerNorms, norm2, norm2_context; per single block
    # the AdaLN module and its LayerNorm; norm_out.norm
    assert len(norms) == 2 * 6 + 2 * 2 + 1
    assert_not_called(norms, lambda: check_training(stock, patched, make_inputs(), sample))


@pytest.mark.parametrize("condition", CONDITIONS)
def test_inference_matches_stock(condition):
    stock = make_model(condition)
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    with torch.inference_mode():
        want, got = stock(**make_inputs()).sample, patched(**make_inputs()).sample
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-4, err


def test_one_rank_sequence_parallel_composes():
    stock = make_model()
    both = dd.apply_fused_adaln(dd.parallelize(copy.deepcopy(stock), strategy="ulysses"))
    check_training(stock, both, make_inputs(), sample)


@pytest.mark.parametrize("condition", CONDITIONS)
def test_state_dict_unchanged_and_remove_restores(condition):
    from ditscale.diffusers import adaln_hunyuan_video

    stock = make_model(condition)
    patched = dd.apply_fused_adaln(copy.deepcopy(stock))
    assert_same_state_dict(stock.state_dict(), patched.state_dict())
    adaln_hunyuan_video.remove(patched)
    assert not any("forward" in m.__dict__ for m in patched.modules())
    with torch.no_grad():
        assert torch.equal(patched(**make_inputs()).sample, stock(**make_inputs()).sample)


def _block_args(model, condition):
    """Inputs of a block as the model calls it: (video, text, temb, mask, rotary, token-replace
    embedding, first-frame tokens)."""
    rotary = model.rope(torch.zeros(BATCH, 4, FRAMES, HEIGHT, WIDTH))
    mask = torch.ones(BATCH, 1, 1, VIDEO + TEXT, dtype=torch.bool)
    mask[1, ..., VIDEO + 3:] = False
    replace = leaf(BATCH, DIM, seed=8) if condition else None
    return lambda: (leaf(BATCH, VIDEO, DIM, seed=5), leaf(BATCH, TEXT, DIM, seed=6),
                    leaf(BATCH, DIM, seed=4), mask, rotary, replace, HEIGHT * WIDTH)


@pytest.mark.parametrize("condition", CONDITIONS)
def test_compiled_blocks_fullgraph(condition):
    patched = dd.apply_fused_adaln(make_model(condition))
    args = _block_args(patched, condition)
    check_compiled(patched.transformer_blocks[0], args)
    if condition is None:  # the token_replace single block is the same code as its double's
        check_compiled(patched.single_transformer_blocks[0], args)


def test_refusals():
    model = make_model()
    model.single_transformer_blocks[1].norm.norm = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"single_transformer_blocks\.1\.norm\.norm is Identity"):
        dd.apply_fused_adaln(model)
    model = make_model()
    model.transformer_blocks[0].norm1 = copy.deepcopy(model.single_transformer_blocks[0].norm)
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.norm1 is AdaLayerNormZeroSingle"):
        dd.apply_fused_adaln(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
