"""Fused AdaLN for diffusers' ``FluxTransformer2DModel`` (Flux.1 dev / schnell): the double
blocks' norm1 / norm1_context (``ops.adaln``), attention residual + norm2 (``ops.adaln_gated``)
and feed-forward residual (addcmul) per stream, the single blocks' norm and residual, and
``norm_out``; every attention's rotary embedding through ``rotary_flux``.

Shapes: image tokens x [B, S, D], text tokens c [B, T, D], ``temb`` [B, D]; every modulation is
per sample, [B, D] chunks of ``linear(silu(temb))`` read in place (LN: no affine, eps 1e-6).
The formulas, what stays as diffusers has it, and the numerics (fp32 inside, one rounding, x's
dtype kept): docs/diffusers/adaln_models.md (section Flux). Only the blocks' and norm_out's
``forward`` and those processors are replaced, on the instance; :func:`remove` restores them.
The helpers every family shares are in ``_adaln_common``.
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
