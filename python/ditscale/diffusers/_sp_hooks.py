"""The forward hooks that the entries of a sequence-parallel plan (``_sp_plan``) install: the
model's input hook (argument binding, device check, refusals, the training refusal), the count,
shard and gather of token dimensions (differentiable: a shard's backward is the slice's gradient,
the gather's backward this rank's slice). Hooks read the mesh's size per call (a CFG-parallel
pipeline runs a pass on a half of the mesh, which may be one rank: then they pass their input
through). Shapes: B batch, S image/video tokens, S_r this rank's shard of them, T text tokens.
See docs/diffusers.md.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from ..sp.grad import GRAD_DEVICES, GRAD_STRATEGIES
from ._sp_context import SpContext


@dataclass
class Tokens:
    """Token counts of the forward pass in flight (set by the plan's hooks): ``text`` the
    replicated text tokens T, ``image`` the image/video tokens S before sharding; ``mask`` and
    ``counts``: the last key mask a family read on the host and its valid text tokens per sample
    (HunyuanVideo: read once per forward pass)."""

    text: int = 0
    image: int = 0
    mask: Optional[torch.Tensor] = None
    counts: List[int] = field(default_factory=list)


def argument_names(fn) -> List[str]:
    """The parameter names of ``fn`` (a bound ``forward``) in order, looked up once: a hook
    built with them binds a call's arguments without ``inspect`` per call."""
    return list(inspect.signature(fn).parameters)


def bind(names: List[str], args: tuple, kwargs: dict) -> Dict[str, object]:
    """The call's arguments by name (``names`` from :func:`argument_names`; defaults left
    out)."""
    named = dict(zip(names, args))
    named.update(kwargs)
    return named


def check_devices(where: str, named: Dict[str, object], device: torch.device) -> None:
    """Every tensor in ``named`` (argument name -> value, tuples and lists looked into) is on
    ``device``, else a ValueError naming the argument."""
    for name, value in named.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if isinstance(v, torch.Tensor) and v.device != device:
                raise ValueError(f"{where}: {name} is on {v.device}, the transformer's "
                                 f"parameters on {device}")


# What sequence-parallel training supports on more than one rank (a plan with ``trains``).
TRAINING_SUPPORTED = ("every family with any strategy on CPU tensors over gloo and CUDA tensors "
                      "over NCCL")


def trains_here(ctx: SpContext, trains: bool, device: torch.device) -> bool:
    """Whether a plan with ``trains`` has a correct backward on ``device`` with this context's
    strategy (``ditscale.sp``'s differentiable strategies on its devices, eagerly or under
    torch.compile)."""
    return trains and ctx.config.strategy in GRAD_STRATEGIES and device.type in GRAD_DEVICES


def refuse_training(where: str, ctx: SpContext, module, named: Dict[str, object],
                    trains: bool = False) -> None:
    """On more than one rank, a module in training mode with gradients enabled and parameters
    or tensor inputs that require grad: a ValueError unless :func:`trains_here` (the plan's
    hooks and the sharded attention then have a backward across ranks). One rank is the stock
    module: allowed."""
    if ctx.size == 1 or not module.training or not torch.is_grad_enabled():
        return
    inputs = any(isinstance(v, torch.Tensor) and v.requires_grad for v in named.values())
    if not inputs and not any(p.requires_grad for p in module.parameters()):
        return
    device = next(module.parameters()).device
    if trains_here(ctx, trains, device):
        return
    raise ValueError(f"{where}: sequence-parallel training is not supported yet for "
                     f"{type(module).__name__} with strategy {ctx.config.strategy!r} on "
                     f"{device.type} tensors on {ctx.size} ranks (supported: "
                     f"{TRAINING_SUPPORTED}); call .eval() or run under torch.no_grad() for "
                     f"inference, or train on one rank")


def no_refusal(named: dict) -> None:
    """The ``refuse`` of a model whose inputs are all honoured."""


# Entries of a joint-attention model's ``joint_attention_kwargs`` the plans cannot honour (Flux,
# SD3), and why.
REFUSED_JOINT_ATTENTION_KWARGS = {
    "ip_adapter_image_embeds": "IP-Adapter image embeddings (their attention is not sharded)",
    "attention_mask": "an attention mask (the sequence-parallel attention is unmasked)",
}


def refuse_attention_kwargs(where: str, key: str = "joint_attention_kwargs",
                            refused: Dict[str, str] = REFUSED_JOINT_ATTENTION_KWARGS):
    """The ``refuse`` of an :class:`Inputs`: a ValueError for any entry of ``refused`` (kwarg ->
    what it is) set in the call's attention kwargs dict ``named[key]``."""

    def refuse(named: dict) -> None:
        attention_kwargs = named.get(key) or {}
        for name, what in refused.items():
            if attention_kwargs.get(name) is not None:
                raise ValueError(f"{where}: {key}[{name!r}]: {what} is not supported")

    return refuse


def input_hook(where: str, ctx: SpContext, tokens: Tokens, module, refuse: Callable,
               shard_lists, prepare: Optional[Callable], trains: bool = False):
    """The model's forward pre-hook (``with_kwargs=True``): binds the call's arguments to their
    names, checks their devices and refuses training on several ranks (unless ``trains`` and
    :func:`trains_here`), calls ``refuse(named)``
    (options the integration cannot honour) and ``prepare(ctx, tokens, module, named)`` (a
    family's own input step; True when it changed ``named``), and on more than one rank replaces
    each list of full-sequence residuals [B, S, D] named in ``shard_lists`` (ControlNet samples)
    by this rank's shards [B, S_r, D]."""
    names = argument_names(module.forward)

    def hook(module, args, kwargs):
        named = bind(names, args, kwargs)
        check_devices(where, named, next(module.parameters()).device)
        refuse_training(where, ctx, module, named, trains)
        refuse(named)
        changed = bool(prepare(ctx, tokens, module, named)) if prepare is not None else False
        if ctx.size > 1:
            for key in shard_lists:
                samples = named.get(key)
                if samples is not None:
                    named[key] = [ctx.shard(s, 1) for s in samples]
                    changed = True
        return ((), named) if changed else None

    return hook


def count_hook(tokens: Tokens, name: str, dim: int):
    """A forward hook recording ``output.shape[dim]`` as ``tokens.<name>``."""

    def hook(module, args, output):
        setattr(tokens, name, output.shape[dim])

    return hook


def shard_after(ctx: SpContext, x: torch.Tensor, dim: int, keep: int) -> torch.Tensor:
    """``x`` with its first ``keep`` entries along ``dim`` kept whole and the rest replaced by
    this rank's shard of them."""
    head = x.narrow(dim, 0, keep)
    tail = ctx.shard(x.narrow(dim, keep, x.shape[dim] - keep), dim)
    return torch.cat([head, tail], dim)


def shard_output_hook(where: str, ctx: SpContext, tokens: Tokens, dim: int, record: bool,
                      keep_text: bool):
    """A forward hook: the output (a tensor, or each tensor of a tuple) -> this rank's shard
    along ``dim``. ``record``: the first tensor's length there is S (``tokens.image``; fewer
    tokens than ranks refused). ``keep_text``: the first T entries stay whole, the S after them
    are sharded (T + S checked)."""

    def hook(module, args, output):
        parts = output if isinstance(output, tuple) else (output,)
        if record:
            tokens.image = parts[0].shape[dim]
            ctx.local_range(tokens.image)  # refuses fewer image tokens than ranks
        if ctx.size == 1:
            return None
        if keep_text:
            rows = tokens.text + tokens.image
            if parts[0].shape[dim] != rows:
                raise ValueError(f"{where}: {type(module).__name__}'s output has "
                                 f"{parts[0].shape[dim]} rows, the text and image tokens "
                                 f"{tokens.text} + {tokens.image}")
            sharded = tuple(shard_after(ctx, p, dim, tokens.text) for p in parts)
        else:
            sharded = tuple(ctx.shard(p, dim) for p in parts)
        return sharded if isinstance(output, tuple) else sharded[0]

    return hook


def shard_input_hook(where: str, ctx: SpContext, tokens: Tokens, module, name: str, dim: int):
    """A forward pre-hook (``with_kwargs=True``): the argument ``name`` [.., S, ..] (S along
    ``dim``, as recorded) -> this rank's shard."""
    names = argument_names(module.forward)

    def hook(module, args, kwargs):
        if ctx.size == 1:
            return None
        named = bind(names, args, kwargs)
        x = named[name]
        if x.shape[dim] != tokens.image:
            raise ValueError(f"{where}: {type(module).__name__}'s {name} has {x.shape[dim]} "
                             f"tokens, the model made {tokens.image}")
        named[name] = ctx.shard(x, dim)
        return (), named

    return hook


def gather_hook(ctx: SpContext, tokens: Tokens, dim: int):
    """A forward hook for the last token-wise layer: [B, S_r, C] -> the full [B, S, C] on every
    rank (S = ``tokens.image``); its backward gives this rank's slice of the gradient."""

    def hook(module, args, output):
        return ctx.gather(output, dim, tokens.image)

    return hook
