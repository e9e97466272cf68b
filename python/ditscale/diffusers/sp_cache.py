"""diffusers' step caches (``transformer.enable_cache``) on a sequence-parallel transformer:
every rank makes the single-process decision, or the cache is refused by name.

:func:`make_cache_consistent` (called on a parallelized transformer) checks the cache hooks
already on it, turns FirstBlockCache's decision into one over the whole sequence (the sums its
metric is made of, all-reduced over the sequence-parallel group; the batched CFG split adds the
other half's rows), and wraps the instance's ``enable_cache`` so that a later cache is checked
and converted the same way. Every data-dependent decision is followed by an agreement check
(min == max over the group) that raises on every rank, naming the hook, block and step, instead
of letting ranks enter different collectives. :func:`remove_cache_consistency` undoes it.
What each hook is and why it is kept or refused: docs/diffusers/cache.md.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._sp_plan import context_of

WHERE = "ditscale.diffusers cache"

# Hook class (diffusers 0.42) -> None (consistent as it is: decisions from step counters and
# the schedule only, or no decision), "reduce" (made consistent here) or the refusal's reason.
HOOKS: Dict[str, Optional[str]] = {
    "FBCHeadBlockHook": "reduce",
    "FBCBlockHook": None,
    "PyramidAttentionBroadcastHook": None,
    "TaylorSeerCacheHook": None,
    "MagCacheHeadHook": None,  # calibrate=True is refused by CONFIGS
    "MagCacheBlockHook": None,
    "FasterCacheDenoiserHook": None,  # refused under a CFG split: ANY_SPLIT
    "FasterCacheBlockHook": None,
    "SeaCacheRootHook": "its spectral filter needs the whole frame on one rank and it votes "
                        "over the default process group, not the sequence-parallel one",
    "SeaCacheLeaderBlockHook": "SeaCache is refused as a whole",
    "SeaCacheBlockHook": "SeaCache is refused as a whole",
    "SeaCachePostNormHook": "SeaCache is refused as a whole",
    "TextKVCacheTransformerHook": "its cached text keys and values bypass the sequence-parallel "
                                  "attention processors (not supported)",
    "TextKVCacheBlockHook": "TextKVCache is refused as a whole",
}

# Hooks kept under sequence parallelism and a batched CFG split but refused under a two-call one
# (the pipeline's own refusal of its stateful hooks, at the call): the reason.
TWO_CALL_SPLIT: Dict[str, str] = {
    "PyramidAttentionBroadcastHook": "its one cache is shared by the 'cond' and the 'uncond' "
                                     "call of a step, which the split runs on different ranks",
}

# Hooks kept under sequence parallelism but refused under any CFG split (batched or two-call), at
# the call: the reason.
_FASTER_CACHE = ("it approximates the unconditional rows of a batch [uncond; cond] from the "
                 "conditional ones, which a CFG split runs on different ranks")
ANY_SPLIT: Dict[str, str] = {"FasterCacheDenoiserHook": _FASTER_CACHE,
                             "FasterCacheBlockHook": _FASTER_CACHE}

# enable_cache's config class -> None (kept) or the refusal's reason; any other class: refused.
CONFIGS: Dict[str, Optional[str]] = {
    "FirstBlockCacheConfig": None,
    "PyramidAttentionBroadcastConfig": None,
    "TaylorSeerCacheConfig": None,
    "MagCacheConfig": None,
    "FasterCacheConfig": None,
    "SeaCacheConfig": HOOKS["SeaCacheRootHook"],
    "TextKVCacheConfig": HOOKS["TextKVCacheTransformerHook"],
}


def _refuse(what: str, reason: str):
    raise ValueError(f"{WHERE}: {what} is refused on a sequence-parallel transformer: {reason}; "
                     f"supported: {', '.join(k for k, v in CONFIGS.items() if v is None)} "
                     f"(see docs/diffusers/cache.md)")


def _blocks(transformer) -> int:
    """The transformer blocks the block caches see (diffusers' block-list identifiers)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS as names

    return sum(len(sub) for name, sub in transformer.named_children()
               if name in names and isinstance(sub, torch.nn.ModuleList))


def check_config(config, transformer=None) -> None:
    """Refuses (ValueError naming it) an ``enable_cache`` config that ranks cannot follow, or
    that ``transformer`` has too few blocks for (a head and a tail block: diffusers would fail
    with an IndexError)."""
    name = type(config).__name__
    if name in ("FirstBlockCacheConfig", "MagCacheConfig") and transformer is not None:
        blocks = _blocks(transformer)
        if blocks < 2:
            raise ValueError(f"{WHERE}: {name} needs at least 2 transformer blocks (a head and "
                             f"a tail); this {type(transformer).__name__} has {blocks}")
    if name not in CONFIGS:
        _refuse(name, "not a cache this version knows")
    if CONFIGS[name] is not None:
        _refuse(name, CONFIGS[name])
    if name == "MagCacheConfig" and getattr(config, "calibrate", False):
        _refuse("MagCacheConfig(calibrate=True)", "its calibration ratios would be each rank's "
                "shard's; calibrate on one process")


def _hooks(module) -> List[Tuple[str, Any]]:
    """("submodule: hook name", hook) of every diffusers hook on ``module`` and below."""
    found = []
    for name, sub in module.named_modules():
        registry = getattr(sub, "_diffusers_hook", None)
        for hook_name, hook in (getattr(registry, "hooks", None) or {}).items():
            found.append((f"{name or '(root)'}: {hook_name}", hook))
    return found


def check_cache_hooks(transformer) -> None:
    """Refuses (ValueError naming hook and submodule) any cache hook on ``transformer`` that
    ranks cannot follow: a refused one, or an unknown stateful one."""
    config = getattr(transformer, "_cache_config", None)
    if config is not None:
        check_config(config)
    for where, hook in _hooks(transformer):
        kind = type(hook).__name__
        if is_consistent(hook):
            continue
        if kind in HOOKS:
            if HOOKS[kind] not in (None, "reduce"):
                _refuse(f"the hook {kind} ({where})", HOOKS[kind])
        elif getattr(hook, "_is_stateful", False):
            _refuse(f"the stateful hook {kind} ({where})", "a hook this version does not know")


def _pipeline_state(module):
    """The _sp_pipeline.PipelineState of a parallelized pipeline's transformer, else None; a
    RuntimeError if it lacks what this module reads (mode, spec.pattern, mesh)."""
    state = getattr(module, "_ditscale_cfg", None)  # _sp_pipeline.TransformerState
    if state is None:
        return None
    pipeline = getattr(state, "pipeline", None)
    if not all(hasattr(x, a) for x, a in ((pipeline, "mode"), (pipeline, "mesh"),
                                           (getattr(pipeline, "spec", None), "pattern"))):
        raise RuntimeError(f"{WHERE}: the CFG state of parallelize_pipeline has no "
                           f"pipeline.mode, pipeline.mesh or pipeline.spec.pattern (the module "
                           f"that reads it must follow _sp_pipeline)")
    return pipeline


def _split_pattern(module) -> Optional[str]:
    """"two-call" or "batched": the CFG split pattern of a parallelized pipeline's
    transformer, else None."""
    pipeline = _pipeline_state(module)
    return None if pipeline is None else pipeline.spec.pattern


def unsafe_stateful_hooks(module) -> List[str]:
    """The stateful diffusers hooks on ``module`` that a CFG split must still refuse
    ("submodule: hook (reason)"): those :func:`make_cache_consistent` has not made safe, those
    of :data:`ANY_SPLIT`, and under a two-call split those of :data:`TWO_CALL_SPLIT`."""
    two_call = _split_pattern(module) == "two-call"
    found = []
    for where, hook in _hooks(module):
        kind = type(hook).__name__
        refused = {**ANY_SPLIT, **(TWO_CALL_SPLIT if two_call else {})}
        safe = is_consistent(hook) or (kind in HOOKS and HOOKS[kind] is None
                                       and kind not in refused)
        if getattr(hook, "_is_stateful", False) and not safe:
            found.append(f"{where} ({refused.get(kind, kind)})")
    return found


# ---- the group a decision is made over ------------------------------------------------------

def decision_group(transformer) -> Tuple[Any, int]:
    """(process group, size) whose ranks hold the rows and tokens of this transformer call:
    the sequence-parallel mesh in force (a CFG half's during a split two-call pass), or the
    whole pipeline mesh during a batched CFG split (the single process decides over both
    halves' rows [uncond; cond] at once)."""
    pipeline = _pipeline_state(transformer)
    if pipeline is not None and pipeline.mode == "split" and pipeline.spec.pattern == "batched":
        return pipeline.mesh.group, pipeline.mesh.size
    ctx = context_of(transformer)
    return ctx.mesh.group, ctx.mesh.size


def all_reduce(values: torch.Tensor, group, op, where: str) -> torch.Tensor:
    """``values`` (float64) all-reduced over ``group``, on the CPU (gloo) or the current CUDA
    device (NCCL), bounded by the group's timeout: a rank left alone in it gets a RuntimeError
    naming ``where`` (gloo; NCCL's watchdog aborts the process at its timeout)."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)):
        values = values.to(torch.device("cuda", torch.cuda.current_device()))
    try:
        dist.all_reduce(values, op=op, group=group)
    except RuntimeError as e:
        raise RuntimeError(f"{WHERE}: {where}: the collective of the decision failed (another "
                           f"rank did not enter it within the group timeout?): {e}") from None
    return values.cpu()


def agree(decision: bool, group, size: int, where: str) -> bool:
    """``decision`` if every rank of ``group`` made it, else a RuntimeError on every rank
    naming ``where`` (one all-reduce of (d, -d) with MAX)."""
    if size == 1:
        return decision
    d = float(decision)
    votes = all_reduce(torch.tensor([d, -d], dtype=torch.float64), group,
                       torch.distributed.ReduceOp.MAX, where)
    if votes[0].item() != -votes[1].item():
        raise RuntimeError(f"{WHERE}: {where}: ranks disagree whether to compute the remaining "
                           f"blocks (this rank: {'compute' if decision else 'skip'}); every "
                           f"rank stops here instead of entering different collectives")
    return decision


# ---- FirstBlockCache over the whole sequence --------------------------------------------------

def _fbc_base():
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    return FBCHeadBlockHook


def is_consistent(hook) -> bool:
    """Whether ``hook`` is a FirstBlockCache head hook made consistent here."""
    return getattr(hook, "_ditscale_consistent", False)


_CLASS: List[type] = []  # the consistent head hook's class, made on first use


def _should_compute(self, hidden_states_residual: torch.Tensor) -> bool:
    """FirstBlockCache's decision ``mean|r - r_prev| / mean|r_prev| > threshold`` with both
    sums over the whole sequence (the token counts cancel): float64 sums of this rank's shard,
    all-reduced over :func:`decision_group`; then the agreement check."""
    shared = self.state_manager.get_state()
    transformer = self._ditscale_transformer()
    group, size = decision_group(transformer)
    shared.ditscale_step = getattr(shared, "ditscale_step", 0) + 1  # per cache context
    where = (f"FirstBlockCache at {self._ditscale_block!r}, cache context "
             f"{self.state_manager.context.name!r}, step {shared.ditscale_step}")
    if shared.head_block_residual is None:
        return agree(True, group, size, where)
    prev = shared.head_block_residual
    sums = torch.stack([(hidden_states_residual - prev).abs().sum(dtype=torch.float64),
                        prev.abs().sum(dtype=torch.float64)]).cpu()
    if size > 1:
        sums = self._ditscale_reduce(sums, group, where)
    decision = bool((sums[0] / sums[1]).item() > self.threshold)
    return agree(decision, group, size, where)


def _reduce_sums(self, sums: torch.Tensor, group, where: str) -> torch.Tensor:
    return all_reduce(sums, group, torch.distributed.ReduceOp.SUM, where)


def _fbc_class() -> type:
    """FBCHeadBlockHook with :func:`_should_compute` (a subclass: its state, ``reset_state``
    and the registry's handling are the stock ones)."""
    if not _CLASS:
        _CLASS.append(type("ConsistentFBCHeadHook", (_fbc_base(),), {
            "__module__": __name__, "_ditscale_consistent": True,
            "_should_compute_remaining_blocks": torch.compiler.disable(_should_compute),
            "_ditscale_reduce": _reduce_sums}))
    return _CLASS[0]


def _convert(transformer) -> None:
    """Every stock FirstBlockCache head hook on ``transformer`` -> ConsistentFBCHeadHook."""
    for name, sub in transformer.named_modules():
        registry = getattr(sub, "_diffusers_hook", None)
        for hook in (getattr(registry, "hooks", None) or {}).values():
            if type(hook) is _fbc_base():
                hook.__class__ = _fbc_class()
                hook._ditscale_transformer = weakref.ref(transformer)
                hook._ditscale_block = name


def _restore(transformer) -> None:
    for _, hook in _hooks(transformer):
        if is_consistent(hook):
            hook.__class__ = _fbc_base()


# ---- the entry points -----------------------------------------------------------------------

def _enable_cache(self, config) -> None:
    """``enable_cache`` of a transformer made consistent: ``config`` checked first (a
    ValueError naming a refused one, before any change), then the stock method, then its hooks
    converted."""
    check_config(config, self)
    type(self).enable_cache(self, config)
    _convert(self)


def make_cache_consistent(transformer) -> None:
    """Makes ``transformer``'s step caches (enabled now or later through its
    ``enable_cache``) decide identically on every rank (see the module). Call once the
    transformer is parallelized, on every rank; a refused cache already on it is a ValueError
    naming it. Idempotent."""
    if context_of(transformer) is None:
        raise ValueError(f"{WHERE}: this {type(transformer).__name__} is not parallelized")
    check_cache_hooks(transformer)
    _convert(transformer)
    if hasattr(type(transformer), "enable_cache"):  # CacheMixin (SD3's transformer is none)
        transformer.__dict__["enable_cache"] = types.MethodType(_enable_cache, transformer)


def remove_cache_consistency(transformer) -> None:
    """Undoes :func:`make_cache_consistent`: the stock ``enable_cache`` and hooks."""
    transformer.__dict__.pop("enable_cache", None)
    _restore(transformer)
