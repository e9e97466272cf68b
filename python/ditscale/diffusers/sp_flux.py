"""Sequence parallelism for diffusers' ``FluxTransformer2DModel`` (Flux.1 dev / schnell).

The model (diffusers 0.42): ``x_embedder`` embeds the S packed image tokens [B, S, C_in] ->
[B, S, D], ``context_embedder`` the T text tokens [B, T, C_txt] -> [B, T, D]; ``pos_embed`` turns
the ids ``cat(txt_ids, img_ids)`` [T + S, 3] into the rotary tables (cos, sin), each [T + S, d]
(d = head dim); the double-stream blocks (``transformer_blocks``) attend jointly over
[text; image] with separate projections per stream; the single-stream blocks
(``single_transformer_blocks``) concatenate [text; image] into one stream of T + S tokens and
split it again at T after the block; ``norm_out`` and ``proj_out`` map the image tokens back to
[B, S, C_out]. The timestep, guidance and pooled-text embedding ``temb`` is one vector per
sample and needs nothing.

Sharding on N ranks (rank r holds the image tokens ``sp.shard_range(S, N, r)``, S_r of them;
the text stays replicated):

- ``x_embedder``'s output [B, S, D] -> this rank's [B, S_r, D];
- ``pos_embed``'s output: the T text rows stay, the S image rows -> this rank's S_r rows, so
  (cos, sin) [T + S_r, d] line up with the rank's [text; image shard] tokens;
- every attention (both block kinds) runs through ``ctx.attention``: this rank's image queries,
  keys and values [B, S_r, H, d] and the text's as the joint tokens [B, T, H, d], after the
  module's own projections, RMS norms of q and k and the rotary embedding; the result is the
  dense softmax(q k^T / sqrt(d)) v over all T + S tokens, as the stock processor computes;
- ``controlnet_block_samples`` / ``controlnet_single_block_samples`` (full [B, S, D] residuals)
  -> this rank's [B, S_r, D];
- ``proj_out``'s output [B, S_r, C_out] -> gathered to [B, S, C_out] on every rank (the last
  token-wise layer, whose output is the narrowest).

On one rank (mesh of size 1) only the input hook (device check, refusals) is registered and the
processors run the stock FluxAttnProcessor they replaced (``_sp_hooks.OneRankStock``): the
output is the stock module's, bit for bit.

Refused with a ValueError naming the feature: attention processors other than diffusers'
``FluxAttnProcessor`` and ``apply_fused_adaln``'s ``RotaryFluxAttnProcessor`` (the same
attention; the one-rank path runs it), such as IP-Adapter and custom processors;
``ip_adapter_image_embeds`` and ``attention_mask`` in ``joint_attention_kwargs``, a model
already under diffusers' own ``enable_parallelism``, and inputs on a device other than the
parameters'.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import (FluxAttnProcessor,
                                                            _get_qkv_projections)

from ._sp_context import SpContext
from ._sp_hooks import (OneRankStock, Tokens, gather_hook, image_shard_hook, input_hook,
                        joint_attention, refuse_attention_kwargs, shard_after)
from .rotary_flux import RotaryFluxAttnProcessor

WHERE = "ditscale.diffusers.parallelize (FluxTransformer2DModel)"

# joint_attention_kwargs the integration cannot honour, and why.
_REFUSED_ATTENTION_KWARGS = {
    "ip_adapter_image_embeds": "IP-Adapter image embeddings (their attention is not sharded)",
    "attention_mask": "an attention mask (the sequence-parallel attention is unmasked)",
}


def parallelize(transformer, ctx: SpContext) -> None:
    """Installs the hooks and attention processors described in the module docstring."""
    _check_model(transformer)
    tokens = Tokens()
    transformer.register_forward_pre_hook(
        input_hook(WHERE, ctx, transformer, _refuse_inputs,
                   ("controlnet_block_samples", "controlnet_single_block_samples")),
        with_kwargs=True)
    for block in transformer.transformer_blocks:
        block.attn.set_processor(DoubleStreamProcessor(ctx, block.attn.processor))
    for block in transformer.single_transformer_blocks:
        block.attn.set_processor(SingleStreamProcessor(ctx, block.attn.processor, tokens))
    if ctx.size == 1:  # every token is local: the hooks below would change nothing
        return
    transformer.context_embedder.register_forward_hook(_text_hook(tokens))
    transformer.x_embedder.register_forward_hook(image_shard_hook(ctx, tokens))
    transformer.pos_embed.register_forward_hook(_rotary_hook(ctx, tokens))
    transformer.proj_out.register_forward_hook(gather_hook(ctx, tokens))


def _check_model(transformer) -> None:
    if getattr(transformer, "_parallel_config", None) is not None:
        raise ValueError(f"{WHERE}: the model is already parallelized by diffusers' "
                         f"enable_parallelism; use one or the other")
    blocks = list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)
    for i, block in enumerate(blocks):
        processor = block.attn.processor
        if type(processor) not in (FluxAttnProcessor, RotaryFluxAttnProcessor):
            raise ValueError(f"{WHERE}: block {i}'s attention processor is "
                             f"{type(processor).__name__}; only diffusers' FluxAttnProcessor "
                             f"can be sequence-parallelized (unload IP-Adapters and custom "
                             f"processors first)")


# ---- hooks (the shared ones: _sp_hooks) ---------------------------------------------------------

def _refuse_inputs(named: dict) -> None:
    refuse_attention_kwargs(WHERE, named, "joint_attention_kwargs", _REFUSED_ATTENTION_KWARGS)


def _text_hook(tokens: Tokens):
    def hook(module, args, output):
        tokens.text = output.shape[1]

    return hook


def _rotary_hook(ctx: SpContext, tokens: Tokens):
    def hook(module, args, output):
        if ctx.size == 1:
            return None
        rows = tokens.text + tokens.image
        if output[0].shape[0] != rows:
            raise ValueError(f"{WHERE}: the rotary tables have {output[0].shape[0]} rows, "
                             f"txt_ids + img_ids should give {tokens.text} + {tokens.image}")
        return tuple(shard_after(ctx, table, 0, tokens.text) for table in output)

    return hook


# ---- attention ---------------------------------------------------------------------------------

def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, N, H * d] -> [B, N, H, d]."""
    return x.unflatten(-1, (-1, head_dim))


