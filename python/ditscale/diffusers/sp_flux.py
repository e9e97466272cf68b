"""Sequence parallelism for diffusers' ``FluxTransformer2DModel`` (Flux.1 dev / schnell): its
plan (:data:`PLAN`, data applied by ``_sp_plan.apply``) and its two attention processors.

The double-stream blocks attend jointly over [text; image]; the single-stream blocks run one
stream [text; image shard] that the processor splits at T. What is sharded where, and what is
refused: docs/diffusers/flux_sd3_hunyuan.md; the plan entries: docs/diffusers.md.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import (FluxAttnProcessor,
                                                            _get_qkv_projections)

from ._sp_attention import ImageRotaryProcessor, joint_attention
from ._sp_hooks import refuse_attention_kwargs
from ._sp_plan import Count, Gather, Inputs, Plan, Processors, Shard
from .rotary_flux import RotaryFluxAttnProcessor

WHERE = "ditscale.diffusers.parallelize (FluxTransformer2DModel)"


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, N, H * d] -> [B, N, H, d]."""
    return x.unflatten(-1, (-1, head_dim))


def _rotate(x: torch.Tensor, rotary: Optional[Tuple[torch.Tensor, torch.Tensor]], begin: int,
            count: int) -> torch.Tensor:
    """``x`` [B, count, H, d] rotated by rows [begin, begin + count) of the rotary tables."""
    if rotary is None:
        return x
    cos, sin = (t.narrow(0, begin, count) for t in rotary)
    return apply_rotary_emb(x, (cos, sin), sequence_dim=1)


class DoubleStreamProcessor(ImageRotaryProcessor):
    """The attention of a ``FluxTransformerBlock``: image stream [B, S_r, D] and text stream
    [B, T, D] -> (image out [B, S_r, D], text out [B, T, D])."""

    def sharded(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                image_rotary_emb=None):
        if encoder_hidden_states is None or attn.added_kv_proj_dim is None:
            raise ValueError(f"{self.where}: a double-stream attention needs the text stream")
        q, k, v, tq, tk, tv = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        d = attn.head_dim
        image = (attn.norm_q(_heads(q, d)), attn.norm_k(_heads(k, d)), _heads(v, d))
        text = (attn.norm_added_q(_heads(tq, d)), attn.norm_added_k(_heads(tk, d)), _heads(tv, d))
        T, S = text[0].shape[1], image[0].shape[1]
        r = image_rotary_emb
        text = (_rotate(text[0], r, 0, T), _rotate(text[1], r, 0, T), text[2])
        image = (_rotate(image[0], r, T, S), _rotate(image[1], r, T, S), image[2])
        text_out, image_out = joint_attention(self.ctx, text, image)
        dtype = image[0].dtype
        image_out = attn.to_out[1](attn.to_out[0](image_out.flatten(2).to(dtype).contiguous()))
        return image_out, attn.to_add_out(text_out.flatten(2).to(dtype).contiguous())


class SingleStreamProcessor(ImageRotaryProcessor):
    """The attention of a ``FluxSingleTransformerBlock``: the stream [text; image shard]
    [B, T + S_r, D] -> [B, T + S_r, H * d] (no output projection: the block's proj_out)."""

    def sharded(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                image_rotary_emb=None):
        if encoder_hidden_states is not None:
            raise ValueError(f"{self.where}: a single-stream attention takes one stream")
        q, k, v, _, _, _ = _get_qkv_projections(attn, hidden_states)
        d = attn.head_dim
        q, k, v = attn.norm_q(_heads(q, d)), attn.norm_k(_heads(k, d)), _heads(v, d)
        n = q.shape[1]
        q, k = _rotate(q, image_rotary_emb, 0, n), _rotate(k, image_rotary_emb, 0, n)
        if self.ctx.size == 1:  # every token is local: one attention, as stock
            return self.ctx.attention(q, k, v).flatten(2).to(q.dtype)
        T = self.tokens.text
        text = tuple(x.narrow(1, 0, T) for x in (q, k, v))
        image = tuple(x.narrow(1, T, n - T) for x in (q, k, v))
        text_out, image_out = joint_attention(self.ctx, text, image)
        return torch.cat([text_out, image_out], 1).flatten(2).to(q.dtype)


_STOCK = (FluxAttnProcessor, RotaryFluxAttnProcessor)  # apply_fused_adaln's: the same attention

PLAN = Plan(
    where=WHERE,
    inputs=Inputs(refuse=refuse_attention_kwargs(WHERE),
                  # ControlNet residuals: lists of [B, S, D] -> [B, S_r, D]
                  shard_lists=("controlnet_block_samples", "controlnet_single_block_samples")),
    hooks={
        "context_embedder": Count("text"),          # text tokens [B, T, D]: records T
        "x_embedder": Shard(dim=1, record=True),    # image tokens [B, S, D] -> [B, S_r, D]
        "pos_embed": Shard(dim=0, keep_text=True),  # (cos, sin) [T + S, d] -> [T + S_r, d]
        "proj_out": Gather(dim=1),                  # [B, S_r, C_out] -> [B, S, C_out]
    },
    processors=(Processors("transformer_blocks.*.attn", _STOCK, DoubleStreamProcessor),
                Processors("single_transformer_blocks.*.attn", _STOCK, SingleStreamProcessor)),
    trains=True)  # every hook above differentiates (docs/diffusers.md, "Training")
