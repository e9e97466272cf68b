"""The collectives of a parallel VAE: the input shape check, the gather of a band into the
full tensor, GroupNorm's statistics, and the exchange of halo rows with the neighbouring bands.

Every collective is an all-gather into one tensor on the mesh's group, so it ends within the
group's timeout when a rank does not join. Halos travel as an all-gather of every rank's edge
rows (a few rows of one layer: small beside the band's compute); rank r takes rank r-1's bottom
rows and rank r+1's top rows, the true image border gets zero rows (the stock zero padding).
See docs/diffusers/vae.md.
"""

from __future__ import annotations

import zlib
from typing import List

import torch
import torch.distributed as dist

from .bands import Bands

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _failed(where: str, e: Exception) -> RuntimeError:
    return RuntimeError(f"{where}: a collective of the parallel VAE failed on rank "
                        f"{dist.get_rank()} (a rank that did not join, or the group timed out): "
                        f"{e}")


def _all_gather(bands: Bands, x: torch.Tensor, where: str) -> torch.Tensor:
    """Every rank's ``x`` stacked, [size, *x.shape]: one collective into one tensor (no
    per-rank outputs to allocate and copy; a caller indexes only the parts it reads)."""
    out = x.new_empty(bands.size * x.numel())  # flat: what every backend takes
    try:
        dist.all_gather_into_tensor(out, x.reshape(-1), group=bands.mesh.group)
    except RuntimeError as e:
        raise _failed(where, e) from e
    return out.view((bands.size,) + tuple(x.shape))


def group_stats(bands: Bands, count: int, mean: torch.Tensor, var: torch.Tensor,
                where: str):
    """(mean, variance) over every band of statistics that each band computed over its
    ``count`` elements (``mean``, ``var``: float64, the same shape on every rank): one
    all-gather of (count, mean, var), then mean = sum n_r m_r / n and
    var = sum n_r (v_r + (m_r - mean)^2) / n (the same inputs, so the same bits, on every
    rank)."""
    if bands.size == 1:
        return mean, var
    mine = torch.stack([torch.full_like(mean, float(count)), mean, var])
    n, m, v = _all_gather(bands, mine, where).unbind(1)  # each [size, *mean.shape]
    total = n.sum(0)
    mean = (n * m).sum(0) / total
    return mean, (n * (v + (m - mean).square())).sum(0) / total


def check_same_shape(bands: Bands, z: torch.Tensor, where: str, tiling: List[int]) -> None:
    """Raises on every rank unless every rank passes an input of the same shape and dtype and
    its VAE has the same tiling settings (``tiling``: use_tiling, then the other settings)."""
    if bands.size == 1:
        return
    if z.dim() > 8:
        raise ValueError(f"{where}: an input of {z.dim()} dimensions (at most 8)")
    code = _DTYPES.index(z.dtype) if z.dtype in _DTYPES else len(_DTYPES)
    digest = zlib.crc32(repr(tiling).encode())
    meta = [z.dim(), code, int(bool(tiling[0])), digest] + list(z.shape) + [0] * (8 - z.dim())
    parts = _all_gather(bands, torch.tensor(meta, dtype=torch.int64, device=z.device),
                        where)
    metas = parts.tolist()
    if any(m != metas[0] for m in metas):
        shapes = [f"rank {r}: {tuple(m[4:4 + m[0]])} {_name(m[1])}, tiling "
                  f"{'on' if m[2] else 'off'}" for r, m in enumerate(metas)]
        raise ValueError(f"{where}: the ranks pass inputs of different shapes or dtypes or "
                         f"their VAEs' tiling settings differ ({'; '.join(shapes)}); every rank "
                         f"must pass the same full input to the same VAE")


def _name(code: int) -> str:
    return str(_DTYPES[code]) if code < len(_DTYPES) else "another dtype"


