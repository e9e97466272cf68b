"""The forward hooks and attention helpers that every family's sequence-parallel module shares
(sp_flux, sp_sd3, sp_hunyuan_video, sp_wan, sp_cogvideox): binding a call's arguments by name,
the device check and refusals of the model's input, the shard of the image/video tokens where
the embedder makes them, the gather of the last token-wise layer, and the joint attention of
[text; image shard] through ``SpContext.attention``.

World size 1: a family registers the input hook only (the device check and the refusals); the
shard, rotary and gather hooks would return their input unchanged, so they are left out, and the
attention processors run the stock processor they replaced (:class:`OneRankStock`). The
parallelized module then costs the stock module's host time plus one hook and one Python call
per attention (bench/results/diffusers-sp-host-cpu.md). On a larger mesh every hook is
registered and reads the mesh's size per call: a CFG-parallel pipeline (``_sp_pipeline``) runs
each pass on a half of the mesh, which may be one rank, where the hooks pass their input through
and the processors run the stock one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

from ._sp_context import SpContext


@dataclass
class Tokens:
    """Token counts of the forward pass in flight (set by the embedders' hooks): ``text`` the
    replicated text tokens T, ``image`` the image/video tokens S before sharding."""

    text: int = 0
    image: int = 0


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


def no_refusal(named: dict) -> None:
    """The ``refuse`` of :func:`input_hook` for a model whose inputs are all honoured."""


def input_hook(where: str, ctx: SpContext, transformer,
               refuse: Callable[[dict], None] = no_refusal,
               residual_lists: Tuple[str, ...] = ()):
    """A forward pre-hook (``with_kwargs=True``) for ``transformer``: binds the call's arguments
    to their names, checks that every tensor argument is on the parameters' device, calls
    ``refuse(named)`` (which raises on options the integration cannot honour), and, on more than
    one rank, replaces each list of full-sequence residuals [B, S, D] named in
    ``residual_lists`` (ControlNet samples) by this rank's shards [B, S_r, D]."""
    names = argument_names(transformer.forward)

    def hook(module, args, kwargs):
        named = bind(names, args, kwargs)
        check_devices(where, named, next(module.parameters()).device)
        refuse(named)
        if ctx.size == 1:
            return None
        changed = False
        for key in residual_lists:
            samples = named.get(key)
            if samples is not None:
                named[key] = [ctx.shard(s, 1) for s in samples]
                changed = True
        return ((), named) if changed else None

    return hook


def refuse_attention_kwargs(where: str, named: dict, key: str, refused: Dict[str, str]) -> None:
    """Raises a ValueError for any entry of ``refused`` (kwarg -> what it is) set in the call's
    ``named[key]`` (the attention kwargs dict)."""
    attention_kwargs = named.get(key) or {}
    for name, what in refused.items():
        if attention_kwargs.get(name) is not None:
            raise ValueError(f"{where}: {key}[{name!r}]: {what} is not supported")


def image_shard_hook(ctx: SpContext, tokens: Tokens):
    """A forward hook for the layer that makes the image tokens [B, S, D]: records S in
    ``tokens.image`` and returns this rank's [B, S_r, D]."""

    def hook(module, args, output):
        tokens.image = output.shape[1]
        ctx.local_range(tokens.image)  # refuses fewer image tokens than ranks
        return ctx.shard(output, 1)

    return hook


def gather_hook(ctx: SpContext, tokens: Tokens):
    """A forward hook for the last token-wise layer: [B, S_r, C] -> the full [B, S, C] on every
    rank (S = ``tokens.image``)."""

    def hook(module, args, output):
        return ctx.gather(output, 1, tokens.image)

    return hook


def shard_after(ctx: SpContext, x: torch.Tensor, dim: int, keep: int) -> torch.Tensor:
    """``x`` with its first ``keep`` entries along ``dim`` kept whole and the rest replaced by
    this rank's shard of them."""
    head = x.narrow(dim, 0, keep)
    tail = ctx.shard(x.narrow(dim, keep, x.shape[dim] - keep), dim)
    return torch.cat([head, tail], dim)


def joint_attention(ctx: SpContext, text: Tuple[torch.Tensor, ...],
                    image: Tuple[torch.Tensor, ...],
                    text_first: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of [text; image shard] over all text and image tokens of the mesh.

    ``text``: (q, k, v) [B, T, H, d]; ``image``: (q, k, v) [B, S_r, H, d], rotary already
    applied. Returns (text_out [B, T, H, d], image_out [B, S_r, H, d]). On one rank this is one
    attention over the concatenation in the model's own order (``text_first``: [text; image],
    else [image; text]), as the stock processors compute it."""
    T = text[0].shape[1]
    if ctx.size == 1:
        parts = zip(text, image) if text_first else zip(image, text)
        out = ctx.attention(*(torch.cat(p, 1) for p in parts))
        S = out.shape[1] - T
        return (out[:, :T], out[:, T:]) if text_first else (out[:, S:], out[:, :S])
    out, text_out = ctx.attention(*(x.contiguous() for x in image),
                                  joint_q=text[0].contiguous(), joint_k=text[1].contiguous(),
                                  joint_v=text[2].contiguous())
    return text_out, out



class OneRankStock:
    """Base of the integration's attention processors. ``stock`` is the diffusers processor the
    integration replaced (with the attention backend it was set to). On a mesh of one rank a
    processor's ``__call__`` makes its refusals and then runs ``stock``: ``ditscale.sp.attention``
    of one rank is one SDPA over all tokens, which the stock processor already computes, so the
    module computes exactly what the stock module computes (bit-identical, the same kernels, the
    same graph under ``torch.compile``) for the cost of one Python call. On more ranks it runs
    ``sharded``, the sequence-parallel attention, which also runs on one rank (through the
    one-rank paths of :func:`joint_attention` and ``SpContext``): the tests compare it with
    ``stock`` in one process."""

    def __init__(self, ctx: SpContext, stock):
        self.ctx = ctx
        self.stock = stock
