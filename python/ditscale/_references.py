"""The ops of ditscale.ops in plain PyTorch: the eager baselines of the benchmarks and the
references of the tests (docs/adaln.md, "Reference"). Public through ditscale.ops
(``adaln_reference``, ``adaln_gated_reference``, ``rotary_reference``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ._adaln_checks import NORMS
from ._modulation import as_modulation, mod_broadcast


def check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"ditscale.ops: norm must be one of {NORMS}, got {norm!r}")


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
    check_norm(norm)
    scale = mod_broadcast(as_modulation(scale, x, "scale"))
    shift = mod_broadcast(as_modulation(shift, x, "shift"))
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
    gate = mod_broadcast(as_modulation(gate, residual, "gate"))
    h = (residual + gate * branch).to(residual.dtype)
    y = adaln_reference(h, scale, shift, weight=weight, bias=bias, norm=norm, eps=eps)
    return h, y


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ditscale.ops.rotary in plain PyTorch (the arithmetic of diffusers' WanAttnProcessor): the
    products and sums as separate float32 ops, then one cast to x's dtype."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)
