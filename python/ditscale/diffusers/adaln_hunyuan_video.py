"""Fused AdaLN for diffusers' ``HunyuanVideoTransformer3DModel`` (T2V, and the I2V variants
``latent_concat`` and ``token_replace``): the double blocks' AdaLayerNormZero per stream, the
single blocks' AdaLayerNormZeroSingle on [video; text] (video first), and ``norm_out``, as
:mod:`.adaln_flux`; with ``token_replace`` the first frame's tokens take the modulation of
``token_replace_emb``, one fused call per token range (strided views, no copy).

Shapes: video tokens x [B, S, D], text tokens c [B, T, D] (after the token refiner), ``temb``
[B, D]; per-sample [B, D] modulation read in place (LN: no affine, eps 1e-6). The token refiner
is not patched (its norms have no shift / scale). The table of what is fused:
docs/diffusers/adaln_models.md (section HunyuanVideo); numerics as in :mod:`.adaln_flux`.
"""

from __future__ import annotations

from typing import List

import torch
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
from diffusers.models.transformers.transformer_hunyuan_video import (
    HunyuanVideoSingleTransformerBlock, HunyuanVideoTokenReplaceAdaLayerNormZero,
    HunyuanVideoTokenReplaceAdaLayerNormZeroSingle, HunyuanVideoTokenReplaceSingleTransformerBlock,
    HunyuanVideoTokenReplaceTransformerBlock, HunyuanVideoTransformerBlock)

from .. import ops
from ._adaln_common import (Patch, check_plan, continuous_patch, fused, gated_ff, norm_options,
                            patch_all, unpatch_all, zero_modulation)

WHERE = "ditscale.diffusers.apply_fused_adaln (HunyuanVideoTransformer3DModel)"


def apply(transformer) -> None:
    """Patches every double and single block and norm_out of ``transformer`` in place (see the
    module docstring; the rules of :func:`.adaln_flux.apply`)."""
    plan = _plan(transformer)
    check_plan(WHERE, plan)
    patch_all(plan)


def remove(transformer) -> None:
    """Restores diffusers' forwards (a no-op for modules that are not patched)."""
    unpatch_all(WHERE, _plan(transformer))


def _plan(transformer) -> List[Patch]:
    replace = transformer.config.image_condition_type == "token_replace"
    if replace:
        double = (HunyuanVideoTokenReplaceTransformerBlock, _replace_double_forward,
                  HunyuanVideoTokenReplaceAdaLayerNormZero)
        single = (HunyuanVideoTokenReplaceSingleTransformerBlock, _replace_single_forward,
                  HunyuanVideoTokenReplaceAdaLayerNormZeroSingle)
    else:
        double = (HunyuanVideoTransformerBlock, _double_forward, AdaLayerNormZero)
        single = (HunyuanVideoSingleTransformerBlock, _single_forward, AdaLayerNormZeroSingle)
    plan = [Patch(f"transformer_blocks.{i}", b, double[0], double[1],
                  (("norm1", double[2]), ("norm1_context", AdaLayerNormZero), ("norm2", None),
                   ("norm2_context", None)))
            for i, b in enumerate(transformer.transformer_blocks)]
    plan += [Patch(f"single_transformer_blocks.{i}", b, single[0], single[1],
                   (("norm", single[2]),))
             for i, b in enumerate(transformer.single_transformer_blocks)]
    plan.append(continuous_patch("norm_out", transformer.norm_out))
    return plan


# ---- T2V / latent_concat -----------------------------------------------------------------------

@fused
def _double_forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None,
                    freqs_cis=None, *args, **kwargs):
    img = zero_modulation(self.norm1, temb, 6)  # shift1, scale1, gate1, shift2, scale2, gate2
    txt = zero_modulation(self.norm1_context, temb, 6)
    x = ops.adaln(hidden_states, img[1], img[0], **norm_options(self.norm1.norm))
    c = ops.adaln(encoder_hidden_states, txt[1], txt[0], **norm_options(self.norm1_context.norm))
    attn_x, attn_c = self.attn(hidden_states=x, encoder_hidden_states=c,
                               attention_mask=attention_mask, image_rotary_emb=freqs_cis)
    hidden_states = gated_ff(hidden_states, attn_x, img, self.norm2, self.ff)
    encoder_hidden_states = gated_ff(encoder_hidden_states, attn_c, txt, self.norm2_context,
                                     self.ff_context)
    return hidden_states, encoder_hidden_states


