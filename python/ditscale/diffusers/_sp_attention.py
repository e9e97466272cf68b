"""The attention side of every family's sequence-parallel plan: the processor template
(:class:`SpProcessor`: one rank -> the stock diffusers processor it replaced, more ranks ->
the family's ``sharded`` path through ``ditscale.sp``) and the joint attention of
[text; image shard] that the joint-attention families share. See docs/diffusers.md.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ._sp_context import SpContext
from ._sp_hooks import Tokens


QKV = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def project_qkv(attn, x: torch.Tensor, added: bool) -> QKV:
    """The stream ``x`` [B, N, D] -> q, k and v [B, N, H, d] through the module's own separate
    projections and q/k norms where it has them (``added``: the text stream's add_*_proj and
    norm_added_*)."""
    if added:
        projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        norms = (attn.norm_added_q, attn.norm_added_k)
    else:
        projections = (attn.to_q, attn.to_k, attn.to_v)
        norms = (attn.norm_q, attn.norm_k)
    q, k, v = (p(x).unflatten(-1, (attn.heads, -1)) for p in projections)
    q = q if norms[0] is None else norms[0](q)
    k = k if norms[1] is None else norms[1](k)
    return q, k, v


def joint_attention(ctx: SpContext, text: Tuple[torch.Tensor, ...],
                    image: Tuple[torch.Tensor, ...],
                    text_first: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of [text; image shard] over all text and image tokens of the mesh.

    ``text``: (q, k, v) [B, T, H, d]; ``image``: (q, k, v) [B, S_r, H, d], rotary already
    applied. Returns (text_out [B, T, H, d], image_out [B, S_r, H, d]). On one rank this is one
    attention over the concatenation in the model's own order (``text_first``: [text; image],
    else [image; text]), as the stock processors compute it."""
    T = text[0].shape[1]
    if ctx.size == 1:
        parts = zip(text, image) if text_first else zip(image, text)
        out = ctx.attention(*(torch.cat(p, 1) for p in parts))
        S = out.shape[1] - T
        return (out[:, :T], out[:, T:]) if text_first else (out[:, S:], out[:, :S])
    out, text_out = ctx.attention(*(x.contiguous() for x in image),
                                  joint_q=text[0].contiguous(), joint_k=text[1].contiguous(),
                                  joint_v=text[2].contiguous())
    return text_out, out


class SpProcessor:
    """Base of the integration's attention processors. ``stock`` is the diffusers processor the
    plan replaced (with the attention backend it was set to), ``tokens`` the plan's per-forward
    token counts. A family's processor defines ``sharded(attn, hidden_states,
    encoder_hidden_states, attention_mask, **extra)`` and, where the stock processor takes more
    arguments than (hidden_states, encoder_hidden_states, attention_mask), a ``__call__`` with
    the stock signature (diffusers' Attention passes a processor only the arguments its
    ``__call__`` names) that calls :meth:`run`.

    :meth:`run`: on a mesh of one rank the stock processor (``ditscale.sp.attention`` of one rank
    is one SDPA over all tokens, which the stock processor already computes: bit-identical, the
    same kernels, the same graph under ``torch.compile``, for one Python call); on more ranks
    ``sharded``. ``sharded`` also runs on one rank (the tests compare it with ``stock``)."""

    # None: an attention_mask is passed on (the family's sharded path honours it).
    REFUSED_MASK = "an attention mask (the sequence-parallel attention is unmasked)"

    def __init__(self, where: str, ctx: SpContext, stock, tokens: Tokens):
        self.where, self.ctx, self.stock, self.tokens = where, ctx, stock, tokens

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        return self.run(attn, hidden_states, encoder_hidden_states, attention_mask)

    def run(self, attn, hidden_states, encoder_hidden_states, attention_mask, **extra):
        """The stock processor on one rank, else ``sharded``; a mask refused first."""
        if attention_mask is not None and self.REFUSED_MASK is not None:
            raise ValueError(f"{self.where}: attention_mask: {self.REFUSED_MASK} is not "
                             f"supported")
        if self.ctx.size == 1:
            return self.stock(attn, hidden_states, encoder_hidden_states=encoder_hidden_states,
                              attention_mask=attention_mask, **extra)
        return self.sharded(attn, hidden_states, encoder_hidden_states, attention_mask, **extra)

    def sharded(self, attn, hidden_states, encoder_hidden_states, attention_mask, **extra):
        raise NotImplementedError(f"{type(self).__name__} defines no sharded attention")


class ImageRotaryProcessor(SpProcessor):
    """The template for stock processors that also take ``image_rotary_emb`` (Flux,
    HunyuanVideo, CogVideoX)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        return self.run(attn, hidden_states, encoder_hidden_states, attention_mask,
                        image_rotary_emb=image_rotary_emb)
