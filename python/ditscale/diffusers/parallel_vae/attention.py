"""The self-attention of a VAE's mid block over the bands: each rank computes the queries of its
own band against the keys and values of the gathered input (1 / N of the attention, its mask
included), exactly what diffusers' ``Attention`` with ``AttnProcessor2_0`` computes for those
positions: group norm over the whole input, q / k / v, SDPA, output projection, residual,
rescale. Another processor is refused by name (:func:`check_attention`).
See docs/diffusers/vae.md.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .bands import Bands
from .comm import gather_rows

# Attention processors whose computation band_attention reproduces.
PROCESSORS = frozenset({"AttnProcessor2_0", "AttnProcessor"})


def check_attention(full: str, attn) -> None:
    """Refuses an Attention whose processor or spatial norm band_attention does not reproduce."""
    kind = type(getattr(attn, "processor", None)).__name__
    if kind not in PROCESSORS or getattr(attn, "spatial_norm", None) is not None:
        extra = " with a spatial norm" if getattr(attn, "spatial_norm", None) is not None else ""
        raise ValueError(f"parallelize_vae: {full} uses {kind}{extra}; the parallel VAE "
                         f"computes {', '.join(sorted(PROCESSORS))}'s attention only")


def band_attention(attn, band: torch.Tensor, full: torch.Tensor, begin: int,
                   mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``attn``'s output at the positions of ``band`` [B, C, ..., rows, W], which start at row
    ``begin`` of ``full`` [B, C, ..., H, W] (the same positions flattened in the same order);
    ``mask``: an additive [band positions, all positions] mask, or None."""
    b = full.shape[0]
    normed = full if attn.group_norm is None else attn.group_norm(
        full.flatten(2)).view(full.shape)
    kv = normed.flatten(2).transpose(1, 2)                            # [B, L, C]
    q = attn.to_q(normed.narrow(-2, begin, band.shape[-2]).flatten(2).transpose(1, 2))
    k, v = attn.to_k(kv), attn.to_v(kv)
    d = k.shape[-1] // attn.heads
    q, k, v = (z.view(b, -1, attn.heads, d).transpose(1, 2) for z in (q, k, v))
    q = q if attn.norm_q is None else attn.norm_q(q)
    k = k if attn.norm_k is None else attn.norm_k(k)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else
                                       mask[None, None])
    o = attn.to_out[1](attn.to_out[0](o.transpose(1, 2).flatten(2).to(q.dtype)))
    if attn.residual_connection:
        o = o + band.flatten(2).transpose(1, 2)
    o = o / attn.rescale_output_factor
    return o.transpose(1, 2).reshape(band.shape)


def attention(bands: Bands, name: str) -> Callable:
    """forward(self, x [B, C, rows, W]) of diffusers' Attention in a mid block (AutoencoderKL):
    :func:`band_attention` over the gathered input."""
    def forward(self, x: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
                **kwargs) -> torch.Tensor:
        if not bands.active:
            return type(self).forward(self, x, encoder_hidden_states, attention_mask, **kwargs)
        if encoder_hidden_states is not None or attention_mask is not None or any(
                v is not None for v in kwargs.values()):
            raise ValueError(f"parallelize_vae: {name} got a cross-attention input, a mask or "
                             f"extra arguments; the parallel VAE supports self-attention only")
        begin, _ = bands.local_range(x.shape[-2], name)
        return band_attention(self, x, gather_rows(bands, x, -2, name), begin)
    return forward
