"""Applying and removing a parallel VAE: the class table, the band-aware ``_decode`` /
``_encode`` (shape and tiling check across ranks; where diffusers' tiling would tile the input,
its tiles over the ranks (:mod:`.tiles`); else this rank's rows, the stock code on them, the
gather of the output rows) and the handle whose ``remove()`` gives the stock module back.

The replacements are instance attributes bound over the stock methods (``forward`` of each
replaced layer, ``_decode`` and ``_encode`` of the VAE); weights and buffers are never touched,
so removing them restores the stock module exactly. See docs/diffusers/vae.md.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch.nn as nn

from ... import sp
from . import cogvideox, hunyuan, kl, tiles, wan
from .bands import Bands
from .comm import check_same_shape, gather_rows

# The attribute a parallelized VAE carries (its handle); parallelizing twice is refused.
ATTR = "_ditscale_parallel_vae"



@dataclass(frozen=True)
class Plan:
    """One VAE class: ``layers(vae, bands)`` lists its (module, band-aware forward) pairs;
    ``latent_dims``: the rank of its latents and inputs (height at dim -2)."""

    layers: Callable
    latent_dims: int


PLANS: Dict[str, Plan] = {
    "AutoencoderKLWan": Plan(wan.wan_layers, 5),
    "AutoencoderKL": Plan(kl.WALK.layers, 4),
    "AutoencoderKLHunyuanVideo": Plan(hunyuan.WALK.layers, 5),
    "AutoencoderKLCogVideoX": Plan(cogvideox.WALK.layers, 5),
}


def encode_factor(vae) -> int:
    """Input rows per latent row of the encoder: the product of its convolutions' height
    strides, times the patch size (Wan 2.2)."""
    factor = getattr(vae.config, "patch_size", None) or 1
    for m in vae.encoder.modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d)):
            factor *= m.stride[-2]
    return factor


class VaeHandle:
    """A parallelized VAE: ``bands`` (the group and, during a decode, the split);
    ``remove()`` unbinds every replacement."""

    def __init__(self, vae, bands: Bands, patched: List[Tuple[object, str]]):
        self.vae, self.bands, self._patched = vae, bands, patched

    def remove(self) -> None:
        for obj, attr in self._patched:
            obj.__dict__.pop(attr, None)
        self._patched = []
        self.vae.__dict__.pop(ATTR, None)


def _band_decode(bands: Bands, plan: Plan) -> Callable:
    def _decode(self, z, return_dict: bool = True):
        where = f"parallelize_vae: {type(self).__name__}.decode"
        check_same_shape(bands, z, where, tiles.settings(self))  # first: ranks decide alike
        if z.dim() != plan.latent_dims:
            raise ValueError(f"{where}: latents must have {plan.latent_dims} dimensions "
                             f"(height at -2), got {tuple(z.shape)}")
        if bands.size == 1:  # one band is the whole image: the stock decode
            return type(self)._decode(self, z, return_dict=return_dict)
        if tiles.tiles(self, z, encode=False):
            out = tiles.run_tiled(self, bands, False, lambda: type(self)._decode(
                self, z, return_dict=False)[0], where)
        else:
            out = _on_bands(bands, z.shape[-2], 1, lambda: type(self)._decode(
                self, bands.latent_slice(z, -2), return_dict=False)[0], where)
        if not return_dict:
            return (out,)
        from diffusers.models.autoencoders.vae import DecoderOutput
        return DecoderOutput(sample=out)
    return _decode


def _on_bands(bands: Bands, height: int, factor: int, fn: Callable, where: str):
    """``fn()`` (the stock code on this rank's rows; ``height`` rows of the input, ``factor``
    a latent row) with the bands started, its output rows gathered."""
    bands.start(height // factor)
    try:
        return gather_rows(bands, fn(), -2, f"{where} (output)")
    finally:
        bands.stop()


def _band_encode(bands: Bands, plan: Plan) -> Callable:
    def _encode(self, x):
        where = f"parallelize_vae: {type(self).__name__}.encode"
        check_same_shape(bands, x, where, tiles.settings(self))  # first: ranks decide alike
        if bands.size == 1:  # one band is the whole image: the stock encode
            return type(self)._encode(self, x)
        if x.dim() == plan.latent_dims and tiles.tiles(self, x, encode=True):
            return tiles.run_tiled(self, bands, True, lambda: type(self)._encode(self, x), where)
        factor = encode_factor(self)
        if x.dim() != plan.latent_dims or x.shape[-2] % factor != 0:
            raise ValueError(f"{where}: a parallel encode takes {plan.latent_dims} dimensions "
                             f"with the height (-2) a multiple of {factor}, got "
                             f"{tuple(x.shape)}")
        if x.shape[-2] < factor * bands.size:
            raise ValueError(f"{where}: an input height of {x.shape[-2]} rows cannot be split "
                             f"over {bands.size} ranks (every rank needs at least 1 latent row "
                             f"of {factor} input rows: height >= {factor * bands.size})")
        return _on_bands(bands, x.shape[-2], factor, lambda: type(self)._encode(
            self, x.narrow(-2, bands.begin * factor, bands.counts[bands.rank] * factor)), where)
    return _encode


def parallelize_vae(vae, mesh: Optional[sp.Mesh] = None) -> VaeHandle:
    """Makes ``vae.decode(z)`` and ``vae.encode(x)`` (called on every rank of ``mesh``'s
    group, default: the default process group, with the same full input) compute this rank's
    band of rows and return the full output on every rank. Returns the handle;
    ``handle.remove()`` undoes it."""
    cls = type(vae).__name__
    if cls not in PLANS:
        raise ValueError(f"parallelize_vae: {cls} is not supported (supported: "
                         f"{', '.join(PLANS)})")
    if vae.__dict__.get(ATTR) is not None:
        raise ValueError(f"parallelize_vae: this {cls} is already parallelized")
    if mesh is None:
        mesh = sp.Mesh.from_process_group()
    elif not isinstance(mesh, sp.Mesh):
        raise TypeError(f"parallelize_vae: mesh must be a ditscale.sp.Mesh or None, got "
                        f"{type(mesh).__name__}")
    bands, plan = Bands(mesh), PLANS[cls]
    pairs = plan.layers(vae, bands)  # refuses before anything is bound
    patched = []
    for module, forward in pairs:
        module.__dict__["forward"] = types.MethodType(forward, module)
        patched.append((module, "forward"))
    vae.__dict__["_decode"] = types.MethodType(_band_decode(bands, plan), vae)
    patched.append((vae, "_decode"))
    vae.__dict__["_encode"] = types.MethodType(_band_encode(bands, plan), vae)
    patched.append((vae, "_encode"))
    handle = VaeHandle(vae, bands, patched)
    vae.__dict__[ATTR] = handle
    return handle


def unparallelize_vae(vae) -> None:
    """Gives the stock module back (the same as ``handle.remove()``)."""
    handle = vae.__dict__.get(ATTR)
    if handle is None:
        raise ValueError(f"unparallelize_vae: this {type(vae).__name__} is not parallelized")
    handle.remove()
