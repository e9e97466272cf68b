"""The CUDA kernels of block_kernels.py: one attention block with its log-sum-exp, and its backward
from a given (out, LSE), on heads-first tensors q [B, H, Tq, d], k, v [B, H, Tk, d] (d a
multiple of 8), scale given, no dropout, natural log, LSE [B, H, Tq] float32.

- bfloat16 / float16: cuDNN attention through aten (on an H100 at 32,760 tokens x 20 heads of
  128: forward 19 ms against flash attention's 31, backward 50 ms against 85;
  lab/probes/block_kernel_probe.py). cuDNN's backward is not deterministic (nor is flash's by
  default); under ``torch.use_deterministic_algorithms(True)`` the backward runs flash
  attention's deterministic algorithm (about 2x its default time), so that a step gives the same
  bits. On first use cuDNN's LSE is checked once against a float32 reference (its base); a
  mismatch, or a layout cuDNN refuses, switches to flash attention for good, with a warning.
- float32: the memory-efficient kernels (their LSE rows padded to a multiple of 32).
"""

from __future__ import annotations

import warnings
from typing import Tuple

import torch

A = torch.ops.aten
HALF = (torch.bfloat16, torch.float16)
_LSE_ALIGN = 32  # the efficient kernel's LSE rows are padded to a multiple of this
_CUDNN = {"usable": None}  # None: not checked yet; False: flash for good


def _placeholders(device, kind: str):
    """Philox seed and offset shaped as each forward returns them (never read: no dropout)."""
    if kind == "flash":
        return (torch.empty(2, dtype=torch.uint64, device=device),
                torch.empty((), dtype=torch.uint64, device=device))
    return (torch.empty((), dtype=torch.int64, device=device),
            torch.empty((), dtype=torch.int64, device=device))


def _cudnn_forward(q, k, v, scale):
    o, lse = A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                   scale=scale)[:2]
    return o, lse.reshape(lse.shape[:3])


def _flash_forward(q, k, v, scale):
    return tuple(A._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False,
                                                       scale=scale)[:2])


def _give_up_cudnn(why: str) -> None:
    _CUDNN["usable"] = False
    warnings.warn(f"ditscale.sp: cuDNN attention is not used for the sequence-parallel "
                  f"gradients ({why}); flash attention runs instead", RuntimeWarning)


def _cudnn_usable(device) -> bool:
    """Whether cuDNN runs here with a natural-log LSE (checked once on a small case)."""
    if _CUDNN["usable"] is None:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, 2, 16, 64, device=device, generator=g).bfloat16()
                   for _ in range(3))
        try:
            _, lse = _cudnn_forward(q, k, v, 0.125)
        except RuntimeError as e:
            _give_up_cudnn(f"it failed on a small case: {str(e)[:200]}")
            return False
        ref = torch.logsumexp(q.float() @ k.float().transpose(-1, -2) * 0.125, -1)
        err = (lse.float() - ref).abs().max().item()
        if err > 0.05:
            _give_up_cudnn(f"its log-sum-exp is off by {err:.3g} from the natural log's")
            return False
        _CUDNN["usable"] = True
    return _CUDNN["usable"]


def forward(q, k, v, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, Tq, d] in q's dtype, lse [B, H, Tq] float32)."""
    if q.dtype not in HALF:
        o, lse = A._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                           scale=scale)[:2]
        return o, lse[..., :q.shape[2]]  # the padding rows are not the block's
    if _cudnn_usable(q.device):
        try:
            return _cudnn_forward(q, k, v, scale)
        except RuntimeError as e:
            _give_up_cudnn(f"it refused a layer of shape {tuple(q.shape)}: {str(e)[:200]}")
    return _flash_forward(q, k, v, scale)


def _efficient_backward(do, q, k, v, o, lse, scale):
    rows = q.shape[2]
    padded = -(-rows // _LSE_ALIGN) * _LSE_ALIGN
    lse_p = lse.new_zeros(*lse.shape[:2], padded)
    lse_p[..., :rows] = lse
    seed, offset = _placeholders(q.device, "efficient")
    g = A._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, None, o, lse_p, seed, offset, 0.0, [True, True, True, False], False,
        scale=scale)
    return g[0], g[1], g[2]


def _flash_backward(do, q, k, v, o, lse, scale):
    seed, offset = _placeholders(q.device, "flash")
    return A._scaled_dot_product_flash_attention_backward(
        do, q, k, v, o, lse, None, None, q.shape[2], k.shape[2], 0.0, False, seed, offset,
        scale=scale)


def _cudnn_backward(do, q, k, v, o, lse, scale):
    seed, offset = _placeholders(q.device, "cudnn")
    return A._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse.unsqueeze(-1), seed, offset, None, None, None, q.shape[2],
        k.shape[2], 0.0, False, scale=scale)


def backward(do, q, k, v, o, lse, scale: float):
    """(dq, dk, dv) in q's dtype from dO, o (q's dtype) and lse [B, H, Tq] float32."""
    if q.dtype not in HALF:
        return _efficient_backward(do, q, k, v, o, lse, scale)
    if not torch.are_deterministic_algorithms_enabled() and _cudnn_usable(q.device):
        try:
            return _cudnn_backward(do, q, k, v, o, lse, scale)
        except RuntimeError as e:
            _give_up_cudnn(f"its backward refused a layer of shape {tuple(q.shape)}: "
                           f"{str(e)[:200]}")
    return _flash_backward(do, q, k, v, o, lse, scale)
