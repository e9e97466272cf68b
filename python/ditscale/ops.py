"""Fused adaptive LayerNorm / RMSNorm with shift/scale modulation, and Wan's rotary embedding,
as PyTorch ops: the public wrappers of ``torch.ops.ditscale.*`` (ditscale._C, loaded by
ditscale._extension; C++ autograd, fake kernels in ditscale._fake_kernels so that
``torch.compile(fullgraph=True)`` traces them) and their plain-PyTorch references
(ditscale._references). The math, shapes, dtypes, host cost and kernels: docs/adaln.md::

    y = norm(x) * (1 + scale) + shift                       adaln / adaln_rows
    h = residual + gate * branch;  y = adaln(h)  -> (h, y)   adaln_gated / adaln_gated_rows
    rotary(x, cos, sin): interleaved pairs rotated           rotary

x, residual, branch ``[B, N, D]``; scale, shift, gate per sample ``[B, D]`` / ``[B, 1, D]`` or
per token ``[B, N, D]``, x's dtype or float32, strided views read in place.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._adaln_checks import EPS_RANGE, NORMS
from ._checks import check_real
from ._extension import OPS as _OPS
from ._extension import is_available, load_error
from ._extension import require as _require
from ._modulation import as_modulation as _as_modulation
from ._modulation import packed_eager as _packed_eager
from ._references import adaln_gated_reference, adaln_reference, rotary_reference
from ._references import check_norm as _check_norm

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


def _check_eps(eps) -> float:
    """``eps`` as a float in EPS_RANGE (ValueError / TypeError otherwise); a float in range, the
    usual case, costs two comparisons."""
    if type(eps) is float and EPS_RANGE[0] <= eps <= EPS_RANGE[1]:
        return eps
    return float(check_real("eps", eps, *EPS_RANGE))


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
