"""Sequence parallelism for diffusers' ``HunyuanVideoTransformer3DModel`` (HunyuanVideo T2V and
its ``latent_concat`` I2V variant): its plan (:data:`PLAN`, data applied by ``_sp_plan.apply``)
and the joint attention processor of both block kinds.

The processor honours the model's text mask exactly: the video tokens and the n_b valid text
tokens of sample b attend jointly (padded text positions get an attention output of zero; they
never reach the output). The mask is read on the host once per forward pass. What is sharded
where, and what is refused: docs/diffusers/flux_sd3_hunyuan.md; the plan entries:
docs/diffusers.md.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

from ._sp_attention import QKV, ImageRotaryProcessor, joint_attention, project_qkv
from ._sp_hooks import Tokens
from ._sp_plan import Gather, Inputs, Plan, Processors, Shard

WHERE = "ditscale.diffusers.parallelize (HunyuanVideoTransformer3DModel)"

def _check_model(transformer) -> None:
    if transformer.config.image_condition_type == "token_replace":
        raise ValueError(f"{WHERE}: image_condition_type='token_replace' is not supported (its "
                         f"first-frame tokens are modulated by global position)")


def valid_text(tokens: Tokens, mask: Optional[torch.Tensor], batch: int, video: int,
               text: int) -> List[int]:
    """The valid text-token count n_b per sample of the model's key mask [B, 1, 1, S_r + T]
    over [video; text] (the model passes one mask object to every block of a forward pass, so
    it is read once: ``tokens.mask`` / ``tokens.counts``)."""
    if mask is None:
        return [text] * batch
    if mask is tokens.mask:
        return tokens.counts
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
    tokens.mask, tokens.counts = mask, counts
    return counts


class JointProcessor(ImageRotaryProcessor):
    """The attention of both block kinds: video stream [B, S_r, D] and text stream [B, T, D] ->
    (video out, text out), each through the module's output projection where it has one."""

    REFUSED_MASK = None  # the model's text mask is honoured (valid_text)

    def sharded(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                image_rotary_emb=None):
        if encoder_hidden_states is None:
            raise ValueError(f"{self.where}: a block attention needs the text stream")
        B, S, T = hidden_states.shape[0], hidden_states.shape[1], encoder_hidden_states.shape[1]
        counts = valid_text(self.tokens, attention_mask, B, S, T)
        q, k, v = project_qkv(attn, hidden_states, added=False)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        text = project_qkv(attn, encoder_hidden_states, added=attn.add_q_proj is not None)
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


_STOCK = (HunyuanVideoAttnProcessor2_0,)

PLAN = Plan(
    where=WHERE,
    inputs=Inputs(),
    hooks={
        "rope": Shard(dim=0),                       # (cos, sin) [S, d] -> [S_r, d]
        "x_embedder": Shard(dim=1, record=True),    # video tokens [B, S, D] -> [B, S_r, D]
        "proj_out": Gather(dim=1),                  # [B, S_r, C] -> [B, S, C]
    },
    # The token refiner (context_embedder) keeps its stock processor and runs whole everywhere.
    processors=(Processors("transformer_blocks.*.attn", _STOCK, JointProcessor),
                Processors("single_transformer_blocks.*.attn", _STOCK, JointProcessor)),
    check=_check_model,
    trains=True)  # every hook above differentiates (docs/diffusers.md, "Training")
