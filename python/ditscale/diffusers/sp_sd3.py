"""Sequence parallelism for diffusers' ``SD3Transformer2DModel`` (Stable Diffusion 3 / 3.5).

The model (diffusers 0.42): ``pos_embed`` (PatchEmbed) turns the latent [B, C, H, W] into the
S = (H / p) (W / p) image tokens [B, S, D] with the (cropped sin-cos) positional embedding
already added; ``context_embedder`` maps the T text tokens to [B, T, D]; every
``JointTransformerBlock`` attends jointly over [image; text] (``attn``: separate projections per
stream, optional q/k norms), SD3.5's dual-attention blocks add ``attn2``, a self-attention over
the image tokens only, and the last block is ``context_pre_only`` (its text output is dropped);
``norm_out`` and ``proj_out`` give [B, S, p * p * C_out], unpatchified to [B, C_out, H, W]. The
timestep and pooled-text embedding is one vector per sample.

Sharding on N ranks (rank r holds the image tokens ``sp.shard_range(S, N, r)``, S_r of them,
in PatchEmbed's row-major patch order; the text stays replicated):

- ``pos_embed``'s output [B, S, D] (positional embedding included) -> this rank's [B, S_r, D];
- ``attn`` of every block: this rank's image q, k, v [B, S_r, H, d] and the text's as the joint
  tokens [B, T, H, d] through ``ctx.attention`` (dense softmax(q k^T / sqrt(d)) v over all
  S + T tokens: the order [image; text] of the stock processor does not change the result);
  ``attn2``: the image tokens alone through ``ctx.attention``;
- ``block_controlnet_hidden_states`` (full [B, S, D] residuals) -> this rank's [B, S_r, D];
- ``proj_out``'s output [B, S_r, p * p * C_out] -> gathered to [B, S, p * p * C_out] on every
  rank before the stock unpatchify.

On one rank (mesh of size 1) only the input hook (device check, refusals) is registered and the
processors run the stock JointAttnProcessor2_0 they replaced (``_sp_hooks.OneRankStock``): the
output is the stock module's, bit for bit.

``skip_layers`` (skip-layer guidance: whole blocks left out) is honoured as is: skipping a block
skips its attention on every rank alike. Refused with a ValueError naming the feature: attention
processors other than diffusers' ``JointAttnProcessor2_0`` (fused QKV projections, IP-Adapter,
PAG, custom processors), ``ip_adapter_image_embeds`` and ``attention_mask`` in
``joint_attention_kwargs``, a model already under diffusers' ``enable_parallelism``, and inputs
on a device other than the parameters'.
"""

from __future__ import annotations

from typing import Tuple

import torch
from diffusers.models.attention_processor import JointAttnProcessor2_0

from ._sp_context import SpContext
from ._sp_hooks import (OneRankStock, Tokens, gather_hook, image_shard_hook, input_hook,
                        joint_attention, refuse_attention_kwargs)

WHERE = "ditscale.diffusers.parallelize (SD3Transformer2DModel)"

_REFUSED_ATTENTION_KWARGS = {
    "ip_adapter_image_embeds": "IP-Adapter image embeddings (their attention is not sharded)",
    "attention_mask": "an attention mask (the sequence-parallel attention is unmasked)",
}


def parallelize(transformer, ctx: SpContext) -> None:
    """Installs the hooks and the attention processor described in the module docstring."""
    _check_model(transformer)
    tokens = Tokens()
    transformer.register_forward_pre_hook(
        input_hook(WHERE, ctx, transformer, _refuse_inputs, ("block_controlnet_hidden_states",)),
        with_kwargs=True)
    for _, attn in list(_attentions(transformer)):
        attn.set_processor(JointProcessor(ctx, attn.processor))
    if ctx.size == 1:  # every token is local: the hooks below would change nothing
        return
    transformer.pos_embed.register_forward_hook(image_shard_hook(ctx, tokens))
    transformer.proj_out.register_forward_hook(gather_hook(ctx, tokens))


def _attentions(transformer):
    """(name, Attention module) of every block's attn and attn2."""
    for i, block in enumerate(transformer.transformer_blocks):
        yield f"transformer_blocks.{i}.attn", block.attn
        if block.attn2 is not None:
            yield f"transformer_blocks.{i}.attn2", block.attn2


def _check_model(transformer) -> None:
    if getattr(transformer, "_parallel_config", None) is not None:
        raise ValueError(f"{WHERE}: the model is already parallelized by diffusers' "
                         f"enable_parallelism; use one or the other")
    for name, attn in _attentions(transformer):
        if type(attn.processor) is not JointAttnProcessor2_0:
            raise ValueError(f"{WHERE}: {name}'s attention processor is "
                             f"{type(attn.processor).__name__}; only diffusers' "
                             f"JointAttnProcessor2_0 can be sequence-parallelized (unfuse QKV "
                             f"projections, unload IP-Adapters and custom processors first)")


def _refuse_inputs(named: dict) -> None:
    refuse_attention_kwargs(WHERE, named, "joint_attention_kwargs", _REFUSED_ATTENTION_KWARGS)


def _qkv(attn, x: torch.Tensor, added: bool) -> Tuple[torch.Tensor, ...]:
    """The stream ``x`` [B, N, D] -> normed q, k and v [B, N, H, d] through the module's own
    projections (``added``: the text stream's add_*_proj and norm_added_*)."""
    if added:
        projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        norms = (attn.norm_added_q, attn.norm_added_k)
    else:
        projections = (attn.to_q, attn.to_k, attn.to_v)
        norms = (attn.norm_q, attn.norm_k)
    q, k, v = (p(x).unflatten(-1, (attn.heads, -1)) for p in projections)
    q = q if norms[0] is None else norms[0](q)
    k = k if norms[1] is None else norms[1](k)
    return q, k, v


class JointProcessor(OneRankStock):
    """``attn`` of a JointTransformerBlock: image stream [B, S_r, D] and text stream [B, T, D]
    -> (image out [B, S_r, D], text out [B, T, D]; not projected when ``context_pre_only``);
    ``attn2`` (no text stream): [B, S_r, D] -> [B, S_r, D]. On one rank the stock
    JointAttnProcessor2_0 (see OneRankStock)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        if attention_mask is not None:
            raise ValueError(f"{WHERE}: attention_mask: "
                             f"{_REFUSED_ATTENTION_KWARGS['attention_mask']} is not supported")
        if self.ctx.size == 1:
            return self.stock(attn, hidden_states, encoder_hidden_states=encoder_hidden_states)
        return self.sharded(attn, hidden_states, encoder_hidden_states)

    def sharded(self, attn, hidden_states, encoder_hidden_states=None):
        """The sequence-parallel attention (any mesh size)."""
        image = _qkv(attn, hidden_states, added=False)
        dtype = image[0].dtype
        if encoder_hidden_states is None:
            out = self.ctx.attention(*image).flatten(2).to(dtype)
            return attn.to_out[1](attn.to_out[0](out))
        text = _qkv(attn, encoder_hidden_states, added=True)
        text_out, image_out = joint_attention(self.ctx, text, image, text_first=False)
        image_out = image_out.flatten(2).to(dtype)
        text_out = text_out.flatten(2).to(dtype)
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return attn.to_out[1](attn.to_out[0](image_out)), text_out
