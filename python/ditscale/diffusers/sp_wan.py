"""Sequence parallelism for diffusers' ``WanTransformer3DModel`` (Wan 2.1 T2V / I2V, Wan 2.2
A14B and TI2V 5B): its plan (:data:`PLAN`, data applied by ``_sp_plan.apply``), the per-token
timestep hook of Wan 2.2 TI2V and the self-attention processor.

The self-attention ``attn1`` runs through ``ditscale.sp``; the cross-attention ``attn2`` keeps
diffusers' processor (this rank's queries attend the full context locally). What is sharded
where, and what is refused: docs/diffusers/wan_cogvideox.md; the plan entries:
docs/diffusers.md.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_wan import (WanAttnProcessor,
                                                           _get_qkv_projections)

from . import rotary_wan
from ._sp_attention import SpProcessor
from ._sp_context import SpContext
from ._sp_hooks import Tokens, argument_names, bind
from ._sp_plan import Gather, Inputs, Plan, Processors, Shard, ShardInput, Special
from .rotary_wan import RotaryWanAttnProcessor

WHERE = "ditscale.diffusers.parallelize (WanTransformer3DModel)"


def _check_model(transformer) -> None:
    if len(transformer.blocks) == 0:
        raise ValueError(f"{WHERE}: the model has no blocks (num_layers = 0): nothing attends "
                         f"over the video tokens")


def _timestep_hook(ctx: SpContext, tokens: Tokens, embedder):
    """``condition_embedder``'s per-token timesteps [B * S] (``timestep_seq_len`` S) -> this
    rank's [B * S_r], so temb [B, S_r, D] and timestep_proj [B, S_r, 6, D] come out sharded
    (one timestep per sample needs nothing)."""
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
        per_sample = named["timestep"].unflatten(0, (-1, seq))
        named["timestep"] = ctx.shard(per_sample, 1).flatten()
        named["timestep_seq_len"] = ctx.local_range(seq)[1]
        return (), named

    return hook


class SelfAttentionProcessor(SpProcessor):
    """``attn1`` of a ``WanTransformerBlock``: this rank's video tokens [B, S_r, D] ->
    [B, S_r, D], attending over the video tokens of every rank (q and k RMS-normed over all
    heads, then rotated by interleaved pairs)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        return self.run(attn, hidden_states, encoder_hidden_states, attention_mask,
                        rotary_emb=rotary_emb)

    def sharded(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                rotary_emb=None):
        if encoder_hidden_states is not None:
            raise ValueError(f"{self.where}: attn1 is a self-attention; it got a context")
        q, k, v = _get_qkv_projections(attn, hidden_states, None)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))
        if rotary_emb is not None:
            q, k = rotary_wan.rotate(q, rotary_emb), rotary_wan.rotate(k, rotary_emb)
        if self.ctx.size > 1:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = self.ctx.attention(q, k, v).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


PLAN = Plan(
    where=WHERE,
    inputs=Inputs(),
    hooks={
        "rope": Shard(dim=1, record=True),          # (cos, sin) [1, S, 1, d] -> [1, S_r, 1, d]
        "condition_embedder": Special(_timestep_hook, pre=True),  # TI2V: [B * S] -> [B * S_r]
        "blocks.0": ShardInput("hidden_states", dim=1),  # video tokens [B, S, D] -> [B, S_r, D]
        "proj_out": Gather(dim=1),                  # [B, S_r, p_t p_h p_w C] -> [B, S, ...]
    },
    # attn1 through ditscale.sp (apply_fused_adaln's RotaryWanAttnProcessor is the same
    # attention); attn2 (cross-attention to the replicated context) checked and kept.
    processors=(Processors("blocks.*.attn1", (WanAttnProcessor, RotaryWanAttnProcessor),
                           SelfAttentionProcessor),
                Processors("blocks.*.attn2", (WanAttnProcessor,))),
    check=_check_model,
    hint="custom processors are not supported",
    trains=True)  # every hook above differentiates (docs/diffusers.md, "Training")