def _rotate(x: torch.Tensor, rotary: Optional[Tuple[torch.Tensor, torch.Tensor]], begin: int,
            count: int) -> torch.Tensor:
    """``x`` [B, count, H, d] rotated by rows [begin, begin + count) of the rotary tables."""
    if rotary is None:
        return x
    cos, sin = (t.narrow(0, begin, count) for t in rotary)
    return apply_rotary_emb(x, (cos, sin), sequence_dim=1)


def _refuse_mask(attention_mask) -> None:
    if attention_mask is not None:
        raise ValueError(f"{WHERE}: attention_mask: {_REFUSED_ATTENTION_KWARGS['attention_mask']} "
                         f"is not supported")


class DoubleStreamProcessor(OneRankStock):
    """The attention of a ``FluxTransformerBlock``: image stream [B, S_r, D] and text stream
    [B, T, D] -> (image out [B, S_r, D], text out [B, T, D]); on one rank the stock
    FluxAttnProcessor (see OneRankStock)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        _refuse_mask(attention_mask)
        if self.ctx.size == 1:
            return self.stock(attn, hidden_states, encoder_hidden_states=encoder_hidden_states,
                              image_rotary_emb=image_rotary_emb)
        return self.sharded(attn, hidden_states, encoder_hidden_states, image_rotary_emb)

    def sharded(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb):
        """The sequence-parallel attention (any mesh size)."""
        if encoder_hidden_states is None or attn.added_kv_proj_dim is None:
            raise ValueError(f"{WHERE}: a double-stream attention needs the text stream")
        q, k, v, tq, tk, tv = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        d = attn.head_dim
        image = (attn.norm_q(_heads(q, d)), attn.norm_k(_heads(k, d)), _heads(v, d))
        text = (attn.norm_added_q(_heads(tq, d)), attn.norm_added_k(_heads(tk, d)), _heads(tv, d))
        T, S = text[0].shape[1], image[0].shape[1]
        r = image_rotary_emb
        text = (_rotate(text[0], r, 0, T), _rotate(text[1], r, 0, T), text[2])
        image = (_rotate(image[0], r, T, S), _rotate(image[1], r, T, S), image[2])
        text_out, image_out = joint_attention(self.ctx, text, image)
        dtype = image[0].dtype
        image_out = image_out.flatten(2).to(dtype)
        text_out = text_out.flatten(2).to(dtype)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


class SingleStreamProcessor(OneRankStock):
    """The attention of a ``FluxSingleTransformerBlock``: the stream [text; image shard]
    [B, T + S_r, D] -> [B, T + S_r, H * d] (no output projection: the block's proj_out); on one
    rank the stock FluxAttnProcessor (see OneRankStock)."""

    def __init__(self, ctx: SpContext, stock, tokens: Tokens):
        super().__init__(ctx, stock)
        self.tokens = tokens

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        _refuse_mask(attention_mask)
        if self.ctx.size == 1:
            return self.stock(attn, hidden_states, encoder_hidden_states=encoder_hidden_states,
                              image_rotary_emb=image_rotary_emb)
        return self.sharded(attn, hidden_states, encoder_hidden_states, image_rotary_emb)

    def sharded(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb):
        """The sequence-parallel attention (any mesh size)."""
        if encoder_hidden_states is not None:
            raise ValueError(f"{WHERE}: a single-stream attention takes one stream")
        q, k, v, _, _, _ = _get_qkv_projections(attn, hidden_states)
        d = attn.head_dim
        q, k, v = attn.norm_q(_heads(q, d)), attn.norm_k(_heads(k, d)), _heads(v, d)
        n = q.shape[1]
        q, k = _rotate(q, image_rotary_emb, 0, n), _rotate(k, image_rotary_emb, 0, n)
        if self.ctx.size == 1:  # every token is local: one attention, as stock
            return self.ctx.attention(q, k, v).flatten(2).to(q.dtype)
        T = self.tokens.text
        text = tuple(x.narrow(1, 0, T) for x in (q, k, v))
        image = tuple(x.narrow(1, T, n - T) for x in (q, k, v))
        text_out, image_out = joint_attention(self.ctx, text, image)
        return torch.cat([text_out, image_out], 1).flatten(2).to(q.dtype)
