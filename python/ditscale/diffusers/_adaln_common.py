"""Shared pieces of the ``adaln_<family>`` modules: patching blocks' forwards on the instance
(:class:`Patch`, :func:`check_plan` refusing before anything changes, :func:`patch_all`,
:func:`unpatch_all`), checking the norms the fused ops compute (:func:`check_norm`: LayerNorm,
FP32LayerNorm, RMSNorm over the last dimension; :func:`norm_options` reads weight, bias and eps
at call time), and the AdaLN-Zero / AdaLayerNormContinuous pieces several families share.

A fused forward is a plain function of ``(self, ...)`` with the signature of the forward it
replaces (hooks binding arguments by name keep working), decorated with :func:`fused`; it calls
the module's own submodules, so parameters, names, the state_dict and others' processors and
hooks stay in force. Modulation is read in place as per-sample [B, D] or per-token [B, S, D]
views, in x's dtype or fp32. The rules every family follows: docs/diffusers/adaln_models.md.
"""

from __future__ import annotations

from types import MethodType
from typing import Callable, Dict, Iterable, List, Tuple

import torch
from diffusers.models.normalization import AdaLayerNormContinuous, RMSNorm

from .. import ops

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
    ``.norm`` is one; attribute "" is the module itself."""

    def __init__(self, name: str, module, cls, forward: Callable,
                 norms: Iterable[Tuple[str, object]] = ()):
        self.name, self.module, self.cls, self.forward = name, module, cls, forward
        self.norms = tuple(norms)


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
    """Sets each module's fused forward on the instance (after :func:`check_plan`)."""
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


# Under torch.compile, a patched block whose activations have at most this many rows (B * S on
# this rank) runs diffusers' own forward instead (see compiled_stock). Read at trace time (a
# change takes effect at the next compile: torch._dynamo guards on it); 0 switches it off.
COMPILED_STOCK_MAX_ROWS = 2048


def compiled_stock(x: torch.Tensor) -> bool:
    """True while torch.compile traces a block whose activations ``x`` [B, S, D] have at most
    COMPILED_STOCK_MAX_ROWS rows: the fused forward then calls diffusers' own one. At such sizes
    a step is host-bound and inductor fuses the stock norm chains into its neighbours' kernels,
    while every fused op is an opaque call with its own dispatch (docs/diffusers/adaln.md has the
    measurements). Eager calls always take the fused ops."""
    return (torch.compiler.is_compiling()
            and x.shape[0] * x.shape[1] <= COMPILED_STOCK_MAX_ROWS)


def constant_modulation(like: torch.Tensor, value: float) -> torch.Tensor:
    """A per-sample ``[B, D]`` float32 tensor of ``value`` for ``like`` [B, S, D]: scale = shift
    = 0 computes a norm without modulation, gate = 1 an ungated residual, through the fused ops
    (exact: ``z * (1 + 0) + 0 = z``, ``r + 1 * a = r + a``)."""
    return torch.full((like.shape[0], like.shape[-1]), value, dtype=torch.float32,
                      device=like.device)


# ---- AdaLN-Zero (Flux, SD3, HunyuanVideo, CogVideoX) ---------------------------------------------

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


def continuous_patch(name: str, module) -> Patch:
    """The Patch of an AdaLayerNormContinuous (``norm_out`` of Flux, SD3, HunyuanVideo; SD3's
    context_pre_only ``norm1_context``)."""
    return Patch(name, module, AdaLayerNormContinuous, continuous_forward, (("norm", None),))


@fused
def continuous_forward(self, x, conditioning_embedding):
    """AdaLayerNormContinuous: ``scale, shift = linear(silu(cond).to(x.dtype)).chunk(2)`` (scale
    first), ``norm(x) * (1 + scale) + shift`` in one ops.adaln pass."""
    emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = emb.chunk(2, dim=1)
    return ops.adaln(x, scale, shift, **norm_options(self.norm))
