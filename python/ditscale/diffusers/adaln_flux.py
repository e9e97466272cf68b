"""Fused AdaLN for diffusers' ``FluxTransformer2DModel`` (Flux.1 dev / schnell).

Shapes: image tokens x [B, S, D], text tokens c [B, T, D], ``temb`` [B, D] (one conditioning
vector per sample). Every modulation is per sample, ``linear(silu(temb))`` chunked into [B, D]
views that the fused ops read in place (``LN`` = LayerNorm without affine, eps 1e-6).

Double-stream block (``transformer_blocks``), for each stream (image: ``norm1``, ``norm2``, ``ff``;
text: ``norm1_context``, ``norm2_context``, ``ff_context``), with
``shift1, scale1, gate1, shift2, scale2, gate2 = linear(silu(temb)).chunk(6)``::

    y1 = LN(x) * (1 + scale1) + shift1                  ops.adaln        (was AdaLayerNormZero)
    a  = attention(y1 image, y1 text)                   the block's own attn (its processor)
    x  = x + gate1 * a;  y2 = LN(x) * (1 + scale2) + shift2
                                                        ops.adaln_gated  (was 4 ops + norm2)
    x  = x + gate2 * ff(y2)                             one addcmul (the next norm is in the
                                                        next block)

Single-stream block (``single_transformer_blocks``), on h = [c; x] [B, T + S, D] with
``shift, scale, gate = linear(silu(temb)).chunk(3)``::

    y = LN(h) * (1 + scale) + shift                     ops.adaln (was AdaLayerNormZeroSingle)
    h = h + gate * proj_out([attn(y), gelu(proj_mlp(y))])   one addcmul

``norm_out`` (AdaLayerNormContinuous, scale first)::

    scale, shift = linear(silu(temb).to(x.dtype)).chunk(2);  y = LN(x) * (1 + scale) + shift

Everything else (attention and its processor, so the sequence-parallel integration's processors
and hooks, IP-Adapter outputs, the fp16 clip) runs as diffusers has it. The patch replaces each
block's and norm_out's ``forward`` on the instance only: parameters, module names and the
state_dict are unchanged, and :func:`remove` restores diffusers' forwards.

Numerics: the kernels compute in fp32 and round once to x's dtype; fp32 modulation (or an fp32
weight of the norm) is read as fp32. The outputs keep x's dtype where diffusers' broadcasting
would promote bf16 activations times fp32 modulation to fp32.

The shared helpers of this file (patching, norm options, the AdaLayerNormZero /
AdaLayerNormContinuous pieces) serve adaln_sd3, adaln_hunyuan_video and adaln_cogvideox too.
"""

from __future__ import annotations

from types import MethodType
from typing import Callable, Dict, Iterable, List, Tuple

import torch
from diffusers.models.normalization import (AdaLayerNormContinuous, AdaLayerNormZero,
                                            AdaLayerNormZeroSingle, RMSNorm)
from diffusers.models.transformers.transformer_flux import (FluxSingleTransformerBlock,
                                                            FluxTransformerBlock)

from .. import ops

WHERE = "ditscale.diffusers.apply_fused_adaln (FluxTransformer2DModel)"


def apply(transformer) -> None:
    """Patches every double and single block and norm_out of ``transformer`` in place (see the
    module docstring). Applying twice is the same as once; a module whose ``forward`` another
    library already replaced on the instance is refused (ValueError) before anything changes."""
    plan = _plan(transformer)
    check_plan(WHERE, plan)
    patch_all(plan)


def remove(transformer) -> None:
    """Restores diffusers' forwards (a no-op for modules that are not patched)."""
    unpatch_all(WHERE, _plan(transformer))


def _plan(transformer) -> List["Patch"]:
    plan = [Patch(f"transformer_blocks.{i}", b, FluxTransformerBlock, _double_forward,
                  (("norm1", AdaLayerNormZero), ("norm1_context", AdaLayerNormZero),
                   ("norm2", None), ("norm2_context", None)))
            for i, b in enumerate(transformer.transformer_blocks)]
    plan += [Patch(f"single_transformer_blocks.{i}", b, FluxSingleTransformerBlock,
                   _single_forward, (("norm", AdaLayerNormZeroSingle),))
             for i, b in enumerate(transformer.single_transformer_blocks)]
    plan.append(continuous_patch("norm_out", transformer.norm_out))
    return plan


