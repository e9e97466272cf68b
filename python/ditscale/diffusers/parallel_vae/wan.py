"""The plan of ``AutoencoderKLWan`` (Wan 2.1 and 2.2): which decoder modules get a band-aware
forward (:mod:`.layers`) and which work per position and run as they are (RMS norm over
channels, activations, nearest up-sampling by 2, Wan 2.2's DupUp3D, the containers).
Any other class in the decoder is refused by name. See docs/diffusers/vae.md.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch.nn as nn

from . import layers
from .bands import Bands

# Classes that act per position (or only hold children): no halo, no collective.
LOCAL = frozenset({"WanDecoder3d", "WanMidBlock", "WanResidualBlock", "WanUpBlock",
                   "WanResidualUpBlock", "WanResample", "WanUpsample", "WanRMS_norm", "DupUp3D",
                   "Dropout", "Identity", "Sequential", "ModuleList", "SiLU"})

# Class -> (the factory of its band-aware forward, the kernel's height index to check or None).
REPLACED: Dict[str, Tuple[Callable, object]] = {
    "WanCausalConv3d": (layers.wan_causal_conv3d, 1),
    "Conv2d": (layers.conv2d, 0),
    "WanAttentionBlock": (layers.wan_attention, None),  # its children run as they are
}


def _visit(full: str, module: nn.Module, found: list) -> None:
    cls = type(module).__name__
    if cls in REPLACED:
        factory, kdim = REPLACED[cls]
        if kdim is not None:
            layers.check_conv(module, full, kdim)
        found.append((full, module, factory))
        return  # a convolution has no children; the attention block's run as they are
    if cls not in LOCAL:
        raise ValueError(f"parallelize_vae: {full} is a {cls}, which the parallel "
                         f"AutoencoderKLWan decoder does not support")
    for name, child in module.named_children():
        _visit(f"{full}.{name}", child, found)


def decoder_layers(vae, bands: Bands) -> List[Tuple[nn.Module, Callable]]:
    """(module, band-aware forward) of every decoder layer to replace (post_quant_conv and
    vae.decoder); refuses an unknown class or an unsupported convolution by name."""
    found: list = []
    _visit("post_quant_conv", vae.post_quant_conv, found)
    _visit("decoder", vae.decoder, found)
    return [(m, factory(bands, name)) for name, m, factory in found]
