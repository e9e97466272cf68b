"""Sequence parallelism for diffusers' ``SD3Transformer2DModel`` (Stable Diffusion 3 / 3.5): its
plan (:data:`PLAN`, data applied by ``_sp_plan.apply``) and its attention processor.

Every block's ``attn`` attends jointly over [image; text], SD3.5's ``attn2`` over the image
alone; ``skip_layers`` is honoured as is (a skipped block is skipped on every rank alike). What
is sharded where, and what is refused: docs/diffusers/flux_sd3_hunyuan.md; the plan entries:
docs/diffusers.md.
"""

from __future__ import annotations

from diffusers.models.attention_processor import JointAttnProcessor2_0

from ._sp_attention import SpProcessor, joint_attention, project_qkv
from ._sp_hooks import refuse_attention_kwargs
from ._sp_plan import Gather, Inputs, Plan, Processors, Shard

WHERE = "ditscale.diffusers.parallelize (SD3Transformer2DModel)"


class JointProcessor(SpProcessor):
    """``attn`` of a JointTransformerBlock: image stream [B, S_r, D] and text stream [B, T, D]
    -> (image out [B, S_r, D], text out [B, T, D]; not projected when ``context_pre_only``);
    ``attn2`` (no text stream): [B, S_r, D] -> [B, S_r, D]."""

    def sharded(self, attn, hidden_states, encoder_hidden_states, attention_mask):
        image = project_qkv(attn, hidden_states, added=False)
        dtype = image[0].dtype
        if encoder_hidden_states is None:
            out = self.ctx.attention(*image).flatten(2).to(dtype)
            return attn.to_out[1](attn.to_out[0](out))
        text = project_qkv(attn, encoder_hidden_states, added=True)
        text_out, image_out = joint_attention(self.ctx, text, image, text_first=False)
        image_out = image_out.flatten(2).to(dtype)
        text_out = text_out.flatten(2).to(dtype)
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return attn.to_out[1](attn.to_out[0](image_out)), text_out


PLAN = Plan(
    where=WHERE,
    inputs=Inputs(refuse=refuse_attention_kwargs(WHERE),
                  # ControlNet residuals: a list of [B, S, D] -> [B, S_r, D]
                  shard_lists=("block_controlnet_hidden_states",)),
    hooks={
        # PatchEmbed: image tokens [B, S, D] (positional embedding added, row-major patches)
        "pos_embed": Shard(dim=1, record=True),     # -> [B, S_r, D]
        "proj_out": Gather(dim=1),                  # [B, S_r, p*p*C] -> [B, S, p*p*C]
    },
    processors=(Processors("transformer_blocks.*.attn", (JointAttnProcessor2_0,), JointProcessor),
                Processors("transformer_blocks.*.attn2", (JointAttnProcessor2_0,), JointProcessor,
                           optional=True)),
    hint="unfuse QKV projections, unload IP-Adapters and custom processors first",
    trains=True)  # every hook above differentiates (docs/diffusers.md, "Training")
