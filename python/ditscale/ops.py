"""Fused adaptive LayerNorm / RMSNorm with shift/scale modulation as PyTorch ops.

Math (statistics in fp32, one rounding to x's dtype at the end)::

    xhat = (x - mean) * rstd        layernorm: mean, var over D; rstd = 1 / sqrt(var + eps)
    xhat = x * rstd                 rmsnorm:   rstd = 1 / sqrt(mean(x^2) + eps), mean = 0
    z    = xhat * weight + bias     optional elementwise affine (weight/bias of shape [D])
    y    = z * (1 + scale) + shift

Gated residual variant (the other half of an AdaLN-Zero DiT block), in one pass::

    h = residual + gate * branch;   y = adaln(h)     -> returns (h, y)

Shapes: x, residual, branch are ``[B, N, D]``; each modulation tensor (scale, shift, gate) is
per sample ``[B, D]`` (also accepted as ``[B, 1, D]``) or per token ``[B, N, D]``, in x's dtype or
float32, and may be a strided view (e.g. a chunk of ``[B, 6, D]`` or ``[B, N, 6D]``): only its
last dimension must be contiguous, otherwise the op makes a contiguous copy. x must have a
contiguous last dimension too (a copy is made otherwise).

The compiled ops live in ``ditscale._C`` (a shared library loaded with
``torch.ops.load_library``) and are registered as ``torch.ops.ditscale.adaln_fwd`` /
``adaln_bwd`` / ``adaln_gated_fwd`` / ``adaln_gated_bwd`` (and the ``adaln_mod`` /
``adaln_gated_mod`` pairs), with their autograd in C++ (ditscale/torch/adaln_autograd.cc); this
module adds the fake (meta) kernels, so the ops can be traced by ``torch.compile(fullgraph=True)``.
The library is looked up in the package folder, or at ``$DITSCALE_EXT_PATH`` when set.

``adaln_rows`` / ``adaln_gated_rows`` take per-sample modulation as rows of one [B, K, D]
tensor directly (the ``adaln_mod`` ops), for blocks that build that tensor themselves.

Host cost. The forward ops' autograd is a C++ kernel for the Autograd dispatch key: an eager
call with grad records a C++ autograd node (saving the inputs the backward reads, mean and rstd)
and its backward calls the backward op, without entering Python; without grad the kernel calls
the op below autograd. The wrappers call each op's default overload directly, eagerly and while
torch.compile traces alike (AOTAutograd traces the same C++ autograd); only the packed-row search
of :func:`adaln` / :func:`adaln_gated` is eager-only. bench/adaln/host_cost.py measures the cost
per call. torch.func.grad works through the same C++ autograd; vmap runs the ops through
PyTorch's (per-sample) batching fallback.

``adaln_reference`` / ``adaln_gated_reference`` are the same functions in plain PyTorch (the
eager baseline of the benchmark, and the reference of the tests).
"""

from __future__ import annotations

import glob
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ._adaln_checks import (
    EPS_RANGE,
    NORMS,
    check_affine,
    check_config,
    check_devices,
    check_mod_rows,
    check_modulation,
    check_rows,
    check_stats,
)
from ._checks import check_real
from ._compile_cache import tag_compile_caches

__all__ = [
    "adaln",
    "adaln_gated",
    "adaln_rows",
    "adaln_gated_rows",
    "adaln_reference",
    "adaln_gated_reference",
    "rotary",
    "rotary_reference",
    "is_available",
    "load_error",
    "NORMS",
    "EPS_RANGE",
]

_OP_NAMES = ("adaln_fwd", "adaln_bwd", "adaln_mod_fwd", "adaln_mod_bwd", "adaln_gated_fwd",
             "adaln_gated_bwd", "adaln_gated_mod_fwd", "adaln_gated_mod_bwd", "rotary")
_load_error: Optional[str] = None
# Op name -> its default overload (torch.ops.ditscale.<name>.default), once the extension is
# loaded: the wrappers call these (one Python frame less per call than the overload packet).
_OPS = {}


def _library_path() -> Optional[str]:
    env = os.environ.get("DITSCALE_EXT_PATH")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for pattern in ("_C.so", "_C.*.so", "_C.pyd", "_C.dylib"):
        found = sorted(glob.glob(os.path.join(here, pattern)))
        if found:
            return found[0]
    return None


