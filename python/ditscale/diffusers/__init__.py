"""ditscale for diffusers models and pipelines: one call each.

- :func:`parallelize` (transformer): sequence parallelism through ``ditscale.sp`` (every
  attention of the image/video tokens over the mesh, the text tokens joint or local as the model
  attends them, rotary embeddings sharded with their tokens). Called on every rank with the full
  inputs, the module returns the full output on every rank.
- :func:`parallelize_pipeline` (pipeline): the same for a pipeline's transformer, plus CFG
  parallelism (the conditional and unconditional passes of a step on the two halves of the ranks).
- :func:`apply_fused_adaln` (transformer): every norm + shift/scale modulation (+ gated residual)
  through ``ditscale.ops``' fused AdaLN kernels.

Each keeps the module, its parameters and its state_dict. Supported classes:
:data:`SUPPORTED_TRANSFORMERS` and :data:`SUPPORTED_PIPELINES`; any other class is refused by
name. One module per model family (``sp_<family>.py``, ``adaln_<family>.py``) maps its blocks
onto ``ditscale.sp`` and ``ditscale.ops``; this file only dispatches. diffusers itself is imported
only by those modules (pinned version: tools/setup_debian.sh).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

# diffusers transformer class name -> ditscale family (the modules sp_<family>, adaln_<family>).
SUPPORTED_TRANSFORMERS: Dict[str, str] = {
    "FluxTransformer2DModel": "flux",
    "SD3Transformer2DModel": "sd3",
    "CogVideoXTransformer3DModel": "cogvideox",
    "WanTransformer3DModel": "wan",
    "HunyuanVideoTransformer3DModel": "hunyuan_video",
}

# diffusers pipeline class name -> family of its transformer.
SUPPORTED_PIPELINES: Dict[str, str] = {
    "FluxPipeline": "flux",
    "StableDiffusion3Pipeline": "sd3",
    "CogVideoXPipeline": "cogvideox",
    "WanPipeline": "wan",
    "HunyuanVideoPipeline": "hunyuan_video",
}


def family_of(obj: Any, table: Dict[str, str], what: str, where: str) -> str:
    """The family of ``obj``'s class, or a ValueError naming the class and the supported ones."""
    name = type(obj).__name__
    family = table.get(name)
    if family is None:
        raise ValueError(f"{where}: {what} class {name!r} is not supported; supported: "
                         f"{', '.join(sorted(table))}")
    return family


def _family_module(kind: str, family: str):
    return importlib.import_module(f"{__name__}.{kind}_{family}")


def parallelize(transformer, mesh=None, strategy: str = "auto", **options):
    """Sequence-parallel ``transformer`` in place (see the module docstring); returns it.

    ``mesh``: a ``ditscale.sp.Mesh`` (None = the mesh of the default process group, or one rank
    when torch.distributed is not initialised). ``strategy``: any of ``ditscale.sp.STRATEGIES``
    or ``"auto"`` (the planner's choice per attention shape). ``options``: further
    ``ditscale.sp.Config`` fields (chunks, ulysses_chunks, transport, comm_sms, topology, ...).
    """
    from ._sp_context import make_context, mark

    where = "ditscale.diffusers.parallelize"
    family = family_of(transformer, SUPPORTED_TRANSFORMERS, "transformer", where)
    ctx = make_context(where, transformer, mesh, strategy, options)
    _family_module("sp", family).parallelize(transformer, ctx)
    mark(transformer, ctx)
    return transformer


def parallelize_pipeline(pipe, mesh=None, cfg_parallel: bool = True, strategy: str = "auto",
                         **options):
    """Sequence (and CFG) parallel ``pipe`` in place; returns it. See the module docstring."""
    from ._sp_pipeline import parallelize_pipeline as _impl

    return _impl(pipe, mesh=mesh, cfg_parallel=cfg_parallel, strategy=strategy, **options)


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


__all__ = ["SUPPORTED_TRANSFORMERS", "SUPPORTED_PIPELINES", "parallelize",
           "parallelize_pipeline", "apply_fused_adaln", "remove_fused_adaln", "family_of"]
