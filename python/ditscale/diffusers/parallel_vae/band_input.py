"""The padded input of a band's convolution assembled in one buffer: the cached frames and this
band's frames, the zero frames of causal time padding, the zero width padding, and the halo
rows of the neighbouring bands (zeros at the image border), each written once into
``[B, C, (T',) top + rows + bottom, left + W + right]``, channels innermost on request (the
layout cuDNN computes in: no transposes around the convolution).

The stock causal convolution concatenates its cache and then pads (two copies of the whole
input); :func:`.comm.add_halo` would add a third. Here the band's own rows are copied once and
everything else (frames of the cache, a few halo rows, the padding strips) is small, in few
calls (a thin band is launch-bound: every call counts). The halo rows include the padding frames
and columns, so the neighbours exchange exactly the rows the stock padded input holds. See
docs/diffusers/vae.md.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import comm
from .bands import Bands

# Memory format of a channels-last buffer, by the buffer's rank.
_CHANNELS_LAST = {5: torch.channels_last_3d, 4: torch.channels_last}


def _empty(x: torch.Tensor, shape, channels_last: bool) -> torch.Tensor:
    """An uninitialized buffer of ``shape`` like ``x`` (channels innermost if asked)."""
    if not channels_last:
        return x.new_empty(shape)
    return torch.empty(shape, dtype=x.dtype, device=x.device,
                       memory_format=_CHANNELS_LAST[len(shape)])


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


def _fill(out: torch.Tensor, frames: Sequence[torch.Tensor], front: int, back: int,
          window) -> None:
    """Copies ``frames`` (concatenated along dim 2 when 5-D) into the rows x columns ``window``
    of ``out``, after ``front`` and before ``back`` zero frames."""
    rows, cols = window
    if out.dim() == 4:
        out[..., rows, cols].copy_(frames[0])
        return
    t = front + sum(f.shape[2] for f in frames)
    inner = out[:, :, front:t, rows, cols]
    if len(frames) == 1:
        inner.copy_(frames[0])
    else:
        torch.cat(frames, 2, out=inner)
    if front:
        out[:, :, :front].zero_()
    if back:
        out[:, :, t:].zero_()


def _add_halo_rows(bands: Bands, out: torch.Tensor, top: int, bottom: int, rows: int,
                   where: str) -> None:
    """Writes rank r-1's last ``top`` rows and rank r+1's first ``bottom`` rows (whole padded
    rows: :func:`.comm.neighbour_rows`) above and below this band's ``rows`` rows of ``out``
    (zeros at the image border)."""
    above, below = comm.neighbour_rows(bands, out.narrow(-2, top, rows), top, bottom, -2, where)
    if top:
        _write(out[..., :top, :], above)
    if bottom:
        _write(out[..., top + rows:, :], below)


def _write(dst: torch.Tensor, rows) -> None:
    """``rows`` into ``dst``, or zeros where there are none (the image border)."""
    if rows is None:
        dst.zero_()
    else:
        dst.copy_(rows)


def conv_input(bands: Bands, frames: Sequence[torch.Tensor], front: int, back: int,
               top: int, bottom: int, left: int, right: int, where: str,
               channels_last: bool = False) -> torch.Tensor:
    """The zero-padded input of a convolution over this band: ``frames`` (5-D [B, C, t, rows,
    W] pieces concatenated along time, or one 4-D [N, C, rows, W]) after ``front`` and before
    ``back`` zero frames (5-D only), ``left`` / ``right`` zero columns, ``top`` rows of the band
    above and ``bottom`` of the band below; the one frame piece itself when there is nothing to
    add. Refuses a band thinner than the halo by name."""
    x = frames[-1]
    rows, width = x.shape[-2], x.shape[-1]
    if len(frames) == 1 and not (front or back or top or bottom or left or right):
        return x
    comm.check_halo(bands, bands.level_counts(rows, where), max(top, bottom), where)
    shape = list(x.shape)
    shape[-2:] = [top + rows + bottom, left + width + right]
    if x.dim() == 5:
        shape[2] = front + sum(f.shape[2] for f in frames) + back
    out = _empty(x, shape, channels_last)
    frames = [f if f.device == x.device else f.to(x.device) for f in frames]
    _fill(out, frames, front, back, (slice(top, top + rows), slice(left, left + width)))
    _zero_columns(out, left, right)
    if top or bottom:
        _add_halo_rows(bands, out, top, bottom, rows, where)
    return out
