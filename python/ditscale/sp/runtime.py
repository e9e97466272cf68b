"""ditscale.sp.attention and the GPU runtime of ditscale.sp: one
``torch.classes.ditscale.SpRuntime`` per mesh (its NCCL communicators, NVSHMEM on first use of a
one-sided transport, one executor per configuration and shape, buffers allocated once), and the
entry points that run on it: attention, synchronize, describe, set_trace, timeline (needs
ditscale._C built with CUDA). attention on more than one rank goes through the custom op
``torch.ops.ditscale_sp.attention`` (custom_op.py) to distributed_attention: CUDA tensors to the
SpRuntime, CPU tensors to the CPU executor over gloo (cpu_runtime.py)."""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import ops as _ops  # loads ditscale._C (the ops and the SpRuntime class)
from . import cpu_runtime as _cpu_runtime
from . import custom_op as _custom_op
from .config import (ENV_COMM_SMS, ENV_ENGINE, ENV_NET_CHANNELS, ENV_SIGNAL, ENV_TOPOLOGY,
                     Config, make_config, op_fields)
from .meshes import Mesh, check_transport_on_mesh
from .planning import best_for_transport, plan, planned_config


class _Runtime:
    """Communicators and executors of one mesh (collective construction)."""

    def __init__(self, mesh: Mesh, device: torch.device, timeout_s: float, net_channels: int):
        _require()
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


def _require() -> None:
    if not _ops.is_available():
        raise RuntimeError(f"ditscale.sp: the compiled extension is missing: {_ops.load_error()}")
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


def _existing_runtime(mesh: Mesh, device: Optional[torch.device], cfg: Config) -> _Runtime:
    device = device or torch.device("cuda", torch.cuda.current_device())
    return _runtime(mesh, device, cfg.net_channels_per_peer)


def _local_attention(q, k, v, joint_q, joint_k, joint_v):
    """One rank holds everything: SDPA over [joint; image]."""
    T = 0 if joint_q is None else joint_q.shape[1]
    if T:
        q, k, v = (torch.cat([a, b], 1) for a, b in ((joint_q, q), (joint_k, k), (joint_v, v)))
    if k.shape[2] != q.shape[2]:
        g = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return (o[:, T:], o[:, :T]) if T else (o, None)


# make_config's results for attention: (config, overrides, the variables it reads) -> Config.
# make_config costs ~25 us (two validated dataclass copies), a lookup here ~2 us.
_CONFIG_MEMO: Dict[Tuple, Config] = {}
_CONFIG_MEMO_SIZE = 256
_CONFIG_ENV = (ENV_TOPOLOGY, ENV_COMM_SMS, ENV_ENGINE, ENV_SIGNAL, ENV_NET_CHANNELS)


def _attention_config(where: str, config: Optional[Config], overrides: dict) -> Config:
    """make_config(where, config, **overrides), memoised while the environment variables it
    reads keep their values (torch.compile traces make_config itself)."""
    if torch.compiler.is_compiling():
        return make_config(where, config, **overrides)
    key = (config, tuple((type(v), v) for v in overrides.values()),
           tuple(os.environ.get(n) for n in _CONFIG_ENV))
    try:
        cfg = _CONFIG_MEMO.get(key)
    except TypeError:  # an unhashable argument: make_config names it
        return make_config(where, config, **overrides)
    if cfg is None:
        cfg = make_config(where, config, **overrides)
        if len(_CONFIG_MEMO) < _CONFIG_MEMO_SIZE:
            _CONFIG_MEMO[key] = cfg
    return cfg