# ---- shared with the other adaln_<family> modules ----------------------------------------------

_MARK = "_ditscale_fused_adaln"


def fused(fn: Callable) -> Callable:
    """Marks ``fn`` as one of ditscale's fused forwards (how :func:`is_patched` knows it)."""
    setattr(fn, _MARK, True)
    return fn


class Patch:
    """One module to patch: its dotted ``name`` in the transformer, the ``module``, the diffusers
    class it must be exactly (``cls``), the fused ``forward`` (a function of (self, ...)), and
    ``norms``: (attribute, required class or None) of the norm modules the forward reads; None
    means a plain norm (nn.LayerNorm or diffusers' RMSNorm), a class means an AdaLN module whose
    ``.norm`` is one."""

    def __init__(self, name: str, module, cls, forward: Callable,
                 norms: Iterable[Tuple[str, object]] = ()):
        self.name, self.module, self.cls, self.forward = name, module, cls, forward
        self.norms = tuple(norms)


def continuous_patch(name: str, module) -> Patch:
    """The Patch of an AdaLayerNormContinuous (``norm_out`` of Flux, SD3, HunyuanVideo; SD3's
    context_pre_only ``norm1_context``)."""
    return Patch(name, module, AdaLayerNormContinuous, continuous_forward, (("norm", None),))


def is_patched(module) -> bool:
    """True when ``module.forward`` is one of ditscale's fused forwards, set on the instance."""
    fwd = module.__dict__.get("forward")
    return bool(getattr(getattr(fwd, "__func__", None), _MARK, False))


def check_plan(where: str, plan: List[Patch]) -> None:
    """Every module of ``plan`` is exactly its diffusers class, has the norms its fused forward
    reads, and has no instance-level ``forward`` of someone else; else a ValueError naming it."""
    for p in plan:
        if type(p.module) is not p.cls:
            raise ValueError(f"{where}: {p.name} is {type(p.module).__name__}; only diffusers' "
                             f"{p.cls.__name__} can be patched there")
        if "forward" in p.module.__dict__ and not is_patched(p.module):
            raise ValueError(f"{where}: {p.name}.forward is already replaced on the instance "
                             f"(a diffusers / accelerate hook or another patch); call "
                             f"apply_fused_adaln before enabling those")
        for attr, ada_cls in p.norms:
            _check_norm_module(where, p.name, p.module, attr, ada_cls)


def _check_norm_module(where: str, name: str, module, attr: str, ada_cls) -> None:
    full = f"{name}.{attr}" if attr else name
    norm = getattr(module, attr) if attr else module
    if ada_cls is not None:
        if type(norm) is not ada_cls:
            raise ValueError(f"{where}: {full} is {type(norm).__name__}; expected diffusers' "
                             f"{ada_cls.__name__}")
        if getattr(norm, "emb", None) is not None:
            raise ValueError(f"{where}: {full} embeds its own timestep / class labels "
                             f"(num_embeddings set); that form is not supported")
        full, norm = f"{full}.norm", norm.norm
    check_norm(where, full, norm)


def check_norm(where: str, name: str, norm) -> None:
    """``norm`` is a norm over the last dimension the fused ops compute: nn.LayerNorm (FP32LayerNorm
    included, with or without weight / bias) or diffusers' RMSNorm; else a ValueError."""
    if isinstance(norm, torch.nn.LayerNorm):
        shape = tuple(norm.normalized_shape)
    elif type(norm) is RMSNorm:
        shape = tuple(norm.dim)
    else:
        raise ValueError(f"{where}: {name} is {type(norm).__name__}; the fused AdaLN computes "
                         f"torch.nn.LayerNorm or diffusers' RMSNorm only")
    if len(shape) != 1:
        raise ValueError(f"{where}: {name} normalizes over {shape}; the fused AdaLN normalizes "
                         f"over the last dimension only")


def norm_options(norm) -> Dict[str, object]:
    """The keyword arguments of ops.adaln / adaln_gated computing ``norm`` (checked by
    :func:`check_norm`): its weight, bias, kind and eps, read at call time (FSDP2 swaps the
    parameters between calls)."""
    kind = "layernorm" if isinstance(norm, torch.nn.LayerNorm) else "rmsnorm"
    return {"weight": norm.weight, "bias": norm.bias, "norm": kind, "eps": norm.eps}