def _load() -> None:
    """Loads ditscale._C once, then keys torch.compile's caches to this build (graphs cached by
    another build of ditscale are not replayed: ditscale._compile_cache)."""
    global _load_error
    path = _library_path()
    if not all(hasattr(torch.ops.ditscale, n) for n in _OP_NAMES):  # not loaded by another path
        _load_error = _load_library(path)
    tag_compile_caches(path if _load_error is None else None)


def _load_library(path: Optional[str]) -> Optional[str]:
    """Loads the extension at ``path``; None, or why it could not be loaded."""
    if path is None:
        return (
            "ditscale._C (the PyTorch extension) was not found next to "
            f"{os.path.abspath(__file__)}; build the package with torch installed "
            "(`pip install --no-build-isolation .`) or set DITSCALE_EXT_PATH"
        )
    try:
        torch.ops.load_library(path)
    except OSError as e:  # wrong torch version, missing CUDA runtime, ...
        return f"loading {path} failed: {e}"
    return None


_load()


def is_available() -> bool:
    """True when the compiled ops are registered (``torch.ops.ditscale.adaln_fwd`` exists)."""
    return _load_error is None


def load_error() -> Optional[str]:
    """Why the extension could not be loaded, or None."""
    return _load_error


def _require() -> None:
    if _load_error is not None:
        raise RuntimeError(f"ditscale.ops: {_load_error}")


# ---------------------------------------------------------------------------------------------
# Shape helpers shared by the wrappers, the references and the fake kernels.


