"""Sequence parallelism for diffusers' ``CogVideoXTransformer3DModel`` (CogVideoX 2B / 5B / 5B
I2V, CogVideoX 1.5).

The model (diffusers 0.42), for latents [B, F, C, H, W], patch p (and p_t for CogVideoX 1.5)
and text [B, T, C_txt]: ``patch_embed`` embeds text and video together into [B, T + S, D],
text first (S = F' * H/p * W/p video tokens, F' = F, or F // p_t with p_t), and adds the
positional embedding of the variants that have one (sinusoidal for 2B, learned for 5B I2V);
the model splits it at T into the text stream [B, T, D] and the video stream [B, S, D]. Every
block modulates both streams with the per-sample ``temb`` [B, D_t], attends jointly over
[text; video] (``attn1``: one set of projections, LayerNorm of q and k per head, the rotary
embedding ``image_rotary_emb`` (cos, sin) [S, d] on the video part only) and runs the
feed-forward on the concatenation. Then ``norm_final``, ``norm_out`` (modulated by temb),
``proj_out`` [B, S, p^2 (p_t) C_out] and the unpatchify.

Sharding on N ranks (rank r holds the video tokens ``sp.shard_range(S, N, r)``, S_r of them;
the text stays replicated on every rank):

- the model's input ``image_rotary_emb``: (cos, sin) [S, d] -> this rank's rows [S_r, d];
- ``patch_embed``'s output [B, T + S, D]: the T text rows stay, the video rows -> this rank's
  S_r rows, so the model's split at T gives the text and this rank's video shard;
- ``attn1`` runs through ``ctx.attention`` with this rank's video queries, keys and values
  [B, S_r, H, d] and the text's as the joint tokens [B, T, H, d] (after the module's own
  projections, fused or not, q/k norms and the rotary embedding of the video part): the dense
  softmax(q k^T / sqrt(d)) v over all T + S tokens, as the stock processor computes;
- ``proj_out``'s output [B, S_r, C] -> gathered to [B, S, C] on every rank (the last token-wise
  layer, whose output is the narrowest; norm_final and norm_out are token-wise with a per-sample
  modulation, so they run on the shard).

On one rank (mesh of size 1) only the input hook (device check, refusals) is registered and the
processors run the stock CogVideoXAttnProcessor2_0 or FusedCogVideoXAttnProcessor2_0 they
replaced (``_sp_hooks.OneRankStock``): the output is the stock module's, bit for bit.

Refused with a ValueError naming the feature: attention processors other than diffusers'
``CogVideoXAttnProcessor2_0`` / ``FusedCogVideoXAttnProcessor2_0``, an ``attention_mask`` in
``attention_kwargs``, rotary tables whose row count is not S, a model already under diffusers'
own ``enable_parallelism``, and inputs on a device other than the parameters'.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import (CogVideoXAttnProcessor2_0,
                                                  FusedCogVideoXAttnProcessor2_0)
from diffusers.models.embeddings import apply_rotary_emb

from ._sp_context import SpContext
from ._sp_hooks import OneRankStock, Tokens, argument_names, bind, check_devices, gather_hook

WHERE = "ditscale.diffusers.parallelize (CogVideoXTransformer3DModel)"
_PROCESSORS = (CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0)


def parallelize(transformer, ctx: SpContext) -> None:
    """Installs the hooks and attention processors described in the module docstring."""
    _check_model(transformer)
    tokens = Tokens()
    transformer.register_forward_pre_hook(_input_hook(ctx, tokens, transformer), with_kwargs=True)
    for block in transformer.transformer_blocks:
        block.attn1.set_processor(JointAttentionProcessor(ctx, block.attn1.processor))
    if ctx.size == 1:  # every token is local: the hooks below would change nothing
        return
    transformer.patch_embed.register_forward_hook(_patch_hook(ctx, tokens))
    transformer.proj_out.register_forward_hook(gather_hook(ctx, tokens))


def _check_model(transformer) -> None:
    if getattr(transformer, "_parallel_config", None) is not None:
        raise ValueError(f"{WHERE}: the model is already parallelized by diffusers' "
                         f"enable_parallelism; use one or the other")
    for i, block in enumerate(transformer.transformer_blocks):
        processor = block.attn1.processor
        if type(processor) not in _PROCESSORS:
            raise ValueError(f"{WHERE}: transformer_blocks[{i}].attn1's attention processor is "
                             f"{type(processor).__name__}; only diffusers' "
                             f"{' and '.join(p.__name__ for p in _PROCESSORS)} can be "
                             f"sequence-parallelized")


def video_tokens(config, latent_shape) -> int:
    """S of latents [B, F, C, H, W]: F' * (H // p) * (W // p), F' = F or F // p_t."""
    _, frames, _, height, width = latent_shape
    p, p_t = config.patch_size, config.patch_size_t
    return (frames if p_t is None else frames // p_t) * (height // p) * (width // p)


# ---- hooks -------------------------------------------------------------------------------------

def _input_hook(ctx: SpContext, tokens: Tokens, transformer):
    """Checks devices, records S, shards ``image_rotary_emb`` (cos, sin) [S, d] by rows."""
    names = argument_names(transformer.forward)

    def hook(module, args, kwargs):
        named = bind(names, args, kwargs)
        check_devices(WHERE, named, next(module.parameters()).device)
        # The mesh's size is read per call: a CFG-parallel pipeline runs a pass on a half of it.
        tokens.image = video_tokens(module.config, named["hidden_states"].shape)
        ctx.local_range(tokens.image)  # refuses fewer video tokens than ranks
        rotary = named.get("image_rotary_emb")
        if rotary is None or ctx.size == 1:
            return None
        for name, table in zip(("cos", "sin"), rotary):
            if table.shape[0] != tokens.image:
                raise ValueError(f"{WHERE}: image_rotary_emb's {name} table has "
                                 f"{table.shape[0]} rows; the latents have {tokens.image} video "
                                 f"tokens")
        named["image_rotary_emb"] = tuple(ctx.shard(table, 0) for table in rotary)
        return (), named

    return hook


def _patch_hook(ctx: SpContext, tokens: Tokens):
    """[B, T + S, D] (text first) -> [B, T + S_r, D]: the text and this rank's video rows."""

    def hook(module, args, output):
        text = args[0].shape[1]
        if output.shape[1] - text != tokens.image:
            raise ValueError(f"{WHERE}: patch_embed made {output.shape[1] - text} video tokens, "
                             f"the latents' shape gives {tokens.image}")
        if ctx.size == 1:
            return None
        video = ctx.shard(output.narrow(1, text, tokens.image), 1)
        return torch.cat([output.narrow(1, 0, text), video], 1)

    return hook


# ---- attention ---------------------------------------------------------------------------------

def joint_attention(ctx: SpContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    text: int) -> torch.Tensor:
    """Attention of [text; video shard] over all text and video tokens of the mesh. q, k, v:
    [B, T + S_r, H, d], the ``text`` = T text tokens first. Returns [B, T + S_r, H, d]; on one
    rank, one attention over q, k, v as they are (no copy)."""
    if ctx.size == 1:
        return ctx.attention(q, k, v)
    tq, tk, tv = (y.narrow(1, 0, text).contiguous() for y in (q, k, v))
    vq, vk, vv = (y.narrow(1, text, y.shape[1] - text).contiguous() for y in (q, k, v))
    video_out, text_out = ctx.attention(vq, vk, vv, joint_q=tq, joint_k=tk, joint_v=tv)
    return torch.cat([text_out, video_out], 1)


def _projections(attn, x: torch.Tensor):
    """q, k, v [B, N, H * d] of ``x`` [B, N, D] through the module's fused or separate layers."""
    if getattr(attn, "fused_projections", False):
        return attn.to_qkv(x).chunk(3, dim=-1)
    return attn.to_q(x), attn.to_k(x), attn.to_v(x)


class JointAttentionProcessor(OneRankStock):
    """``attn1`` of a ``CogVideoXBlock``: video shard [B, S_r, D] and text [B, T, D] ->
    (video out [B, S_r, D], text out [B, T, D]); on one rank the stock processor (see
    OneRankStock)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None,
                 image_rotary_emb=None):
        if attention_mask is not None:
            raise ValueError(f"{WHERE}: attention_kwargs['attention_mask']: an attention mask is "
                             f"not supported (the sequence-parallel attention is unmasked)")
        if self.ctx.size == 1:
            return self.stock(attn, hidden_states, encoder_hidden_states,
                              image_rotary_emb=image_rotary_emb)
        return self.sharded(attn, hidden_states, encoder_hidden_states, image_rotary_emb)

    def sharded(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb=None):
        """The sequence-parallel attention (any mesh size)."""
        T = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], 1)
        q, k, v = (y.unflatten(-1, (attn.heads, -1)) for y in _projections(attn, x))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:  # the video rows, in place (fresh tensors)
            q[:, T:] = apply_rotary_emb(q[:, T:], image_rotary_emb, sequence_dim=1)
            if not attn.is_cross_attention:
                k[:, T:] = apply_rotary_emb(k[:, T:], image_rotary_emb, sequence_dim=1)
        out = joint_attention(self.ctx, q, k, v, T).flatten(2).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        return out.narrow(1, T, out.shape[1] - T), out.narrow(1, 0, T)
