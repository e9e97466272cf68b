"""How bench/diffusers/compare_peers.py makes each row's model from the stock ``master`` (never
modified), and why a row is skipped. Each ``prepare_*`` returns a function of no arguments that
makes the model (called on every rank, inside the row's memory accounting); each ``*_skip``
returns the reason a row cannot run here, or None.

- ditscale: ``ditscale.diffusers.parallelize(copy, strategy=...)``; a hybrid strategy that is a
  plain one on this mesh is skipped (:func:`mesh_skip`).
- diffusers' context parallelism: ``set_attention_backend("_native_cudnn")`` (CPU: "native"),
  then ``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N | ring_degree=N))``.
- xDiT: ``xfuser``'s sequence-parallel subclass of the diffusers transformer
  (``xFuserFlux1Transformer2DWrapper`` / ``xFuserWanTransformer3DWrapper``) with the master's
  state_dict, under xfuser's model-parallel groups (``initialize_model_parallel``) and runtime
  state (``xFuserArgs(..., attention_backend="CUDNN").create_config()``,
  ``initialize_runtime_state``), the lightest entry point of xfuser 0.7.0 that takes an
  existing diffusers transformer (its runner does the same in ``xFuserFluxModel`` and
  ``xFuserWan21T2VModel``). xfuser needs a GPU; flash-attn is not needed (cuDNN through ATen).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

from bench.diffusers.compare_models import build


def mesh_skip(strategy: str, mesh) -> Optional[str]:
    """Why ``strategy`` is not run on ``mesh`` (it is a plain strategy there), or None."""
    m, g = mesh.machines, mesh.gpus_per_machine
    if strategy == "usp" and (m == 1 or g == 1):
        same = "ulysses" if m == 1 else "ring"
        return (f"usp on {m} machine(s) x {g} GPU(s) has ulysses_degree {g}, ring_degree {m}: "
                f"the row '{same}'")
    if strategy == "swiftfusion-tas" and (m == 1 or g == 1):
        same = "ring" if m == 1 else "ulysses"
        return (f"swiftfusion-tas on {m} machine(s) x {g} GPU(s) has ulysses_degree {m}, "
                f"ring_degree {g}: the row '{same}'")
    if strategy == "torus" and m == 1:
        return "torus cuts the all-to-all across machines; on one machine it has none (ring)"
    return None


def prepare_ditscale(master, strategy):
    import ditscale.diffusers as dd

    return lambda: dd.parallelize(copy.deepcopy(master), strategy=strategy)


def auto_choice(mesh, family, cfg, inp, device) -> Optional[str]:
    """The planner's first choice for the self-attention of ``strategy="auto"``."""
    from ditscale import sp

    try:
        ranked = sp.plan(mesh, batch=1, seq=inp.tokens, text=inp.text if family == "flux" else 0,
                         heads=cfg["num_attention_heads"], head_dim=cfg["attention_head_dim"],
                         one_sided=None if device.type == "cuda" else False)["ranked"]
        return ranked[0]["name"] if ranked else None
    except Exception as e:  # noqa: BLE001 - informative only
        return f"(plan failed: {type(e).__name__})"


def diffusers_skip(kind, world, cfg, inp, device) -> Optional[str]:
    if world == 1:
        return "ContextParallelConfig needs ulysses_degree or ring_degree > 1 (world size 1)"
    if kind == "ring" and device.type != "cuda":
        return ("diffusers' ring needs each attention call's log-sum-exp, which its CPU backend "
                "(native) does not return ('Native attention does not support return_lse=True')")
    heads = cfg["num_attention_heads"]
    if kind == "ulysses" and heads % world:
        return f"{heads} heads do not divide by ulysses_degree {world}"
    for what, n in (("image/video tokens", inp.tokens), ("text tokens", inp.text)):
        if n % world:
            return f"{n} {what} do not divide by {world} ranks (diffusers' split needs it)"
    return None


