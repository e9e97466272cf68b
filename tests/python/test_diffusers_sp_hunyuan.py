"""ditscale.diffusers.parallelize for HunyuanVideoTransformer3DModel, on the shared harness
(diffusers_sp_harness.py: one rank bit-identical, unparallelize, refusals, one gloo spawn of
4 ranks and two groups of 2 for every strategy).

A small random-weight HunyuanVideo (5 heads of 8: uneven Ulysses head groups on 2 and 4 ranks;
one double- and one single-stream block, one token-refiner block; guidance embedding), batch 2,
a 3 x 2 x 10 latent of patch (1, 2, 2) (15 video tokens: uneven shards) and 6 text tokens with
an encoder_attention_mask that pads the prompts (the configurations): all valid, both samples
padded alike, and samples padded differently (one attention call per sample).

What is compared: the model's output (every video token) and the text stream after each block
at the valid text positions (padded positions are keys for nobody under the stock mask and
never reach the output; there the integration leaves attention outputs of zero). Tolerance:
1e-4 of max(1, max |reference|), fp32.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from diffusers_sp_harness import SpFamilyTests  # noqa: E402

BATCH, TEXT = 2, 6


def valid_of(kind: str):
    return [int(n) for n in kind.split(",")]


class TestHunyuanVideo(SpFamilyTests):
    KINDS = ("6,6", "4,4", "6,3")  # valid text tokens per sample
    ALL_STRATEGY_KINDS = KINDS
    DEVICE_INPUT = "encoder_attention_mask"

    def make_model(self, kind=None, **config):
        from diffusers import HunyuanVideoTransformer3DModel

        torch.manual_seed(0)
        return HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=5, attention_head_dim=8,
            num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2,
            patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4),
            guidance_embeds=True, **config).eval()

    def make_inputs(self, kind="6,6", frames=3, width=10):
        g = torch.Generator().manual_seed(1)
        mask = (torch.arange(TEXT)[None] < torch.tensor(valid_of(kind))[:, None]).long()
        return dict(hidden_states=torch.randn(BATCH, 4, frames, 2, width, generator=g),
                    timestep=torch.linspace(10.0, 900.0, BATCH),
                    encoder_hidden_states=torch.randn(BATCH, TEXT, 16, generator=g),
                    encoder_attention_mask=mask,
                    pooled_projections=torch.randn(BATCH, 8, generator=g),
                    guidance=torch.linspace(2.0, 6.0, BATCH))

    def too_few_tokens(self, kind, world):
        return self.make_inputs(frames=1, width=2 * (world - 1))

    def run(self, model, inputs):
        """(output, [text stream after each block]) of one forward pass."""
        texts = []
        blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
        hooks = [b.register_forward_hook(lambda m, a, out: texts.append(out[1])) for b in blocks]
        try:
            with torch.no_grad():
                return model(**inputs).sample, texts
        finally:
            for h in hooks:
                h.remove()

    def error(self, got, ref, kind):
        (out, texts), (ref_out, ref_texts) = got, ref
        valid = valid_of(kind or "6,6")
        errors = [float((out - ref_out).abs().max()) / max(1.0, float(ref_out.abs().max()))]
        for t, r in zip(texts, ref_texts):
            scale = max(1.0, float(r.abs().max()))
            errors += [float((t[b, :n] - r[b, :n]).abs().max()) / scale
                       for b, n in enumerate(valid)]
        return max(errors)

    def same(self, got, ref):
        return torch.equal(got[0], ref[0]) and all(map(torch.equal, got[1], ref[1]))


class ShardedPath:
    """A processor that always takes the sequence-parallel path of the integration's processor
    ``proc`` (on one rank the integration runs the stock processor instead; the shard, rotary and
    gather hooks it leaves out there are identities at one rank)."""

    def __init__(self, proc):
        self.proc = proc

    # The stock signature: diffusers' Attention drops keyword arguments __call__ does not name.
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        return self.proc.sharded(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 image_rotary_emb=image_rotary_emb)


def sharded_path(model):
    for block in list(model.transformer_blocks) + list(model.single_transformer_blocks):
        block.attn.set_processor(ShardedPath(block.attn.processor))
    return model


def test_one_rank_sharded_path_matches_the_stock_module():
    fam = TestHunyuanVideo()
    base = fam.make_model()
    model = sharded_path(dd.parallelize(copy.deepcopy(base)))
    for kind in fam.KINDS:
        inputs = fam.make_inputs(kind)
        assert fam.error(fam.run(model, inputs), fam.run(base, inputs), kind) <= 1e-6, kind


def test_padded_text_positions_get_zero_attention():
    fam = TestHunyuanVideo()
    model = sharded_path(dd.parallelize(fam.make_model()))
    block = model.transformer_blocks[0]
    seen = []
    block.attn.register_forward_hook(lambda m, a, out: seen.append(out[1]))
    fam.run(model, fam.make_inputs("6,3"))
    bias = block.attn.to_add_out.bias
    assert torch.equal(seen[0][1, 3:], bias.expand(3, -1))  # to_add_out(0)
    assert not torch.equal(seen[0][0, 3:], bias.expand(3, -1))


def test_refuses_masks_it_cannot_shard_and_token_replace():
    fam = TestHunyuanVideo()
    model = dd.parallelize(fam.make_model())
    # A key mask that hides a video token (the processor reads the mask the blocks get).
    attn = model.transformer_blocks[0].attn
    mask = torch.ones(BATCH, 1, 1, 15 + TEXT, dtype=torch.bool)
    mask[0, 0, 0, 2] = False
    with pytest.raises(ValueError, match="masking video tokens"):
        attn.processor.sharded(attn, torch.randn(BATCH, 15, 40), torch.randn(BATCH, TEXT, 40),
                               mask)
    with pytest.raises(ValueError, match="token_replace"):
        dd.parallelize(fam.make_model(image_condition_type="token_replace"))
