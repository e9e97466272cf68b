"""Applying and removing a parallel VAE: the class table, the band-aware ``_decode`` (shape
check across ranks, this rank's latent rows, the stock decode on them, the gather of the
output rows) and the handle whose ``remove()`` gives the stock module back.

The replacements are instance attributes bound over the stock methods (``forward`` of each
replaced layer, ``_decode`` of the VAE); weights and buffers are never touched, so removing
them restores the stock module exactly. See docs/diffusers/vae.md.
"""

from __future__ import annotations

import types
from typing import Callable, Dict, List, Optional, Tuple

from ... import sp
from . import wan
from .bands import Bands
from .comm import check_same_shape, gather_rows

# The attribute a parallelized VAE carries (its handle); parallelizing twice is refused.
ATTR = "_ditscale_parallel_vae"

# VAE class -> the function listing its decoder's (module, band-aware forward) pairs.
PLANS: Dict[str, Callable] = {"AutoencoderKLWan": wan.wan_layers}
NOT_YET = ("AutoencoderKL", "AutoencoderKLHunyuanVideo", "AutoencoderKLCogVideoX")


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


def _band_decode(bands: Bands) -> Callable:
    def _decode(self, z, return_dict: bool = True):
        where = f"parallelize_vae: {type(self).__name__}.decode"
        check_same_shape(bands, z, where)  # first: every rank then decides alike below
        if z.dim() != 5:
            raise ValueError(f"{where}: latents must be [B, C, T, H, W], got {tuple(z.shape)}")
        if self.use_tiling:
            raise ValueError(f"{where}: enable_tiling is not supported yet on a parallel VAE "
                             f"(call vae.disable_tiling())")
        bands.start(z.shape[3])
        try:
            out = type(self)._decode(self, bands.latent_slice(z, 3), return_dict=False)[0]
            out = gather_rows(bands, out, 3, f"{where} (output)")
        finally:
            bands.stop()
        if not return_dict:
            return (out,)
        from diffusers.models.autoencoders.vae import DecoderOutput
        return DecoderOutput(sample=out)
    return _decode


def _band_encode(bands: Bands) -> Callable:
    def _encode(self, x):
        where = f"parallelize_vae: {type(self).__name__}.encode"
        check_same_shape(bands, x, where)  # first: every rank then decides alike below
        factor = wan.spatial_factor(self)
        if x.dim() != 5 or x.shape[3] % factor != 0:
            raise ValueError(f"{where}: a parallel encode takes [B, C, T, H, W] with H a "
                             f"multiple of {factor}, got {tuple(x.shape)}")
        if self.use_tiling:
            raise ValueError(f"{where}: enable_tiling is not supported yet on a parallel VAE "
                             f"(call vae.disable_tiling())")
        bands.start(x.shape[3] // factor)
        try:
            rows = x.narrow(3, bands.begin * factor, bands.counts[bands.rank] * factor)
            return gather_rows(bands, type(self)._encode(self, rows), 3, f"{where} (output)")
        finally:
            bands.stop()
    return _encode


def parallelize_vae(vae, mesh: Optional[sp.Mesh] = None) -> VaeHandle:
    """Makes ``vae.decode(z)`` and ``vae.encode(x)`` (called on every rank of ``mesh``'s group,
    default: the default process group, with the same full input) compute this rank's band of
    rows and return the full output on every rank. Returns the handle; ``handle.remove()`` undoes it."""
    cls = type(vae).__name__
    if cls in NOT_YET:
        raise ValueError(f"parallelize_vae: {cls} is not supported yet (supported: "
                         f"{', '.join(PLANS)})")
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
    bands = Bands(mesh)
    pairs = PLANS[cls](vae, bands)  # refuses before anything is bound
    patched = []
    for module, forward in pairs:
        module.__dict__["forward"] = types.MethodType(forward, module)
        patched.append((module, "forward"))
    vae.__dict__["_decode"] = types.MethodType(_band_decode(bands), vae)
    vae.__dict__["_encode"] = types.MethodType(_band_encode(bands), vae)
    patched += [(vae, "_decode"), (vae, "_encode")]
    handle = VaeHandle(vae, bands, patched)
    vae.__dict__[ATTR] = handle
    return handle


def unparallelize_vae(vae) -> None:
    """Gives the stock module back (the same as ``handle.remove()``)."""
    handle = vae.__dict__.get(ATTR)
    if handle is None:
        raise ValueError(f"unparallelize_vae: this {type(vae).__name__} is not parallelized")
    handle.remove()
