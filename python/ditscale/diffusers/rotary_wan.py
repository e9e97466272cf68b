"""Wan's self-attention with the rotary embedding as one ditscale kernel (``ops.rotary``).

:class:`RotaryWanAttnProcessor` computes the attention of diffusers' ``WanAttnProcessor`` with q
and k rotated by one kernel each (the stock formula's bits; one backward kernel, only cos / sin
saved), where the stock processor runs a chain of float32 elementwise ops per tensor. It is the
stock processor, by calling it, under ``torch.compile``, without ``rotary_emb``, with an image
context, with frequencies the op does not take, or without the compiled ops. :func:`rotate` is
the rotation alone, for the sequence-parallel processor's own attention. Installed by
``apply_fused_adaln`` on ``attn1`` where the processor is diffusers' own; the conditions,
composition with ``parallelize`` and the measurements: docs/diffusers/adaln.md (section Wan).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections

from .. import ops
from ._rotary_common import Replacing, op_applies


class RotaryWanAttnProcessor(Replacing, WanAttnProcessor):
    """``WanAttnProcessor`` with ``ops.rotary`` for q and k (see the module)."""

    def __init__(self, stock: WanAttnProcessor):
        super().__init__()
        self._replace(stock)

    def __call__(self, attn, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if (rotary_emb is None or attn.add_k_proj is not None
                or not op_applies(hidden_states, rotary_emb)):
            return WanAttnProcessor.__call__(self, attn, hidden_states, encoder_hidden_states,
                                             attention_mask, rotary_emb)
        q, k, v = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        cos, sin = rotary_emb
        q = ops.rotary(attn.norm_q(q).unflatten(2, (attn.heads, -1)), cos, sin)
        k = ops.rotary(attn.norm_k(k).unflatten(2, (attn.heads, -1)), cos, sin)
        v = v.unflatten(2, (attn.heads, -1))
        out = dispatch_attention_fn(
            q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config if encoder_hidden_states is None else None)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def rotate(x: torch.Tensor, rotary_emb) -> torch.Tensor:
    """``x`` [B, S, H, Dh] rotated as Wan rotates it (``rotary_emb`` = (cos, sin), [1 or B, S,
    1, Dh]): ``ops.rotary`` where :func:`op_applies`, else the same formula in PyTorch
    (``ops.rotary_reference``); the same bits either way."""
    if op_applies(x, rotary_emb):
        return ops.rotary(x, *rotary_emb)
    return ops.rotary_reference(x, *rotary_emb)


def install(transformer) -> None:
    """Every block's stock ``attn1`` processor -> :class:`RotaryWanAttnProcessor` (any other
    processor, ours included, stays)."""
    for block in transformer.blocks:
        processor = block.attn1.processor
        if type(processor) is WanAttnProcessor:
            block.attn1.set_processor(RotaryWanAttnProcessor(processor))


def uninstall(transformer) -> None:
    """Undoes :func:`install` (a no-op where ours is not the processor)."""
    for block in transformer.blocks:
        processor = block.attn1.processor
        if type(processor) is RotaryWanAttnProcessor:
            block.attn1.set_processor(processor.restore())
