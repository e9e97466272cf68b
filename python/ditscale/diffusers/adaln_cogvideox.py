"""Fused AdaLN for diffusers' ``CogVideoXTransformer3DModel`` (CogVideoX 2B / 5B, 1.5, I2V): each
block's two CogVideoXLayerNormZero (one LayerNorm with weight and bias shared by both streams,
a modulation per stream): norm1 (``ops.adaln`` per stream), the attention residual + norm2
(``ops.adaln_gated`` per stream), the feed-forward residuals on [text; video] (two addcmul), and
``norm_out`` (AdaLayerNorm, chunk_dim=1, shift first). ``norm_final`` has no modulation and stays.

Shapes: video tokens x [B, S, D], text tokens c [B, T, D], ``temb`` [B, E] (E = time_embed_dim);
[B, D] modulation views read in place. The table of what is fused:
docs/diffusers/adaln_models.md (section CogVideoX); numerics as in :mod:`.adaln_flux`.
"""

from __future__ import annotations

from typing import List

import torch
from diffusers.models.normalization import AdaLayerNorm, CogVideoXLayerNormZero
from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock

from .. import ops
from ._adaln_common import (Patch, check_plan, fused, norm_options, patch_all, unpatch_all,
                            zero_modulation)

WHERE = "ditscale.diffusers.apply_fused_adaln (CogVideoXTransformer3DModel)"


def apply(transformer) -> None:
    """Patches every block and norm_out of ``transformer`` in place (see the module docstring;
    the rules of :func:`.adaln_flux.apply`)."""
    plan = _plan(transformer)
    check_plan(WHERE, plan)
    _check_norm_out(transformer.norm_out)
    patch_all(plan)


def remove(transformer) -> None:
    """Restores diffusers' forwards (a no-op for modules that are not patched)."""
    unpatch_all(WHERE, _plan(transformer))


def _plan(transformer) -> List[Patch]:
    plan = [Patch(f"transformer_blocks.{i}", b, CogVideoXBlock, _block_forward,
                  (("norm1", CogVideoXLayerNormZero), ("norm2", CogVideoXLayerNormZero)))
            for i, b in enumerate(transformer.transformer_blocks)]
    plan.append(Patch("norm_out", transformer.norm_out, AdaLayerNorm, _norm_out_forward,
                      (("norm", None),)))
    return plan


def _check_norm_out(norm_out) -> None:
    if norm_out.chunk_dim != 1 or norm_out.emb is not None:
        raise ValueError(f"{WHERE}: norm_out is an AdaLayerNorm with chunk_dim="
                         f"{norm_out.chunk_dim} and {'an' if norm_out.emb is not None else 'no'} "
                         f"embedding of its own; only CogVideoX's form (chunk_dim=1, temb "
                         f"given) is supported")


@fused
def _block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                   attention_kwargs=None):
    text = encoder_hidden_states.size(1)
    m1 = zero_modulation(self.norm1, temb, 6)  # shift, scale, gate, enc_shift, enc_scale, enc_gate
    m2 = zero_modulation(self.norm2, temb, 6)
    options = norm_options(self.norm1.norm)
    x = ops.adaln(hidden_states, m1[1], m1[0], **options)
    c = ops.adaln(encoder_hidden_states, m1[4], m1[3], **options)
    attn_x, attn_c = self.attn1(hidden_states=x, encoder_hidden_states=c,
                                image_rotary_emb=image_rotary_emb, **(attention_kwargs or {}))
    options = norm_options(self.norm2.norm)
    hidden_states, x = ops.adaln_gated(hidden_states, m1[2], attn_x, m2[1], m2[0], **options)
    encoder_hidden_states, c = ops.adaln_gated(encoder_hidden_states, m1[5], attn_c, m2[4],
                                               m2[3], **options)
    ff = self.ff(torch.cat([c, x], dim=1))
    hidden_states = torch.addcmul(hidden_states, m2[2].unsqueeze(1), ff[:, text:])
    encoder_hidden_states = torch.addcmul(encoder_hidden_states, m2[5].unsqueeze(1), ff[:, :text])
    return hidden_states, encoder_hidden_states


@fused
def _norm_out_forward(self, x, timestep=None, temb=None):
    shift, scale = self.linear(self.silu(temb)).chunk(2, dim=1)
    return ops.adaln(x, scale, shift, **norm_options(self.norm))
