"""The diffusers classes the integration supports, and the one class check of ``parallelize``,
``parallelize_pipeline`` and ``apply_fused_adaln``: an object's class must be diffusers' own
class (imported lazily from the module that defines it), or the same-name subclass that
``parallelize_pipeline`` puts in its place; a look-alike class of the same name from another
module is refused. See docs/diffusers.md.
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

# Where diffusers (the pinned 0.42) defines each supported class.
DIFFUSERS_MODULES: Dict[str, str] = {
    "FluxTransformer2DModel": "diffusers.models.transformers.transformer_flux",
    "SD3Transformer2DModel": "diffusers.models.transformers.transformer_sd3",
    "CogVideoXTransformer3DModel": "diffusers.models.transformers.cogvideox_transformer_3d",
    "WanTransformer3DModel": "diffusers.models.transformers.transformer_wan",
    "HunyuanVideoTransformer3DModel": "diffusers.models.transformers.transformer_hunyuan_video",
    "FluxPipeline": "diffusers.pipelines.flux.pipeline_flux",
    "StableDiffusion3Pipeline":
        "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3",
    "CogVideoXPipeline": "diffusers.pipelines.cogvideo.pipeline_cogvideox",
    "WanPipeline": "diffusers.pipelines.wan.pipeline_wan",
    "HunyuanVideoPipeline": "diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video",
}

# Set on the class that parallelize_pipeline substitutes (same name): the diffusers class it wraps.
BASE_ATTR = "_ditscale_base"


def diffusers_class(name: str) -> type:
    """diffusers' class ``name`` (one of :data:`DIFFUSERS_MODULES`), imported on first use."""
    return getattr(importlib.import_module(DIFFUSERS_MODULES[name]), name)


def stock_class(obj: Any) -> type:
    """The class of ``obj``, or the diffusers class that parallelize_pipeline's same-name
    subclass of it wraps."""
    cls = type(obj)
    return cls.__dict__.get(BASE_ATTR, cls)


def family_of(obj: Any, table: Dict[str, str], what: str, where: str) -> str:
    """The family of ``obj``'s class in ``table`` (:data:`SUPPORTED_TRANSFORMERS` or
    :data:`SUPPORTED_PIPELINES`); a ValueError naming the class for any other class, a class
    named like a supported one that is not diffusers' (another module, or a subclass) included."""
    cls = stock_class(obj)
    name = cls.__name__
    family = table.get(name)
    if family is None:
        raise ValueError(f"{where}: {what} class {name!r} is not supported; supported: "
                         f"{', '.join(sorted(table))}")
    real = diffusers_class(name)
    if cls is not real:
        raise ValueError(f"{where}: {what} class {name!r} of module {cls.__module__!r} is not "
                         f"diffusers' {name} (module {real.__module__!r}); only diffusers' own "
                         f"class is supported, not a look-alike or a subclass")
    return family
