"""Fused AdaLN for diffusers' ``SD3Transformer2DModel`` (Stable Diffusion 3 / 3.5): each
JointTransformerBlock's AdaLayerNormZero per stream (``ops.adaln``), its attention residual +
norm2 (``ops.adaln_gated``) and feed-forward residual (addcmul); SD 3.5's dual-attention blocks
(SD35AdaLayerNormZeroX: a second modulation of the same norm for ``attn2``); the last block's
text AdaLayerNormContinuous (``context_pre_only``) and ``norm_out``.

Shapes: image tokens x [B, S, D], text tokens c [B, T, D], ``temb`` [B, D]; per-sample [B, D]
modulation read in place (LN: no affine, eps 1e-6). A chunked feed-forward
(``enable_forward_chunking``) is kept. The table of what is fused:
docs/diffusers/adaln_models.md (section SD3); numerics as in :mod:`.adaln_flux`.
"""

from __future__ import annotations

from typing import List

import torch
from diffusers.models.attention import JointTransformerBlock, _chunked_feed_forward
from diffusers.models.normalization import (AdaLayerNormContinuous, AdaLayerNormZero,
                                            SD35AdaLayerNormZeroX)

from .. import ops
from ._adaln_common import (Patch, check_plan, continuous_forward, continuous_patch, fused,
                            gated_ff, norm_options, patch_all, unpatch_all, zero_modulation)

WHERE = "ditscale.diffusers.apply_fused_adaln (SD3Transformer2DModel)"


def apply(transformer) -> None:
    """Patches every block and norm_out of ``transformer`` in place (see the module docstring;
    the rules of :func:`.adaln_flux.apply`)."""
    plan = _plan(transformer)
    check_plan(WHERE, plan)
    patch_all(plan)


def remove(transformer) -> None:
    """Restores diffusers' forwards (a no-op for modules that are not patched)."""
    unpatch_all(WHERE, _plan(transformer))


def _plan(transformer) -> List[Patch]:
    plan = [Patch(f"transformer_blocks.{i}", b, JointTransformerBlock, _joint_forward,
                  _block_norms(b))
            for i, b in enumerate(transformer.transformer_blocks)]
    plan.append(continuous_patch("norm_out", transformer.norm_out))
    return plan


def _block_norms(block):
    """The norm modules a block's fused forward reads, by its configuration."""
    dual = getattr(block, "use_dual_attention", False)
    pre_only = getattr(block, "context_pre_only", False)
    norms = [("norm1", SD35AdaLayerNormZeroX if dual else AdaLayerNormZero), ("norm2", None)]
    if pre_only:
        return norms + [("norm1_context", AdaLayerNormContinuous)]
    return norms + [("norm1_context", AdaLayerNormZero), ("norm2_context", None)]


@fused
def _joint_forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
    kwargs = joint_attention_kwargs or {}
    img = zero_modulation(self.norm1, temb, 9 if self.use_dual_attention else 6)
    options = norm_options(self.norm1.norm)
    x = ops.adaln(hidden_states, img[1], img[0], **options)
    if self.use_dual_attention:  # the second attention's input, from the same (old) stream
        x3 = ops.adaln(hidden_states, img[7], img[6], **options)
    if self.context_pre_only:
        c = continuous_forward(self.norm1_context, encoder_hidden_states, temb)
    else:
        txt = zero_modulation(self.norm1_context, temb, 6)
        c = ops.adaln(encoder_hidden_states, txt[1], txt[0],
                      **norm_options(self.norm1_context.norm))
    attn_x, attn_c = self.attn(hidden_states=x, encoder_hidden_states=c, **kwargs)
    if self.use_dual_attention:
        hidden_states = torch.addcmul(hidden_states, img[2].unsqueeze(1), attn_x)
        attn_x = self.attn2(hidden_states=x3, **kwargs)
        img = img[6:9] + img[3:6]  # gate3 gates attn2's residual, fused with norm2
    hidden_states = gated_ff(hidden_states, attn_x, img, self.norm2, _feed_forward(self, self.ff))
    if self.context_pre_only:
        return None, hidden_states
    encoder_hidden_states = gated_ff(encoder_hidden_states, attn_c, txt, self.norm2_context,
                                     _feed_forward(self, self.ff_context))
    return encoder_hidden_states, hidden_states


def _feed_forward(block, ff):
    """``ff``, or diffusers' chunked application of it when the block has a chunk size."""
    if block._chunk_size is None:
        return ff
    return lambda y: _chunked_feed_forward(ff, y, block._chunk_dim, block._chunk_size)