@contextlib.contextmanager
def _cpu_device_count():
    """diffusers 0.42.1's enable_parallelism takes ``rank % torch.accelerator.device_count()``
    (a ZeroDivisionError without an accelerator): on CPU it sees 1 device while it is set up."""
    import torch

    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = real


def prepare_diffusers(master, kind, world, device):
    from diffusers import ContextParallelConfig

    def make():
        model = copy.deepcopy(master)
        model.set_attention_backend("_native_cudnn" if device.type == "cuda" else "native")
        degree = {"ulysses_degree": world} if kind == "ulysses" else {"ring_degree": world}
        with (_cpu_device_count() if device.type == "cpu" else contextlib.nullcontext()):
            model.enable_parallelism(config=ContextParallelConfig(**degree))
        return model

    return make


def xfuser_skip(world, device, cfg, ulysses) -> Optional[str]:
    if device.type != "cuda":
        return ("xfuser needs a GPU (with a CUDA build of torch it calls torch.cuda.set_device; "
                "its USP takes yunchang's process groups only when CUDA is available)")
    try:
        import xfuser  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or its imports fail
        return f"xfuser cannot be imported ({type(e).__name__}: {str(e)[:120]})"
    heads = cfg["num_attention_heads"]
    if heads % ulysses:
        return f"{heads} heads do not divide by ulysses_degree {ulysses} (xfuser needs it)"
    return None


class _PipelineShim:
    """What xfuser's runtime state reads of a pipeline: the transformer and the VAE's scale."""

    def __init__(self, family, transformer):
        self.transformer = transformer
        self.vae_scale_factor = 8  # FluxPipeline's; xfuser doubles it for Flux's 2x2 packing
        self.vae_scale_factor_spatial, self.vae_scale_factor_temporal = 8, 4


def _shim(family, transformer):
    # xfuser picks its metadata by the pipeline class name's prefix (Flux..., Wan...).
    name = "FluxPipelineShim" if family == "flux" else "WanPipelineShim"
    return type(name, (_PipelineShim,), {})(family, transformer)


def prepare_xfuser(master, family, cfg, inp, ulysses, ring, args, device):
    """xfuser's transformer subclass with ``master``'s weights under its groups and state."""

    def make():
        import xfuser.core.distributed as xd
        from xfuser.config import xFuserArgs
        from xfuser.core.distributed.parallel_state import destroy_model_parallel

        backend = "nccl" if device.type == "cuda" else "gloo"
        xd.init_distributed_environment(backend=backend)
        if xd.model_parallel_is_initialized():
            destroy_model_parallel()
        xd.initialize_model_parallel(sequence_parallel_degree=ulysses * ring,
                                     ulysses_degree=ulysses, ring_degree=ring, backend=backend)
        engine, _ = xFuserArgs(model=f"compare-peers-{family}", ulysses_degree=ulysses,
                               ring_degree=ring, attention_backend="CUDNN").create_config()
        if family == "flux":
            from xfuser.model_executor.models.transformers.transformer_flux import (
                xFuserFlux1Transformer2DWrapper as cls)
        else:
            from xfuser.model_executor.models.transformers.transformer_wan import (
                xFuserWanTransformer3DWrapper as cls)
        model = build(cls, cfg, args.torch_dtype, device, args.seed)
        model.load_state_dict(master.state_dict())
        xd.initialize_runtime_state(_shim(family, model), engine)
        if family == "flux":
            _, h, w = args.grid
            xd.get_runtime_state().set_input_parameters(
                height=16 * h, width=16 * w, batch_size=1,
                num_inference_steps=args.warmup_steps + args.steps,
                max_condition_sequence_length=inp.text, split_text_embed_in_sp=True)
        return model

    return make


def prepare_stock_cudnn(master):
    def make():
        model = copy.deepcopy(master)
        model.set_attention_backend("_native_cudnn")
        return model

    return make
