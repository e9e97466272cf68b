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


class MergedRows:
    """The attention of fixed query rows over kv blocks in turn (a ring's steps), merged in
    float32 in the order of :meth:`add` (cpu_kernels.merge_lse_; the first block taken as it
    is); :meth:`result` is (out [B, Tq, Hq, d], lse [B, Tq, Hq, 1]). q [B, Tq, Hq, d]; on CUDA
    q is folded and padded once and the merged rows kept in that layout."""

    def __init__(self, q: torch.Tensor, kv_heads: int):
        self.shape, self.kv_heads = tuple(q.shape), kv_heads
        self.cuda = q.device.type != "cpu"
        if self.cuda:
            _check_cuda(q, "attention_lse")
        self.q = _pad(_fold(q, kv_heads)) if self.cuda else q.float()
        self.out = self.lse = None

    def _part(self, k: torch.Tensor, v: torch.Tensor):
        if not self.cuda:
            return cpu_kernels.attention_lse(self.q, k.float(), v.float())
        q = self.q
        if k.shape[1] == 0 or q.shape[2] == 0:  # no keys: out 0, lse -inf
            return (q.new_zeros(q.shape, dtype=torch.float32),
                    q.new_full((*q.shape[:3], 1), float("-inf"), dtype=torch.float32))
        o, lse = cuda_attention.forward(q, _pad(_heads_first(k.to(q.dtype))),
                                        _pad(_heads_first(v.to(q.dtype))),
                                        1.0 / math.sqrt(self.shape[3]))
        return o.float(), lse.float().unsqueeze(-1)

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        part = self._part(k, v)
        if self.out is None:
            self.out, self.lse = part
        else:
            cpu_kernels.merge_lse_(self.out, self.lse, *part)

    def result(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self.cuda:
            return self.out, self.lse
        _, Tq, Hq, d = self.shape
        return (cpu_kernels._unfold(self.out[..., :d], Tq, Hq),
                cpu_kernels._unfold(self.lse, Tq, Hq))


def attention_lse(q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Tq, Hq, d], lse [B, Tq, Hq, 1]), both float32, of q over k, v (see the module):
    one block of :class:`MergedRows`."""
    rows = MergedRows(q, k.shape[2])
    rows.add(k, v)
    return rows.result()


class QueryRows:
    """The backward of fixed query rows against kv blocks in turn (a ring's steps), from the
    rows' saved (merged) out and LSE: :meth:`add` runs one block's backward, adds its dQ to a
    float32 sum and returns the block's (dk, dv) [B, Tk, Hk, d] (views in the kernels' dtype,
    float32 on the CPU: to add into float32 sums); :meth:`dq` is the sum
    [B, Tq, Hq, d]. dout, q, out [B, Tq, Hq, d], lse [B, Tq, Hq, 1]; on CUDA they are folded,
    cast to q's dtype and padded once, not per block."""

    def __init__(self, dout, q, out, lse, kv_heads: int):
        self.shape, self.kv_heads = tuple(q.shape), kv_heads
        self.cuda = q.device.type != "cpu"
        if not self.cuda:
            self.rows = tuple(t.float() for t in (dout, q, out, lse))
            self.sum = torch.zeros(q.shape, dtype=torch.float32)
            return
        _check_cuda(q, "attention_lse_backward")
        dt, Hk = q.dtype, kv_heads
        self.rows = (*(_pad(_fold(t.to(dt), Hk)) for t in (dout, q, out)),
                     _fold(lse.float(), Hk).reshape(q.shape[0], Hk, -1))
        self.sum = torch.zeros(self.rows[1].shape, dtype=torch.float32, device=q.device)

    def add(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        B, Tq, Hq, d = self.shape
        if k.shape[1] == 0 or Tq == 0:  # no scores: nothing flows
            f32 = torch.float32
            return torch.zeros_like(k, dtype=f32), torch.zeros_like(v, dtype=f32)
        if not self.cuda:
            dq, dk, dv = cpu_kernels.attention_lse_backward(self.rows[0], self.rows[1], k.float(),
                                                            v.float(), *self.rows[2:])
            self.sum += dq
            return dk, dv
        dt = self.rows[1].dtype
        dq, dk, dv = cuda_attention.backward(
            self.rows[0], self.rows[1], _pad(_heads_first(k.to(dt))), _pad(_heads_first(v.to(dt))),
            self.rows[2], self.rows[3], 1.0 / math.sqrt(d))
        self.sum += dq
        return dk[..., :d].transpose(1, 2), dv[..., :d].transpose(1, 2)

    def dq(self) -> torch.Tensor:
        B, Tq, Hq, d = self.shape
        if not self.cuda:
            return self.sum
        return cpu_kernels._unfold(self.sum[..., :d], Tq, Hq)


def attention_lse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> Grads:
    """(dq [B, Tq, Hq, d], dk, dv [B, Tk, Hk, d]), float32, of attention_lse's block given the
    rows' (merged) out, lse [B, Tq, Hq, 1] and dout [B, Tq, Hq, d] (see the module): one
    block of :class:`QueryRows`."""
    rows = QueryRows(dout, q, out, lse, k.shape[2])
    dk, dv = rows.add(k, v)
    return rows.dq(), dk.float(), dv.float()
