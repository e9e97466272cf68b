"""Sequence parallelism for diffusers' ``CogVideoXTransformer3DModel`` (CogVideoX 2B / 5B / 5B
I2V, CogVideoX 1.5): its plan (:data:`PLAN`, data applied by ``_sp_plan.apply``), the input and
patch-embedding hooks it needs and the joint attention processor.

``patch_embed`` embeds text and video together into [B, T + S, D] (text first) and the model
splits it at T; the rotary tables are a model input. What is sharded where, and what is
refused: docs/diffusers/wan_cogvideox.md; the plan entries: docs/diffusers.md.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import (CogVideoXAttnProcessor2_0,
                                                  FusedCogVideoXAttnProcessor2_0)
from diffusers.models.embeddings import apply_rotary_emb

from ._sp_attention import ImageRotaryProcessor
from ._sp_context import SpContext
from ._sp_hooks import Tokens
from ._sp_plan import Gather, Inputs, Plan, Processors, Special

WHERE = "ditscale.diffusers.parallelize (CogVideoXTransformer3DModel)"


def video_tokens(config, latent_shape) -> int:
    """S of latents [B, F, C, H, W]: F' * (H // p) * (W // p), F' = F or F // p_t."""
    _, frames, _, height, width = latent_shape
    p, p_t = config.patch_size, config.patch_size_t
    return (frames if p_t is None else frames // p_t) * (height // p) * (width // p)


def _prepare(ctx: SpContext, tokens: Tokens, module, named: dict) -> bool:
    """The model's input step: records S from the latents' shape (fewer than ranks refused) and
    shards the input ``image_rotary_emb`` (cos, sin) [S, d] by rows -> [S_r, d]."""
    tokens.image = video_tokens(module.config, named["hidden_states"].shape)
    ctx.local_range(tokens.image)  # refuses fewer video tokens than ranks
    rotary = named.get("image_rotary_emb")
    if rotary is None or ctx.size == 1:
        return False
    for name, table in zip(("cos", "sin"), rotary):
        if table.shape[0] != tokens.image:
            raise ValueError(f"{WHERE}: image_rotary_emb's {name} table has {table.shape[0]} "
                             f"rows; the latents have {tokens.image} video tokens")
    named["image_rotary_emb"] = tuple(ctx.shard(table, 0) for table in rotary)
    return True


def _patch_hook(ctx: SpContext, tokens: Tokens, module):
    """``patch_embed``'s output [B, T + S, D] (text first) -> [B, T + S_r, D]."""

    def hook(module, args, output):
        text = args[0].shape[1]
        if output.shape[1] - text != tokens.image:
            raise ValueError(f"{WHERE}: patch_embed made {output.shape[1] - text} video tokens, "
                             f"the latents' shape gives {tokens.image}")
        if ctx.size == 1:
            return None
        video = ctx.shard(output.narrow(1, text, tokens.image), 1)
        return torch.cat([output.narrow(1, 0, text), video], 1)

    return hook


def _joint(ctx: SpContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           text: int) -> torch.Tensor:
    """Attention of [text; video shard] over all text and video tokens of the mesh. q, k, v:
    [B, T + S_r, H, d], the ``text`` = T text tokens first. Returns [B, T + S_r, H, d]; on one
    rank, one attention over q, k, v as they are (no copy)."""
    if ctx.size == 1:
        return ctx.attention(q, k, v)
    tq, tk, tv = (y.narrow(1, 0, text).contiguous() for y in (q, k, v))
    vq, vk, vv = (y.narrow(1, text, y.shape[1] - text).contiguous() for y in (q, k, v))
    video_out, text_out = ctx.attention(vq, vk, vv, joint_q=tq, joint_k=tk, joint_v=tv)
    return torch.cat([text_out, video_out], 1)


def _projections(attn, x: torch.Tensor):
    """q, k, v [B, N, H * d] of ``x`` [B, N, D] through the module's fused or separate layers."""
    if getattr(attn, "fused_projections", False):
        return attn.to_qkv(x).chunk(3, dim=-1)
    return attn.to_q(x), attn.to_k(x), attn.to_v(x)


class JointAttentionProcessor(ImageRotaryProcessor):
    """``attn1`` of a ``CogVideoXBlock``: video shard [B, S_r, D] and text [B, T, D] ->
    (video out [B, S_r, D], text out [B, T, D]); q/k LayerNorm per head, the rotary embedding
    on the video part only."""

    def sharded(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                image_rotary_emb=None):
        T = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], 1)
        q, k, v = (y.unflatten(-1, (attn.heads, -1)) for y in _projections(attn, x))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:  # the video rows, in place (fresh tensors)
            q[:, T:] = apply_rotary_emb(q[:, T:], image_rotary_emb, sequence_dim=1)
            if not attn.is_cross_attention:
                k[:, T:] = apply_rotary_emb(k[:, T:], image_rotary_emb, sequence_dim=1)
        out = _joint(self.ctx, q, k, v, T).flatten(2).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        return out.narrow(1, T, out.shape[1] - T), out.narrow(1, 0, T)


PLAN = Plan(
    where=WHERE,
    inputs=Inputs(prepare=_prepare),
    hooks={
        "patch_embed": Special(_patch_hook),  # [B, T + S, D] -> [B, T + S_r, D]
        "proj_out": Gather(dim=1),            # [B, S_r, p^2 (p_t) C] -> [B, S, ...]
    },
    processors=(Processors("transformer_blocks.*.attn1",
                           (CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0),
                           JointAttentionProcessor),),
    hint="custom processors are not supported",
    trains=True)  # every hook above differentiates (docs/diffusers.md, "Training")
