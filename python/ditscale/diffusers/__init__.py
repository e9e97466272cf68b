"""ditscale for diffusers models and pipelines: one call each, and one call that undoes it.

- :func:`parallelize` / :func:`unparallelize` (transformer): sequence parallelism through
  ``ditscale.sp``, applied from the family's declarative plan (``sp_<family>.PLAN``,
  ``_sp_plan``) and removed bit for bit; :func:`sequence_group` runs its calls on another
  group for a while (a sequence-parallel degree per micro-batch).
- :func:`parallelize_pipeline` / :func:`unparallelize_pipeline`: the same for a pipeline's
  transformer(s), plus CFG parallelism.
- :func:`apply_fused_adaln` / :func:`remove_fused_adaln`: norm + modulation through
  ``ditscale.ops``' fused AdaLN kernels.

Supported: diffusers' own classes of :data:`SUPPORTED_TRANSFORMERS` and
:data:`SUPPORTED_PIPELINES` (``_classes``: a look-alike class is refused). This file only
dispatches; see docs/diffusers.md.
"""

from __future__ import annotations

import importlib

from ._classes import SUPPORTED_PIPELINES, SUPPORTED_TRANSFORMERS, family_of


def _family_module(kind: str, family: str):
    return importlib.import_module(f"{__name__}.{kind}_{family}")


def parallelize(transformer, mesh=None, strategy: str = "auto", **options):
    """Sequence-parallel ``transformer`` in place (its family's plan); returns it. Called on
    every rank with the full inputs, the module returns the full output on every rank.

    ``mesh``: a ``ditscale.sp.Mesh`` (None = the mesh of the default process group, or one rank
    when torch.distributed is not initialised). ``strategy``: any of ``ditscale.sp.STRATEGIES``
    or ``"auto"`` (the planner's choice per attention shape). ``options``: further
    ``ditscale.sp.Config`` fields (chunks, ulysses_chunks, transport, comm_sms, topology, ...).
    Parallelizing twice is refused; :func:`unparallelize` undoes it.
    """
    from . import _sp_plan, sp_cache
    from ._sp_context import make_context

    where = "ditscale.diffusers.parallelize"
    family = family_of(transformer, SUPPORTED_TRANSFORMERS, "transformer", where)
    ctx = make_context(where, mesh, strategy, options)
    _sp_plan.apply(_family_module("sp", family).PLAN, transformer, ctx)
    try:  # step caches (enabled now or later) decide alike on every rank, or are refused
        sp_cache.make_cache_consistent(transformer)
    except BaseException:
        _sp_plan.remove(where, transformer)
        raise
    return transformer


def sequence_group(transformer, mesh):
    """A context manager: within it, the parallelized ``transformer`` runs its calls on ``mesh``
    (a ``ditscale.sp.Mesh`` of another process group; one rank runs the stock path) instead of
    the mesh of :func:`parallelize`, which must have more than one rank. Training with a
    sequence-parallel degree per micro-batch parallelizes once on the largest group and runs
    each micro-batch on its own group (docs/diffusers.md, "Training")."""
    from . import _sp_plan

    return _sp_plan.on_mesh("ditscale.diffusers.sequence_group", transformer, mesh)


def unparallelize(obj):
    """Undoes :func:`parallelize` on a transformer (every hook removed, the stock processor
    objects back: the stock module, bit for bit), or :func:`parallelize_pipeline` on a pipeline;
    returns ``obj``. Refused for what was not parallelized."""
    from . import _sp_pipeline, _sp_plan, sp_cache

    where = "ditscale.diffusers.unparallelize"
    if type(obj).__name__ in SUPPORTED_PIPELINES:
        return _sp_pipeline.unparallelize_pipeline(obj)
    family_of(obj, SUPPORTED_TRANSFORMERS, "transformer", where)
    if _sp_pipeline.is_in_pipeline(obj):
        raise ValueError(f"{where}: this {type(obj).__name__} belongs to a parallelized "
                         f"pipeline; call unparallelize_pipeline on the pipeline")
    _sp_plan.remove(where, obj)
    sp_cache.remove_cache_consistency(obj)
    return obj


def parallelize_pipeline(pipe, mesh=None, cfg_parallel: bool = True, strategy: str = "auto",
                         parallel_vae: bool = True, **options):
    """Sequence (and CFG) parallel ``pipe`` in place, its VAE banded over every rank
    (``parallel_vae``, docs/diffusers/vae.md); returns it (docs/diffusers/pipelines.md).
    :func:`unparallelize_pipeline` undoes it."""
    from ._sp_pipeline import parallelize_pipeline as _impl

    return _impl(pipe, mesh=mesh, cfg_parallel=cfg_parallel, strategy=strategy,
                 parallel_vae=parallel_vae, **options)


def parallelize_vae(vae, mesh=None):
    """Bands ``vae``'s decode (and Wan's encode) over the mesh's ranks, exactly; returns a handle
    whose ``remove()`` undoes it (docs/diffusers/vae.md)."""
    from .parallel_vae import parallelize_vae as _impl

    return _impl(vae, mesh=mesh)


def unparallelize_vae(vae):
    """Undoes :func:`parallelize_vae`: the stock module back."""
    from .parallel_vae import unparallelize_vae as _impl

    return _impl(vae)


def unparallelize_pipeline(pipe):
    """Undoes :func:`parallelize_pipeline`: the pipeline's and its transformers' classes, hooks
    and processors as they were; returns ``pipe``."""
    from ._sp_pipeline import unparallelize_pipeline as _impl

    return _impl(pipe)


def apply_fused_adaln(transformer):
    """Routes ``transformer``'s norm + modulation through ditscale's fused AdaLN ops in place;
    returns it."""
    where = "ditscale.diffusers.apply_fused_adaln"
    family = family_of(transformer, SUPPORTED_TRANSFORMERS, "transformer", where)
    _family_module("adaln", family).apply(transformer)
    return transformer


def remove_fused_adaln(transformer):
    """Undoes :func:`apply_fused_adaln` (the stock forwards again); returns ``transformer``. A
    transformer that was not patched is returned unchanged."""
    where = "ditscale.diffusers.remove_fused_adaln"
    family = family_of(transformer, SUPPORTED_TRANSFORMERS, "transformer", where)
    _family_module("adaln", family).remove(transformer)
    return transformer


__all__ = ["SUPPORTED_TRANSFORMERS", "SUPPORTED_PIPELINES", "parallelize", "unparallelize",
           "parallelize_pipeline", "unparallelize_pipeline", "parallelize_vae",
           "unparallelize_vae", "apply_fused_adaln",
           "remove_fused_adaln", "family_of"]