def gather_rows(bands: Bands, x: torch.Tensor, dim: int, where: str) -> torch.Tensor:
    """The full tensor along ``dim`` (rows) from every rank's band ``x``, on every rank."""
    if bands.size == 1:
        return x
    dim = dim % x.dim()
    counts = bands.level_counts(x.shape[dim], where)
    width = max(counts)
    if x.shape[dim] < width:  # pad to the largest band, gather, trim
        pad = list(x.shape)
        pad[dim] = width - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim)
    parts = _all_gather(bands, x, where)  # [size, ..., width, ...]
    if min(counts) == width:  # even bands: one copy
        return parts.movedim(0, dim).flatten(dim, dim + 1)
    return torch.cat([p.narrow(dim, 0, c) for p, c in zip(parts.unbind(0), counts)], dim)


def gather_flat(bands: Bands, mine: List[torch.Tensor], sizes: List[int], dtype: torch.dtype,
                device, where: str) -> List[torch.Tensor]:
    """Every rank's 1-D tensors ``mine`` concatenated (rank r's: ``sizes[r]`` elements), on
    every rank: one all-gather of buffers padded to the largest."""
    width = max(sizes)
    buf = torch.cat(mine) if mine else torch.empty(0, dtype=dtype, device=device)
    buf = torch.cat([buf, buf.new_zeros(width - buf.numel())])
    parts = _all_gather(bands, buf, where) if bands.size > 1 else buf[None]
    return [p.narrow(0, 0, n) for p, n in zip(parts.unbind(0), sizes)]


def check_halo(bands: Bands, counts: List[int], halo: int, where: str) -> None:
    """Refuses (on every rank alike) bands ``counts`` (rows of each rank at a layer's
    resolution) of which one is thinner than the ``halo`` rows a layer takes from it, with the
    latent height that would do."""
    if min(counts) >= halo:
        return
    scale = counts[bands.rank] // bands.counts[bands.rank]
    need = -(-halo // scale)  # latent rows per rank
    raise ValueError(f"parallelize_vae: {where} needs {halo} halo rows but the thinnest band "
                     f"has {min(counts)} rows at its resolution; every rank needs at least "
                     f"{need} latent rows (latent height >= {need * bands.size} on "
                     f"{bands.size} ranks)")


def neighbour_rows(bands: Bands, x: torch.Tensor, top: int, bottom: int, dim: int,
                   where: str):
    """(rank r-1's last ``top`` rows, rank r+1's first ``bottom`` rows) of the bands ``x`` along
    ``dim``: one all-gather of every band's edge rows; None where there are none (0 rows, or
    the image's top or bottom)."""
    if bands.size == 1:
        return None, None
    edges = [x.narrow(dim, 0, bottom), x.narrow(dim, x.shape[dim] - top, top)]
    parts = _all_gather(bands, torch.cat(edges, dim), where)
    r = bands.rank
    above = parts[r - 1].narrow(dim, bottom, top) if top and r > 0 else None
    below = parts[r + 1].narrow(dim, 0, bottom) if bottom and r + 1 < bands.size else None
    return above, below


def add_halo(bands: Bands, x: torch.Tensor, top: int, bottom: int, dim: int, where: str,
             border: str = "zeros") -> torch.Tensor:
    """``x`` (this rank's band along ``dim``) with ``top`` rows of the band above before it and
    ``bottom`` rows of the band below after it; at the image's top and bottom, zero rows
    (``border="zeros"``) or copies of the edge row (``"replicate"``)."""
    if top == 0 and bottom == 0:
        return x
    dim = dim % x.dim()
    check_halo(bands, bands.level_counts(x.shape[dim], where), max(top, bottom), where)
    above, below = neighbour_rows(bands, x, top, bottom, dim, where)
    pieces = [x]
    if top:
        pieces.insert(0, above if above is not None else _border(x, dim, top, 0, border))
    if bottom:
        pieces.append(below if below is not None else
                      _border(x, dim, bottom, x.shape[dim] - 1, border))
    return torch.cat(pieces, dim)


def _border(x: torch.Tensor, dim: int, rows: int, edge: int, border: str) -> torch.Tensor:
    """``rows`` rows outside the image: zeros, or copies of row ``edge`` of ``x``."""
    if border == "replicate":
        return torch.cat([x.narrow(dim, edge, 1)] * rows, dim)
    shape = list(x.shape)
    shape[dim] = rows
    return x.new_zeros(shape)
