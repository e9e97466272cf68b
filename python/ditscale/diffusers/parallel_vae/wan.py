"""The plan of ``AutoencoderKLWan`` (Wan 2.1 and 2.2): which encoder and decoder modules get a
band-aware forward (:mod:`.layers`: the convolutions, whose inputs a band assembles channels
innermost, the RMS norm over channels as one fused kernel, the attention block) and which work
per position and run as they are (activations, nearest up-sampling by 2, Wan 2.2's DupUp3D /
AvgDown3D on bands aligned to their factor, the containers). The encoder's down-sampling (a
bottom zero row, then a stride-2 convolution) takes the row below from the next band. Any other
class is refused by name. See docs/diffusers/vae.md.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch.nn as nn

from . import layers
from .bands import Bands

# Classes that act per position (or only hold children): no halo, no collective.
LOCAL = frozenset({"WanEncoder3d", "WanDecoder3d", "WanMidBlock", "WanResidualBlock",
                   "WanUpBlock", "WanResidualUpBlock", "WanResidualDownBlock", "WanUpsample",
                   "DupUp3D", "AvgDown3D", "Dropout", "Identity", "Sequential",
                   "ModuleList", "SiLU"})

# Class -> (the factory of its band-aware forward, the kernel's height index to check or None).
REPLACED: Dict[str, Tuple[Callable, object]] = {
    "WanCausalConv3d": (layers.wan_causal_conv3d, 1),
    "Conv2d": (layers.wan_conv2d, 0),
    "WanRMS_norm": (layers.wan_rms_norm, None),
    "WanAttentionBlock": (layers.wan_attention, None),  # its children run as they are
}


def _downsample(full: str, module: nn.Module, found: list) -> None:
    """A WanResample down-sampling: ZeroPad2d((0, 1, 0, 1)) and Conv2d(3, stride 2), whose
    bottom row comes from the next band (bands start on even rows: see apply)."""
    pad, conv = module.resample[0], module.resample[1]
    if (type(pad).__name__ != "ZeroPad2d" or tuple(pad.padding) != (0, 1, 0, 1)
            or type(conv).__name__ != "Conv2d" or conv.kernel_size[0] != 3
            or conv.stride[0] != 2 or conv.padding[0] != 0 or conv.dilation[0] != 1):
        raise ValueError(f"parallelize_vae: {full} ({module.mode}) is not the stock "
                         f"ZeroPad2d((0, 1, 0, 1)) + Conv2d(3, stride 2) down-sampling")
    found.append((f"{full}.resample.0", pad, layers.zero_pad2d))
    if hasattr(module, "time_conv"):
        _visit(f"{full}.time_conv", module.time_conv, found)


def _visit(full: str, module: nn.Module, found: list) -> None:
    cls = type(module).__name__
    if cls == "WanResample":
        if module.mode.startswith("downsample"):
            return _downsample(full, module, found)
        if module.mode not in ("upsample2d", "upsample3d", "none"):
            raise ValueError(f"parallelize_vae: {full} has the unknown mode {module.mode!r}")
    elif cls in REPLACED:
        factory, kdim = REPLACED[cls]
        if kdim is not None:
            layers.check_conv(module, full, kdim)
        found.append((full, module, factory))
        return  # a convolution has no children; the attention block's run as they are
    elif cls not in LOCAL:
        raise ValueError(f"parallelize_vae: {full} is a {cls}, which the parallel "
                         f"AutoencoderKLWan does not support")
    for name, child in module.named_children():
        _visit(f"{full}.{name}", child, found)


def wan_layers(vae, bands: Bands) -> List[Tuple[nn.Module, Callable]]:
    """(module, band-aware forward) of every layer of the encoder and decoder to replace;
    refuses an unknown class or an unsupported convolution by name."""
    found: list = []
    for name in ("encoder", "quant_conv", "post_quant_conv", "decoder"):
        _visit(name, getattr(vae, name), found)
    return [(m, factory(bands, name)) for name, m, factory in found]

