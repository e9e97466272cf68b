"""The plan of ``AutoencoderKLHunyuanVideo``: its causal Conv3d (time and width padded as
stock, replicate padding by default: the image's top and bottom rows are copied, the rows
between bands come from the neighbours; the encoder's stride-2 ones on bands aligned to 2),
GroupNorm (statistics combined over the bands), and the mid blocks, whose attention over all
frames and positions (causal over frames) runs for this band's queries over the keys and values
of the gathered input.
Up-sampling is nearest: per position. Any other class is refused by name.
See docs/diffusers/vae.md.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import layers
from .bands import Bands
from .comm import gather_rows

LOCAL = frozenset({"HunyuanVideoEncoder3D", "HunyuanVideoDownBlock3D",
                   "HunyuanVideoDownsampleCausal3D", "HunyuanVideoDecoder3D",
                   "HunyuanVideoUpBlock3D",
                   "HunyuanVideoResnetBlockCausal3D", "HunyuanVideoUpsampleCausal3D",
                   "Dropout", "Identity", "ModuleList", "SiLU"})


def causal_conv3d(bands: Bands, name: str) -> Callable:
    """forward(self, x [B, C, T, rows, W]) of a HunyuanVideoCausalConv3d."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bands.active:
            return type(self).forward(self, x)
        padding = list(self.time_causal_padding)
        halo = padding[2]
        padding[2] = padding[3] = 0
        x = F.pad(x, padding, mode=self.pad_mode)
        border = "replicate" if self.pad_mode == "replicate" else "zeros"
        conv = self.conv
        return conv(layers.conv_rows(bands, x, conv.kernel_size[1], conv.stride[1], halo, -2,
                                     name, border))
    return forward


def mid_block(bands: Bands, name: str) -> Callable:
    """forward(self, x [B, C, T, rows, W]) of a HunyuanVideoMidBlock3D: its resnets on the band,
    each attention for this band's queries over the keys and values of the gathered input."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bands.active:
            return type(self).forward(self, x)
        x = self.resnets[0](x)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            if attn is not None:
                begin, _ = bands.local_range(x.shape[-2], name)
                x = band_attention(attn, x, gather_rows(bands, x, -2, name), begin)
            x = resnet(x)
        return x
    return forward


def band_attention(attn, band: torch.Tensor, full: torch.Tensor, begin: int) -> torch.Tensor:
    """What diffusers' Attention computes with AttnProcessor2_0 and the stock frame-causal mask
    (group norm, q / k / v, SDPA, output projection, residual, rescale) for the positions of
    ``band`` [B, C, T, rows, W] only, which start at row ``begin`` of ``full`` [B, C, T, H, W]:
    queries of the band, keys and values of every position (1 / N of the stock's work)."""
    b, _, t, h, w = full.shape
    rows = band.shape[-2]
    normed = full if attn.group_norm is None else attn.group_norm(
        full.flatten(2)).view(full.shape)
    kv = normed.permute(0, 2, 3, 4, 1).flatten(1, 3)                      # [B, T*H*W, C]
    q = attn.to_q(normed.narrow(-2, begin, rows).permute(0, 2, 3, 4, 1).flatten(1, 3))
    k, v = attn.to_k(kv), attn.to_v(kv)
    d = k.shape[-1] // attn.heads
    q, k, v = (z.view(b, -1, attn.heads, d).transpose(1, 2) for z in (q, k, v))
    q = q if attn.norm_q is None else attn.norm_q(q)
    k = k if attn.norm_k is None else attn.norm_k(k)
    frame_q = torch.arange(t, device=band.device).repeat_interleave(rows * w)
    frame_k = torch.arange(t, device=band.device).repeat_interleave(h * w)
    mask = torch.zeros((), dtype=q.dtype, device=band.device).masked_fill(
        frame_k[None, :] > frame_q[:, None], float("-inf"))              # [T*rows*W, T*H*W]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
    o = attn.to_out[1](attn.to_out[0](o.transpose(1, 2).flatten(2).to(q.dtype)))
    if attn.residual_connection:
        o = o + band.permute(0, 2, 3, 4, 1).flatten(1, 3)
    o = o / attn.rescale_output_factor
    return o.unflatten(1, (t, rows, w)).permute(0, 4, 1, 2, 3)


def _check(full: str, module: nn.Module) -> None:
    cls = type(module).__name__
    if cls == "HunyuanVideoCausalConv3d":
        conv, pad = module.conv, module.time_causal_padding
        if module.pad_mode not in ("replicate", "constant") or pad[2] != pad[3]:
            raise ValueError(f"parallelize_vae: {full} pads with {module.pad_mode!r} {pad}; "
                             f"not supported yet")
        if conv.padding[1] != 0:
            raise ValueError(f"parallelize_vae: {full} (HunyuanVideoCausalConv3d) pads in its "
                             f"Conv3d too; not supported yet")
        layers.check_window(full, "HunyuanVideoCausalConv3d", conv.kernel_size[1],
                            conv.stride[1], conv.dilation[1], pad[2])
    elif cls == "Conv3d" and (module.kernel_size[1], module.stride[1],
                              module.padding[1]) != (1, 1, 0):
        raise ValueError(f"parallelize_vae: {full} (Conv3d) is not 1x1 in height; not "
                         f"supported yet")
    elif cls == "HunyuanVideoUpsampleCausal3D" and module.upsample_factor[1] not in (1, 2):
        raise ValueError(f"parallelize_vae: {full} up-samples the height by "
                         f"{module.upsample_factor[1]}; only 1 or 2 are supported")


# Attention processors whose computation band_attention reproduces.
PROCESSORS = frozenset({"AttnProcessor2_0", "AttnProcessor"})


def _mid_block(full: str, module: nn.Module, found: list, walk: layers.Walk) -> bool:
    """The mid block is replaced whole (its attentions: band queries over the gathered input)
    and its resnets are walked."""
    if type(module).__name__ != "HunyuanVideoMidBlock3D":
        return False
    for i, attn in enumerate(module.attentions):
        kind = type(getattr(attn, "processor", None)).__name__
        if attn is not None and (kind not in PROCESSORS or attn.spatial_norm is not None):
            raise ValueError(f"parallelize_vae: {full}.attentions.{i} uses {kind}"
                             f"{' with a spatial norm' if attn.spatial_norm is not None else ''};"
                             f" the parallel mid block computes {', '.join(sorted(PROCESSORS))}'s"
                             f" attention only")
    found.append((full, module, mid_block))
    for i, resnet in enumerate(module.resnets):
        walk(f"{full}.resnets.{i}", resnet, found)
    return True


WALK = layers.Walk(
    {"HunyuanVideoCausalConv3d": causal_conv3d, "GroupNorm": layers.group_norm},
    LOCAL | {"Conv3d"},  # a Conv3d here is 1x1 (quant_conv, post_quant_conv)
    "AutoencoderKLHunyuanVideo", check=_check, special=_mid_block)
