"""The plan of ``AutoencoderKL`` (Flux, SD3, SD): which encoder and decoder modules get a
band-aware forward (:mod:`.layers`): the 3x3 convolutions (halo), the encoder's Downsample2D
(its stride-2 conv takes the row below from the next band instead of its own zero pad row),
GroupNorm (statistics combined over the bands), the mid blocks' Attention (this band's queries
over the gathered keys and values: :mod:`.attention`); the rest acts per position (activations,
nearest up-sampling by 2, 1x1 convolutions) or only holds children. Any other class is refused
by name. See docs/diffusers/vae.md.
"""

from __future__ import annotations

import torch.nn as nn

from . import layers
from .attention import attention, check_attention

LOCAL = frozenset({"Encoder", "DownEncoderBlock2D", "Downsample2D", "Decoder",
                   "UNetMidBlock2D", "UpDecoderBlock2D", "ResnetBlock2D",
                   "Dropout", "Identity", "ModuleList", "SiLU"})

# Class -> the factory of its band-aware forward.
REPLACED = {"Conv2d": layers.conv2d, "GroupNorm": layers.group_norm,
            "Attention": attention}


def _check(full: str, module: nn.Module) -> None:
    cls = type(module).__name__
    if cls == "Conv2d":
        layers.check_conv(module, full, 0)
    elif cls == "Attention":
        check_attention(full, module)
    elif cls == "Upsample2D" and (module.use_conv_transpose or not module.interpolate
                                  or module.norm is not None):
        raise ValueError(f"parallelize_vae: {full} (Upsample2D) with a transposed convolution, a "
                         f"norm or no interpolation is not supported yet")
    elif cls == "ResnetBlock2D" and (module.upsample is not None or module.downsample is not None
                                     or module.time_emb_proj is not None):
        raise ValueError(f"parallelize_vae: {full} (ResnetBlock2D) re-samples or takes a time "
                         f"embedding; not supported yet")


WALK = layers.Walk(REPLACED, LOCAL | {"Upsample2D"}, "AutoencoderKL", check=_check,
                   special=layers.down_sampler)