@fused
def _single_forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None,
                    image_rotary_emb=None, *args, **kwargs):
    video = hidden_states.shape[1]
    h = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    shift, scale, gate = zero_modulation(self.norm, temb, 3)
    y = ops.adaln(h, scale, shift, **norm_options(self.norm.norm))
    h = torch.addcmul(h, gate.unsqueeze(1),
                      _single_branch(self, y, video, attention_mask, image_rotary_emb))
    return h[:, :video], h[:, video:]


def _single_branch(block, y, video, attention_mask, image_rotary_emb):
    """proj_out([attention(y), gelu(proj_mlp(y))]) of a single-stream block, y = [video; text]."""
    mlp = block.act_mlp(block.proj_mlp(y))
    attn_x, attn_c = block.attn(hidden_states=y[:, :video], encoder_hidden_states=y[:, video:],
                                attention_mask=attention_mask, image_rotary_emb=image_rotary_emb)
    return block.proj_out(torch.cat([torch.cat([attn_x, attn_c], dim=1), mlp], dim=2))


# ---- token_replace (I2V): the first num_tokens video tokens modulated apart ------------------

@fused
def _replace_double_forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None,
                            freqs_cis=None, token_replace_emb=None, num_tokens=None):
    parts = _parts(self.norm1, temb, token_replace_emb, num_tokens, 6)
    txt = zero_modulation(self.norm1_context, temb, 6)
    x = _parts_adaln(hidden_states, parts, norm_options(self.norm1.norm))
    c = ops.adaln(encoder_hidden_states, txt[1], txt[0], **norm_options(self.norm1_context.norm))
    attn_x, attn_c = self.attn(hidden_states=x, encoder_hidden_states=c,
                               attention_mask=attention_mask, image_rotary_emb=freqs_cis)
    options = norm_options(self.norm2)
    gated = [ops.adaln_gated(hidden_states[:, s], m[2], attn_x[:, s], m[4], m[3], **options)
             for s, m in parts]
    ff = self.ff(torch.cat([y for _, y in gated], dim=1))
    hidden_states = torch.cat([torch.addcmul(h, m[5].unsqueeze(1), ff[:, s])
                               for (h, _), (s, m) in zip(gated, parts)], dim=1)
    encoder_hidden_states = gated_ff(encoder_hidden_states, attn_c, txt, self.norm2_context,
                                     self.ff_context)
    return hidden_states, encoder_hidden_states


@fused
def _replace_single_forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None,
                            image_rotary_emb=None, token_replace_emb=None, num_tokens=None):
    video = hidden_states.shape[1]
    h = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    # the text tokens belong to the second part (temb's modulation), as in diffusers
    parts = _parts(self.norm, temb, token_replace_emb, num_tokens, 3)
    y = _parts_adaln(h, parts, norm_options(self.norm.norm))
    branch = _single_branch(self, y, video, attention_mask, image_rotary_emb)
    h = torch.cat([torch.addcmul(h[:, s], m[2].unsqueeze(1), branch[:, s]) for s, m in parts],
                  dim=1)
    return h[:, :video], h[:, video:]


def _parts(norm_module, temb, token_replace_emb, num_tokens: int, chunks: int):
    """((slice of the first num_tokens tokens, token_replace_emb's modulation), (slice of the
    rest, temb's modulation)); each modulation the ``chunks`` [B, D] views."""
    first = zero_modulation(norm_module, token_replace_emb, chunks)
    rest = zero_modulation(norm_module, temb, chunks)
    return ((slice(0, num_tokens), first), (slice(num_tokens, None), rest))


def _parts_adaln(x, parts, options):
    """LN(x) * (1 + scale) + shift with each part's (shift, scale) on its token range."""
    return torch.cat([ops.adaln(x[:, s], m[1], m[0], **options) for s, m in parts], dim=1)
