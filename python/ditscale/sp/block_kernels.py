"""The block attention with its log-sum-exp and its backward from a saved log-sum-exp, one API for
CPU and CUDA tensors (the formulas: cpu_kernels.py; docs/sp.md ("Gradients")).

Layout [batch, tokens, heads, width]; q [B, Tq, Hq, d], k, v [B, Tk, Hk, d], Hq a multiple of
Hk: the g = Hq / Hk query heads of a kv head are folded into its query rows (non-causal rows are
independent), so GQA needs no copy of k, v. scale = 1 / sqrt(d), no dropout, natural log.

- CPU: cpu_kernels' functions (float32; other dtypes are converted to float32 first).
- CUDA: the inputs' dtype, by cuda_attention.py (cuDNN attention for bfloat16 / float16, flash
  attention's deterministic backward under torch.use_deterministic_algorithms(True), the
  memory-efficient kernels for float32). The backward casts the merged float32 out to q's
  dtype for the kernel. head_dim is padded with zeros to a
  multiple of 8 (the kernels' alignment), at most 256 (:func:`supports`).

Empty blocks: Tk == 0 gives out 0 and lse -inf; their gradients are 0. Outputs and gradients are
float32.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from . import cpu_kernels, cuda_attention

Grads = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_DIM_ALIGN = 8  # head_dim padded with zeros to a multiple of this for the CUDA kernels
MAX_CUDA_HEAD_DIM = 256  # flash attention's largest head_dim


def supports(q: torch.Tensor) -> bool:
    """Whether these kernels run q's layer: any CPU layer; on CUDA bfloat16, float16 or float32
    with head_dim <= MAX_CUDA_HEAD_DIM."""
    if q.device.type == "cpu":
        return True
    return q.dtype in (*cuda_attention.HALF, torch.float32) and q.shape[-1] <= MAX_CUDA_HEAD_DIM


def _pad(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] with zero columns up to a multiple of _DIM_ALIGN (scores, out unchanged)."""
    extra = -x.shape[-1] % _DIM_ALIGN
    return x if not extra else torch.nn.functional.pad(x, (0, extra))


def _fold(x: torch.Tensor, Hk: int) -> torch.Tensor:
    """[B, Tq, Hq, w] -> [B, Hk, g * Tq, w] (contiguous): a kv head's query heads as its rows."""
    return cpu_kernels._fold(x, Hk).contiguous()


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, d] -> [B, H, T, d], contiguous (the aten kernels' layout)."""
    return x.transpose(1, 2).contiguous()


def _check_cuda(q: torch.Tensor, where: str) -> None:
    if not supports(q):
        raise ValueError(f"ditscale.sp.block_kernels.{where}: CUDA tensors of dtype {q.dtype}, "
                         f"head_dim {q.shape[-1]}: bfloat16, float16 or float32 with head_dim in "
                         f"[1, {MAX_CUDA_HEAD_DIM}]")


def _empty(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    B, Tq, Hq, d = q.shape
    return (q.new_zeros(B, Tq, Hq, d, dtype=torch.float32),
            q.new_full((B, Tq, Hq, 1), float("-inf"), dtype=torch.float32))


def attention_lse(q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Tq, Hq, d], lse [B, Tq, Hq, 1]), both float32, of q over k, v (see the module)."""
    if q.device.type == "cpu":
        return cpu_kernels.attention_lse(q.float(), k.float(), v.float())
    _check_cuda(q, "attention_lse")
    B, Tq, Hq, d = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if Tk == 0 or Tq == 0:
        return _empty(q)
    o, lse = cuda_attention.forward(_pad(_fold(q, Hk)), _pad(_heads_first(k.to(q.dtype))),
                           _pad(_heads_first(v.to(q.dtype))), 1.0 / math.sqrt(d))
    out = cpu_kernels._unfold(o[..., :d].float(), Tq, Hq)
    return out, cpu_kernels._unfold(lse.float().unsqueeze(-1), Tq, Hq)


def attention_lse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> Grads:
    """(dq [B, Tq, Hq, d], dk, dv [B, Tk, Hk, d]), float32, of attention_lse's block given the
    rows' (merged) out, lse [B, Tq, Hq, 1] and dout [B, Tq, Hq, d] (see the module)."""
    if q.device.type == "cpu":
        return cpu_kernels.attention_lse_backward(*(t.float() for t in (dout, q, k, v, out, lse)))
    _check_cuda(q, "attention_lse_backward")
    B, Tq, Hq, d = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if Tk == 0 or Tq == 0:
        return (torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32),
                torch.zeros_like(v, dtype=torch.float32))
    dt = q.dtype
    dq, dk, dv = cuda_attention.backward(
        *(_pad(t) for t in (_fold(dout.to(dt), Hk), _fold(q, Hk), _heads_first(k.to(dt)),
                            _heads_first(v.to(dt)), _fold(out.to(dt), Hk))),
        _fold(lse.float(), Hk).reshape(B, Hk, -1), 1.0 / math.sqrt(d))
    return (cpu_kernels._unfold(dq[..., :d].float(), Tq, Hq), dk[..., :d].float().transpose(1, 2),
            dv[..., :d].float().transpose(1, 2))