def _as_modulation(t: torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    """Per-sample views as [B, D]: ``[B, 1, D]`` and ``[B, N, D]`` expanded along N (stride 0)
    become ``t[:, 0]`` (a view, so the backward reduces over N in the kernel); other shapes pass
    through unchanged (the op checks them)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ditscale.ops: {name} must be a Tensor, got {type(t).__name__}")
    if t.dim() == 3 and x.dim() == 3 and x.shape[1] != 1:
        if t.shape[1] == 1 or (t.shape[1] == x.shape[1] and t.stride(1) == 0):
            return t[:, 0]
    return t


def _packed_rows(*views: torch.Tensor):
    """``(mod, index, ...)`` when the per-sample modulation ``views`` ([B, D], after
    _as_modulation) are different rows of one tensor that requires grad, viewable as a [B, K, D]
    ``mod`` (e.g. ``emb.chunk(6, dim=1)`` of a [B, 6 D] tensor, ``mod[:, i]`` of a [B, 6, D]
    one); else None. The adaln_mod / adaln_gated_mod ops then take ``mod`` itself, so autograd
    gets mod's gradient from the backward's reduction directly instead of a select_backward
    zero-fill and copy per view and their sum (5 small kernels for two views, 8 for three).
    Eager only (views' bases are not tracked while torch.compile traces)."""
    first = views[0]
    base = first._base
    if base is None or not base.requires_grad or first.dim() != 2:
        return None
    shape, stride = first.shape, first.stride()
    B, D = shape
    if B == 0 or D == 0 or stride[1] != 1 or not base.is_contiguous():
        return None
    numel = base.numel()
    sb = stride[0] if B > 1 else numel
    if sb <= 0 or sb % D != 0 or numel != B * sb:
        return None
    origin = base.storage_offset()
    rows = []
    for v in views:
        if v._base is not base or v.stride() != stride or v.shape != shape:
            return None
        offset = v.storage_offset() - origin
        if offset < 0 or offset >= sb or offset % D != 0 or offset // D in rows:
            return None
        rows.append(offset // D)
    return (base.view(B, sb // D, D), *rows)


def _check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"ditscale.ops: norm must be one of {NORMS}, got {norm!r}")


def _check_eps(eps) -> float:
    """``eps`` as a float in EPS_RANGE (ValueError / TypeError otherwise); a float in range, the
    usual case, costs two comparisons."""
    if type(eps) is float and EPS_RANGE[0] <= eps <= EPS_RANGE[1]:
        return eps
    return float(check_real("eps", eps, *EPS_RANGE))


def _packed_eager(*views: torch.Tensor):
    """_packed_rows of ``views`` for an eager call that autograd records (grad mode on, the
    views require grad, no torch.compile trace or functorch transform), else None."""
    if not (torch.is_grad_enabled() and views[0].requires_grad) or _traced():
        return None
    return _packed_rows(*views)


def _traced() -> bool:
    """torch.compile is tracing, or a functorch transform (vmap, grad) is active: views' bases
    are not what they are eagerly, so no packed-row search."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def _mod_broadcast(t: torch.Tensor) -> torch.Tensor:
    """Per-sample [B, D] -> [B, 1, D] for broadcasting against [B, N, D]."""
    return t.unsqueeze(1) if t.dim() == 2 else t


# ---------------------------------------------------------------------------------------------
# Public wrappers.


def adaln(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    norm: str = "layernorm",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Fused ``y = norm(x) * (1 + scale) + shift`` (see the module docstring for the math).

    Args:
      x: ``[B, N, D]`` activations, bfloat16, float16, float32 or float64 (float64: CPU only).
      scale, shift: modulation, ``[B, D]``, ``[B, 1, D]`` or ``[B, N, D]``, x's dtype or float32;
        strided views are read in place when their last dimension is contiguous.
      weight, bias: optional elementwise affine of the norm, ``[D]`` (applied before modulation).
      norm: ``"layernorm"`` (no affine unless weight/bias given) or ``"rmsnorm"``.
      eps: added to the variance (layernorm) or the mean square (rmsnorm), in ``EPS_RANGE``
        (ValueError otherwise).

    Every tensor must be on one device (RuntimeError naming the argument and both devices
    otherwise, as PyTorch's own ops do, also for meta / fake tensors).

    Returns:
      y: ``[B, N, D]`` in x's dtype, a new contiguous tensor. Differentiable in x, scale, shift,
      weight and bias; the backward is one fused pass (deterministic reductions). When scale and
      shift are two rows of one per-sample modulation tensor that requires grad (the usual
      ``emb.chunk(6, dim=1)``), that tensor is the op's input and its gradient comes out of the
      backward directly (``adaln_mod_fwd``); the views themselves then get no ``.grad`` even
      with ``retain_grad()``.
    """
    _require()
    _check_norm(norm)
    eps = _check_eps(eps)
    scale = _as_modulation(scale, x, "scale")
    shift = _as_modulation(shift, x, "shift")
    packed = _packed_eager(scale, shift)
    if packed is not None:
        mod, scale_index, shift_index = packed
        return _OPS["adaln_mod_fwd"](x, mod, scale_index, shift_index, weight, bias, norm,
                                     eps)[0]
    return _OPS["adaln_fwd"](x, scale, shift, weight, bias, norm, eps)[0]


def adaln_gated(
    residual: torch.Tensor,
    gate: torch.Tensor,
    branch: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    norm: str = "layernorm",
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fused ``h = residual + gate * branch; y = norm(h) * (1 + scale) + shift``.

    Args:
      residual, branch: ``[B, N, D]`` in the same dtype (the block's stream and the output of
        the previous sub-layer, e.g. attention).
      gate: modulation like scale/shift: ``[B, D]``, ``[B, 1, D]`` or ``[B, N, D]``.
      scale, shift, weight, bias, norm, eps: as in :func:`adaln`.

    Returns:
      ``(h, y)``, both ``[B, N, D]`` in residual's dtype: the updated residual stream and the
      modulated norm of it (the next sub-layer's input). Both are differentiable. gate, scale
      and shift that are rows of one per-sample tensor requiring grad take that tensor
      (``adaln_gated_mod_fwd``), as in :func:`adaln`.
    """
    _require()
    _check_norm(norm)
    eps = _check_eps(eps)
    gate = _as_modulation(gate, residual, "gate")
    scale = _as_modulation(scale, residual, "scale")
    shift = _as_modulation(shift, residual, "shift")
    packed = _packed_eager(gate, scale, shift)
    if packed is not None:
        mod, gate_index, scale_index, shift_index = packed
        return _OPS["adaln_gated_mod_fwd"](residual, branch, mod, gate_index, scale_index,
                                           shift_index, weight, bias, norm, eps)[:2]
    return _OPS["adaln_gated_fwd"](residual, gate, branch, scale, shift, weight, bias, norm,
                                   eps)[:2]


def adaln_rows(
    x: torch.Tensor,
    mod: torch.Tensor,
    scale_row: int,
    shift_row: int,
    *,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    norm: str = "layernorm",
    eps: float = 1e-6,
) -> torch.Tensor:
    """:func:`adaln` with per-sample scale and shift given as rows of one modulation tensor:
    ``scale = mod[:, scale_row]``, ``shift = mod[:, shift_row]``.

    ``mod`` is ``[B, K, D]`` (x's dtype or float32; rows distinct and in [0, K), else the op's
    RuntimeError). The op reads the rows in place and its backward writes mod's gradient
    ``[B, K, D]`` directly (zero in the other rows), eagerly and under torch.compile alike: what
    :func:`adaln` does when it finds its views to be rows of one tensor, without the search.
    For a block that makes its modulation itself (e.g. ``table + temb`` [B, 6, D])."""
    _require()
    _check_norm(norm)
    eps = _check_eps(eps)
    return _OPS["adaln_mod_fwd"](x, mod, scale_row, shift_row, weight, bias, norm, eps)[0]


def adaln_gated_rows(
    residual: torch.Tensor,
    branch: torch.Tensor,
    mod: torch.Tensor,
    gate_row: int,
    scale_row: int,
    shift_row: int,
    *,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    norm: str = "layernorm",
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`adaln_gated` with per-sample gate, scale and shift as rows of one ``[B, K, D]``
    modulation tensor (``mod[:, gate_row]``, ...), as :func:`adaln_rows`. Returns ``(h, y)``."""
    _require()
    _check_norm(norm)
    eps = _check_eps(eps)
    return _OPS["adaln_gated_mod_fwd"](residual, branch, mod, gate_row, scale_row, shift_row,
                                       weight, bias, norm, eps)[:2]


# ---------------------------------------------------------------------------------------------
# Pure-PyTorch references (eager baseline).


def _norm_reference(x: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    if norm == "layernorm":
        return F.layer_norm(x, (d,), eps=eps)
    return F.rms_norm(x, (d,), eps=eps)


def adaln_reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    norm: str = "layernorm",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Unfused PyTorch: ``norm(x) [* weight + bias] * (1 + scale) + shift``, cast to x's dtype.

    This is the diffusers / Wan pattern (norm in x's dtype with fp32 statistics inside ATen,
    modulation by broadcasting; an fp32 modulation promotes the product to fp32). Pass float64
    tensors to get an exact reference.
    """
    _check_norm(norm)
    scale = _mod_broadcast(_as_modulation(scale, x, "scale"))
    shift = _mod_broadcast(_as_modulation(shift, x, "shift"))
    z = _norm_reference(x, norm, eps)
    if weight is not None:
        z = z * weight
    if bias is not None:
        z = z + bias
    return (z * (1 + scale) + shift).to(x.dtype)


def adaln_gated_reference(
    residual: torch.Tensor,
    gate: torch.Tensor,
    branch: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    norm: str = "layernorm",
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Unfused PyTorch ``h = residual + gate * branch`` then :func:`adaln_reference` of h."""
    gate = _mod_broadcast(_as_modulation(gate, residual, "gate"))
    h = (residual + gate * branch).to(residual.dtype)
    y = adaln_reference(h, scale, shift, weight=weight, bias=bias, norm=norm, eps=eps)
    return h, y


# ---------------------------------------------------------------------------------------------
# Fake kernels (here: the extension names ditscale.ops as their module); registered only when
# the extension is loaded, which also registers the ops' C++ autograd.


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of interleaved pairs (diffusers' Wan convention), one kernel.

    ``x`` [B, S, H, Dh] (Dh even; bf16, fp16, fp32, or fp64 on the CPU; any strides with a
    contiguous last dimension), ``cos`` / ``sin`` float32 [1 or B, S, 1, Dh] (or without the
    head axis). For each pair (a, b) = (x[2j], x[2j + 1]) with c = cos[2j], s = sin[2j + 1]:
    y[2j] = a*c - b*s, y[2j + 1] = a*s + b*c, in float32 (each product and sum rounded on its
    own), rounded once to x's dtype: the bits of :func:`rotary_reference`. Returns a new
    contiguous tensor. Differentiable in x (C++ autograd: the backward is the inverse rotation,
    one kernel; only cos and sin are saved); cos and sin get no gradient (one that requires
    grad is a RuntimeError). Errors name the argument (RuntimeError from the op)."""
    _require()
    return _OPS["rotary"](x, cos, sin, False)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotary` in plain PyTorch (the arithmetic of diffusers' WanAttnProcessor): the
    products and sums as separate float32 ops, then one cast to x's dtype."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)


def _stats_shape(x: torch.Tensor) -> Tuple[int, int]:
    return (x.shape[0], x.shape[1])


def _fake_grad_like(ref: torch.Tensor, t: Optional[torch.Tensor]) -> torch.Tensor:
    if t is None:
        return ref.new_empty((0,), dtype=torch.float32)
    return t.new_empty(t.shape)


def _register() -> None:
    lib = "ditscale::"

    @torch.library.register_fake(lib + "adaln_fwd")
    def _adaln_fwd_fake(x, scale, shift, weight, bias, norm, eps, op=lib + "adaln_fwd"):
        if op == lib + "adaln_fwd":  # the packed ops checked their own arguments
            check_devices(op, (("x", x), ("scale", scale), ("shift", shift), ("weight", weight),
                                ("bias", bias)))
        check_config(op, "x", x, norm, eps)
        check_modulation(op, "scale", scale, x)
        check_modulation(op, "shift", shift, x)
        check_affine(op, x, weight, bias)
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        mean = x.new_empty(_stats_shape(x), dtype=torch.float32)
        rstd = x.new_empty(_stats_shape(x), dtype=torch.float32)
        return y, mean, rstd

    @torch.library.register_fake(lib + "adaln_bwd")
    def _adaln_bwd_fake(dy, x, scale, shift, weight, bias, mean, rstd, norm, eps):
        op = lib + "adaln_bwd"
        check_devices(op, (("dy", dy), ("x", x), ("scale", scale), ("shift", shift),
                            ("weight", weight), ("bias", bias), ("mean", mean), ("rstd", rstd)))
        check_config(op, "x", x, norm, eps)
        check_rows(op, "dy", dy, x)
        check_modulation(op, "scale", scale, x)
        check_modulation(op, "shift", shift, x)
        check_affine(op, x, weight, bias)
        check_stats(op, x, mean, rstd)
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dscale = scale.new_empty(scale.shape)
        dshift = shift.new_empty(shift.shape)
        return dx, dscale, dshift, _fake_grad_like(x, weight), _fake_grad_like(x, bias)

    @torch.library.register_fake(lib + "adaln_mod_fwd")
    def _adaln_mod_fwd_fake(x, mod, scale_index, shift_index, weight, bias, norm, eps):
        op = lib + "adaln_mod_fwd"
        check_devices(op, (("x", x), ("mod", mod), ("weight", weight), ("bias", bias)))
        check_config(op, "x", x, norm, eps)
        check_mod_rows(op, mod, x, (("scale_index", scale_index), ("shift_index", shift_index)))
        return _adaln_fwd_fake(
            x, mod[:, scale_index], mod[:, shift_index], weight, bias, norm, eps, op=op
        )

    @torch.library.register_fake(lib + "adaln_mod_bwd")
    def _adaln_mod_bwd_fake(
        dy, x, mod, scale_index, shift_index, weight, bias, mean, rstd, norm, eps
    ):
        op = lib + "adaln_mod_bwd"
        check_devices(op, (("dy", dy), ("x", x), ("mod", mod), ("weight", weight),
                            ("bias", bias), ("mean", mean), ("rstd", rstd)))
        check_config(op, "x", x, norm, eps)
        check_mod_rows(op, mod, x, (("scale_index", scale_index), ("shift_index", shift_index)))
        check_rows(op, "dy", dy, x)
        check_modulation(op, "scale", mod[:, scale_index], x)
        check_affine(op, x, weight, bias)
        check_stats(op, x, mean, rstd)
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dmod = mod.new_empty(mod.shape)
        return dx, dmod, _fake_grad_like(x, weight), _fake_grad_like(x, bias)

    @torch.library.register_fake(lib + "adaln_gated_mod_fwd")
    def _adaln_gated_mod_fwd_fake(
        residual, branch, mod, gate_index, scale_index, shift_index, weight, bias, norm, eps
    ):
        op = lib + "adaln_gated_mod_fwd"
        check_devices(op, (("residual", residual), ("branch", branch), ("mod", mod),
                            ("weight", weight), ("bias", bias)))
        check_config(op, "residual", residual, norm, eps)
        check_mod_rows(op, mod, residual, (("scale_index", scale_index),
                                            ("shift_index", shift_index),
                                            ("gate_index", gate_index)))
        return _adaln_gated_fwd_fake(
            residual, mod[:, gate_index], branch, mod[:, scale_index], mod[:, shift_index],
            weight, bias, norm, eps, op=op,
        )

    @torch.library.register_fake(lib + "adaln_gated_mod_bwd")
    def _adaln_gated_mod_bwd_fake(
        dh, dy, residual, branch, mod, gate_index, scale_index, shift_index, weight, bias, mean,
        rstd, norm, eps,
    ):
        op = lib + "adaln_gated_mod_bwd"
        check_devices(op, (("dh", dh), ("dy", dy), ("residual", residual), ("branch", branch),
                            ("mod", mod), ("weight", weight), ("bias", bias), ("mean", mean),
                            ("rstd", rstd)))
        check_config(op, "residual", residual, norm, eps)
        check_mod_rows(op, mod, residual, (("scale_index", scale_index),
                                           ("shift_index", shift_index),
                                           ("gate_index", gate_index)))
        for name, t in (("dy", dy), ("branch", branch), ("dh", dh)):
            if t is not None:
                check_rows(op, name, t, residual)
        check_modulation(op, "scale", mod[:, scale_index], residual)
        check_affine(op, residual, weight, bias)
        check_stats(op, residual, mean, rstd)
        dres = torch.empty_like(residual, memory_format=torch.contiguous_format)
        dbranch = torch.empty_like(residual, memory_format=torch.contiguous_format)
        return (
            dres,
            dbranch,
            mod.new_empty(mod.shape),
            _fake_grad_like(residual, weight),
            _fake_grad_like(residual, bias),
        )

    @torch.library.register_fake(lib + "adaln_gated_fwd")
    def _adaln_gated_fwd_fake(
        residual, gate, branch, scale, shift, weight, bias, norm, eps, op=lib + "adaln_gated_fwd"
    ):
        if op == lib + "adaln_gated_fwd":  # the packed op checked its own arguments
            check_devices(op, (("residual", residual), ("gate", gate), ("branch", branch),
                                ("scale", scale), ("shift", shift), ("weight", weight),
                                ("bias", bias)))
        check_config(op, "residual", residual, norm, eps)
        check_rows(op, "branch", branch, residual)
        for name, t in (("gate", gate), ("scale", scale), ("shift", shift)):
            check_modulation(op, name, t, residual)
        check_affine(op, residual, weight, bias)
        h = torch.empty_like(residual, memory_format=torch.contiguous_format)
        y = torch.empty_like(residual, memory_format=torch.contiguous_format)
        mean = residual.new_empty(_stats_shape(residual), dtype=torch.float32)
        rstd = residual.new_empty(_stats_shape(residual), dtype=torch.float32)
        return h, y, mean, rstd

    @torch.library.register_fake(lib + "adaln_gated_bwd")
    def _adaln_gated_bwd_fake(
        dh, dy, residual, gate, branch, scale, shift, weight, bias, mean, rstd, norm, eps
    ):
        op = lib + "adaln_gated_bwd"
        check_devices(op, (("dh", dh), ("dy", dy), ("residual", residual), ("gate", gate),
                            ("branch", branch), ("scale", scale), ("shift", shift),
                            ("weight", weight), ("bias", bias), ("mean", mean), ("rstd", rstd)))
        check_config(op, "residual", residual, norm, eps)
        for name, t in (("dy", dy), ("branch", branch), ("dh", dh)):
            if t is not None:
                check_rows(op, name, t, residual)
        for name, t in (("gate", gate), ("scale", scale), ("shift", shift)):
            check_modulation(op, name, t, residual)
        check_affine(op, residual, weight, bias)
        check_stats(op, residual, mean, rstd)
        dres = torch.empty_like(residual, memory_format=torch.contiguous_format)
        dbranch = torch.empty_like(residual, memory_format=torch.contiguous_format)
        return (
            dres,
            gate.new_empty(gate.shape),
            dbranch,
            scale.new_empty(scale.shape),
            shift.new_empty(shift.shape),
            _fake_grad_like(residual, weight),
            _fake_grad_like(residual, bias),
        )

    @torch.library.register_fake(lib + "rotary")
    def _(x, cos, sin, inverse=False):
        torch._check(x.dim() == 4, lambda: f"ditscale.ops.rotary: x must be [B, S, H, Dh], "
                                           f"got shape {tuple(x.shape)}")
        torch._check(x.shape[3] >= 2 and x.shape[3] % 2 == 0,
                     lambda: f"ditscale.ops.rotary: x's head dim (its last) must be even and "
                             f">= 2, got {x.shape[3]}")
        for name, f in (("cos", cos), ("sin", sin)):
            torch._check(f.dtype == torch.float32,
                         lambda: f"ditscale.ops.rotary: {name} must be float32, got {f.dtype}")
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    for name in _OP_NAMES:
        _OPS[name] = getattr(torch.ops.ditscale, name).default


if _load_error is None:
    _register()
