"""Sequence-parallel attention for DiT inference (SwiftFusion): Ulysses, Ring, USP,
SwiftFusion's topology-aware scheduling (TAS) and Torus attention on NCCL or NVSHMEM.

Usage, one process per GPU under ``torchrun``::

    import ditscale.sp as sp
    sp.emulate_machines(2)          # optional, BEFORE init_process_group: see below
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    mesh = sp.Mesh.from_process_group()            # machines x GPUs from the host names
    begin, count = sp.shard_range(S, mesh.size, mesh.rank)   # this rank's image tokens
    out = sp.attention(q, k, v, mesh=mesh)                   # q, k, v: [B, count, H, D]
    cfg = sp.Config(strategy="torus", chunks=2)
    out, text_out = sp.attention(q, k, v, mesh=mesh, config=cfg,
                                 joint_q=tq, joint_k=tk, joint_v=tv)   # MMDiT text: [B, T, H, D]

The configuration is one :class:`Config` (strategy, degrees, chunks, transport, comm_sms,
topology; validated when made), taken by attention, plan, predict, describe and timeline as
``config=``, each also taking the same fields as keyword overrides. The result is dense,
non-causal attention (scale 1/sqrt(D)) of the local queries over all tokens of all ranks, joint
text tokens first. On more than one rank it runs the custom op ``torch.ops.ditscale_sp.attention``
(traced by ``torch.compile``): CUDA tensors on NCCL / NVSHMEM, CPU tensors over gloo; it has a
backward for strategy "ulysses" on CPU tensors (grad.py) and refuses inputs that require grad
elsewhere. Strategies, transports, emulated
machines, the environment and the experiment variants (ditscale._experimental): docs/sp.md.

Modules, a chain with no cycle: api (attention) -> custom_op -> grad -> dispatch -> gpu_runtime
(SpRuntime; synchronize, describe, set_trace, timeline) | cpu_runtime (gloo: cpu_executor,
cpu_backward, cpu_kernels); config (Config, its text encoding), meshes, planning (plan,
predict: _core, no torch) below them.
"""

from __future__ import annotations

import importlib

from .config import STRATEGIES, TRANSPORTS, Config, default_topology, make_config
from .meshes import Mesh, emulate_machines, emulated_machines, shard_range
from .planning import plan, predict, predict_candidate

# The GPU runtime needs torch and ditscale._C: imported on first use, so that planning works
# without them.
_LAZY = {
    "attention": "api",
    "synchronize": "gpu_runtime",
    "describe": "gpu_runtime",
    "set_trace": "gpu_runtime",
    "timeline": "gpu_runtime",
}

__all__ = ["Config", "Mesh", "STRATEGIES", "TRANSPORTS", "default_topology", "make_config",
           "emulate_machines", "emulated_machines", "shard_range", "plan", "predict",
           "predict_candidate"] + list(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
