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
topology, engine, ...; validated when made), taken by attention, plan, predict, describe,
timeline, run_local and replay_compute as ``config=``; each also takes the same fields as
keyword overrides (``sp.attention(q, k, v, mesh=mesh, strategy="ring")``). Environment
variables only fill fields left unset, for A/B runs: docs/configuration.md lists them.

The result is dense, non-causal attention (scale 1/sqrt(D)) of the local queries over all
tokens of all ranks, joint text tokens first; ``text_out`` (the joint queries' output) is the same
on every rank. Strategies: ``ulysses`` (with ``ulysses_chunks`` > 1 the head group is cut into
that many chunks, each chunk's all-to-all pipelined with the attention of the chunk before),
``ulysses-overlap`` (Ulysses with its all-to-alls under three attention calls cut on whole waves
of the attention kernel), ``ring``, ``usp`` (Ulysses within machines, Ring across),
``swiftfusion-tas`` (Ulysses across machines, Ring within), ``torus`` (TAS with the all-to-all
cut into ``chunks`` token chunks pipelined with attention), ``auto`` (the planner's choice for
the mesh and a topology: ``Config.topology``, else ``$DITSCALE_SP_TOPOLOGY`` (e.g. the JSON that
``bench/sp/calibrate.py fit`` measures on this cluster), else the ``h200-local`` preset).

``transport="nvshmem"`` runs the one-sided form (puts with signals, NVSHMEM symmetric memory);
it needs ditscale built with NVSHMEM (``nvidia-nvshmem-cu13``). ``transport="nvshmem-intra"``
puts within machines and uses NCCL send/recv between them: for clusters whose NVSHMEM has no
remote transport, and for emulated machines. How the one-sided ops run is ``Config.engine``:
``copy-engine`` (the default, ``auto``: cudaMemcpyAsync into the peer's symmetric buffer and
cuStreamWriteValue64 / WaitValue64 signals on per-sender words: no SM, so transfers run beside
cuDNN's attention calls, which hold every SM; a peer on another host gets NVSHMEM's
put-with-signal on the same words) or ``nvshmem`` (NVSHMEM's on-stream put-with-signal, signal
and wait for every peer: kernels, which wait for the SMs). ``Config.signal="copy"`` makes the
copy-engine engine's signals 8-byte copies of a word written locally instead of stream writes
into the peer's memory.

``comm_sms=k`` keeps at least k SMs out of the compute stream's reach: the executor runs its
compute stream in a CUDA green context of the largest SM partition that leaves k (on an H200,
k = 4 -> 128 of 132 SMs), so that kernels of the comm streams (NCCL's send/recv, packs, NVSHMEM's
puts) run beside cuDNN's attention calls instead of after them, for a few % of compute
(bench/results/sp-smpart-h200/). ``strategy="auto"`` lets the planner choose it (it pays where
transfers are kernels on a slow link: emulated machines); an explicit strategy uses
``$DITSCALE_SP_COMM_SMS`` (default 0: the whole GPU computes).

Emulated machines: ``emulate_machines(m)`` gives the processes of each group of
``LOCAL_WORLD_SIZE / m`` consecutive local ranks their own ``NCCL_HOSTID``, so NCCL (ours and
torch.distributed's) treats the groups as different hosts: its socket transport between them,
NVLink within. Call it before any NCCL communicator is created. NVSHMEM knows nothing of the
emulation: its puts between emulated machines would go over NVLink, around the emulated network,
so on emulated machines ``transport="nvshmem"`` is refused; use ``"nvshmem-intra"``.

CPU tensors with a gloo process group run the same schedules on CPU (one process per rank,
torch.distributed's send/recv, attention with its log-sum-exp through PyTorch's CPU attention,
fp32 compute): every strategy and "auto" (among the two-sided candidates); one-sided transports
are CUDA only. On more than one rank attention is the custom op
``torch.ops.ditscale_sp.attention`` (with a fake kernel), so ``torch.compile(fullgraph=True)``
traces through it; one rank runs SDPA. docs/sp.md ("CPU execution over gloo", "torch.compile").

The schedules, executor and kernels are C++/CUDA (``ditscale/sp``, ``ditscale/runtime``,
``ditscale/comm``, ``ditscale/kernels``). Planning (plan, predict, strategy="auto"'s choice) runs
in ``ditscale._core`` and needs neither torch nor CUDA; the runtime (attention and the
diagnostics) is ``ditscale._C``'s ``SpRuntime``, imported on first use.

Modules: config (Config, the environment), meshes (Mesh, shards, emulated machines), planning
(plan, predict), runtime (attention, synchronize, describe, set_trace, timeline), custom_op (the
op torch.ops.ditscale_sp.attention), cpu_runtime / cpu_executor / cpu_kernels (CPU execution
over gloo), local (run_local, replay_compute).
"""

from __future__ import annotations

import importlib

from .config import (ENGINES, SIGNALS, STRATEGIES, TRANSPORTS, Config, default_topology,
                     make_config)
from .meshes import Mesh, emulate_machines, emulated_machines, shard_range
from .planning import plan, predict, predict_candidate

# The GPU runtime needs torch and ditscale._C: imported on first use, so that planning works
# without them.
_LAZY = {
    "attention": "runtime",
    "synchronize": "runtime",
    "describe": "runtime",
    "set_trace": "runtime",
    "timeline": "runtime",
    "run_local": "local",
    "replay_compute": "local",
}

__all__ = ["Config", "Mesh", "STRATEGIES", "TRANSPORTS", "ENGINES", "SIGNALS", "default_topology",
           "make_config", "emulate_machines", "emulated_machines", "shard_range", "plan",
           "predict", "predict_candidate"] + list(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
