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
from .attention import band_attention, check_attention
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
                _, _, t, rows, w = x.shape
                full = gather_rows(bands, x, -2, name)
                mask = causal_mask(t, rows * w, full.shape[-2] * w, x.dtype, x.device)
                x = band_attention(attn, x, full, begin, mask)
            x = resnet(x)
        return x
    return forward


def causal_mask(frames: int, band: int, whole: int, dtype, device) -> torch.Tensor:
    """The stock frame-causal mask's rows of a band: [frames * band, frames * whole], 0 where
    the key's frame is at most the query's, -inf elsewhere (``band`` / ``whole``: positions of
    one frame in the band / the image)."""
    frame_q = torch.arange(frames, device=device).repeat_interleave(band)
    frame_k = torch.arange(frames, device=device).repeat_interleave(whole)
    return torch.zeros((), dtype=dtype, device=device).masked_fill(
        frame_k[None, :] > frame_q[:, None], float("-inf"))


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


def _mid_block(full: str, module: nn.Module, found: list, walk: layers.Walk) -> bool:
    """The mid block is replaced whole (its attentions: band queries over the gathered input)
    and its resnets are walked."""
    if type(module).__name__ != "HunyuanVideoMidBlock3D":
        return False
    for i, attn in enumerate(module.attentions):
        if attn is not None:
            check_attention(f"{full}.attentions.{i}", attn)
    found.append((full, module, mid_block))
    for i, resnet in enumerate(module.resnets):
        walk(f"{full}.resnets.{i}", resnet, found)
    return True


WALK = layers.Walk(
    {"HunyuanVideoCausalConv3d": causal_conv3d, "GroupNorm": layers.group_norm},
    LOCAL | {"Conv3d"},  # a Conv3d here is 1x1 (quant_conv, post_quant_conv)
    "AutoencoderKLHunyuanVideo", check=_check, special=_mid_block)
