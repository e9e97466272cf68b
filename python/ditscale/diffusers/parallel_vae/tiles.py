"""diffusers' own tiles over the ranks: a parallel VAE whose tiling is on (``enable_tiling``)
runs the stock tiled decode / encode twice. First every rank walks the stock tiles in their
order: a tile (the calls of the tile module, ``decoder`` or ``encoder`` + ``quant_conv``, from
one that starts a tile to the next) belongs to rank ``index % N``, which runs it for real; the
other ranks run it on the meta device (shapes only, no compute). Then one all-gather gives every
rank every tile's output, and the stock tiled code runs again with each call answered by the
gathered output, so the stock blending makes the stock tiled result on every rank.
See docs/diffusers/vae.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .bands import Bands
from .comm import gather_flat


def _wan_first(kwargs) -> bool:  # clear_cache() emptied the feature cache: a new tile
    return all(c is None for c in kwargs["feat_cache"])


@dataclass(frozen=True)
class Tiling:
    """When a class's stock decode / encode tiles (the latent / input (height, width) above
    ``decode_min(vae)`` / ``encode_min(vae)``; the input divided by ``encode_div(vae)`` first)
    and ``first(kwargs)``: whether a call of the decoder / encoder starts a tile."""

    decode_min: Callable
    encode_min: Callable
    first: Callable = lambda kwargs: True
    encode_div: Callable = lambda vae: 1


def _ratio_min(vae) -> Tuple[int, int]:
    r = vae.spatial_compression_ratio
    return vae.tile_sample_min_height // r, vae.tile_sample_min_width // r


def _sample_min(vae) -> Tuple[int, int]:
    return vae.tile_sample_min_height, vae.tile_sample_min_width


TILINGS: Dict[str, Tiling] = {
    "AutoencoderKL": Tiling(lambda v: (v.tile_latent_min_size,) * 2,
                            lambda v: (v.tile_sample_min_size,) * 2),
    "AutoencoderKLWan": Tiling(_ratio_min, _sample_min, _wan_first,
                               lambda v: v.config.patch_size or 1),
    "AutoencoderKLHunyuanVideo": Tiling(_ratio_min, _sample_min),
    "AutoencoderKLCogVideoX": Tiling(lambda v: (v.tile_latent_min_height, v.tile_latent_min_width),
                                     _sample_min, lambda kwargs: kwargs["conv_cache"] is None),
}


def tiles(vae, x: torch.Tensor, encode: bool) -> bool:
    """Whether the stock ``_decode`` (``_encode``) of ``vae`` tiles ``x`` spatially."""
    if not vae.use_tiling:
        return False
    t = TILINGS[type(vae).__name__]
    h, w = (t.encode_min if encode else t.decode_min)(vae)
    div = t.encode_div(vae) if encode else 1
    return x.shape[-2] // div > h or x.shape[-1] // div > w


def settings(vae) -> List[int]:
    """The tiling settings of ``vae`` as integers (compared across ranks): ``use_tiling`` and
    every numeric ``tile_*`` / ``use_*`` attribute, floats in millionths."""
    names = sorted(k for k in vae.__dict__ if k.startswith(("tile_", "use_")))
    values = [vae.use_tiling] + [getattr(vae, k) for k in names]
    return [round(v * 1_000_000) if isinstance(v, float) else int(v) for v in values
            if isinstance(v, (bool, int, float))]


@dataclass
class _Call:
    module: nn.Module
    tile: int
    out: Any  # the output with its tensors on the meta device (the shapes)
    real: Optional[torch.Tensor] = None  # the last module's real output (after the gather)


@dataclass
class _Run:
    bands: Bands
    first: Callable
    main: nn.Module  # the module whose calls start tiles
    last: nn.Module  # the module whose outputs are gathered
    replay: bool = False
    inside: bool = False  # a meta call: the wrappers step aside
    tile: int = -1
    calls: List[_Call] = field(default_factory=list)
    cursor: int = 0
    meta: Dict[int, dict] = field(default_factory=dict)

    def owner(self, tile: int) -> int:
        return tile % self.bands.size


def _head(out):
    """The tile tensor of a module's output (CogVideoX's modules return (tensor, cache))."""
    return out[0] if isinstance(out, tuple) else out


def _with_head(out, head):
    return (head,) + tuple(out[1:]) if isinstance(out, tuple) else head


def _meta_call(run: _Run, module: nn.Module, args, kwargs):
    """``module(*args, **kwargs)`` on the meta device (the parameters and inputs as meta
    tensors; caches in ``kwargs`` as they are): the output shapes without compute."""
    state = run.meta.get(id(module))
    if state is None:
        named = itertools.chain(module.named_parameters(), module.named_buffers())
        state = run.meta[id(module)] = {n: t.to("meta") for n, t in named}
    args = tree_map(lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a, args)
    run.inside = True
    try:
        return torch.func.functional_call(module, state, args, kwargs)
    finally:
        run.inside = False


def _plan_call(run: _Run, module: nn.Module, prev: Callable, args, kwargs):
    """First pass: this rank's tiles for real, the others on the meta device; the last
    module's real outputs kept, meta ones returned (the first pass's blend is shapes only)."""
    if module is run.main and run.first(kwargs):
        run.tile += 1
    mine = run.owner(run.tile) == run.bands.rank
    real = mine and not any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
    out = prev(*args, **kwargs) if real else _meta_call(run, module, args, kwargs)
    meta = _with_head(out, _head(out).to("meta"))
    call = _Call(module, run.tile, meta, _head(out) if real and module is run.last else None)
    run.calls.append(call)
    return meta if module is run.last else out


def _replay_call(run: _Run, module: nn.Module):
    """Second pass: the recorded call's output (the last module's: the gathered real one)."""
    if run.cursor >= len(run.calls) or run.calls[run.cursor].module is not module:
        raise RuntimeError("parallelize_vae: the stock tiled code called its modules in another "
                           "order the second time; tiling cannot be distributed")
    call = run.calls[run.cursor]
    run.cursor += 1
    return _with_head(call.out, call.real) if module is run.last else call.out


def _wrapper(run: _Run, module: nn.Module, prev: Callable) -> Callable:
    def forward(self, *args, **kwargs):
        if run.inside:
            return prev(*args, **kwargs)
        if run.replay:
            return _replay_call(run, module)
        return _plan_call(run, module, prev, args, kwargs)
    return forward


def _gather(run: _Run, device, where: str) -> None:
    """Every rank's real outputs of the last module into every call (one all-gather)."""
    lasts = [c for c in run.calls if c.module is run.last]
    dtypes = {_head(c.out).dtype for c in lasts}
    if len(dtypes) != 1:
        raise RuntimeError(f"{where}: tiles of several dtypes {sorted(map(str, dtypes))}")
    mine = [c.real.reshape(-1) for c in lasts if c.real is not None]
    sizes = [sum(_head(c.out).numel() for c in lasts if run.owner(c.tile) == r)
             for r in range(run.bands.size)]
    parts = gather_flat(run.bands, mine, sizes, dtypes.pop(), device, where)
    offsets = [0] * run.bands.size
    for c in lasts:
        r, shape = run.owner(c.tile), _head(c.out).shape
        n = _head(c.out).numel()
        c.real = parts[r].narrow(0, offsets[r], n).view(shape)
        offsets[r] += n


def run_tiled(vae, bands: Bands, encode: bool, fn: Callable[[], Any], where: str):
    """``fn()`` (the stock tiled ``_decode`` / ``_encode`` of ``vae``) with its tiles spread
    over the ranks; returns what ``fn`` returns, the same on every rank."""
    t = TILINGS[type(vae).__name__]
    main = vae.encoder if encode else vae.decoder
    last = vae.quant_conv if encode and vae.quant_conv is not None else main
    run = _Run(bands, t.first, main, last)
    bound = []
    for module in {id(m): m for m in (main, last)}.values():
        prev = module.__dict__.get("forward")
        call = prev if prev is not None else type(module).forward.__get__(module)
        module.__dict__["forward"] = _wrapper(run, module, call).__get__(module)
        bound.append((module, prev))
    try:
        with torch.no_grad():
            fn()
        _gather(run, next(vae.parameters()).device, where)
        run.replay = True
        out = fn()
        if run.cursor != len(run.calls):
            raise RuntimeError(f"{where}: the stock tiled code made fewer calls the second time")
        return out
    finally:
        for module, prev in bound:
            if prev is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = prev
