"""Sequence parallelism for diffusers' ``HunyuanVideoTransformer3DModel`` (HunyuanVideo T2V and
its ``latent_concat`` I2V variant).

The model (diffusers 0.42): ``rope`` gives the rotary tables (cos, sin) [S, d] of the
S = (F / p_t) (H / p) (W / p) video tokens (d = head dim); ``x_embedder`` (a Conv3d patch
embedding) makes the video tokens [B, S, D]; ``context_embedder`` (the token refiner: its own
self-attention over the T text tokens, masked by ``encoder_attention_mask``) makes the text
tokens [B, T, D]; the model builds one key mask [B, 1, 1, S + T] over [video; text] that keeps
the video tokens and the first ``n_b = encoder_attention_mask[b].sum()`` text tokens of sample b
(the valid ones: the prompt's tokens come first, padding after); the double-stream blocks
attend jointly over [video; text] with separate projections per stream, the single-stream
blocks with the same projections for both; the rotary embedding rotates the video queries and
keys only; ``norm_out`` and ``proj_out`` give [B, S, p_t p p C_out], unpatchified to
[B, C_out, F, H, W].

Sharding on N ranks (rank r holds the video tokens ``sp.shard_range(S, N, r)``, S_r of them, in
the patch embedding's (frame, row, column) order; the text stays replicated, the token refiner
runs whole on every rank with the stock processor):

- ``rope``'s output: (cos, sin) [S, d] -> this rank's rows [S_r, d];
- ``x_embedder``'s output [B, S, D] -> this rank's [B, S_r, D];
- every block's attention: this rank's video q, k, v [B, S_r, H, d] (rotated) and the valid
  text tokens' q, k, v [B, n_b, H, d] as the joint tokens through ``ctx.attention``: the dense
  softmax(q k^T / sqrt(d)) v over the S video and n_b valid text tokens, which is what the
  stock mask computes for every valid query (samples with different n_b are run one at a
  time);
- ``proj_out``'s output [B, S_r, C] -> gathered to [B, S, C] on every rank before the stock
  unpatchify.

Padded text tokens (positions >= n_b) are keys for nobody under the mask, so they never reach a
video token or a valid text token, and the model's output (video tokens only) does not depend
on them. Their own attention output (a query over the valid keys in the stock model) is set to
zero here: the text stream differs from the stock one at the padded positions only. The mask
is read once per forward pass (one device-to-host copy of [B, S_r + T] booleans, the first
block's; the same tensor object reaches every block); a mask that hides video tokens or valid
text tokens after a padded one is refused.

On one rank (mesh of size 1) only the input hook (device check, refusals) is registered and the
processors run the stock HunyuanVideoAttnProcessor2_0 they replaced
(``_sp_hooks.OneRankStock``): the output is the stock module's, bit for bit (the stock masked
attention: the text stream is the stock one at the padded positions too, and the mask is not
read on the host).

Refused with a ValueError naming the feature: ``image_condition_type="token_replace"`` (its
first-frame tokens are modulated apart by global position), attention processors other than
diffusers' ``HunyuanVideoAttnProcessor2_0`` on the blocks, a model already under diffusers'
``enable_parallelism``, and inputs on a device other than the parameters'.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

from ._sp_context import SpContext
from ._sp_hooks import (OneRankStock, Tokens, gather_hook, image_shard_hook, input_hook,
                        joint_attention)

WHERE = "ditscale.diffusers.parallelize (HunyuanVideoTransformer3DModel)"

QKV = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def parallelize(transformer, ctx: SpContext) -> None:
    """Installs the hooks and the attention processor described in the module docstring."""
    _check_model(transformer)
    tokens = Tokens()
    transformer.register_forward_pre_hook(
        input_hook(WHERE, ctx, transformer), with_kwargs=True)
    valid = _ValidText()  # one for every block: the mask is read once per forward pass
    for block in list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks):
        block.attn.set_processor(JointProcessor(ctx, block.attn.processor, valid))
    if ctx.size == 1:  # every token is local: the hooks below would change nothing
        return
    transformer.rope.register_forward_hook(_rotary_hook(ctx))
    transformer.x_embedder.register_forward_hook(image_shard_hook(ctx, tokens))
    transformer.proj_out.register_forward_hook(gather_hook(ctx, tokens))


def _check_model(transformer) -> None:
    if getattr(transformer, "_parallel_config", None) is not None:
        raise ValueError(f"{WHERE}: the model is already parallelized by diffusers' "
                         f"enable_parallelism; use one or the other")
    condition = transformer.config.image_condition_type
    if condition == "token_replace":
        raise ValueError(f"{WHERE}: image_condition_type='token_replace' is not supported (its "
                         f"first-frame tokens are modulated by global position)")
    kinds = (("transformer_blocks", transformer.transformer_blocks),
             ("single_transformer_blocks", transformer.single_transformer_blocks))
    for kind, blocks in kinds:
        for i, block in enumerate(blocks):
            if type(block.attn.processor) is not HunyuanVideoAttnProcessor2_0:
                raise ValueError(f"{WHERE}: {kind}.{i}.attn's processor is "
                                 f"{type(block.attn.processor).__name__}; only diffusers' "
                                 f"HunyuanVideoAttnProcessor2_0 can be sequence-parallelized")


def _rotary_hook(ctx: SpContext):
    def hook(module, args, output):
        if ctx.size == 1:
            return None
        return tuple(ctx.shard(table, 0) for table in output)

    return hook


class _ValidText:
    """The valid text-token count n_b per sample, read from the model's key mask once per mask
    tensor (the model passes one mask object to every block of a forward pass)."""

    def __init__(self):
        self.mask: Optional[torch.Tensor] = None
        self.counts: List[int] = []

    def of(self, mask: Optional[torch.Tensor], batch: int, video: int, text: int) -> List[int]:
        if mask is None:
            return [text] * batch
        if mask is self.mask:
            return self.counts
        if mask.dtype != torch.bool or tuple(mask.shape) != (batch, 1, 1, video + text):
            raise ValueError(f"{WHERE}: attention_mask must be the model's boolean key mask "
                             f"[{batch}, 1, 1, {video} + {text}], got {mask.dtype} "
                             f"{list(mask.shape)}")
        keys = mask[:, 0, 0, :].cpu()
        counts = keys[:, video:].sum(1).tolist()
        for b, n in enumerate(counts):
            prefix = torch.arange(text) < n
            if not bool(keys[b, :video].all()) or not torch.equal(keys[b, video:], prefix):
                raise ValueError(f"{WHERE}: attention_mask of sample {b} is not the model's "
                                 f"[video; valid text; padding] key mask: masking video tokens "
                                 f"or text tokens between valid ones is not supported")
        self.mask, self.counts = mask, counts
        return counts


def _qkv(attn, x: torch.Tensor, added: bool) -> QKV:
    """The stream ``x`` [B, N, D] -> normed q, k and v [B, N, H, d] through the module's own
    projections (``added``: the text stream's add_*_proj and norm_added_*)."""
    if added:
        projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        norms = (attn.norm_added_q, attn.norm_added_k)
    else:
        projections = (attn.to_q, attn.to_k, attn.to_v)
        norms = (attn.norm_q, attn.norm_k)
    q, k, v = (p(x).unflatten(2, (attn.heads, -1)) for p in projections)
    q = q if norms[0] is None else norms[0](q)
    k = k if norms[1] is None else norms[1](k)
    return q, k, v


class JointProcessor(OneRankStock):
    """The attention of both block kinds: video stream [B, S_r, D] and text stream [B, T, D] ->
    (video out, text out), each through the module's output projection where it has one. On
    one rank the stock HunyuanVideoAttnProcessor2_0 (see OneRankStock). ``valid``: the
    _ValidText every block's processor shares."""

    def __init__(self, ctx: SpContext, stock, valid: "_ValidText"):
        super().__init__(ctx, stock)
        self.valid = valid

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if self.ctx.size == 1:
            return self.stock(attn, hidden_states, encoder_hidden_states=encoder_hidden_states,
                              attention_mask=attention_mask, image_rotary_emb=image_rotary_emb)
        return self.sharded(attn, hidden_states, encoder_hidden_states, attention_mask,
                            image_rotary_emb)

    def sharded(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                image_rotary_emb=None):
        """The sequence-parallel attention (any mesh size)."""
        if encoder_hidden_states is None:
            raise ValueError(f"{WHERE}: a block attention needs the text stream")
        B, S, T = hidden_states.shape[0], hidden_states.shape[1], encoder_hidden_states.shape[1]
        counts = self.valid.of(attention_mask, B, S, T)
        q, k, v = _qkv(attn, hidden_states, added=False)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        text = _qkv(attn, encoder_hidden_states, added=attn.add_q_proj is not None)
        text_out, video_out = self._attend(text, (q, k, v), counts)
        video_out = video_out.flatten(2).to(q.dtype)
        text_out = text_out.flatten(2).to(q.dtype)
        if attn.to_out is not None:
            video_out = attn.to_out[1](attn.to_out[0](video_out))
        if attn.to_add_out is not None:
            text_out = attn.to_add_out(text_out)
        return video_out, text_out

    def _attend(self, text: QKV, video: QKV, counts: List[int]) -> Tuple[torch.Tensor, ...]:
        """(text out [B, T, H, d], zero at padded positions; video out [B, S_r, H, d])."""
        T = text[0].shape[1]
        if all(n == T for n in counts):
            return joint_attention(self.ctx, text, video, text_first=False)
        if all(n == counts[0] for n in counts):
            groups = [(slice(None), counts[0])]
        else:  # one call per sample: every rank loops alike (the counts are the same everywhere)
            groups = [(slice(b, b + 1), n) for b, n in enumerate(counts)]
        text_out = torch.zeros_like(text[0])
        video_out = []
        for rows, n in groups:
            valid = tuple(x[rows, :n] for x in text)
            part = tuple(x[rows] for x in video)
            if n == 0:
                video_out.append(self.ctx.attention(*part))
                continue
            t_out, v_out = joint_attention(self.ctx, valid, part, text_first=False)
            text_out[rows, :n] = t_out
            video_out.append(v_out)
        return text_out, torch.cat(video_out, 0) if len(video_out) > 1 else video_out[0]
