"""Fused AdaLN for diffusers' ``WanTransformer3DModel`` (Wan 2.1 T2V / I2V, Wan 2.2 A14B and
TI2V 5B).

Shapes: video tokens h [B, S, D] (x's dtype, e.g. bf16), the context c [B, L, D], and the
block's ``temb`` (the model's ``timestep_proj``): per sample [B, 6, D] (Wan 2.1, 2.2 A14B) or
per token [B, S, 6, D] (Wan 2.2 TI2V; [B, 1, 6, D] counts as per sample). Each block adds its
``scale_shift_table`` [1, 6, D] in float32::

    shift1, scale1, gate1, shift3, scale3, gate3 = scale_shift_table + temb.float()

and computes (``LN`` = the block's FP32LayerNorm: statistics and affine in fp32; every line's
result rounded once to h's dtype, as diffusers' ``.type_as(hidden_states)`` does)::

    y = LN1(h) * (1 + scale1) + shift1              ops.adaln         (stock: 6 ops)
    a = attn1(y, rotary)                            the block's own attn1 (its processor)
    h = h + gate1 * a;  y = LN2(h) (affine)          ops.adaln_gated   (stock: 7 ops; scale =
                                                    shift = 0 rows, so y = LN2(h) exactly)
    a = attn2(y, c)                                 the block's own attn2
    h = h + a;  y = LN3(h) * (1 + scale3) + shift3  ops.adaln_gated   (stock: 7 ops; gate = 1)
    h = h + gate3 * ffn(y)                          one fp32 addcmul, rounded to h's dtype

With ``cross_attn_norm=False`` (norm2 is nn.Identity) the second line is the gated residual
alone (an addcmul). Per-sample modulation is one float32 tensor [B, 9, D] (the six rows, then
two zero rows and a row of ones for the constants above) whose rows the ops read in place, so
its gradient comes out of the kernels' reductions (ops.adaln's packed rows); per-token
modulation is read as strided [B, S, D] views of [B, S, 6, D] (the constants per sample).

Not fused: ``norm_out`` (its norm + modulation is written inline in WanTransformer3DModel.forward,
not in a module, so fusing it means replacing the model's forward, which the sequence-parallel
integration and diffusers' hooks wrap; it runs once per forward), and the last residual of a
block with the next block's norm1 (the block loop is diffusers': a block returns one tensor, so
the next block's normed input would need a side channel that gradient checkpointing, hooks
between blocks and per-block torch.compile break; it would save one read of h per block).

Under torch.compile, a block of at most ``_adaln_common.COMPILED_STOCK_MAX_ROWS`` rows (B * S,
2,048) runs diffusers' own forward (compiled, inductor fuses its norm chains with their
neighbours; the fused ops' per-call dispatch would cost more than they save there); eager calls
always take the fused ops.

Everything else runs as diffusers has it: attention and its processors (so
``ditscale.diffusers.parallelize``'s processors and hooks), the feed-forward, the embedders. Only
the blocks' ``forward`` is replaced, on the instance: parameters, module names and the
state_dict are unchanged; :func:`remove` restores diffusers' forwards.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from diffusers.models.transformers.transformer_wan import WanTransformerBlock

from .. import ops
from . import _adaln_common as common
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


def remove(transformer) -> None:
    """Restores diffusers' forwards (a no-op for blocks that are not patched)."""
    unpatch_all(WHERE, _plan(transformer))


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
    reads them (a no-op for the float32 parameters diffusers keeps; a bf16 cast model's are
    converted)."""
    w, b = norm.weight, norm.bias
    return {"weight": None if w is None else w.float(), "bias": None if b is None else b.float(),
            "norm": "layernorm", "eps": norm.eps}


def _modulation(table: torch.Tensor, temb: torch.Tensor, h: torch.Tensor) -> Tuple:
    """The nine modulation operands (rows _SHIFT1 .. _ONE), each [B, D] or [B, S, D] float32."""
    if temb.dim() == 4 and temb.shape[1] == 1:
        temb = temb[:, 0]  # one timestep per sample given as a sequence of one
    if temb.dim() == 3:  # [B, 6, D]
        mod = table + temb.float()
        B, _, D = mod.shape
        const = mod.new_zeros((B, 3, D))
        const[:, 2] = 1.0
        return torch.cat([mod, const], dim=1).unbind(1)
    # [B, S, 6, D]: per-token views; the constants per sample.
    rows = [r.squeeze(2) for r in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    zero = h.new_zeros((h.shape[0], h.shape[2]), dtype=torch.float32)
    one = h.new_ones((h.shape[0], h.shape[2]), dtype=torch.float32)
    return (*rows, zero, zero, one)


def _gated_residual(h: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``(h.float() + branch.float() * gate).type_as(h)`` as one addcmul (gate [B, D] or
    [B, S, D] float32: type promotion computes it in float32 without fp32 copies of h and
    branch, and autograd saves branch in its own dtype), then the rounding to h's dtype."""
    g = gate.unsqueeze(1) if gate.dim() == 2 else gate
    return torch.addcmul(h, branch, g).to(h.dtype)


@fused
def _block_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
    if common.compiled_stock(hidden_states):  # compiled and small: diffusers' own forward
        return WanTransformerBlock.forward(self, hidden_states, encoder_hidden_states, temb,
                                           rotary_emb)
    m = _modulation(self.scale_shift_table, temb, hidden_states)
    y = ops.adaln(hidden_states, m[_SCALE1], m[_SHIFT1], **_fp32_norm(self.norm1))
    a = self.attn1(y, None, None, rotary_emb)
    if isinstance(self.norm2, torch.nn.Identity):
        h = y = _gated_residual(hidden_states, a, m[_GATE1])
    else:
        h, y = ops.adaln_gated(hidden_states, m[_GATE1], a, m[_ZERO_A], m[_ZERO_B],
                               **_fp32_norm(self.norm2))
    a = self.attn2(y, encoder_hidden_states, None, None)
    h, y = ops.adaln_gated(h, m[_ONE], a, m[_SCALE3], m[_SHIFT3], **_fp32_norm(self.norm3))
    return _gated_residual(h, self.ffn(y), m[_GATE3])
