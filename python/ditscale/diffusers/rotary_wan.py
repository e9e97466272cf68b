"""Wan's self-attention with the rotary embedding as one ditscale kernel (``ops.rotary``).

diffusers' ``WanAttnProcessor`` rotates q and k with a chain of float32 elementwise ops per
tensor (two strided views, four products, a sum and a difference in float32, two strided copies
into x's dtype) and autograd records each of them; on one H200 at 32,760 tokens that chain is
~16 ms of a 4-block forward+backward step of Wan 2.1 1.3B
(bench/results/diffusers-adaln_h200-h100_2026-12.md). :class:`RotaryWanAttnProcessor` computes the
same attention with ``ops.rotary``: one kernel per tensor forward (the same bits: float32 products
and sums, one rounding), one backward kernel (the inverse rotation), and only cos / sin saved for
the backward.

It is installed by ``ditscale.diffusers.apply_fused_adaln`` on every block's ``attn1`` whose
processor is diffusers' own ``WanAttnProcessor`` (removed by ``remove_fused_adaln``), and is
the stock processor in every other case, by calling it:

- under ``torch.compile`` (inductor fuses the stock chain with its neighbours itself);
- without ``rotary_emb``, with an image context (I2V's ``add_k_proj``: not on ``attn1``), or with
  frequencies the op does not take (not float32, requiring grad, another device);
- when the compiled ops are not available.

:func:`rotate` is the rotation alone (the op where it applies, else the formula), for the
sequence-parallel processor's own attention.

Composition: ``ditscale.diffusers.parallelize`` accepts it where it accepts ``WanAttnProcessor``
(its one-rank path runs it; its multi-rank path computes the attention itself); diffusers'
``set_attention_backend`` sets this processor's backend as the stock one's.
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
