"""Flux's joint attention with the rotary embedding as one ditscale kernel (``ops.rotary``).

:class:`RotaryFluxAttnProcessor` computes the attention of diffusers' ``FluxAttnProcessor`` with q
and k of the joint [text; image] sequence rotated by one kernel each (one backward kernel, only
cos / sin saved) instead of ``apply_rotary_emb(use_real=True)``. The two agree bit for bit when
the tables hold each value twice, once per member of a pair (cos[2j] = cos[2j + 1], the same for
sin): diffusers' formula reads sin[2j] for the even output and cos[2j + 1] for the odd one, the
op cos[2j] and sin[2j + 1] for both, with the same float32 operations. ``FluxPosEmbed`` makes its
tables that way, so :func:`install` applies only under it. Where it is installed and when the
stock processor runs instead: docs/diffusers/adaln_models.md (section Flux).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import (FluxAttnProcessor, FluxPosEmbed,
                                                            _get_qkv_projections)

from .. import ops
from ._rotary_common import Replacing, op_applies


class RotaryFluxAttnProcessor(Replacing, FluxAttnProcessor):
    """``FluxAttnProcessor`` with ``ops.rotary`` for q and k (see the module)."""

    def __init__(self, stock: FluxAttnProcessor):
        super().__init__()
        self._replace(stock)

    def __call__(self, attn, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: torch.Tensor | None = None) -> torch.Tensor:
        if image_rotary_emb is None or not op_applies(hidden_states, image_rotary_emb):
            return FluxAttnProcessor.__call__(self, attn, hidden_states, encoder_hidden_states,
                                              attention_mask, image_rotary_emb)
        q, k, v = _joint_qkv(attn, hidden_states, encoder_hidden_states)
        cos, sin = (t.unsqueeze(0) for t in image_rotary_emb)  # [S, d] -> [1, S, d]
        out = dispatch_attention_fn(ops.rotary(q, cos, sin), ops.rotary(k, cos, sin), v,
                                    attn_mask=attention_mask, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        text, image = out.split_with_sizes(
            [encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


def _joint_qkv(attn, hidden_states, encoder_hidden_states):
    """q, k, v [B, T + S, H, d] (text first when the block has the text stream's projections),
    the q / k norms applied, as the stock processor makes them."""
    q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
    q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))
    q, k = attn.norm_q(q), attn.norm_k(k)
    if attn.added_kv_proj_dim is None:
        return q, k, v
    eq, ek, ev = (t.unflatten(-1, (-1, attn.head_dim)) for t in (eq, ek, ev))
    eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
    return torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)


def _blocks(transformer):
    return list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)


def install(transformer) -> None:
    """Every block's stock ``attn`` processor -> :class:`RotaryFluxAttnProcessor`, when the
    rotary tables come from diffusers' ``FluxPosEmbed`` (see the module); any other processor,
    ours included, stays."""
    if type(getattr(transformer, "pos_embed", None)) is not FluxPosEmbed:
        return
    for block in _blocks(transformer):
        processor = block.attn.processor
        if type(processor) is FluxAttnProcessor:
            block.attn.set_processor(RotaryFluxAttnProcessor(processor))


def uninstall(transformer) -> None:
    """Undoes :func:`install` (a no-op where ours is not the processor)."""
    for block in _blocks(transformer):
        processor = block.attn.processor
        if type(processor) is RotaryFluxAttnProcessor:
            block.attn.set_processor(processor.restore())
