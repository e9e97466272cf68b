"""Modules built on the fused ops of :mod:`ditscale.ops`.

``AdaLayerNorm`` replaces the DiT pattern (diffusers, Wan, Flux, HunyuanVideo). Before::

    self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
    x = self.norm1(x) * (1 + scale_msa) + shift_msa
    ...
    h = h + gate_msa * attn_out
    x = self.norm2(h) * (1 + scale_mlp) + shift_mlp

After (one fused pass each; the second also applies the gated residual of AdaLN-Zero)::

    self.norm1 = AdaLayerNorm(dim)                  # eps=1e-6, no affine, like the original
    x = self.norm1(x, shift_msa, scale_msa)         # note: shift before scale
    ...
    h, x = self.norm2.forward_gated(h, gate_msa, attn_out, shift_mlp, scale_mlp)

The modulation chunks are usually views of one projection, e.g. Wan 2.1's ``[B, 6, D]``
(``e.chunk(6, dim=1)``), Flux/SD3's ``[B, 6D]`` or Wan 2.2's per-token ``[B, N, 6D]``;
:func:`chunk_modulation` returns those views without copying, in the same order as ``chunk``.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from . import ops
from ._checks import INT64_MAX, check_int, check_real

__all__ = ["AdaLayerNorm", "chunk_modulation"]


def chunk_modulation(mod: torch.Tensor, num_chunks: int = 6) -> List[torch.Tensor]:
    """Splits a packed modulation tensor into ``num_chunks`` views for :class:`AdaLayerNorm`.

    Accepted layouts (k = num_chunks):
      * ``[B, k*D]``     per sample (Flux, SD3, PixArt: ``emb.chunk(k, dim=1)``) -> k x ``[B, D]``
      * ``[B, k, D]``    per sample (Wan 2.1: ``e.chunk(k, dim=1)``)           -> k x ``[B, D]``
      * ``[B, N, k, D]`` per token  (Wan 2.2: ``e.chunk(k, dim=2)``)           -> k x ``[B, N, D]``
      * ``[B, N, k*D]``  per token                                           -> k x ``[B, N, D]``

    A 3-D tensor whose dim 1 equals k is read as ``[B, k, D]``; pass the 4-D view
    ``mod.unflatten(-1, (k, -1))`` for a per-token tensor with N == k. The views keep the
    strides of ``mod`` (no copy): the fused ops read strided modulation in place.
    """
    k = int(num_chunks)
    if k <= 0:
        raise ValueError(f"chunk_modulation: num_chunks must be positive, got {num_chunks}")
    if mod.dim() == 2:
        if mod.shape[1] % k:
            raise ValueError(f"chunk_modulation: [B, k*D] expected, got {tuple(mod.shape)}, k={k}")
        return list(mod.chunk(k, dim=1))
    if mod.dim() == 3 and mod.shape[1] == k:
        return [mod[:, i] for i in range(k)]
    if mod.dim() == 3:
        if mod.shape[2] % k:
            raise ValueError(
                f"chunk_modulation: [B, N, k*D] expected, got {tuple(mod.shape)}, k={k}"
            )
        return list(mod.chunk(k, dim=2))
    if mod.dim() == 4 and mod.shape[2] == k:
        return [mod[:, :, i] for i in range(k)]
    raise ValueError(
        f"chunk_modulation: expected [B, k*D], [B, k, D], [B, N, k, D] or [B, N, k*D] with "
        f"k={k}, got {tuple(mod.shape)}"
    )


class AdaLayerNorm(torch.nn.Module):
    """Norm + shift/scale modulation in one fused pass: ``norm(x) * (1 + scale) + shift``.

    Args:
      dim: D, the feature size (last dimension of x), >= 1.
      eps: added to the variance (layernorm) or mean square (rmsnorm), in ``ops.EPS_RANGE``;
        diffusers/Wan use 1e-6.
      norm: ``"layernorm"`` or ``"rmsnorm"``.
      elementwise_affine: learnable ``weight`` (ones) and, for layernorm, ``bias`` (zeros) of
        shape [D], applied to the normalised x before modulation (like ``nn.LayerNorm``).
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        norm: str = "layernorm",
        elementwise_affine: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if norm not in ops.NORMS:
            raise ValueError(f"AdaLayerNorm: norm must be one of {ops.NORMS}, got {norm!r}")
        self.dim = check_int("AdaLayerNorm: dim", dim, 1, INT64_MAX)
        self.eps = check_real("AdaLayerNorm: eps", eps, *ops.EPS_RANGE)
        self.norm = norm
        self.elementwise_affine = bool(elementwise_affine)
        kw = {"device": device, "dtype": dtype}
        if self.elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.dim, **kw))
            if norm == "layernorm":
                self.bias = torch.nn.Parameter(torch.zeros(self.dim, **kw))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, eps={self.eps}, norm={self.norm}, "
            f"elementwise_affine={self.elementwise_affine}"
        )

    def _check(self, x: torch.Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(
                f"AdaLayerNorm(dim={self.dim}): x must be [B, N, {self.dim}], got {tuple(x.shape)}"
            )

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``norm(x) * (1 + scale) + shift``. Note the order: **shift before scale**.

        Args:
          x: ``[B, N, D]``.
          shift, scale: ``[B, D]``, ``[B, 1, D]`` or ``[B, N, D]`` (x's dtype or float32), e.g.
            views from :func:`chunk_modulation`.
        Returns:
          ``[B, N, D]`` in x's dtype.
        """
        self._check(x)
        return ops.adaln(
            x, scale, shift, weight=self.weight, bias=self.bias, norm=self.norm, eps=self.eps
        )

    def forward_gated(
        self,
        residual: torch.Tensor,
        gate: torch.Tensor,
        branch: torch.Tensor,
        shift: torch.Tensor,
        scale: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``h = residual + gate * branch``; returns ``(h, norm(h) * (1 + scale) + shift)``.

        Same argument order convention as :meth:`forward` (shift before scale); residual and
        branch are ``[B, N, D]``, gate is shaped like a modulation tensor.
        """
        self._check(residual)
        return ops.adaln_gated(
            residual,
            gate,
            branch,
            scale,
            shift,
            weight=self.weight,
            bias=self.bias,
            norm=self.norm,
            eps=self.eps,
        )
