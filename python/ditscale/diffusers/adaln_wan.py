"""Fused AdaLN for diffusers' ``WanTransformer3DModel`` (Wan 2.1 T2V / I2V, Wan 2.2 A14B and
TI2V 5B): each block's norm1 + modulation (``ops.adaln``), its self-attention residual + norm2
and cross-attention residual + norm3 (``ops.adaln_gated``) and its feed-forward residual (one
fp32 addcmul); ``attn1``'s rotary embedding through ``rotary_wan``.

Shapes: video tokens h [B, S, D], ``temb`` per sample [B, 6, D] or per token [B, S, 6, D] (Wan
2.2 TI2V), plus the block's fp32 ``scale_shift_table`` [1, 6, D]; per-sample modulation is read
as rows of one fp32 [B, 9, D] tensor (the six rows and the constant rows). What is fused, what is
not and why, numerics and measurements: docs/diffusers/adaln.md (section Wan). Only the blocks'
``forward`` and those processors are replaced, on the instance; :func:`remove` restores them.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from diffusers.models.transformers.transformer_wan import WanTransformerBlock

from .. import ops
from . import _adaln_common as common
from . import rotary_wan
from ._adaln_common import Patch, check_plan, fused, patch_all, unpatch_all

WHERE = "ditscale.diffusers.apply_fused_adaln (WanTransformer3DModel)"

# Rows of the per-sample modulation tensor [B, 9, D].
_SHIFT1, _SCALE1, _GATE1, _SHIFT3, _SCALE3, _GATE3, _ZERO_A, _ZERO_B, _ONE = range(9)


def apply(transformer) -> None:
    """Patches every block of ``transformer`` in place (see the module docstring). Applying
    twice is the same as once; a block whose ``forward`` another library already replaced on the
    instance, or whose norms are not LayerNorms, is refused (ValueError) before anything
    changes."""
    plan = _plan(transformer)
    check_plan(WHERE, plan)
    patch_all(plan)
    rotary_wan.install(transformer)


def remove(transformer) -> None:
    """Restores diffusers' forwards and self-attention processors (a no-op for blocks that are
    not patched)."""
    unpatch_all(WHERE, _plan(transformer))
    rotary_wan.uninstall(transformer)


def _plan(transformer) -> List[Patch]:
    plan = []
    for i, block in enumerate(transformer.blocks):
        norms = [("norm1", None), ("norm3", None)]
        if not isinstance(getattr(block, "norm2", None), torch.nn.Identity):
            norms.append(("norm2", None))
        plan.append(Patch(f"blocks.{i}", block, WanTransformerBlock, _block_forward, norms))
    return plan


def _fp32_norm(norm) -> dict:
    """ops keyword arguments of a FP32LayerNorm: its weight and bias as float32, as its forward
    reads them (the float32 parameters diffusers keeps as they are; a bf16 cast model's
    converted)."""
    return {"weight": _fp32(norm.weight), "bias": _fp32(norm.bias), "norm": "layernorm",
            "eps": norm.eps}


def _fp32(t):
    """t as float32 (None stays None); no call for a float32 tensor (the usual case)."""
    return t if t is None or t.dtype == torch.float32 else t.float()


def _modulation(table: torch.Tensor, temb: torch.Tensor, h: torch.Tensor):
    """The modulation operands, rows _SHIFT1 .. _ONE: per sample one float32 [B, 9, D] tensor,
    per token a tuple of nine [B, S, D] / [B, D] float32 tensors."""
    if temb.dim() == 4 and temb.shape[1] == 1:
        temb = temb[:, 0]  # one timestep per sample given as a sequence of one
    if temb.dim() == 3:  # [B, 6, D]
        # = table + temb.float() (stock): with a float32 operand the sum is computed in float32
        # and bf16 / fp16 -> fp32 is exact, so the cast is only needed when neither is float32.
        mod = table + (temb if torch.float32 in (temb.dtype, table.dtype) else temb.float())
        B, _, D = mod.shape
        return torch.cat([mod, _constant_rows(mod).expand(B, 3, D)], dim=1)
    # [B, S, 6, D]: per-token views; the constants per sample.
    rows = [r.squeeze(2) for r in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    zero = h.new_zeros((h.shape[0], h.shape[2]), dtype=torch.float32)
    one = h.new_ones((h.shape[0], h.shape[2]), dtype=torch.float32)
    return (*rows, zero, zero, one)


_CONSTANT_ROWS = {}  # (device, D) -> [1, 3, D] float32 rows 0, 0, 1 (eager calls only)


def _constant_rows(like: torch.Tensor) -> torch.Tensor:
    """[1, 3, D] float32 rows (0, 0, 1) on ``like``'s device: made once per (device, D) for eager
    calls (two kernels fewer per block), made in the graph while torch.compile traces."""
    D = like.shape[-1]
    if torch.compiler.is_compiling():
        return _make_constant_rows(D, like.device)
    key = (like.device, D)
    rows = _CONSTANT_ROWS.get(key)
    if rows is None:
        with torch.inference_mode(False), torch.no_grad():
            rows = _CONSTANT_ROWS[key] = _make_constant_rows(D, like.device)
    return rows


def _make_constant_rows(D: int, device) -> torch.Tensor:
    rows = torch.zeros((1, 3, D), dtype=torch.float32, device=device)
    rows[:, 2] = 1.0
    return rows


def _gate(m, i: int) -> torch.Tensor:
    """Row i of the modulation for broadcasting against [B, S, D]: [B, 1, D] of the per-sample
    [B, 9, D] tensor (one narrow), or the per-token [B, S, D] / constant [B, D] operand."""
    if isinstance(m, torch.Tensor):
        return m.narrow(1, i, 1)
    g = m[i]
    return g.unsqueeze(1) if g.dim() == 2 else g


def _adaln(x, m, scale: int, shift: int, norm) -> torch.Tensor:
    if isinstance(m, torch.Tensor):  # per sample: rows of one tensor
        return ops.adaln_rows(x, m, scale, shift, **_fp32_norm(norm))
    return ops.adaln(x, m[scale], m[shift], **_fp32_norm(norm))


def _adaln_gated(h, branch, m, gate: int, scale: int, shift: int, norm):
    if isinstance(m, torch.Tensor):
        return ops.adaln_gated_rows(h, branch, m, gate, scale, shift, **_fp32_norm(norm))
    return ops.adaln_gated(h, m[gate], branch, m[scale], m[shift], **_fp32_norm(norm))


def _gated_residual(h: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``(h.float() + branch.float() * gate).type_as(h)`` as one addcmul (gate [B, 1, D] or
    [B, S, D] float32: type promotion computes it in float32 without fp32 copies of h and
    branch, and autograd saves branch in its own dtype), then the rounding to h's dtype."""
    return torch.addcmul(h, branch, gate).to(h.dtype)


@fused
def _block_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
    if common.compiled_stock(hidden_states):  # compiled and small: diffusers' own forward
        return WanTransformerBlock.forward(self, hidden_states, encoder_hidden_states, temb,
                                           rotary_emb)
    m = _modulation(self.scale_shift_table, temb, hidden_states)
    y = _adaln(hidden_states, m, _SCALE1, _SHIFT1, self.norm1)
    a = self.attn1(y, None, None, rotary_emb)
    if isinstance(self.norm2, torch.nn.Identity):
        h = y = _gated_residual(hidden_states, a, _gate(m, _GATE1))
    else:
        h, y = _adaln_gated(hidden_states, a, m, _GATE1, _ZERO_A, _ZERO_B, self.norm2)
    a = self.attn2(y, encoder_hidden_states, None, None)
    h, y = _adaln_gated(h, a, m, _ONE, _SCALE3, _SHIFT3, self.norm3)
    return _gated_residual(h, self.ffn(y), _gate(m, _GATE3))
