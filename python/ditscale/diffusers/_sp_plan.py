"""Sequence-parallel plans as data, and the one function that applies a plan and the one that
removes it.

A family module (``sp_<family>.py``) declares a :class:`Plan`: the model's input step
(:class:`Inputs`), submodule path -> what happens to its input or output (:class:`Count`,
:class:`Shard`, :class:`ShardInput`, :class:`Gather`, or a named :class:`Special` hook), and
attention modules -> the processor that replaces their stock one (:class:`Processors`).
:func:`apply` checks everything before changing anything, then installs the plan keeping every
hook handle and every replaced processor in a :class:`Record` on the module; :func:`remove` gives
the stock module back (the same processor objects, no hook left). See docs/diffusers.md.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ._sp_context import SpContext
from ._sp_hooks import (Tokens, count_hook, gather_hook, input_hook, no_refusal,
                        shard_input_hook, shard_output_hook)

# The attribute a parallelized transformer carries (its Record).
ATTR = "_ditscale_sp"


# ---- entries -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Count:
    """Output of the module: records its length along ``dim`` as ``tokens.<name>``."""

    name: str = "text"
    dim: int = 1

    def register(self, where, module, ctx, tokens):
        return module.register_forward_hook(count_hook(tokens, self.name, self.dim))


@dataclass(frozen=True)
class Shard:
    """Output of the module (a tensor, or each tensor of a tuple) -> this rank's shard along
    ``dim``. ``record``: its length is S, the image tokens; ``keep_text``: the first T entries
    (recorded by a Count) stay whole and the S after them are sharded."""

    dim: int
    record: bool = False
    keep_text: bool = False

    def register(self, where, module, ctx, tokens):
        return module.register_forward_hook(
            shard_output_hook(where, ctx, tokens, self.dim, self.record, self.keep_text))


@dataclass(frozen=True)
class ShardInput:
    """The module's argument ``name`` (S recorded tokens along ``dim``) -> this rank's shard."""

    name: str
    dim: int = 1

    def register(self, where, module, ctx, tokens):
        return module.register_forward_pre_hook(
            shard_input_hook(where, ctx, tokens, module, self.name, self.dim), with_kwargs=True)


@dataclass(frozen=True)
class Gather:
    """Output of the module [.., S_r, ..] -> the full [.., S, ..] along ``dim`` on every rank."""

    dim: int = 1

    def register(self, where, module, ctx, tokens):
        return module.register_forward_hook(gather_hook(ctx, tokens, self.dim))


@dataclass(frozen=True)
class Special:
    """A family's own hook: ``make(ctx, tokens, module)`` returns it; ``pre``: a forward
    pre-hook with kwargs, else a forward hook. It reads ``ctx.size`` per call itself."""

    make: Callable
    pre: bool = False

    def register(self, where, module, ctx, tokens):
        hook = self.make(ctx, tokens, module)
        if self.pre:
            return module.register_forward_pre_hook(hook, with_kwargs=True)
        return module.register_forward_hook(hook)


@dataclass(frozen=True)
class Inputs:
    """The model's own input step (registered on every mesh size): ``refuse(named)`` raises on
    options the integration cannot honour; ``shard_lists``: lists of full [B, S, D] residuals
    sharded to [B, S_r, D]; ``prepare(ctx, tokens, module, named)``: a family's own step, True
    when it changed ``named``. The device check and the training refusal always run."""

    refuse: Callable[[dict], None] = no_refusal
    shard_lists: Tuple[str, ...] = ()
    prepare: Optional[Callable] = None


@dataclass(frozen=True)
class Processors:
    """Every attention module at ``pattern`` (dotted, ``*`` = every child of a list) must have
    a processor of exactly one of the classes ``stock``; ``replace`` (a :class:`SpProcessor`
    class) takes its place, or None: checked and kept. ``optional``: a pattern's module may be
    None (SD3's single-attention blocks have no attn2)."""

    pattern: str
    stock: Tuple[type, ...]
    replace: Optional[type] = None
    optional: bool = False


@dataclass(frozen=True)
class Plan:
    """One family's plan: ``where`` (the prefix of its messages), ``inputs``, ``hooks`` (module
    path -> entry, installed on meshes of more than one rank only: on one rank they would change
    nothing), ``processors``; ``check(transformer)`` the family's own refusals; ``hint`` what a
    refused processor's message suggests; ``trains``: every hook and processor of the plan has
    a correct backward, so training on several ranks is allowed where ``ditscale.sp`` has one
    (``_sp_hooks.trains_here``)."""

    where: str
    inputs: Inputs
    hooks: Dict[str, object]
    processors: Tuple[Processors, ...]
    check: Callable = lambda transformer: None
    hint: str = "unload IP-Adapters and custom processors first"
    trains: bool = False


@dataclass
class Record:
    """What :func:`apply` did to one module: its context, every hook handle, and (attention
    module, stock processor, ditscale's processor) of every replaced processor."""

    ctx: SpContext
    handles: List[object] = field(default_factory=list)
    processors: List[Tuple[object, object, object]] = field(default_factory=list)
    hooked: bool = False  # the hooks of a multi-rank mesh are installed (size > 1 at apply)


# ---- apply / remove ----------------------------------------------------------------------------

def record_of(module) -> Optional[Record]:
    """The Record of a parallelized module, else None."""
    return module.__dict__.get(ATTR)


def context_of(module) -> Optional[SpContext]:
    """The SpContext of a parallelized module, else None."""
    record = record_of(module)
    return None if record is None else record.ctx


@contextlib.contextmanager
def on_mesh(where: str, transformer, mesh):
    """Within the block, ``transformer``'s calls run on ``mesh`` (another process group, one
    rank included) instead of the mesh it was parallelized with; the mesh is restored after.
    It must have been parallelized on more than one rank (its hooks installed)."""
    record = record_of(transformer)
    if record is None:
        raise ValueError(f"{where}: this {type(transformer).__name__} is not parallelized")
    if not record.hooked:
        raise ValueError(f"{where}: this {type(transformer).__name__} was parallelized on one "
                         f"rank (no hooks installed); parallelize it on a mesh of more than one "
                         f"rank, e.g. its largest sequence-parallel group")
    ctx, before = record.ctx, record.ctx.mesh
    ctx.mesh = mesh
    try:
        yield transformer
    finally:
        ctx.mesh = before


def _expand(root, pattern: str) -> List[Tuple[str, object]]:
    """(dotted name, module or None) of every module at ``pattern``."""
    found = [("", root)]
    for part in pattern.split("."):
        step = []
        for name, module in found:
            if part == "*":
                step += [(f"{name}.{k}".lstrip("."), m) for k, m in module.named_children()]
            elif module is not None:
                step.append((f"{name}.{part}".lstrip("."), getattr(module, part, None)))
        found = step
    return found


def _swaps(plan: Plan, transformer) -> List[Tuple[object, Optional[type]]]:
    """(attention module, replacing class or None) of every processor the plan names; a
    ValueError naming the first one whose processor is not a stock one."""
    swaps = []
    for rule in plan.processors:
        for name, attn in _expand(transformer, rule.pattern):
            if attn is None and rule.optional:
                continue
            processor = getattr(attn, "processor", None)
            if type(processor) not in rule.stock:
                stock = " / ".join(c.__name__ for c in rule.stock)
                raise ValueError(f"{plan.where}: {name}'s attention processor is "
                                 f"{type(processor).__name__}; only diffusers' {stock} can be "
                                 f"sequence-parallelized ({plan.hint})")
            swaps.append((attn, rule.replace))
    return swaps


def apply(plan: Plan, transformer, ctx: SpContext) -> Record:
    """Installs ``plan`` on ``transformer`` (refusals first, nothing changed by a refused call)
    and records it; returns the Record."""
    if record_of(transformer) is not None:
        raise ValueError(f"{plan.where}: this {type(transformer).__name__} is already "
                         f"parallelized (ditscale.diffusers.unparallelize undoes it)")
    if getattr(transformer, "_parallel_config", None) is not None:
        raise ValueError(f"{plan.where}: the model is already parallelized by diffusers' "
                         f"enable_parallelism; use one or the other")
    plan.check(transformer)
    swaps = _swaps(plan, transformer)
    modules = []
    for path, entry in plan.hooks.items():
        try:
            modules.append((transformer.get_submodule(path), entry))
        except AttributeError:
            raise ValueError(f"{plan.where}: the model has no {path!r} module") from None
    tokens, record = Tokens(), Record(ctx)
    i = plan.inputs
    record.handles.append(transformer.register_forward_pre_hook(
        input_hook(plan.where, ctx, tokens, transformer, i.refuse, i.shard_lists, i.prepare,
                   plan.trains), with_kwargs=True))
    for attn, cls in swaps:
        if cls is not None:
            stock = attn.processor
            ours = cls(plan.where, ctx, stock, tokens)
            attn.set_processor(ours)
            record.processors.append((attn, stock, ours))
    if ctx.size > 1:
        for module, entry in modules:
            record.handles.append(entry.register(plan.where, module, ctx, tokens))
        record.hooked = True
    transformer.__dict__[ATTR] = record
    return record


def remove(where: str, transformer) -> None:
    """Undoes :func:`apply`: every hook handle removed, every stock processor object back; a
    ValueError (before any change) for a module that is not parallelized, or whose processor
    someone replaced after parallelize."""
    record = record_of(transformer)
    if record is None:
        raise ValueError(f"{where}: this {type(transformer).__name__} is not parallelized "
                         f"(nothing to undo)")
    for attn, _, ours in record.processors:
        if attn.processor is not ours:
            raise ValueError(f"{where}: an attention processor was replaced after parallelize "
                             f"(now {type(attn.processor).__name__}); restore it first")
    for handle in record.handles:
        handle.remove()
    for attn, stock, _ in record.processors:
        attn.set_processor(stock)
    del transformer.__dict__[ATTR]
