"""The per-layer replacements of a parallel VAE: forwards bound on the stock modules while a
VAE is parallelized (weights untouched). Each runs its stock form outside a parallel call.

- a height-``k`` convolution (Conv2d, Wan's causal Conv3d with its temporal feature cache) pads
  time and width as the stock layer does, then takes ``(k - 1) / 2`` halo rows from each
  neighbouring band (zeros at the image border) and convolves without height padding: the band
  of the stock output, exactly; a stride-``s`` one (the encoder's down-sampling, bands aligned
  to ``s``) takes its top padding's rows from above and ``k - s - top`` from below;
- GroupNorm combines each group's per-band count, mean and variance over the bands;
- Wan's spatial attention block gathers its keys and values (the 1x1 projections of every band)
  and attends from this band's queries only (diffusers' ``Attention`` of a mid block: the
  same in :mod:`.attention`).
See docs/diffusers/vae.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .band_input import conv_input
from .bands import Bands
from .comm import add_halo, gather_rows, group_stats


@dataclass(frozen=True)
class Walk:
    """How a VAE's layers are found: ``replaced`` (class -> the factory of its band-aware
    forward; the module is taken whole), ``local`` (classes looked through: they compute per
    row), ``check(full, module)`` (refuses an unsupported configuration by name), ``special``
    (``(full, module, found, walk) -> True`` when it took the module itself) and ``what`` (the
    VAE part named in a refusal)."""

    replaced: Dict[str, Callable]
    local: FrozenSet[str]
    what: str
    check: Optional[Callable] = None
    special: Optional[Callable] = None

    def __call__(self, full: str, module: nn.Module, found: list) -> None:
        """Appends (name, module, factory) of every layer below ``module`` to ``found``."""
        cls = type(module).__name__
        if self.check is not None:
            self.check(full, module)
        if self.special is not None and self.special(full, module, found, self):
            return
        if cls in self.replaced:
            found.append((full, module, self.replaced[cls]))
            return
        if cls not in self.local:
            raise ValueError(f"parallelize_vae: {full} is a {cls}, which the parallel "
                             f"{self.what} does not support")
        for name, child in module.named_children():
            self(f"{full}.{name}", child, found)

    def layers(self, vae, bands: Bands) -> List[Tuple[nn.Module, Callable]]:
        """(module, band-aware forward) of every layer of the encoder, quant_conv,
        post_quant_conv and the decoder."""
        found: list = []
        for part in PARTS:
            if getattr(vae, part, None) is not None:
                self(part, getattr(vae, part), found)
        return [(m, factory(bands, name)) for name, m, factory in found]


# The parts of a VAE a plan walks (quant_conv / post_quant_conv may be None).
PARTS = ("encoder", "quant_conv", "post_quant_conv", "decoder")


def check_conv(module: nn.Module, name: str, dim: int) -> None:
    """Refuses a convolution whose height window does not map bands to bands: zero padding
    ``p`` above and below, kernel ``k``, stride ``s`` (> 1 in the encoder only, whose bands
    start on multiples of every stride) with ``k - s <= 2p <= k - 1`` and ``k - s - p >= 0``
    (``dim``: the kernel's height index)."""
    k, s, d, p = (module.kernel_size[dim], module.stride[dim], module.dilation[dim],
                  module.padding[dim] if not hasattr(module, "_padding") else
                  module._padding[2])
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        raise ValueError(f"parallelize_vae: {name} ({type(module).__name__}) pads with "
                         f"{module.padding_mode!r} {module.padding!r}; not supported yet")
    check_window(name, type(module).__name__, k, s, d, p)


def check_window(name: str, cls: str, k: int, s: int, d: int, p: int) -> None:
    """The height window of :func:`check_conv` (``d``: dilation, ``p``: top padding)."""
    strided_ok = s == 1 or name.startswith("encoder.")
    if d != 1 or not strided_ok or not k - s <= 2 * p <= k - 1 or k - s - p < 0:
        raise ValueError(f"parallelize_vae: {name} ({cls}) has a height kernel {k}, stride {s}, "
                         f"dilation {d}, padding {p}; only same-size stride-1 convolutions "
                         f"(and the encoder's down-sampling strides) are supported yet")


def check_aligned(bands: Bands, rows: int, s: int, where: str) -> None:
    """Raises unless this band (``rows`` rows at a stride-``s`` layer's resolution) starts and
    ends on multiples of ``s``."""
    begin, count = bands.local_range(rows, where)
    if begin % s or count % s:
        raise RuntimeError(f"parallelize_vae: {where} has stride {s} but this band holds rows "
                           f"[{begin}, {begin + count}), not aligned to it")


def conv_rows(bands: Bands, x: torch.Tensor, k: int, s: int, top: int, dim: int, where: str,
              border: str = "zeros") -> torch.Tensor:
    """``x`` (this band along ``dim``) with the rows a height-``k``, stride-``s`` convolution
    padded ``top`` rows above needs for this band's output rows (``rows / s`` of them):
    ``top`` rows of the band above, ``k - s - top`` of the band below (at the image border:
    zeros, or copies of the edge row). The band must start on a multiple of ``s``."""
    check_aligned(bands, x.shape[dim], s, where)
    return add_halo(bands, x, top, k - s - top, dim, where, border)


def conv2d(bands: Bands, name: str, channels_last: bool = False) -> Callable:
    """forward(self, x [N, C, rows, W]) of an nn.Conv2d over this rank's band of rows (its
    input assembled channels innermost if asked: :mod:`.band_input`)."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bands.active:
            return type(self).forward(self, x)
        ph, pw = self.padding  # the width padding stays the convolution's own (as stock's)
        k, s = self.kernel_size[0], self.stride[0]
        check_aligned(bands, x.shape[-2], s, name)
        x = conv_input(bands, [x], 0, 0, ph, k - s - ph, 0, 0, name, channels_last)
        return F.conv2d(x, self.weight, self.bias, self.stride, (0, pw), self.dilation,
                        self.groups)
    return forward


def padded_down_conv2d(bands: Bands, name: str) -> Callable:
    """forward(self, x [N, C, rows + 1, W + 1]) of the stride-2 Conv2d of a down-sampler that
    zero-pads (0, 1, 0, 1) itself (AutoencoderKL's Downsample2D with padding 0, CogVideoX's):
    the zero row it added below this band becomes the first row of the band below (zeros at
    the image's bottom only)."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bands.active:
            return type(self).forward(self, x)
        x = conv_rows(bands, x.narrow(-2, 0, x.shape[-2] - 1), self.kernel_size[0],
                      self.stride[0], 0, -2, name)
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
    return forward


# Down-samplers that zero-pad (0, 1, 0, 1) before their stride-2 Conv2d ``conv``:
# class -> whether a module pads itself (else its conv pads and is walked as a Conv2d).
SELF_PADDING = {
    "Downsample2D": lambda m: m.use_conv and m.padding == 0,
    "CogVideoXDownsample3D": lambda m: True,
}


def down_sampler(full: str, module: nn.Module, found: list, walk: "Walk") -> bool:
    """Walk's ``special`` hook for the :data:`SELF_PADDING` down-samplers: True when it took
    ``module`` (its conv gets :func:`padded_down_conv2d`)."""
    cls = type(module).__name__
    if cls not in SELF_PADDING:
        return False
    conv = module.conv
    if (type(conv).__name__ != "Conv2d" or getattr(module, "norm", None) is not None
            or not full.startswith("encoder.")):
        raise ValueError(f"parallelize_vae: {full} ({cls}) with a norm, no convolution or in "
                         f"the decoder is not supported yet")
    if not SELF_PADDING[cls](module):
        return False  # its Conv2d pads: walked as one
    if conv.padding[0] != 0 or conv.padding_mode != "zeros":
        raise ValueError(f"parallelize_vae: {full} ({cls}) pads and its conv pads too")
    if conv.kernel_size[0] - conv.stride[0] != 1 or conv.dilation[0] != 1:  # 1 row below
        raise ValueError(f"parallelize_vae: {full}.conv (Conv2d) has a height kernel "
                         f"{conv.kernel_size[0]}, stride {conv.stride[0]}, dilation "
                         f"{conv.dilation[0]}; a self-padding down-sampler needs kernel = "
                         f"stride + 1, dilation 1")
    found.append((f"{full}.conv", conv, padded_down_conv2d))
    return True


def zero_pad2d(bands: Bands, name: str) -> Callable:
    """forward(self, x [N, C, rows, W]) of an nn.ZeroPad2d (left, right, top, bottom): the
    width padding, then top / bottom rows of the neighbouring bands (zeros at the border)."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bands.active:
            return type(self).forward(self, x)
        left, right, top, bottom = self.padding
        return add_halo(bands, F.pad(x, (left, right, 0, 0)), top, bottom, -2, name)
    return forward


def wan_conv2d(bands: Bands, name: str) -> Callable:
    """:func:`conv2d` with its input channels innermost (the layout of Wan's band)."""
    return conv2d(bands, name, channels_last=True)


def wan_causal_conv3d(bands: Bands, name: str) -> Callable:
    """forward(self, x [B, C, T, rows, W], cache_x) of a WanCausalConv3d: its input (the cached
    frames, the stock causal time and width padding, the height halo) assembled in one buffer,
    channels innermost (:mod:`.band_input`), convolved without padding as the stock layer is."""
    def forward(self, x: torch.Tensor, cache_x=None) -> torch.Tensor:
        if not bands.active:
            return type(self).forward(self, x, cache_x)
        left, right, top, _, front, back = self._padding
        frames = [x]
        if cache_x is not None and front > 0:
            frames.insert(0, cache_x)
            front -= cache_x.shape[2]
        k, s = self.kernel_size[1], self.stride[1]
        check_aligned(bands, x.shape[-2], s, name)
        x = conv_input(bands, frames, front, back, top, k - s - top, left, right, name, True)
        return F.conv3d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
    return forward


def wan_rms_norm(bands: Bands, name: str) -> Callable:
    """forward(self, x [B, C, ...]) of a channels-first WanRMS_norm, whose function
    ``x / ||x||_C * sqrt(C) * gamma + bias`` is ``x * rsqrt(mean_C(x^2) + eps) * gamma + bias``:
    one F.rms_norm over the channels (float32 inside, x's dtype out) instead of the stock's
    chain of float32 copies, with eps = 1e-24 / C, which equals the stock's
    ``max(||x||, 1e-12)`` wherever ``||x|| > 1e-12`` (a zero vector gives zeros in both)."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bands.active:
            return type(self).forward(self, x)
        return _fused_rms(self, x)
    return forward


def _fused_rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """WanRMS_norm ``norm`` of ``x`` as :func:`wan_rms_norm` computes it (channels-last
    ones: the stock forward)."""
    if not norm.channel_first:
        return type(norm).forward(norm, x)
    c = x.shape[1]
    y = F.rms_norm(x.movedim(1, -1), (c,), norm.gamma.reshape(-1).to(x.dtype),
                   eps=1e-24 / c).movedim(-1, 1)
    return y if isinstance(norm.bias, float) and norm.bias == 0.0 else y + norm.bias


def _heads(qkv: torch.Tensor, frames: int, channels: int):
    """q, k, v [frames, 1, rows * W, C] of a to_qkv output [frames, 3C, rows, W]."""
    qkv = qkv.reshape(frames, 1, channels * 3, -1).permute(0, 1, 3, 2).contiguous()
    return qkv.chunk(3, dim=-1)


def wan_attention(bands: Bands, name: str) -> Callable:
    """forward(self, x [B, C, T, rows, W]) of a WanAttentionBlock (one head over each frame's
    positions): its norm fused (:func:`wan_rms_norm`), queries of this band, keys and values of
    the whole frame."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bands.active:
            return type(self).forward(self, x)
        identity = x
        b, c, t, h, w = x.size()
        x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        qkv = self.to_qkv(_fused_rms(self.norm, x))
        q, _, _ = _heads(qkv, b * t, c)
        _, k, v = _heads(gather_rows(bands, qkv, 2, name), b * t, c)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w)
        x = self.proj(x)
        x = x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4)
        return x + identity
    return forward


# Elements of the float32 copy that one step of :func:`_var_mean` makes (64 MiB).
STATS_CHUNK = 1 << 24


def _var_mean(flat: torch.Tensor):
    """(mean, variance) in float64 of each [sample, group] row of ``flat`` [B, G, n]: float32
    Welford (torch.var_mean) over a few groups at a time, so the float32 copy of a bf16
    activation stays near :data:`STATS_CHUNK` elements."""
    step = max(1, STATS_CHUNK // max(1, flat.shape[0] * flat.shape[2]))
    parts = [torch.var_mean(g.float(), dim=-1, correction=0) for g in flat.split(step, dim=1)]
    return (torch.cat([m for _, m in parts], 1).double(),
            torch.cat([v for v, _ in parts], 1).double())


def group_norm(bands: Bands, name: str) -> Callable:
    """forward(self, x [N, C, ..., rows, W]) of an nn.GroupNorm over every band: each band's
    (count, mean, variance) per (sample, group) in float32 (Welford, :func:`_var_mean`),
    combined exactly in float64 (:func:`.comm.group_stats`), then the normalization with those
    statistics per channel as one fused kernel (an inference batch norm over the N * C
    channels: float32 inside, x's dtype out)."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bands.active:
            return type(self).forward(self, x)
        b, c, per = x.shape[0], x.shape[1], x.shape[1] // self.num_groups
        flat = x.reshape(b, self.num_groups, -1)
        mean, var = group_stats(bands, flat.shape[-1], *_var_mean(flat), name)
        weight = self.weight.float().repeat(b) if self.affine else None
        bias = self.bias.float().repeat(b) if self.affine else None
        mean, var = (t.float().repeat_interleave(per, dim=1).reshape(-1) for t in (mean, var))
        eps = max(self.eps, torch.finfo(torch.float32).tiny)  # batch_norm takes eps > 0 only
        y = F.batch_norm(x.reshape(1, b * c, -1), mean, var, weight, bias, False, 0.0, eps)
        return y.reshape(x.shape)
    return forward
