"""Sequence parallelism for diffusers' ``WanTransformer3DModel`` (Wan 2.1 T2V / I2V, Wan 2.2
A14B and TI2V 5B).

The model (diffusers 0.42), for a latent video [B, C, F, H, W] and patch (p_t, p_h, p_w):
``rope`` turns the latent's shape into the rotary tables (cos, sin), each [1, S, 1, d] (S =
F/p_t * H/p_h * W/p_w video tokens, d = head dim, float64); ``patch_embedding`` (a Conv3d) and a
flatten make the video tokens [B, S, D]; ``condition_embedder`` embeds the timestep into ``temb``
and ``timestep_proj`` and the text [B, L, C_txt] (and, for I2V, the CLIP image tokens) into
the context [B, L', D]. Every block: self-attention ``attn1`` over the S video tokens with the
rotary embedding, cross-attention ``attn2`` of the video tokens to the context (I2V: plus a
separate attention to the image tokens through ``add_k_proj`` / ``add_v_proj``), a feed-forward;
each modulated by ``timestep_proj``. Then ``norm_out`` with the (shift, scale) of ``temb``,
``proj_out`` [B, S, p_t p_h p_w C_out] and the unpatchify to [B, C_out, F, H, W].

Timesteps: Wan 2.1 and 2.2 A14B give one per sample (``timestep`` [B]: temb [B, D],
timestep_proj [B, 6 D], the same for every token); Wan 2.2 TI2V gives one per token
(``timestep`` [B, S]: temb [B, S, D], timestep_proj [B, S, 6, D]).

Sharding on N ranks (rank r holds the video tokens ``sp.shard_range(S, N, r)``, S_r of them;
the context stays replicated):

- ``rope``'s output: (cos, sin) [1, S, 1, d] -> this rank's rows [1, S_r, 1, d];
- the video tokens [B, S, D] entering the first block -> this rank's [B, S_r, D];
- per-token timesteps (TI2V): ``condition_embedder``'s input ``timestep`` [B * S] (and its
  ``timestep_seq_len`` S) -> this rank's [B * S_r] (S_r), so temb [B, S_r, D] and timestep_proj
  [B, S_r, 6, D] come out sharded with their tokens (and the time MLP runs on S_r tokens only);
  a timestep of one value per sample ([B] or [B, 1]) needs nothing;
- ``attn1`` runs through ``ctx.attention``: this rank's queries, keys and values
  [B, S_r, H, d] after the module's own projections, RMS norms of q and k (over all heads) and
  the rotary embedding (interleaved pairs: (x_2i, x_2i+1) rotated by cos_2i, sin_2i+1); the
  result is softmax(q k^T / sqrt(d)) v over all S tokens, as the stock processor computes;
- ``attn2`` keeps diffusers' own processor: this rank's S_r queries attend the full context
  (and the I2V image tokens) locally, no communication;
- ``proj_out``'s output [B, S_r, p_t p_h p_w C_out] -> gathered to [B, S, ...] on every rank
  (the last token-wise layer, whose output is the narrowest); the stock unpatchify follows.

On one rank (mesh of size 1) only the input hook (device check, refusals) is registered and the
processors run the stock WanAttnProcessor they replaced (``_sp_hooks.OneRankStock``): the output
is the stock module's, bit for bit.

Refused with a ValueError naming the feature: attention processors other than diffusers'
``WanAttnProcessor`` (and, on ``attn1``, ``apply_fused_adaln``'s ``RotaryWanAttnProcessor``,
which computes the same attention and is the "stock" processor the one-rank path runs), an
``attention_mask`` given to ``attn1``, a model already under diffusers' own
``enable_parallelism``, a model without blocks, a per-token timestep whose length is neither
1 nor S, and inputs on a device other than the parameters'.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import (WanAttnProcessor,
                                                           _get_qkv_projections)

from ._sp_context import SpContext
from ._sp_hooks import OneRankStock, Tokens, argument_names, bind, gather_hook, input_hook
from . import rotary_wan
from .rotary_wan import RotaryWanAttnProcessor

WHERE = "ditscale.diffusers.parallelize (WanTransformer3DModel)"


def parallelize(transformer, ctx: SpContext) -> None:
    """Installs the hooks and the self-attention processors described in the module
    docstring."""
    _check_model(transformer)
    tokens = Tokens()
    transformer.register_forward_pre_hook(input_hook(WHERE, ctx, transformer), with_kwargs=True)
    for block in transformer.blocks:
        block.attn1.set_processor(SelfAttentionProcessor(ctx, block.attn1.processor))
    if ctx.size == 1:  # every token is local: the hooks below would change nothing
        return
    transformer.rope.register_forward_hook(_rope_hook(ctx, tokens))
    transformer.condition_embedder.register_forward_pre_hook(
        _timestep_hook(ctx, tokens, transformer.condition_embedder), with_kwargs=True)
    transformer.blocks[0].register_forward_pre_hook(
        _video_shard_hook(ctx, tokens, transformer.blocks[0]), with_kwargs=True)
    transformer.proj_out.register_forward_hook(gather_hook(ctx, tokens))


# The processors the integration replaces (attn1) or keeps (attn2): diffusers' own, and on attn1
# apply_fused_adaln's, which computes the same attention (rotary_wan).
_STOCK_PROCESSORS = {"attn1": (WanAttnProcessor, RotaryWanAttnProcessor),
                     "attn2": (WanAttnProcessor,)}


def _check_model(transformer) -> None:
    if getattr(transformer, "_parallel_config", None) is not None:
        raise ValueError(f"{WHERE}: the model is already parallelized by diffusers' "
                         f"enable_parallelism; use one or the other")
    if len(transformer.blocks) == 0:
        raise ValueError(f"{WHERE}: the model has no blocks (num_layers = 0): nothing attends "
                         f"over the video tokens")
    for i, block in enumerate(transformer.blocks):
        for name in ("attn1", "attn2"):
            processor = getattr(block, name).processor
            if type(processor) not in _STOCK_PROCESSORS[name]:
                raise ValueError(f"{WHERE}: blocks[{i}].{name}'s attention processor is "
                                 f"{type(processor).__name__}; only diffusers' WanAttnProcessor "
                                 f"can be sequence-parallelized")


# ---- hooks -------------------------------------------------------------------------------------

def _rope_hook(ctx: SpContext, tokens: Tokens):
    """(cos, sin) [1, S, 1, d] -> this rank's [1, S_r, 1, d]; records S."""

    def hook(module, args, output):
        tokens.image = output[0].shape[1]
        ctx.local_range(tokens.image)  # refuses fewer video tokens than ranks
        if ctx.size == 1:
            return None
        return tuple(ctx.shard(table, 1) for table in output)

    return hook


