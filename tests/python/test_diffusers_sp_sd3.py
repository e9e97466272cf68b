"""ditscale.diffusers.parallelize for SD3Transformer2DModel, on the shared harness
(diffusers_sp_harness.py: one rank bit-identical, unparallelize, refusals, one gloo spawn of
4 ranks and two groups of 2 for every strategy).

A small random-weight SD3.5-like model (5 heads of 8: uneven Ulysses head groups on 2 and 4
ranks; two JointTransformerBlocks: the first with dual attention (attn2 over the image), the last
context_pre_only; RMS q/k norms; the patch embedding's cropped positional embedding), batch 2,
a 10 x 6 latent of patch 2 (15 image tokens: uneven shards) and 5 text tokens, with ControlNet
residuals, and skip_layers. Tolerance: max abs error <= 1e-4 of max(1, max |reference|), fp32.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from diffusers_sp_harness import SpFamilyTests  # noqa: E402

BATCH, TEXT = 2, 5


class TestSD3(SpFamilyTests):
    KINDS = ("controlnet", "skip-layers")

    def make_model(self, kind="controlnet"):
        from diffusers import SD3Transformer2DModel

        torch.manual_seed(0)
        return SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=5, joint_attention_dim=16, caption_projection_dim=40,
            pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16,
            dual_attention_layers=(0,), qk_norm="rms_norm").eval()

    def make_inputs(self, kind="controlnet", height=10, width=6):
        g = torch.Generator().manual_seed(1)
        inputs = dict(hidden_states=torch.randn(BATCH, 4, height, width, generator=g),
                      encoder_hidden_states=torch.randn(BATCH, TEXT, 16, generator=g),
                      pooled_projections=torch.randn(BATCH, 8, generator=g),
                      timestep=torch.linspace(10.0, 900.0, BATCH))
        if kind == "controlnet":
            tokens = (height // 2) * (width // 2)
            inputs["block_controlnet_hidden_states"] = [torch.randn(BATCH, tokens, 40,
                                                                    generator=g)]
        else:  # skip-layer guidance: block 0 left out on every rank alike
            inputs["skip_layers"] = [0]
        return inputs

    def too_few_tokens(self, kind, world):
        return self.make_inputs("skip-layers", height=2, width=2 * (world - 1))


def test_refuses_attention_kwargs_and_fused_projections():
    fam = TestSD3()
    model = dd.parallelize(fam.make_model())
    for key in ("attention_mask", "ip_adapter_image_embeds"):
        with pytest.raises(ValueError, match=key):
            model(**fam.make_inputs(), joint_attention_kwargs={key: torch.ones(1)})
    model = fam.make_model()
    model.fuse_qkv_projections()
    with pytest.raises(ValueError, match="FusedJointAttnProcessor2_0"):
        dd.parallelize(model)
