"""Shapes of the AdaLN modulation tensors, shared by the wrappers (ditscale.ops) and the
references (ditscale._references): per-sample views as ``[B, D]``, broadcasting against
``[B, N, D]``, and the packed-row search that lets a backward write one ``[B, K, D]`` gradient
instead of one per view (docs/adaln.md).
"""

from __future__ import annotations

import torch


def as_modulation(t: torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    """Per-sample views as [B, D]: ``[B, 1, D]`` and ``[B, N, D]`` expanded along N (stride 0)
    become ``t[:, 0]`` (a view, so the backward reduces over N in the kernel); other shapes pass
    through unchanged (the op checks them)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ditscale.ops: {name} must be a Tensor, got {type(t).__name__}")
    if t.dim() == 3 and x.dim() == 3 and x.shape[1] != 1:
        if t.shape[1] == 1 or (t.shape[1] == x.shape[1] and t.stride(1) == 0):
            return t[:, 0]
    return t


def mod_broadcast(t: torch.Tensor) -> torch.Tensor:
    """Per-sample [B, D] -> [B, 1, D] for broadcasting against [B, N, D]."""
    return t.unsqueeze(1) if t.dim() == 2 else t


def packed_rows(*views: torch.Tensor):
    """``(mod, index, ...)`` when the per-sample modulation ``views`` ([B, D], after
    as_modulation) are different rows of one tensor that requires grad, viewable as a [B, K, D]
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


def packed_eager(*views: torch.Tensor):
    """packed_rows of ``views`` for an eager call that autograd records (grad mode on, the
    views require grad, no torch.compile trace or functorch transform), else None."""
    if not (torch.is_grad_enabled() and views[0].requires_grad) or traced():
        return None
    return packed_rows(*views)


def traced() -> bool:
    """torch.compile is tracing, or a functorch transform (vmap, grad) is active: views' bases
    are not what they are eagerly, so no packed-row search."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
