"""``parallelize_pipeline`` / ``unparallelize_pipeline``: sequence parallelism of a diffusers
pipeline's transformer(s), and CFG parallelism (the conditional and the unconditional pass of
each denoising step on the two halves of the ranks at the same time).

:data:`SPECS` declares what the split relies on per pipeline family (the batched [uncond; cond]
pattern of SD3 and CogVideoX, the two-call "cond" / "uncond" pattern of Flux, HunyuanVideo and
Wan); a call that departs from it is an error naming what was unexpected, never a wrong image.
The pipeline's and each transformer's class is replaced by a same-name subclass (``__call__``
routed through this module); :class:`PipelineState` records it, and unparallelize_pipeline puts
everything back. How the split works and what it refuses: docs/diffusers/pipelines.md.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import sp
from .._teardown import clear_at_exit
from . import parallelize, unparallelize
from ._classes import BASE_ATTR, SUPPORTED_PIPELINES, SUPPORTED_TRANSFORMERS, family_of
from ._sp_plan import context_of
from .parallel_vae import parallelize_vae, unparallelize_vae
from .sp_cache import unsafe_stateful_hooks

WHERE = "ditscale.diffusers.parallelize_pipeline"
ATTR_PIPE = "_ditscale_pipeline"
ATTR_CFG = "_ditscale_cfg"


# ---- what the split relies on, per pipeline -------------------------------------------------

def _true_cfg(a: Dict[str, Any]) -> bool:
    """FluxPipeline / HunyuanVideoPipeline: ``do_true_cfg = true_cfg_scale > 1 and
    has_neg_prompt`` (a negative prompt, or both negative embeddings)."""
    has_neg = a["negative_prompt"] is not None or (
        a["negative_prompt_embeds"] is not None and a["negative_pooled_prompt_embeds"] is not None)
    return a["true_cfg_scale"] > 1 and has_neg


def _guidance_above_1(a: Dict[str, Any]) -> bool:
    """WanPipeline, StableDiffusion3Pipeline, CogVideoXPipeline: ``guidance_scale > 1``."""
    return a["guidance_scale"] > 1


@dataclass(frozen=True)
class PipelineSpec:
    """The internals of one pipeline family that the CFG split relies on."""

    pattern: str  # "batched" or "two-call"
    guided: Callable[[Dict[str, Any]], bool]  # the pipeline's criterion on its __call__ args
    contexts: Tuple[Optional[str], ...]  # cache_context names: (cond, uncond) / the batched one
    batched: Tuple[str, ...] = ()  # batched: the arguments of 2B rows [uncond; cond]
    shared: Tuple[str, ...] = ()  # batched: the other arguments the call may carry
    text: Tuple[str, ...] = ()  # two-call: the arguments the "uncond" call may change
    transformers: Tuple[str, ...] = ("transformer",)


SPECS: Dict[str, PipelineSpec] = {
    "flux": PipelineSpec("two-call", _true_cfg, ("cond", "uncond"),
                         text=("encoder_hidden_states", "pooled_projections", "txt_ids")),
    "hunyuan_video": PipelineSpec("two-call", _true_cfg, ("cond", "uncond"),
                                  text=("encoder_hidden_states", "encoder_attention_mask",
                                        "pooled_projections")),
    "wan": PipelineSpec("two-call", _guidance_above_1, ("cond", "uncond"),
                        text=("encoder_hidden_states",),
                        transformers=("transformer", "transformer_2")),
    "sd3": PipelineSpec("batched", _guidance_above_1, (None,),
                        batched=("hidden_states", "encoder_hidden_states", "pooled_projections",
                                 "timestep"),
                        shared=("joint_attention_kwargs", "return_dict", "skip_layers")),
    "cogvideox": PipelineSpec("batched", _guidance_above_1, ("cond_uncond",),
                              batched=("hidden_states", "encoder_hidden_states", "timestep"),
                              shared=("image_rotary_emb", "attention_kwargs", "return_dict")),
}


# ---- the two halves of the mesh ---------------------------------------------------------------

@dataclass
class Halves:
    """This rank's half of the mesh: ``index`` (0 or 1), its ``mesh``, and ``partner``, the
    global rank at the same position in the other half."""

    index: int
    mesh: sp.Mesh
    partner: int
    group: Any  # the full mesh's process group (the swap's sends and receives)


_GROUPS: Dict[Tuple[Tuple[int, ...], str], Any] = clear_at_exit({})  # made once per rank list


def _group(ranks: List[int], backend: str):
    import torch.distributed as dist

    key = (tuple(ranks), backend)
    if key not in _GROUPS:  # every rank of the mesh comes here for both halves, in order
        _GROUPS[key] = dist.new_group(ranks, backend=backend, use_local_synchronization=True)
    return _GROUPS[key]


def half_members(ranks: List[int], machines: int, gpus: int):
    """((machines, gpus) of a half, [ranks of half 0, ranks of half 1]) for a mesh of
    ``machines`` x ``gpus`` whose ranks (global, in mesh order) are ``ranks``, or None for an
    odd or single rank count. Whole machines per half when the machine count is even, else the
    first and the second half of every machine's GPUs."""
    size = machines * gpus
    if size < 2 or size % 2:
        return None
    if machines % 2 == 0:
        return (machines // 2, gpus), [ranks[:size // 2], ranks[size // 2:]]
    g = gpus // 2
    return (machines, g), [[ranks[m * gpus + h * g + j] for m in range(machines)
                            for j in range(g)] for h in (0, 1)]


def make_halves(mesh: sp.Mesh) -> Optional[Halves]:
    """This rank's half of ``mesh`` (collective over the mesh's ranks: both halves' process
    groups are made on every rank), or None for an odd or single rank count."""
    import torch.distributed as dist

    if mesh.size < 2 or mesh.size % 2:
        return None
    ranks = (dist.get_process_group_ranks(mesh.group) if mesh.group is not None
             else list(range(dist.get_world_size())))
    shape, members = half_members(ranks, mesh.machines, mesh.gpus_per_machine)
    backend = str(dist.get_backend(mesh.group))
    groups = [_group(members[h], backend) for h in (0, 1)]
    me = ranks[mesh.rank]
    index = 0 if me in members[0] else 1
    hosts = tuple(mesh.hosts[ranks.index(r)] for r in members[index]) if mesh.hosts else ()
    half = sp.Mesh(*shape, group=groups[index], hosts=hosts)
    partner = members[1 - index][members[index].index(me)]
    return Halves(index, half, partner, mesh.group)


def swap(halves: Halves, tensor: torch.Tensor) -> torch.Tensor:
    """Sends ``tensor`` to the partner rank and returns the partner's (same shape and dtype)."""
    import torch.distributed as dist

    mine = tensor.contiguous()
    theirs = torch.empty_like(mine)
    ops = [dist.P2POp(dist.isend, mine, peer=halves.partner, group=halves.group),
           dist.P2POp(dist.irecv, theirs, peer=halves.partner, group=halves.group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return theirs


# ---- the placeholder of a deferred output ---------------------------------------------------

class PendingOutput(torch.Tensor):
    """The output of a "cond" call whose value comes at the following "uncond" call. Until
    then every torch operation on it (arithmetic, printing, shape, indexing) raises; after,
    it is that output (and operations return plain tensors)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, PendingOutput) and not leaf.__dict__.get("_filled", False):
                raise RuntimeError(
                    f"{WHERE}: the transformer's 'cond' output was used before its 'uncond' "
                    f"call came (CFG parallelism computes both at the 'uncond' call); this "
                    f"pipeline's call pattern is not the one CFG parallelism expects: use "
                    f"cfg_parallel=False")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _pending(like: torch.Tensor) -> PendingOutput:
    out = torch.empty(0, dtype=like.dtype, device=like.device).as_subclass(PendingOutput)
    out.__dict__["_filled"] = False
    return out


def _fill(pending: PendingOutput, value: torch.Tensor) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        if value.dtype != pending.dtype or value.device != pending.device:
            raise RuntimeError(f"{WHERE}: the transformer's output is {value.dtype} on "
                               f"{value.device}, its latents {pending.dtype} on "
                               f"{pending.device}; CFG parallelism of a two-call pipeline "
                               f"needs them alike")
        pending.set_(value.contiguous())
    pending.__dict__["_filled"] = True


# ---- outputs --------------------------------------------------------------------------------

def _output_tensor(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.sample


def _with_tensor(out, tensor: torch.Tensor):
    if isinstance(out, tuple):
        return (tensor,) + tuple(out[1:])
    return type(out)(sample=tensor)


def _wrap(tensor: torch.Tensor, return_dict: bool):
    if not return_dict:
        return (tensor,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=tensor)


# ---- per-call state ---------------------------------------------------------------------------

@dataclass
class PipelineState:
    """One parallelized pipeline: its family's spec, mesh, halves (None: no split possible),
    and the mode of the call in flight ("idle", "plain" or "split")."""

    family: str
    spec: PipelineSpec
    mesh: sp.Mesh
    halves: Optional[Halves]
    signature: inspect.Signature
    base: type  # the pipeline's diffusers class (unparallelize_pipeline restores it)
    transformers: List[Any] = field(default_factory=list)
    vae: Any = None  # the VAE parallelize_vae banded (None: stock decode on every rank)
    mode: str = "idle"
    calls: int = 0  # transformer calls of the pipeline call in flight (for messages)


@dataclass
class TransformerState:
    """One transformer of a parallelized pipeline: the cache context in force and the "cond"
    call waiting for its "uncond" partner."""

    pipeline: PipelineState
    names: List[str]  # forward's parameter names (binding positional arguments)
    base: type  # the transformer's diffusers class (unparallelize_pipeline restores it)
    context: Optional[str] = None
    first: Optional[Dict[str, Any]] = None
    pending: Optional[PendingOutput] = None


def _fail(state: TransformerState, what: str):
    p = state.pipeline
    raise RuntimeError(f"{WHERE}: CFG parallelism of a {p.family} pipeline: transformer call "
                       f"{p.calls} {what}; this call pattern is not the one of the pinned "
                       f"diffusers pipeline (use cfg_parallel=False)")


def _named(state: TransformerState, args, kwargs) -> Dict[str, Any]:
    named = dict(zip(state.names, args))
    named.update(kwargs)
    return named


def _on_half(module, base, state: TransformerState, named: Dict[str, Any]):
    """``module(**named)`` sequence-parallel over this rank's half of the mesh."""
    ctx = context_of(module)
    full = ctx.mesh
    ctx.mesh = state.pipeline.halves.mesh
    try:
        return base.__call__(module, **named)
    finally:
        ctx.mesh = full


def _split_call(module, base, state: TransformerState, args, kwargs):
    if torch.is_grad_enabled():
        _fail(state, "runs with gradients enabled (CFG parallelism is for inference: the "
                     "pipelines run under torch.no_grad)")
    named = _named(state, args, kwargs)
    if state.pipeline.spec.pattern == "batched":
        return _batched(module, base, state, named)
    return _two_call(module, base, state, named)


def _batched(module, base, state: TransformerState, named: Dict[str, Any]):
    spec = state.pipeline.spec
    if named.get("skip_layers") is not None:  # SD3's skip-layer guidance pass (batch B)
        return base.__call__(module, **named)
    if state.context != spec.contexts[0]:
        _fail(state, f"runs under cache_context {state.context!r}, expected "
                     f"{spec.contexts[0]!r}")
    for key, value in named.items():
        if value is not None and key not in spec.batched and key not in spec.shared:
            _fail(state, f"has the argument {key!r}, which the batched [uncond; cond] pattern "
                         f"does not know")
    rows = named["hidden_states"].shape[0]
    half = rows // 2
    for key in spec.batched:
        value = named.get(key)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
            _fail(state, f"has {key} of shape {getattr(value, 'shape', None)}, expected "
                         f"[{rows}, ...] like hidden_states")
    if rows % 2 or not all(torch.equal(named[k][:half], named[k][half:])
                           for k in ("hidden_states", "timestep")):
        _fail(state, f"is not the [latents; latents] batch of guidance (hidden_states of "
                     f"{rows} rows whose two halves differ)")
    lo = state.pipeline.halves.index * half
    mine = dict(named)
    for key in spec.batched:
        mine[key] = named[key][lo:lo + half]
    out = _on_half(module, base, state, mine)
    own = _output_tensor(out)
    other = swap(state.pipeline.halves, own)
    parts = (own, other) if state.pipeline.halves.index == 0 else (other, own)
    return _with_tensor(out, torch.cat(parts, 0))


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    return False


def _two_call(module, base, state: TransformerState, named: Dict[str, Any]):
    cond, uncond = state.pipeline.spec.contexts
    if state.first is None:
        if state.context != cond:
            _fail(state, f"runs under cache_context {state.context!r}; the step's first call "
                         f"is expected under {cond!r}")
        state.first = {k: dict(v) if isinstance(v, dict) else v for k, v in named.items()}
        state.pending = _pending(named["hidden_states"])
        return _wrap(state.pending, named.get("return_dict", True))
    if state.context != uncond:
        _fail(state, f"runs under cache_context {state.context!r} while the {cond!r} call "
                     f"before it waits for its {uncond!r} partner")
    first, pending = state.first, state.pending
    text = state.pipeline.spec.text
    for key in set(first) | set(named):
        if key not in text and not _same(first.get(key), named.get(key)):
            _fail(state, f"({uncond!r}) has another {key!r} than the {cond!r} call before it "
                         f"(only {', '.join(text)} may differ)")
    state.first = state.pending = None
    halves = state.pipeline.halves
    out = _on_half(module, base, state, first if halves.index == 0 else named)
    own = _output_tensor(out)
    other = swap(halves, own)
    cond_out, uncond_out = (own, other) if halves.index == 0 else (other, own)
    _fill(pending, cond_out)
    return _with_tensor(out, uncond_out)


# ---- the subclasses -------------------------------------------------------------------------

_SUBCLASSES: Dict[type, type] = {}


def _subclass(base: type, attrs: Dict[str, Any]) -> type:
    """A subclass of ``base`` with the same name, module and qualified name (configs and
    messages that print the class name are unchanged)."""
    if base not in _SUBCLASSES:
        attrs = dict(attrs, __module__=base.__module__, __qualname__=base.__qualname__,
                     **{BASE_ATTR: base})
        _SUBCLASSES[base] = type(base.__name__, (base,), attrs)
    return _SUBCLASSES[base]


def _transformer_class(base: type) -> type:
    def __call__(self, *args, **kwargs):
        state: TransformerState = getattr(self, ATTR_CFG)
        pipeline = state.pipeline
        if pipeline.mode != "split":
            return base.__call__(self, *args, **kwargs)
        pipeline.calls += 1
        return _split_call(self, base, state, args, kwargs)

    @contextlib.contextmanager
    def cache_context(self, name, **kwargs):
        state: TransformerState = getattr(self, ATTR_CFG)
        previous, state.context = state.context, name
        try:
            with base.cache_context(self, name, **kwargs):
                yield
        finally:
            state.context = previous

    attrs = {"__call__": __call__}
    if hasattr(base, "cache_context"):  # CacheMixin models (SD3Transformer2DModel is none)
        attrs["cache_context"] = cache_context
    return _subclass(base, attrs)


def _agree(state: PipelineState, split: bool, device: torch.device) -> None:
    """Every rank of the mesh makes the same choice (else each would wait for the others)."""
    import torch.distributed as dist

    votes = torch.tensor([int(split)], dtype=torch.int64,
                         device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(votes, group=state.mesh.group)
    if votes.item() not in (0, state.mesh.size):
        raise RuntimeError(f"{WHERE}: {votes.item()} of {state.mesh.size} ranks run this "
                           f"pipeline call with guidance and the others without: call the "
                           f"pipeline with the same arguments on every rank")


def _run(pipe, base: type, args, kwargs):
    state: PipelineState = getattr(pipe, ATTR_PIPE)
    if state.mode != "idle":
        raise RuntimeError(f"{WHERE}: the {state.family} pipeline is called from within its "
                           f"own call")
    bound = state.signature.bind(pipe, *args, **kwargs)
    bound.apply_defaults()
    split = state.halves is not None and bool(state.spec.guided(bound.arguments))
    if state.halves is not None:
        _agree(state, split, next(pipe.transformer.parameters()).device)
    hooks = [h for t in state.transformers for h in unsafe_stateful_hooks(t)] if split else []
    if hooks:
        raise RuntimeError(f"{WHERE}: CFG parallelism of a {state.family} pipeline: the "
                           f"transformer has stateful diffusers hooks {hooks} (caches keyed by "
                           f"the cond / uncond context cannot follow the split); disable the "
                           f"cache or use cfg_parallel=False")
    state.mode, state.calls = ("split" if split else "plain"), 0
    left = []
    try:
        result = base.__call__(pipe, *args, **kwargs)
        left = [t for t in state.transformers if getattr(t, ATTR_CFG).first is not None]
    finally:
        state.mode = "idle"
        for t in state.transformers:
            t_state = getattr(t, ATTR_CFG)
            t_state.first = t_state.pending = None
    if left:
        raise RuntimeError(f"{WHERE}: CFG parallelism of a {state.family} pipeline: the "
                           f"pipeline returned with a 'cond' transformer call that no 'uncond' "
                           f"call followed (its output was never computed); this call pattern "
                           f"is not the one of the pinned diffusers pipeline (use "
                           f"cfg_parallel=False)")
    return result


def _pipeline_class(base: type) -> type:
    def __call__(self, *args, **kwargs):
        return _run(self, base, args, kwargs)

    return _subclass(base, {"__call__": __call__})


# ---- the entry point ------------------------------------------------------------------------

def _transformers(pipe, family: str, spec: PipelineSpec) -> list:
    found = []
    for attr in spec.transformers:
        t = getattr(pipe, attr, None)
        if t is None:
            if attr == "transformer":
                raise ValueError(f"{WHERE}: the pipeline has no transformer")
            continue
        if family_of(t, SUPPORTED_TRANSFORMERS, f"the pipeline's {attr}", WHERE) != family:
            raise ValueError(f"{WHERE}: the pipeline's {attr} is a {type(t).__name__}; a "
                             f"{type(pipe).__name__} is parallelized with its own "
                             f"{[k for k, v in SUPPORTED_TRANSFORMERS.items() if v == family]}")
        found.append(t)
    return found


def _parallel_vae(pipe, mesh: sp.Mesh, wanted: bool):
    """The pipeline's VAE, parallel over the whole mesh (every rank decodes the same latents:
    on bands, or diffusers' own tiles spread over the ranks where its tiling is on), or None:
    one rank, or not wanted."""
    vae = getattr(pipe, "vae", None)
    if not wanted or vae is None or mesh.size == 1:
        return None
    parallelize_vae(vae, mesh=mesh)
    return vae


def parallelize_pipeline(pipe, mesh: Optional[sp.Mesh] = None, cfg_parallel: bool = True,
                         strategy: str = "auto", parallel_vae: bool = True, **options):
    """Sequence- (and CFG-) parallel ``pipe`` in place; returns it (see the module docstring).

    ``mesh``: a ``ditscale.sp.Mesh`` (None: the default process group's); ``cfg_parallel``:
    split guided calls over the two halves of an even mesh; ``strategy`` and ``options``: as
    :func:`ditscale.diffusers.parallelize` (the halves plan their own "auto" choice). Called on
    every rank of the mesh (it makes the halves' process groups collectively)."""
    family = family_of(pipe, SUPPORTED_PIPELINES, "pipeline", WHERE)
    if getattr(pipe, ATTR_PIPE, None) is not None:
        raise ValueError(f"{WHERE}: this {type(pipe).__name__} is already parallelized")
    for name, flag in (("cfg_parallel", cfg_parallel), ("parallel_vae", parallel_vae)):
        if not isinstance(flag, bool):
            raise TypeError(f"{WHERE}: {name} must be True or False, got "
                            f"{type(flag).__name__} {flag!r}")
    if mesh is None:
        mesh = sp.Mesh.from_process_group()
    elif not isinstance(mesh, sp.Mesh):
        raise TypeError(f"{WHERE}: mesh must be a ditscale.sp.Mesh or None, got "
                        f"{type(mesh).__name__}")
    if mesh.size > 1 and not (torch.distributed.is_available()
                              and torch.distributed.is_initialized()):
        raise ValueError(f"{WHERE}: a mesh of {mesh.size} ranks needs torch.distributed "
                         f"initialized (one process per rank: NCCL for CUDA, gloo for CPU)")
    sp.make_config(WHERE, None, strategy=strategy, **options)  # bad options: before any change
    spec = SPECS[family]
    transformers = _transformers(pipe, family, spec)
    halves = make_halves(mesh) if cfg_parallel else None
    done, vae = [], None
    try:
        for t in transformers:
            done.append(parallelize(t, mesh=mesh, strategy=strategy, **options))
        vae = _parallel_vae(pipe, mesh, parallel_vae)
    except BaseException:
        for t in done:
            unparallelize(t)
        raise
    base = type(pipe)
    state = PipelineState(family, spec, mesh, halves, inspect.signature(base.__call__), base,
                          transformers, vae)
    for t in transformers:
        names = list(inspect.signature(t.forward).parameters)
        setattr(t, ATTR_CFG, TransformerState(state, names, type(t)))
        t.__class__ = _transformer_class(type(t))
    setattr(pipe, ATTR_PIPE, state)
    pipe.__class__ = _pipeline_class(base)
    return pipe


def unparallelize_pipeline(pipe):
    """Undoes :func:`parallelize_pipeline`: every transformer unparallelized and its class
    back, the pipeline's class back; returns ``pipe``. Refused (before any change) for a
    pipeline that is not parallelized or is in a call."""
    where = "ditscale.diffusers.unparallelize_pipeline"
    family_of(pipe, SUPPORTED_PIPELINES, "pipeline", where)
    state = state_of(pipe)
    if state is None:
        raise ValueError(f"{where}: this {type(pipe).__name__} is not parallelized (nothing to "
                         f"undo)")
    if state.mode != "idle":
        raise RuntimeError(f"{where}: the {state.family} pipeline is in a call")
    for t in state.transformers:
        t_state = getattr(t, ATTR_CFG)
        t.__class__ = t_state.base
        delattr(t, ATTR_CFG)
        unparallelize(t)
    if state.vae is not None:
        unparallelize_vae(state.vae)
    pipe.__class__ = state.base
    delattr(pipe, ATTR_PIPE)
    return pipe


def is_in_pipeline(transformer) -> bool:
    """True for a transformer of a parallelized pipeline (unparallelize_pipeline undoes it)."""
    return getattr(transformer, ATTR_CFG, None) is not None


def state_of(pipe) -> Optional[PipelineState]:
    """The PipelineState of a parallelized pipeline, else None."""
    return getattr(pipe, ATTR_PIPE, None)
