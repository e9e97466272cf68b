"""ditscale.diffusers.parallelize for FluxTransformer2DModel, on the shared harness
(diffusers_sp_harness.py: one rank bit-identical, unparallelize, refusals, one gloo spawn of
4 ranks and two groups of 2 for every strategy).

A small random-weight Flux (5 heads of 8: uneven Ulysses head groups on 2 and 4 ranks; one
double- and one single-stream block; guidance embedding), batch 2, 15 image tokens (odd: uneven
shards) and 5 text tokens, with ControlNet residuals, and without them. Tolerance: max abs
error <= 1e-4 of max(1, max |reference|), fp32.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from diffusers_sp_harness import SpFamilyTests  # noqa: E402

IMAGE, TEXT, BATCH = 15, 5, 2


class TestFlux(SpFamilyTests):
    KINDS = ("controlnet", "plain")

    def make_model(self, kind="controlnet"):
        from diffusers import FluxTransformer2DModel

        torch.manual_seed(0)
        return FluxTransformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=5, joint_attention_dim=16, pooled_projection_dim=8,
            guidance_embeds=True, axes_dims_rope=(2, 2, 4)).eval()

    def make_inputs(self, kind="controlnet", image=IMAGE, text=TEXT, batch=BATCH):
        g = torch.Generator().manual_seed(1)
        side = (image + 2) // 3
        ids = torch.stack([torch.zeros(image), torch.arange(image) // side,
                           torch.arange(image) % side], 1)
        inputs = dict(
            hidden_states=torch.randn(batch, image, 4, generator=g),
            encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
            pooled_projections=torch.randn(batch, 8, generator=g),
            timestep=torch.linspace(0.2, 0.8, batch), img_ids=ids, txt_ids=torch.zeros(text, 3),
            guidance=torch.linspace(2.0, 4.0, batch))
        if kind == "controlnet":
            inputs.update(
                controlnet_block_samples=[torch.randn(batch, image, 40, generator=g)],
                controlnet_single_block_samples=[torch.randn(batch, image, 40, generator=g)])
        return inputs

    def too_few_tokens(self, kind, world):
        return self.make_inputs("plain", image=world - 1)


def test_fused_qkv_projections():
    fam = TestFlux()
    model, inputs = fam.make_model(), fam.make_inputs()
    ref = fam.run(model, inputs)
    model.fuse_qkv_projections()
    dd.parallelize(model)
    assert model.transformer_blocks[0].attn.fused_projections
    assert fam.error(fam.run(model, inputs), ref, "") <= 1e-5


def test_refuses_attention_kwargs_it_cannot_honour():
    fam = TestFlux()
    model = dd.parallelize(fam.make_model())
    for key in ("attention_mask", "ip_adapter_image_embeds"):
        with pytest.raises(ValueError, match=key):
            model(**fam.make_inputs(), joint_attention_kwargs={key: torch.ones(1)})
