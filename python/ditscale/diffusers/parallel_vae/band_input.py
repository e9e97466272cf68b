"""The padded input of a band's convolution assembled in one buffer: the cached frames and this
band's frames, the zero frames of causal time padding, the zero width padding, and the halo
rows of the neighbouring bands (zeros at the image border), each written once into
``[B, C, (T',) top + rows + bottom, left + W + right]``.

The stock causal convolution concatenates its cache and then pads (two copies of the whole
input); :func:`.comm.add_halo` would add a third. Here the band's own rows are copied once and
everything else (frames of the cache, a few halo rows, the padding strips) is small. The halo
rows include the padding frames and columns, so the neighbours exchange exactly the rows the
stock padded input holds. See docs/diffusers/vae.md.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import comm
from .bands import Bands


def _empty(x: torch.Tensor, shape) -> torch.Tensor:
    """An uninitialized buffer of ``shape`` like ``x``."""
    return x.new_empty(shape)


def _zero_columns(out: torch.Tensor, left: int, right: int) -> None:
    """Zeroes the ``left`` first and ``right`` last columns of ``out`` (one fill when both are
    one column: a strided view of the two)."""
    width = out.shape[-1]
    if left == 1 and right == 1 and width > 2:
        out[..., ::width - 1].zero_()
        return
    if left:
        out[..., :left].zero_()
    if right:
        out[..., width - right:].zero_()


def _fill_frames(out: torch.Tensor, frames: Sequence[torch.Tensor], front: int,
                 rows: slice, cols: slice) -> None:
    """Copies ``frames`` (along dim 2, in order) after ``front`` zero frames into the
    ``rows`` x ``cols`` window of ``out``; the frames before and after them become zeros."""
    t = front
    if front:
        out[:, :, :front].zero_()
    for f in frames:
        out[:, :, t:t + f.shape[2], rows, cols].copy_(f)
        t += f.shape[2]
    if t < out.shape[2]:
        out[:, :, t:].zero_()


def _add_halo_rows(bands: Bands, out: torch.Tensor, top: int, bottom: int, rows: int,
                   where: str) -> None:
    """Writes rank r-1's last ``top`` rows and rank r+1's first ``bottom`` rows (whole padded
    rows) above and below this band's ``rows`` rows of ``out`` (zeros at the image border):
    one all-gather of every band's edge rows."""
    body = out.narrow(-2, top, rows)
    edges = torch.cat([body.narrow(-2, 0, bottom), body.narrow(-2, rows - top, top)], -2)
    parts = comm._all_gather(bands, edges, where)  # the module's: a benchmark patches it
    r, last = bands.rank, bands.rank + 1 == bands.size
    if top:
        dst = out.narrow(-2, 0, top)
        dst.copy_(parts[r - 1].narrow(-2, bottom, top)) if r > 0 else dst.zero_()
    if bottom:
        dst = out.narrow(-2, top + rows, bottom)
        dst.copy_(parts[r + 1].narrow(-2, 0, bottom)) if not last else dst.zero_()


def conv_input(bands: Bands, frames: Sequence[torch.Tensor], front: int, back: int,
               top: int, bottom: int, left: int, right: int, where: str) -> torch.Tensor:
    """The zero-padded input of a convolution over this band: ``frames`` (5-D [B, C, t, rows,
    W] pieces concatenated along time, or one 4-D [N, C, rows, W]) after ``front`` and before
    ``back`` zero frames (5-D only), ``left`` / ``right`` zero columns, ``top`` rows of the band
    above and ``bottom`` of the band below. Refuses a band thinner than the halo by name."""
    x = frames[-1]
    rows, width = x.shape[-2], x.shape[-1]
    comm.check_halo(bands, bands.level_counts(rows, where), max(top, bottom), where)
    shape = list(x.shape)
    shape[-2:] = [top + rows + bottom, left + width + right]
    if x.dim() == 5:
        shape[2] = front + sum(f.shape[2] for f in frames) + back
    out = _empty(x, shape)
    window = (slice(top, top + rows), slice(left, left + width))
    if x.dim() == 5:
        _fill_frames(out, [f.to(x.device) for f in frames], front, *window)
    else:
        out[..., window[0], window[1]].copy_(x)
    _zero_columns(out, left, right)
    if top or bottom:
        _add_halo_rows(bands, out, top, bottom, rows, where)
    return out
