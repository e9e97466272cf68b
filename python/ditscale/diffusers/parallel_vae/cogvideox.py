"""The plan of ``AutoencoderKLCogVideoX``: its causal Conv3d (the stock temporal cache of the
frame batches, then the height halo; zero padding, or copies of the edge row where a layer pads
with "replicate", as the stock layer branches on its pad_mode), GroupNorm (the encoder's and
the one inside the decoder's spatial norm: statistics combined over the bands), the encoder's
down-samplers (time averaged per position, then a stride-2 Conv2d whose bottom pad row comes
from the next band); the spatial norm's nearest interpolation of the latents, the up-sampling
(nearest, then a halo Conv2d) and 1x1 convolutions act per position. Any other class is
refused by name. See docs/diffusers/vae.md.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import layers
from .bands import Bands
from .comm import add_halo

LOCAL = frozenset({"CogVideoXEncoder3D", "CogVideoXDownBlock3D", "CogVideoXDecoder3D",
                   "CogVideoXMidBlock3D", "CogVideoXResnetBlock3D", "CogVideoXUpBlock3D",
                   "CogVideoXUpsample3D", "CogVideoXSpatialNorm3D",
                   "Dropout", "Identity", "ModuleList", "SiLU"})


def causal_conv3d(bands: Bands, name: str) -> Callable:
    """forward(self, inputs [B, C, T, rows, W], conv_cache) -> (output, conv_cache) of a
    CogVideoXCausalConv3d: the cache holds this band's frames; the convolution pads no height."""
    def forward(self, inputs: torch.Tensor, conv_cache=None):
        if not bands.active:
            return type(self).forward(self, inputs, conv_cache)
        conv, halo = self.conv, self.height_pad
        if self.pad_mode == "replicate":
            padding = list(self.time_causal_padding)
            padding[2] = padding[3] = 0
            x = F.pad(inputs, padding, mode="replicate")
            x, cache, border, width = x, None, "replicate", 0
        else:
            x = self.fake_context_parallel_forward(inputs, conv_cache)
            cache = x[:, :, -self.time_kernel_size + 1:].clone()
            border, width = "zeros", conv.padding[2]
        x = add_halo(bands, x, halo, halo, -2, name, border)
        out = F.conv3d(x, conv.weight, conv.bias, conv.stride, (conv.padding[0], 0, width),
                       conv.dilation, conv.groups)
        return out, cache
    return forward


def _check(full: str, module: nn.Module) -> None:
    cls = type(module).__name__
    if cls == "CogVideoXCausalConv3d":
        conv = module.conv
        if (conv.stride[1] != 1 or conv.dilation[1] != 1
                or conv.kernel_size[1] != 2 * module.height_pad + 1):
            raise ValueError(f"parallelize_vae: {full} (CogVideoXCausalConv3d) is not a "
                             f"stride-1 same-size convolution in height; not supported yet")
    elif cls == "CogVideoXSafeConv3d" and (module.kernel_size[1], module.stride[1],
                                           module.padding[1]) != (1, 1, 0):
        raise ValueError(f"parallelize_vae: {full} (CogVideoXSafeConv3d) is not 1x1 in height; "
                         f"not supported yet")
    elif cls == "Conv2d":
        layers.check_conv(module, full, 0)


WALK = layers.Walk(
    {"CogVideoXCausalConv3d": causal_conv3d, "GroupNorm": layers.group_norm,
     "Conv2d": layers.conv2d},
    LOCAL | {"CogVideoXSafeConv3d"},  # that one is 1x1 here
    "AutoencoderKLCogVideoX", check=_check, special=layers.down_sampler)