def _timestep_hook(ctx: SpContext, tokens: Tokens, embedder):
    """Per-token timesteps [B * S] (``timestep_seq_len`` S) -> this rank's [B * S_r]."""
    names = argument_names(embedder.forward)

    def hook(module, args, kwargs):
        if ctx.size == 1:
            return None
        named = bind(names, args, kwargs)
        seq = named.get("timestep_seq_len")
        if seq is None or seq == 1:
            return None
        if seq != tokens.image:
            raise ValueError(f"{WHERE}: timestep has {seq} values per sample; per-token "
                             f"timesteps need one per video token ({tokens.image}) or one in all")
        timestep = named["timestep"]
        per_sample = timestep.unflatten(0, (-1, seq))
        named["timestep"] = ctx.shard(per_sample, 1).flatten()
        named["timestep_seq_len"] = ctx.local_range(seq)[1]
        return (), named

    return hook


def _video_shard_hook(ctx: SpContext, tokens: Tokens, block):
    """The first block's ``hidden_states`` [B, S, D] -> this rank's [B, S_r, D]."""
    names = argument_names(block.forward)

    def hook(module, args, kwargs):
        if ctx.size == 1:
            return None
        named = bind(names, args, kwargs)
        x = named["hidden_states"]
        if x.shape[1] != tokens.image:
            raise ValueError(f"{WHERE}: the first block got {x.shape[1]} video tokens, the rotary "
                             f"embedding was made for {tokens.image}")
        named["hidden_states"] = ctx.shard(x, 1)
        return (), named

    return hook


# ---- attention ---------------------------------------------------------------------------------

class SelfAttentionProcessor(OneRankStock):
    """``attn1`` of a ``WanTransformerBlock``: this rank's video tokens [B, S_r, D] ->
    [B, S_r, D], attending over the video tokens of every rank; on one rank the stock
    WanAttnProcessor (see OneRankStock)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        if attention_mask is not None:
            raise ValueError(f"{WHERE}: attention_mask: a mask over the video tokens is not "
                             f"supported (the sequence-parallel attention is unmasked)")
        if self.ctx.size == 1:
            return self.stock(attn, hidden_states, encoder_hidden_states=encoder_hidden_states,
                              rotary_emb=rotary_emb)
        return self.sharded(attn, hidden_states, encoder_hidden_states, rotary_emb)

    def sharded(self, attn, hidden_states, encoder_hidden_states, rotary_emb):
        """The sequence-parallel attention (any mesh size)."""
        if encoder_hidden_states is not None:
            raise ValueError(f"{WHERE}: attn1 is a self-attention; it got a context")
        q, k, v = _get_qkv_projections(attn, hidden_states, None)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))
        if rotary_emb is not None:
            q, k = rotary_wan.rotate(q, rotary_emb), rotary_wan.rotate(k, rotary_emb)
        if self.ctx.size > 1:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = self.ctx.attention(q, k, v).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))