def _check_tensors(where: str, q, k, v, joint) -> None:
    """q [B, S, H, D], k and v [B, S, Hk, D] (H a multiple of Hk), joint (text q, k, v)
    [B, T, H, D], [B, T, Hk, D] x 2: one device and one dtype."""
    named = [("q", q), ("k", k), ("v", v)]
    if joint is not None:
        named += [("joint_q", joint[0]), ("joint_k", joint[1]), ("joint_v", joint[2])]
    for name, t in named:
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{where}: {name} must be a 4-d tensor [batch, tokens, heads, "
                             f"head_dim], got {getattr(t, 'shape', type(t).__name__)}")
        if t.device != q.device or t.dtype != q.dtype:
            raise ValueError(f"{where}: {name} is {t.dtype} on {t.device}, q is {q.dtype} on "
                             f"{q.device}: every tensor of the call on one device, of one dtype")
    B, S, H, D = q.shape
    Hk = k.shape[2]
    want = [("k", k, (B, S, Hk, D)), ("v", v, (B, S, Hk, D))]
    if joint is not None:
        T = joint[0].shape[1]
        want += [("joint_q", joint[0], (B, T, H, D)), ("joint_k", joint[1], (B, T, Hk, D)),
                 ("joint_v", joint[2], (B, T, Hk, D))]
    for name, t, shape in want:
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected {shape} "
                             f"(q {tuple(q.shape)}, k {tuple(k.shape)})")
    if Hk < 1 or H % Hk:
        raise ValueError(f"{where}: the {H} query heads are not a multiple of the {Hk} "
                         f"key/value heads")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Optional[Mesh],
              config: Optional[Config] = None, strategy: Optional[str] = None,
              joint_q: Optional[torch.Tensor] = None, joint_k: Optional[torch.Tensor] = None,
              joint_v: Optional[torch.Tensor] = None, chunks: Optional[int] = None,
              ulysses_chunks: Optional[int] = None, transport: Optional[str] = None,
              ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None,
              topology: Optional[str] = None, comm_sms: Optional[int] = None):
    """Sequence-parallel attention of this rank's image-token shard (see ditscale.sp).
    Returns ``out`` [B, S_local, H, D], or ``(out, joint_out)`` when ``joint_q`` is given.
    ``config`` (default Config(): strategy "auto") and the field overrides: see Config.
    A mesh of one rank runs SDPA here (differentiable, traced by torch.compile as SDPA); more
    ranks run the custom op ``torch.ops.ditscale_sp.attention`` (custom_op.py): CUDA tensors on
    the GPU runtime, CPU tensors on the CPU executor over gloo (two-sided transports only)."""
    where = "ditscale.sp.attention"
    joint = joint_q is not None
    if (joint_k is None) != (joint_q is None) or (joint_v is None) != (joint_q is None):
        raise ValueError(f"{where}: joint_q, joint_k and joint_v go together")
    cfg = _attention_config(where, config, dict(
        strategy=strategy, chunks=chunks, ulysses_chunks=ulysses_chunks, transport=transport,
        ulysses_degree=ulysses_degree, ring_degree=ring_degree, topology=topology,
        comm_sms=comm_sms))
    check_transport_on_mesh(cfg.transport, mesh, where)
    _check_tensors(where, q, k, v, (joint_q, joint_k, joint_v) if joint else None)
    if mesh is None or mesh.size == 1:  # nothing to transport: any transport
        out, jout = _local_attention(q, k, v, joint_q, joint_k, joint_v)
        return (out, jout) if joint else out
    if cfg.one_sided and not q.is_cuda:
        raise ValueError(f"{where}: transport {cfg.transport!r} is one-sided (NVSHMEM: CUDA "
                         f"tensors only); {q.device.type} tensors run the two-sided transport "
                         f"'nccl' (over gloo)")
    out, jout = _custom_op.attention_op(q, k, v, joint_q, joint_k, joint_v,
                                        *_custom_op.mesh_args(mesh), _custom_op.config_text(cfg))
    return (out, jout) if joint else out


def distributed_attention(q, k, v, joint, mesh: Mesh, cfg: Config):
    """The real kernel of torch.ops.ditscale_sp.attention: (out, joint_out or None)."""
    where = "ditscale.sp.attention"
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{where}: a mesh of {mesh.size} ranks needs torch.distributed "
                         f"initialized (one process per rank): NCCL for CUDA tensors, gloo for "
                         f"CPU tensors")
    if q.is_cuda:
        return _gpu_attention(q, k, v, joint, mesh, cfg, where)
    if q.device.type != "cpu":
        raise ValueError(f"{where}: q, k, v on {q.device}: a mesh of {mesh.size} ranks runs "
                         f"CUDA tensors (NCCL) or CPU tensors (gloo)")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: CPU tensors of dtype {q.dtype}: float32, bfloat16 or "
                         f"float16")
    return _cpu_runtime.attention(q, k, v, joint, mesh, cfg, where)


def _gpu_attention(q, k, v, joint, mesh: Mesh, cfg: Config, where: str):
    """The GPU runtime (SpRuntime) of one layer: (out, joint_out or None)."""
    backend = str(dist.get_backend(mesh.group))
    if "nccl" not in backend:
        raise ValueError(f"{where}: CUDA tensors need an NCCL process group, the mesh's group "
                         f"has backend {backend!r}")
    joint_q, joint_k, joint_v = joint if joint is not None else (None, None, None)
    rt = _runtime(mesh, q.device, cfg.net_channels_per_peer)
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
    out, jout = rt.obj.attention(op_fields(cfg), seq_total, q, k, v, joint_q, joint_k, joint_v)
    return out, (jout if joint is not None else None)


def synchronize(mesh: Mesh, device: Optional[torch.device] = None, timeout_s: float = 60.0,
                config: Optional[Config] = None):
    """Waits for the current stream, failing (instead of hanging) when a transfer does not
    complete within ``timeout_s`` (the communicators are aborted)."""
    cfg = make_config("ditscale.sp.synchronize", config)
    _existing_runtime(mesh, device, cfg).obj.synchronize(float(timeout_s))


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
    return _existing_runtime(mesh, device, cfg).obj.describe(op_fields(cfg))


def set_trace(mesh: Mesh, on: bool = True, device: Optional[torch.device] = None,
              config: Optional[Config] = None) -> None:
    """Diagnosis: while on, every layer run on ``mesh`` records when each unit of its schedule
    started and ended on the GPU (two CUDA events per unit; a little overhead). Read it with
    :func:`timeline`."""
    cfg = make_config("ditscale.sp.set_trace", config)
    _existing_runtime(mesh, device, cfg).obj.set_trace(bool(on))


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
    return _existing_runtime(mesh, device, cfg).obj.timeline(op_fields(cfg))
