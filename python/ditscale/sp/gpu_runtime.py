"""The GPU runtime of ditscale.sp: one ``torch.classes.ditscale.SpRuntime`` per mesh (its NCCL
communicators, NVSHMEM on first use of a one-sided transport, one executor per configuration and
shape, buffers allocated once), the layer it runs for dispatch.py, and the diagnostics that read
it: synchronize, describe, set_trace, timeline. Needs ditscale._C built with CUDA. docs/sp.md.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _extension  # loads ditscale._C (the ops and the SpRuntime class)
from .._experimental import sp_variants
from .config import Config, make_config, resolved_text
from .meshes import Mesh
from .planning import best_for_transport, plan, planned_config


class _Runtime:
    """Communicators and executors of one mesh (collective construction)."""

    def __init__(self, mesh: Mesh, device: torch.device, timeout_s: float, net_channels: int):
        require()
        self.mesh = mesh
        self.device = device
        intra, inter = self._ids_from_rank0(torch.ops.ditscale.sp_nccl_id, 2)
        self.obj = torch.classes.ditscale.SpRuntime(
            mesh.rank, mesh.size, device.index, mesh.machines, mesh.gpus_per_machine,
            intra, inter, float(timeout_s), int(net_channels))
        self.seq_total: Dict[Tuple[int, ...], int] = {}
        self.plans: Dict[Tuple, dict] = {}

    def ensure_nvshmem(self) -> None:
        if self.obj.has_nvshmem():
            return
        why = torch.ops.ditscale.sp_nvshmem_unavailable()
        if why:
            raise RuntimeError(f"ditscale.sp: NVSHMEM transports ('nvshmem', 'nvshmem-intra') are "
                               f"not available: {why}")
        # The symmetric heap holds every executor arena of one-sided strategies.
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "16G")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        (nvshmem_id,) = self._ids_from_rank0(torch.ops.ditscale.sp_nvshmem_id, 1)
        self.obj.init_nvshmem(nvshmem_id)

    def _ids_from_rank0(self, make, count: int):
        """``count`` unique ids made by ``make()`` on the mesh's rank 0, broadcast to every rank
        (uint8 CPU tensors)."""
        ids = [None] * count
        if self.mesh.rank == 0:
            ids = [bytes(make().tolist()) for _ in range(count)]
        group = self.mesh.group
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(ids, src=src, group=group, device=self.device)
        return [torch.tensor(list(b), dtype=torch.uint8) for b in ids]

    def total_tokens(self, local: int) -> int:
        key = (local,)
        if key not in self.seq_total:
            t = torch.tensor([local], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, group=self.mesh.group)
            self.seq_total[key] = int(t.item())
        return self.seq_total[key]


_RUNTIMES: Dict[Tuple, _Runtime] = {}


def require() -> None:
    """RuntimeError unless ditscale._C is loaded with the CUDA sequence-parallel runtime."""
    if not _extension.is_available():
        raise RuntimeError(f"ditscale.sp: the compiled extension is missing: "
                           f"{_extension.load_error()}")
    if not hasattr(torch.classes.ditscale, "SpRuntime"):
        raise RuntimeError("ditscale.sp: ditscale._C was built without the CUDA sequence-parallel "
                           "runtime (needs CUDA, NCCL and a CUDA build of torch)")


def _runtime(mesh: Mesh, device: torch.device, net_channels: int = 0,
             timeout_s: float = 120.0) -> _Runtime:
    key = (id(mesh.group), mesh.machines, mesh.gpus_per_machine, device.index, net_channels)
    rt = _RUNTIMES.get(key)
    if rt is None:
        rt = _Runtime(mesh, device, timeout_s, net_channels)
        _RUNTIMES[key] = rt
    return rt


def _existing_runtime(mesh: Mesh, device: Optional[torch.device]) -> _Runtime:
    device = device or torch.device("cuda", torch.cuda.current_device())
    return _runtime(mesh, device, sp_variants.current().net_channels_per_peer)


def run_text(cfg: Config) -> str:
    """The torch ops' configuration text (ditscale/torch/sp_config_text.h): the Config's text
    and the experiment variant's engine and signal (ditscale._experimental.sp_variants; the
    defaults unless a benchmark sets them)."""
    return f"{resolved_text(cfg)};{sp_variants.current().op_text()}"


def attention(q, k, v, joint, mesh: Mesh, cfg: Config, where: str):
    """The GPU runtime (SpRuntime) of one layer: (out, joint_out or None)."""
    backend = str(dist.get_backend(mesh.group))
    if "nccl" not in backend:
        raise ValueError(f"{where}: CUDA tensors need an NCCL process group, the mesh's group "
                         f"has backend {backend!r}")
    joint_q, joint_k, joint_v = joint if joint is not None else (None, None, None)
    rt = _runtime(mesh, q.device, sp_variants.current().net_channels_per_peer)
    seq_total = rt.total_tokens(q.shape[1])
    if cfg.strategy == "auto":
        text = 0 if joint is None else joint_q.shape[1]
        key = (q.shape[0], seq_total, text, q.shape[2], k.shape[2], q.shape[3], q.element_size(),
               cfg.topology, cfg.transport)
        best = rt.plans.get(key)
        if best is None:
            ranked = plan(mesh, batch=q.shape[0], seq=seq_total, text=text, heads=q.shape[2],
                          kv_heads=k.shape[2], head_dim=q.shape[3], dtype_bytes=q.element_size(),
                          config=cfg, one_sided=cfg.one_sided)["ranked"]
            best = best_for_transport(ranked, cfg.transport, mesh)
            rt.plans[key] = best
        cfg = planned_config(cfg, best)
    if cfg.one_sided:
        rt.ensure_nvshmem()
    out, jout = rt.obj.attention(run_text(cfg), seq_total, q, k, v, joint_q, joint_k, joint_v)
    return out, (jout if joint is not None else None)


def synchronize(mesh: Mesh, device: Optional[torch.device] = None, timeout_s: float = 60.0,
                config: Optional[Config] = None):
    """Waits for the current stream, failing (instead of hanging) when a transfer does not
    complete within ``timeout_s`` (the communicators are aborted)."""
    make_config("ditscale.sp.synchronize", config)  # validated; the mesh's runtime serves all
    _existing_runtime(mesh, device).obj.synchronize(float(timeout_s))


def _ran_config(where: str, config: Optional[Config], fields: dict) -> Config:
    cfg = make_config(where, config, **fields)
    if cfg.strategy == "auto":
        raise ValueError(f"{where}: strategy: name the strategy the layer ran with, not 'auto'")
    return cfg


def describe(mesh: Mesh, strategy: Optional[str] = None, *, config: Optional[Config] = None,
             ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None,
             chunks: Optional[int] = None, ulysses_chunks: Optional[int] = None,
             transport: Optional[str] = None, device: Optional[torch.device] = None) -> str:
    """The executor plan (transport, units, streams, events, arena) of a configuration already
    run."""
    cfg = _ran_config("ditscale.sp.describe", config, dict(
        strategy=strategy, ulysses_degree=ulysses_degree, ring_degree=ring_degree,
        chunks=chunks, ulysses_chunks=ulysses_chunks, transport=transport))
    return _existing_runtime(mesh, device).obj.describe(run_text(cfg))


def set_trace(mesh: Mesh, on: bool = True, device: Optional[torch.device] = None,
              config: Optional[Config] = None) -> None:
    """Diagnosis: while on, every layer run on ``mesh`` records when each unit of its schedule
    started and ended on the GPU (two CUDA events per unit; a little overhead). Read it with
    :func:`timeline`."""
    make_config("ditscale.sp.set_trace", config)  # validated; the mesh's runtime serves all
    _existing_runtime(mesh, device).obj.set_trace(bool(on))


def timeline(mesh: Mesh, strategy: Optional[str] = None, *, config: Optional[Config] = None,
             ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None,
             chunks: Optional[int] = None, ulysses_chunks: Optional[int] = None,
             transport: Optional[str] = None, device: Optional[torch.device] = None) -> str:
    """The per-unit GPU timeline of this rank's last traced layer of a configuration (run with
    :func:`set_trace` on): units in start order with stream, begin/end ms after the layer's start
    and their ops, then per stream the busy and idle time. Waits for that layer. Empty when the
    configuration has not run traced. Pass the configuration as the layer ran (torus: 2 chunks
    by default)."""
    cfg = _ran_config("ditscale.sp.timeline", config, dict(
        strategy=strategy, ulysses_degree=ulysses_degree, ring_degree=ring_degree,
        chunks=chunks, ulysses_chunks=ulysses_chunks, transport=transport))
    return _existing_runtime(mesh, device).obj.timeline(run_text(cfg))
