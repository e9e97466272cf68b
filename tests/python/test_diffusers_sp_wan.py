"""ditscale.diffusers.parallelize for WanTransformer3DModel, on the shared harness
(diffusers_sp_harness.py: one rank bit-identical, unparallelize, refusals, one gloo spawn of
4 ranks and two groups of 2 for every strategy).

Three small random-weight configurations (fp32, 2 blocks, 5 heads of 12, so Ulysses head groups
are uneven on 2 and 4 ranks; latents [2, 4, 3, 6, 10], patch (1, 2, 2): 45 video tokens, an odd
count): Wan 2.1 T2V (one timestep per sample), Wan 2.2 TI2V (one timestep per video token) and
Wan 2.1 I2V (CLIP image tokens through add_k_proj). Tolerance: max abs error <= 1e-4 of the
output's largest value.
"""

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import WanTransformer3DModel  # noqa: E402

import ditscale.diffusers as dd  # noqa: E402
from diffusers_sp_harness import SpFamilyTests  # noqa: E402
from ditscale import sp  # noqa: E402

LATENT = (2, 4, 3, 6, 10)  # B, C, F, H, W
VIDEO_TOKENS = 3 * 3 * 5


class TestWan(SpFamilyTests):
    KINDS = ("wan2.1", "wan2.2-ti2v", "wan2.1-i2v")
    ERROR_FLOOR = 0.0

    def make_model(self, kind, num_layers: int = 2):
        torch.manual_seed(0)
        config = dict(patch_size=(1, 2, 2), num_attention_heads=5, attention_head_dim=12,
                      in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=40,
                      num_layers=num_layers, rope_max_seq_len=64)
        if kind == "wan2.1-i2v":
            config.update(image_dim=8, added_kv_proj_dim=60)
        return WanTransformer3DModel(**config).eval()

    def make_inputs(self, kind, latent=LATENT):
        g = torch.Generator().manual_seed(1)
        batch = latent[0]
        tokens = latent[2] * (latent[3] // 2) * (latent[4] // 2)
        if kind == "wan2.2-ti2v":
            timestep = torch.randint(0, 1000, (batch, tokens), generator=g)
        else:
            timestep = torch.tensor([10, 500][:batch])
        # I2V: the attention splits the context at 512 text tokens (diffusers hard-codes it).
        text = 512 if kind == "wan2.1-i2v" else 7
        inputs = dict(hidden_states=torch.randn(*latent, generator=g), timestep=timestep,
                      encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                      return_dict=False)
        if kind == "wan2.1-i2v":
            inputs["encoder_hidden_states_image"] = torch.randn(batch, 5, 8, generator=g)
        return inputs

    def too_few_tokens(self, kind, world):
        return self.make_inputs(kind, (1, 4, 1, 2, 2))  # one video token

    def multi_rank_checks(self, rank, world):
        # per-token timesteps of the wrong length
        model = dd.parallelize(self.make_model("wan2.2-ti2v", 1))
        inputs = self.make_inputs("wan2.2-ti2v")
        inputs["timestep"] = inputs["timestep"][:, :-1]
        with pytest.raises(ValueError, match=f"timestep has {VIDEO_TOKENS - 1} values per "
                                             f"sample"):
            self.run(model, inputs)
        with pytest.raises(ValueError, match=f"has {2 * world} ranks, the process group {world}"):
            sp.Mesh(2, world)
        # one timestep per sample given as [B, 1] broadcasts, as in the stock module
        model = self.make_model("wan2.2-ti2v", 1)
        inputs = self.make_inputs("wan2.2-ti2v")
        inputs["timestep"] = inputs["timestep"][:, :1]
        ref = self.run(model, inputs)
        return {"timestep [B, 1]": self.error(self.run(dd.parallelize(model), inputs), ref, "")}


def test_refuses_a_model_without_blocks():
    with pytest.raises(ValueError, match="no blocks"):
        dd.parallelize(TestWan().make_model("wan2.1", 0))


def test_self_attention_refuses_a_mask():
    model = dd.parallelize(TestWan().make_model("wan2.1", 1))
    with pytest.raises(ValueError, match="attention_mask"):
        model.blocks[0].attn1(torch.randn(1, 4, 60), None,
                              torch.ones(1, 1, 4, 4, dtype=torch.bool), None)


def test_composes_with_fused_adaln_rotary_processor():
    """apply_fused_adaln first (attn1 -> RotaryWanAttnProcessor), then parallelize and undo:
    the rotary processor object is back."""
    from ditscale import ops

    if not ops.is_available():
        pytest.skip(f"ditscale ops unavailable: {ops.load_error()}")
    fam = TestWan()
    model, inputs = fam.make_model("wan2.1", 1), fam.make_inputs("wan2.1")
    dd.apply_fused_adaln(model)
    rotary = model.blocks[0].attn1.processor
    ref = fam.run(model, inputs)
    dd.parallelize(model)
    assert torch.equal(fam.run(model, inputs), ref)
    dd.unparallelize(model)
    assert model.blocks[0].attn1.processor is rotary


def test_a_plan_is_checked_whole_before_any_change_and_undone_only_as_installed():
    """The plan machinery (_sp_plan): a plan naming a module the model lacks changes nothing;
    unparallelize refuses (changing nothing) when a processor was replaced after parallelize."""
    import dataclasses

    from ditscale.diffusers import _sp_context, _sp_plan, sp_wan
    from diffusers_sp_harness import hook_count, processors

    model = TestWan().make_model("wan2.1", 1)
    stock = processors(model)
    plan = dataclasses.replace(sp_wan.PLAN, hooks={**sp_wan.PLAN.hooks, "nope": _sp_plan.Gather()})
    ctx = _sp_context.make_context("test", None, "auto", {})
    with pytest.raises(ValueError, match="the model has no 'nope' module"):
        _sp_plan.apply(plan, model, ctx)
    assert hook_count(model) == 0 and processors(model) == stock
    assert _sp_plan.record_of(model) is None
    dd.parallelize(model)
    model.blocks[0].attn1.set_processor(stock["blocks.0.attn1"])
    with pytest.raises(ValueError, match="replaced after parallelize"):
        dd.unparallelize(model)
    assert hook_count(model) == 1 and _sp_plan.record_of(model) is not None
