"""The two compute ops of an sp schedule on CPU tensors, in float32 (the CPU executor's
Attention and Merge; cpu_executor.py).

Layout: [batch, tokens, heads, width] (width = head_dim d, or 1 for a log-sum-exp), any strides.
For batch b, query token t and query head h (kv head h // g, g = q heads / kv heads):

- block attention: ``s_j = q[b,t,h] . k[b,j,h//g] / sqrt(d)``, ``lse = log(sum_j exp(s_j))``,
  ``out = sum_j exp(s_j - lse) v[b,j,h//g]``; with no kv tokens ``lse = -inf`` and ``out = 0``.
  Computed by PyTorch's CPU flash attention
  (``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp, natural
  log), the g query heads of a kv head folded into its query rows (non-causal rows are
  independent), so GQA needs no copy of k, v.
- merge of a partial (o_p, l_p) into an accumulator (o_a, l_a), in place:
  ``l = log(exp(l_a) + exp(l_p))``, ``o = o_a exp(l_a - l) + o_p exp(l_p - l)``; an accumulator
  with ``l_a = -inf`` takes the partial as it is, whatever o_a holds (NaN included).
- block attention backward (cpu_backward.py): from the block's (out, lse) and dOut,
  ``P = exp(s - lse)``, ``dV = P^T dOut``, ``dS = P (dOut V^T - rowsum(dOut * out))``,
  ``dQ = dS K / sqrt(d)``, ``dK = dS^T Q / sqrt(d)`` (GQA: summed over the g query heads), by
  ``aten._scaled_dot_product_flash_attention_for_cpu_backward`` on the same folding.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

_NEG_INF = float("-inf")


def attention_lse(q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Tq, Hq, d], lse [B, Tq, Hq, 1]) of q [B, Tq, Hq, d] over k, v [B, Tk, Hk, d]
    (Hq a multiple of Hk), all float32."""
    B, Tq, Hq, d = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if Tk == 0 or Tq == 0:  # the CPU kernel divides by the block sizes
        return q.new_zeros(B, Tq, Hq, d), q.new_full((B, Tq, Hq, 1), _NEG_INF)
    g = Hq // Hk
    qh = q.reshape(B, Tq, Hk, g, d).permute(0, 2, 3, 1, 4).reshape(B, Hk, g * Tq, d)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, k.transpose(1, 2), v.transpose(1, 2), 0.0, False, scale=1.0 / math.sqrt(d))[:2]
    out = o.reshape(B, Hk, g, Tq, d).permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, d)
    return out, lse.reshape(B, Hk, g, Tq).permute(0, 3, 1, 2).reshape(B, Tq, Hq, 1)


def _fold(x: torch.Tensor, Hk: int) -> torch.Tensor:
    """[B, Tq, Hq, w] -> [B, Hk, g * Tq, w]: the g query heads of a kv head as its rows."""
    B, Tq, Hq, w = x.shape
    return x.reshape(B, Tq, Hk, Hq // Hk, w).permute(0, 2, 3, 1, 4).reshape(B, Hk, -1, w)


def _unfold(x: torch.Tensor, Tq: int, Hq: int) -> torch.Tensor:
    """The inverse of _fold: [B, Hk, g * Tq, w] -> [B, Tq, Hq, w]."""
    B, Hk, _, w = x.shape
    return x.reshape(B, Hk, Hq // Hk, Tq, w).permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, w)


def attention_lse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [B, Tq, Hq, d], dk, dv [B, Tk, Hk, d]) of attention_lse's block, given its out and
    lse [B, Tq, Hq, 1] and dout [B, Tq, Hq, d], all float32."""
    B, Tq, Hq, d = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if Tk == 0 or Tq == 0:  # no scores: nothing flows
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _fold(dout, Hk).contiguous(), _fold(q, Hk).contiguous(), k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(), _fold(out, Hk).contiguous(),
        _fold(lse, Hk).reshape(B, Hk, -1).contiguous(), 0.0, False, scale=1.0 / math.sqrt(d))
    return _unfold(dq, Tq, Hq), dk.transpose(1, 2), dv.transpose(1, 2)


def merge_lse_(acc: torch.Tensor, acc_lse: torch.Tensor, part: torch.Tensor,
               part_lse: torch.Tensor) -> None:
    """Merges (part, part_lse) into (acc, acc_lse) in place (shapes alike, lse width 1)."""
    lse = torch.logaddexp(acc_lse, part_lse)
    empty = acc_lse == _NEG_INF
    # Where both are -inf, lse is -inf and the weights NaN: the partial (out 0) is taken as is.
    w_part = torch.where(empty, 1.0, torch.exp(part_lse - lse))
    w_acc = torch.where(empty, 0.0, torch.exp(acc_lse - lse))
    merged = torch.where(empty, part, acc * w_acc + part * w_part)
    acc.copy_(merged)
    acc_lse.copy_(lse)