def patch_all(plan: List[Patch]) -> None:
    for p in plan:
        p.module.forward = MethodType(p.forward, p.module)


def unpatch_all(where: str, plan: List[Patch]) -> None:
    """Deletes the fused instance forwards of ``plan``; refuses (before changing anything) when
    someone wrapped one of them after apply_fused_adaln."""
    for p in plan:
        if "forward" in p.module.__dict__ and not is_patched(p.module):
            raise ValueError(f"{where}: {p.name}.forward was replaced after apply_fused_adaln "
                             f"(a hook or another patch); remove that first")
    for p in plan:
        if is_patched(p.module):
            del p.module.forward


def zero_modulation(norm_module, temb: torch.Tensor, chunks: int):
    """``chunks`` [B, D] views of ``linear(silu(temb))`` [B, chunks * D] of an AdaLayerNormZero
    (6: shift1, scale1, gate1, shift2, scale2, gate2), AdaLayerNormZeroSingle (3: shift, scale,
    gate) or SD35AdaLayerNormZeroX (9)."""
    return norm_module.linear(norm_module.silu(temb)).chunk(chunks, dim=1)


def gated_ff(residual: torch.Tensor, branch: torch.Tensor, mod, norm2, ff) -> torch.Tensor:
    """The second half of an AdaLN-Zero block on one stream, ``mod`` = (shift1, scale1, gate1,
    shift2, scale2, gate2)::

        x = residual + gate1 * branch;  x + gate2 * ff(norm2(x) * (1 + scale2) + shift2)

    (the gated residual and the norm in one adaln_gated pass, the last residual one addcmul).
    ``ff`` may be a callable (e.g. a chunked feed-forward)."""
    x, y = ops.adaln_gated(residual, mod[2], branch, mod[4], mod[3], **norm_options(norm2))
    return torch.addcmul(x, mod[5].unsqueeze(1), ff(y))


def clip_fp16(x: torch.Tensor) -> torch.Tensor:
    """diffusers' clip of fp16 activations to the finite range (Flux's blocks)."""
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


@fused
def continuous_forward(self, x, conditioning_embedding):
    """AdaLayerNormContinuous: ``scale, shift = linear(silu(cond).to(x.dtype)).chunk(2)`` (scale
    first), ``norm(x) * (1 + scale) + shift`` in one ops.adaln pass."""
    emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = emb.chunk(2, dim=1)
    return ops.adaln(x, scale, shift, **norm_options(self.norm))


# ---- the forwards -------------------------------------------------------------------------------

@fused
def _double_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                    joint_attention_kwargs=None):
    img = zero_modulation(self.norm1, temb, 6)  # shift1, scale1, gate1, shift2, scale2, gate2
    txt = zero_modulation(self.norm1_context, temb, 6)
    x = ops.adaln(hidden_states, img[1], img[0], **norm_options(self.norm1.norm))
    c = ops.adaln(encoder_hidden_states, txt[1], txt[0], **norm_options(self.norm1_context.norm))
    outputs = self.attn(hidden_states=x, encoder_hidden_states=c,
                        image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    hidden_states = gated_ff(hidden_states, outputs[0], img, self.norm2, self.ff)
    if len(outputs) == 3:  # IP-Adapter's image attention, added after the feed-forward
        hidden_states = hidden_states + outputs[2]
    encoder_hidden_states = gated_ff(encoder_hidden_states, outputs[1], txt, self.norm2_context,
                                     self.ff_context)
    return clip_fp16(encoder_hidden_states), hidden_states


@fused
def _single_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                    joint_attention_kwargs=None):
    text = encoder_hidden_states.shape[1]
    h = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    shift, scale, gate = zero_modulation(self.norm, temb, 3)
    y = ops.adaln(h, scale, shift, **norm_options(self.norm.norm))
    mlp = self.act_mlp(self.proj_mlp(y))
    attn = self.attn(hidden_states=y, image_rotary_emb=image_rotary_emb,
                     **(joint_attention_kwargs or {}))
    h = clip_fp16(torch.addcmul(h, gate.unsqueeze(1), self.proj_out(torch.cat([attn, mlp], 2))))
    return h[:, :text], h[:, text:]
