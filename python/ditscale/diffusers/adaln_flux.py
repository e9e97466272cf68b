"""Fused AdaLN for diffusers' ``FluxTransformer2DModel`` (Flux.1 dev / schnell).

Shapes: image tokens x [B, S, D], text tokens c [B, T, D], ``temb`` [B, D] (one conditioning
vector per sample). Every modulation is per sample, ``linear(silu(temb))`` chunked into [B, D]
views that the fused ops read in place (``LN`` = LayerNorm without affine, eps 1e-6).

Double-stream block (``transformer_blocks``), for each stream (image: ``norm1``, ``norm2``, ``ff``;
text: ``norm1_context``, ``norm2_context``, ``ff_context``), with
``shift1, scale1, gate1, shift2, scale2, gate2 = linear(silu(temb)).chunk(6)``::

    y1 = LN(x) * (1 + scale1) + shift1                  ops.adaln        (was AdaLayerNormZero)
    a  = attention(y1 image, y1 text)                   the block's own attn (its processor)
    x  = x + gate1 * a;  y2 = LN(x) * (1 + scale2) + shift2
                                                        ops.adaln_gated  (was 4 ops + norm2)
    x  = x + gate2 * ff(y2)                             one addcmul (the next norm is in the
                                                        next block)

Single-stream block (``single_transformer_blocks``), on h = [c; x] [B, T + S, D] with
``shift, scale, gate = linear(silu(temb)).chunk(3)``::

    y = LN(h) * (1 + scale) + shift                     ops.adaln (was AdaLayerNormZeroSingle)
    h = h + gate * proj_out([attn(y), gelu(proj_mlp(y))])   one addcmul

``norm_out`` (AdaLayerNormContinuous, scale first)::

    scale, shift = linear(silu(temb).to(x.dtype)).chunk(2);  y = LN(x) * (1 + scale) + shift

The attention's rotary embedding: every block's ``attn`` whose processor is diffusers' own
``FluxAttnProcessor`` gets ``rotary_flux.RotaryFluxAttnProcessor`` (the same attention, q and k
rotated by one ``ops.rotary`` kernel each; see that module). Everything else (other processors,
so the sequence-parallel integration's processors and hooks, IP-Adapter outputs, the fp16 clip)
runs as diffusers has it. The patch replaces each block's and norm_out's ``forward`` and those
processors on the instance only: parameters, module names and the state_dict are unchanged, and
:func:`remove` restores diffusers' forwards and processors.

Numerics: the kernels compute in fp32 and round once to x's dtype; fp32 modulation (or an fp32
weight of the norm) is read as fp32. The outputs keep x's dtype where diffusers' broadcasting
would promote bf16 activations times fp32 modulation to fp32.

The shared helpers (patching, norm options, the AdaLayerNormZero / AdaLayerNormContinuous
pieces) live in ``_adaln_common`` and serve every adaln_<family> module.
"""

from __future__ import annotations

from typing import List

import torch
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
from diffusers.models.transformers.transformer_flux import (FluxSingleTransformerBlock,
                                                            FluxTransformerBlock)

from .. import ops
from . import rotary_flux
from ._adaln_common import (Patch, check_plan, clip_fp16, continuous_patch, fused, gated_ff,
                            norm_options, patch_all, unpatch_all, zero_modulation)

WHERE = "ditscale.diffusers.apply_fused_adaln (FluxTransformer2DModel)"


def apply(transformer) -> None:
    """Patches every double and single block and norm_out of ``transformer`` in place (see the
    module docstring). Applying twice is the same as once; a module whose ``forward`` another
    library already replaced on the instance is refused (ValueError) before anything changes."""
    plan = _plan(transformer)
    check_plan(WHERE, plan)
    patch_all(plan)
    rotary_flux.install(transformer)


def remove(transformer) -> None:
    """Restores diffusers' forwards and attention processors (a no-op for modules that are not
    patched)."""
    unpatch_all(WHERE, _plan(transformer))
    rotary_flux.uninstall(transformer)


def _plan(transformer) -> List[Patch]:
    plan = [Patch(f"transformer_blocks.{i}", b, FluxTransformerBlock, _double_forward,
                  (("norm1", AdaLayerNormZero), ("norm1_context", AdaLayerNormZero),
                   ("norm2", None), ("norm2_context", None)))
            for i, b in enumerate(transformer.transformer_blocks)]
    plan += [Patch(f"single_transformer_blocks.{i}", b, FluxSingleTransformerBlock,
                   _single_forward, (("norm", AdaLayerNormZeroSingle),))
             for i, b in enumerate(transformer.single_transformer_blocks)]
    plan.append(continuous_patch("norm_out", transformer.norm_out))
    return plan


# ---- the forwards -------------------------------------------------------------------------------

@fused
def _double_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                    joint_attention_kwargs=None):
    img = zero_modulation(self.norm1, temb, 6)  # shift1, scale1, gate1, shift2, scale2, gate2
    txt = zero_modulation(self.norm1_context, temb, 6)
    x = ops.adaln(hidden_states, img[1], img[0], **norm_options(self.norm1.norm))
    c = ops.adaln(encoder_hidden_states, txt[1], txt[0], **norm_options(self.norm1_context.norm))
    outputs = self.attn(hidden_states=x, encoder_hidden_states=c,
                        image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    hidden_states = gated_ff(hidden_states, outputs[0], img, self.norm2, self.ff)
    if len(outputs) == 3:  # IP-Adapter's image attention, added after the feed-forward
        hidden_states = hidden_states + outputs[2]
    encoder_hidden_states = gated_ff(encoder_hidden_states, outputs[1], txt, self.norm2_context,
                                     self.ff_context)
    return clip_fp16(encoder_hidden_states), hidden_states


@fused
def _single_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                    joint_attention_kwargs=None):
    text = encoder_hidden_states.shape[1]
    h = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    shift, scale, gate = zero_modulation(self.norm, temb, 3)
    y = ops.adaln(h, scale, shift, **norm_options(self.norm.norm))
    mlp = self.act_mlp(self.proj_mlp(y))
    attn = self.attn(hidden_states=y, image_rotary_emb=image_rotary_emb,
                     **(joint_attention_kwargs or {}))
    h = clip_fp16(torch.addcmul(h, gate.unsqueeze(1), self.proj_out(torch.cat([attn, mlp], 2))))
    return h[:, :text], h[:, text:]
