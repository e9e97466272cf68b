"""Sequence-parallel attention for DiT inference (SwiftFusion): Ulysses, Ring, USP,
SwiftFusion's topology-aware scheduling (TAS) and Torus attention on NCCL or NVSHMEM.

Usage, one process per GPU under ``torchrun``::

    import ditscale.sp as sp
    sp.emulate_machines(2)          # optional, BEFORE init_process_group: see below
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    mesh = sp.Mesh.from_process_group()            # machines x GPUs from the host names
    begin, count = sp.shard_range(S, mesh.size, mesh.rank)   # this rank's image tokens
    out = sp.attention(q, k, v, mesh=mesh)                   # q, k, v: [B, count, H, D]
    out, text_out = sp.attention(q, k, v, mesh=mesh, strategy="torus", chunks=2,
                                 joint_q=tq, joint_k=tk, joint_v=tv)   # MMDiT text: [B, T, H, D]

The result is dense, non-causal attention (scale 1/sqrt(D)) of the local queries over all
tokens of all ranks, joint text tokens first; ``text_out`` (the joint queries' output) is the same
on every rank. Strategies: ``ulysses``, ``ulysses-overlap`` (Ulysses with its all-to-alls under
three attention calls cut on whole waves of the attention kernel), ``ring``, ``usp`` (Ulysses
within machines, Ring across),
``swiftfusion-tas`` (Ulysses across machines, Ring within), ``torus`` (TAS with the all-to-all
cut into ``chunks`` token chunks pipelined with attention; with ``ulysses``, ``chunks`` > 1 cuts
the head group into that many chunks, each chunk's all-to-all pipelined the same way), ``auto`` (the planner's choice for the mesh and a
topology: ``$DITSCALE_SP_TOPOLOGY`` when set (e.g. the JSON that ``bench/sp/calibrate.py fit``
measures on this cluster), else the ``h200-local`` preset).
``transport="nvshmem"`` runs the one-sided form (puts with signals, NVSHMEM symmetric memory);
it needs ditscale built with NVSHMEM (``nvidia-nvshmem-cu13``). ``transport="nvshmem-intra"``
puts within machines and uses NCCL send/recv between them: for clusters whose NVSHMEM has no
remote transport, and for emulated machines. How the one-sided ops run is
``$DITSCALE_SP_ONE_SIDED_ENGINE``: ``copy-engine`` (the default, ``auto``: cudaMemcpyAsync into
the peer's symmetric buffer and cuStreamWriteValue64 / WaitValue64 signals on per-sender words: no
SM, so transfers run beside cuDNN's attention calls, which hold every SM; a peer on another host
gets NVSHMEM's put-with-signal on the same words) or ``nvshmem`` (NVSHMEM's on-stream
put-with-signal, signal and wait for every peer: kernels, which wait for the SMs).
``$DITSCALE_SP_CE_SIGNAL=copy`` makes the copy-engine engine's signals 8-byte copies of a word
written locally instead of stream writes into the peer's memory.

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

The schedules, executor and kernels are C++/CUDA (``ditscale/sp``, ``ditscale/runtime``,
``ditscale/comm``, ``ditscale/kernels``); this module builds the communicators from the process
group and caches one executor per configuration and shape (buffers are allocated once).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import ops as _ops  # loads ditscale._C (the ops and the SpRuntime class)

STRATEGIES = ("ulysses", "ulysses-overlap", "ring", "usp", "swiftfusion-tas", "torus")


def default_topology() -> str:
    """The cluster model of strategy="auto", plan() and predict(): $DITSCALE_SP_TOPOLOGY (a
    preset name or the topology JSON that ``bench/sp/calibrate.py fit`` writes from measurements
    on this cluster), else the ``h200-local`` preset."""
    return os.environ.get("DITSCALE_SP_TOPOLOGY") or "h200-local"


# nccl: Send/Recv everywhere; nvshmem: puts with signals on every link; nvshmem-intra: puts
# within machines, NCCL Send/Recv between them.
TRANSPORTS = ("nccl", "nvshmem", "nvshmem-intra")

# Set by emulate_machines(): the number of emulated machines of this process (0 = none).
_EMULATED_MACHINES = int(os.environ.get("DITSCALE_EMULATED_MACHINES", "0") or 0)


def emulated_machines() -> int:
    """The machine count emulate_machines() set up for this process (0 when not emulating)."""
    return _EMULATED_MACHINES


def _transport_flags(transport: str, where: str) -> Tuple[bool, bool]:
    """(one_sided, one_sided_inter) of a transport name."""
    if transport not in TRANSPORTS:
        raise ValueError(f"{where}: transport {transport!r} is not one of {TRANSPORTS}")
    return transport != "nccl", transport == "nvshmem"


def _check_transport_on_mesh(transport: str, mesh: Optional["Mesh"], where: str) -> None:
    """Refuses NVSHMEM between emulated machines: it would use NVLink, not the emulated link."""
    if (transport == "nvshmem" and _EMULATED_MACHINES > 1 and mesh is not None
            and mesh.machines > 1):
        raise ValueError(
            f"{where}: transport='nvshmem' puts on every link, but these {mesh.machines} machines "
            f"are emulated on one host (emulate_machines): NVSHMEM would move the inter-machine "
            f"data over NVLink, bypassing the emulated network. Use transport='nvshmem-intra' "
            f"(puts within machines, NCCL between them) or 'nccl'")


def shard_range(seq: int, world: int, rank: int) -> Tuple[int, int]:
    """(begin, count) of rank's image tokens: an even split, the first seq % world ranks hold
    one token more (the split every strategy's schedule uses)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard_range: rank {rank} not in [0, {world})")
    base, extra = divmod(int(seq), int(world))
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def emulate_machines(machines: int) -> int:
    """Sets NCCL_HOSTID so that this host's processes form ``machines`` emulated machines of
    consecutive local ranks; returns this process's machine index. Call before NCCL starts."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if machines < 1 or local_world % machines:
        raise ValueError(
            f"emulate_machines({machines}): {local_world} local processes cannot be split "
            f"into {machines} machines of equal size")
    per = local_world // machines
    machine = local_rank // per
    host = socket.gethostname()
    os.environ["NCCL_HOSTID"] = f"{host}-emulated-machine-{machine}"
    os.environ["DITSCALE_EMULATED_MACHINES"] = str(machines)
    global _EMULATED_MACHINES
    _EMULATED_MACHINES = machines
    return machine


def _host_id() -> str:
    return os.environ.get("NCCL_HOSTID") or socket.gethostname()


@dataclass
class Mesh:
    """machines x gpus_per_machine ranks; rank = machine * gpus_per_machine + local GPU."""

    machines: int
    gpus_per_machine: int
    group: Optional[dist.ProcessGroup] = None
    hosts: Tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self):
        if self.machines < 1 or self.gpus_per_machine < 1:
            raise ValueError(f"Mesh: machines ({self.machines}) and gpus_per_machine "
                             f"({self.gpus_per_machine}) must be >= 1")
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size(self.group)
            if world != self.size:
                raise ValueError(f"Mesh {self.machines} x {self.gpus_per_machine} has "
                                 f"{self.size} ranks, the process group {world}")

    @property
    def size(self) -> int:
        return self.machines * self.gpus_per_machine

    @property
    def rank(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.group)
        return 0

    @classmethod
    def from_process_group(cls, group: Optional[dist.ProcessGroup] = None) -> "Mesh":
        """The mesh of an initialised process group: ranks on the same host (NCCL_HOSTID when
        set, as emulate_machines does, else the host name) form a machine. Ranks of a machine
        must be consecutive and every machine must have as many as the others."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(1, 1, None, (_host_id(),))
        world = dist.get_world_size(group)
        hosts = [None] * world
        dist.all_gather_object(hosts, _host_id(), group=group)
        order = []
        for h in hosts:
            if not order or order[-1] != h:
                if h in order:
                    raise ValueError(f"Mesh.from_process_group: the ranks of host {h!r} are not "
                                     f"consecutive: {hosts}")
                order.append(h)
        counts = {h: hosts.count(h) for h in order}
        if len(set(counts.values())) != 1:
            raise ValueError(f"Mesh.from_process_group: machines have different GPU counts: "
                             f"{counts}")
        return cls(len(order), world // len(order), group, tuple(hosts))


class _Runtime:
    """Communicators and executors of one mesh (collective construction)."""

    def __init__(self, mesh: Mesh, device: torch.device, timeout_s: float):
        _require()
        self.mesh = mesh
        self.device = device
        intra, inter = self._ids_from_rank0(torch.ops.ditscale.sp_nccl_id, 2)
        self.obj = torch.classes.ditscale.SpRuntime(
            mesh.rank, mesh.size, device.index, mesh.machines, mesh.gpus_per_machine,
            intra, inter, float(timeout_s))
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


def _runtime(mesh: Mesh, device: torch.device, timeout_s: float = 120.0) -> _Runtime:
    key = (id(mesh.group), mesh.machines, mesh.gpus_per_machine, device.index)
    rt = _RUNTIMES.get(key)
    if rt is None:
        rt = _Runtime(mesh, device, timeout_s)
        _RUNTIMES[key] = rt
    return rt


def plan(mesh: Mesh, *, batch: int, seq: int, text: int, heads: int, head_dim: int,
         kv_heads: int = 0, dtype_bytes: int = 2, topology: Optional[str] = None,
         strategies=(), one_sided: Optional[bool] = None, sm_partitions: bool = True) -> dict:
    """The planner's ranking for one attention layer on ``mesh`` (simulated with
    ``topology``): {"ranked": [{"name", "strategy", "ulysses_degree", "ring_degree", "torus_chunks",
    "one_sided", "one_sided_inter", "transport", "comm_sms", "predicted_layer_s", ...}],
    "explanation": ...}. ``one_sided`` (default: when NVSHMEM is available) adds the one-sided
    candidates: "nvshmem" and, on more than one machine, "nvshmem-intra". ``sm_partitions`` adds
    each candidate with SMs kept for communication (``comm_sms``), where the topology has them."""
    if not _ops.is_available():
        raise RuntimeError(f"ditscale.sp.plan: {_ops.load_error()}")
    topology = topology or default_topology()
    if one_sided is None:
        one_sided = not torch.ops.ditscale.sp_nvshmem_unavailable()
    return json.loads(torch.ops.ditscale.sp_plan(
        mesh.machines, mesh.gpus_per_machine, batch, seq, text, heads, kv_heads, head_dim,
        dtype_bytes, topology, list(strategies), bool(one_sided), bool(one_sided),
        bool(sm_partitions)))


def predict(mesh: Mesh, *, strategy: str, batch: int, seq: int, text: int, heads: int,
            head_dim: int, kv_heads: int = 0, dtype_bytes: int = 2, chunks: int = 1,
            transport: str = "nccl", ulysses_degree: int = 0, ring_degree: int = 0,
            topology: Optional[str] = None, comm_sms: int = 0) -> float:
    """The simulator's time of one attention layer (seconds) for a configuration
    (``transport``: one of TRANSPORTS; ``comm_sms``: SMs kept for communication)."""
    one_sided, one_sided_inter = _transport_flags(transport, "ditscale.sp.predict")
    if not _ops.is_available():
        raise RuntimeError(f"ditscale.sp.predict: {_ops.load_error()}")
    topology = topology or default_topology()
    j = json.loads(torch.ops.ditscale.sp_predict(
        mesh.machines, mesh.gpus_per_machine, batch, seq, text, heads, kv_heads, head_dim,
        dtype_bytes, topology, strategy, ulysses_degree, ring_degree, chunks, one_sided,
        one_sided_inter, int(comm_sms)))
    return float(j["predicted_layer_s"])


def _best_for_transport(ranked, transport: str, mesh: Mesh) -> dict:
    """The fastest plan candidate that runs on ``transport``. On one machine "nvshmem-intra" is
    the plain one-sided schedule (the planner lists it once, as "nvshmem")."""
    want = "nvshmem" if transport == "nvshmem-intra" and mesh.machines == 1 else transport
    for c in ranked:
        if c.get("transport", "nvshmem" if c["one_sided"] else "nccl") == want:
            return c
    raise RuntimeError(f"ditscale.sp.attention: the planner found no configuration for "
                       f"transport {transport!r} on a {mesh.machines} x "
                       f"{mesh.gpus_per_machine} mesh")


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Optional[Mesh],
              strategy: str = "auto", joint_q: Optional[torch.Tensor] = None,
              joint_k: Optional[torch.Tensor] = None, joint_v: Optional[torch.Tensor] = None,
              chunks: Optional[int] = None, transport: str = "nccl",
              ulysses_degree: int = 0, ring_degree: int = 0, topology: Optional[str] = None,
              comm_sms: Optional[int] = None):
    """Sequence-parallel attention of this rank's image-token shard (see the module docstring).
    Returns ``out`` [B, S_local, H, D], or ``(out, joint_out)`` when ``joint_q`` is given.
    ``comm_sms``: SMs kept out of the compute stream for communication kernels (None: the
    planner's choice with strategy="auto", else ``$DITSCALE_SP_COMM_SMS`` or 0)."""
    joint = joint_q is not None
    if (joint_k is None) != (joint_q is None) or (joint_v is None) != (joint_q is None):
        raise ValueError("ditscale.sp.attention: joint_q, joint_k and joint_v go together")
    one_sided, one_sided_inter = _transport_flags(transport, "ditscale.sp.attention")
    _check_transport_on_mesh(transport, mesh, "ditscale.sp.attention")
    if mesh is None or mesh.size == 1:
        out, jout = _local_attention(q, k, v, joint_q, joint_k, joint_v)
        return (out, jout) if joint else out
    if not q.is_cuda:
        raise ValueError("ditscale.sp.attention: q, k, v must be CUDA tensors for a mesh of "
                         f"{mesh.size} ranks")
    rt = _runtime(mesh, q.device)
    seq_total = rt.total_tokens(q.shape[1])
    if strategy == "auto":
        topology = topology or default_topology()
        key = (q.shape[0], seq_total, 0 if not joint else joint_q.shape[1], q.shape[2],
               k.shape[2], q.shape[3], q.element_size(), topology, transport)
        best = rt.plans.get(key)
        if best is None:
            ranked = plan(mesh, batch=q.shape[0], seq=seq_total, text=key[2], heads=q.shape[2],
                          kv_heads=k.shape[2], head_dim=q.shape[3], dtype_bytes=q.element_size(),
                          topology=topology, one_sided=one_sided)["ranked"]
            best = _best_for_transport(ranked, transport, mesh)
            rt.plans[key] = best
        strategy = best["strategy"]
        ulysses_degree, ring_degree = best["ulysses_degree"], best["ring_degree"]
        chunks = best["torus_chunks"]
        if comm_sms is None:
            comm_sms = int(best.get("comm_sms", 0))
    if comm_sms is None:
        comm_sms = _env_comm_sms()
    if comm_sms < 0:
        raise ValueError(f"ditscale.sp.attention: comm_sms must be >= 0, got {comm_sms}")
    if strategy not in STRATEGIES:
        raise ValueError(f"ditscale.sp.attention: unknown strategy {strategy!r}; one of "
                         f"{STRATEGIES + ('auto',)}")
    if chunks is None:
        chunks = 2 if strategy == "torus" else 1
    if one_sided:
        rt.ensure_nvshmem()
    out, jout = rt.obj.attention(strategy, int(ulysses_degree), int(ring_degree), int(chunks),
                                 one_sided, one_sided_inter, int(comm_sms), seq_total, q, k, v,
                                 joint_q, joint_k, joint_v)
    return (out, jout) if joint else out


def _env_comm_sms() -> int:
    """$DITSCALE_SP_COMM_SMS as an integer >= 0 (0 when unset)."""
    text = os.environ.get("DITSCALE_SP_COMM_SMS", "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"ditscale.sp: $DITSCALE_SP_COMM_SMS must be an integer >= 0, got "
                         f"{text!r}")
    return value


def synchronize(mesh: Mesh, device: Optional[torch.device] = None, timeout_s: float = 60.0):
    """Waits for the current stream, failing (instead of hanging) when a transfer does not
    complete within ``timeout_s`` (the communicators are aborted)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    _runtime(mesh, device).obj.synchronize(float(timeout_s))


def describe(mesh: Mesh, strategy: str, *, ulysses_degree: int = 0, ring_degree: int = 0,
             chunks: int = 1, transport: str = "nccl",
             device: Optional[torch.device] = None) -> str:
    """The executor plan (transport, units, streams, events, arena) of a configuration already
    run."""
    one_sided, one_sided_inter = _transport_flags(transport, "ditscale.sp.describe")
    device = device or torch.device("cuda", torch.cuda.current_device())
    return _runtime(mesh, device).obj.describe(strategy, ulysses_degree, ring_degree, chunks,
                                               one_sided, one_sided_inter)


def set_trace(mesh: Mesh, on: bool = True, device: Optional[torch.device] = None) -> None:
    """Diagnosis: while on, every layer run on ``mesh`` records when each unit of its schedule
    started and ended on the GPU (two CUDA events per unit; a little overhead). Read it with
    :func:`timeline`."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    _runtime(mesh, device).obj.set_trace(bool(on))


def timeline(mesh: Mesh, strategy: str, *, ulysses_degree: int = 0, ring_degree: int = 0,
             chunks: int = 1, transport: str = "nccl",
             device: Optional[torch.device] = None) -> str:
    """The per-unit GPU timeline of this rank's last traced layer of a configuration (run with
    :func:`set_trace` on): units in start order with stream, begin/end ms after the layer's start
    and their ops, then per stream the busy and idle time. Waits for that layer. Empty when the
    configuration has not run traced. Pass ``chunks`` as the layer ran (torus: 2 by default)."""
    one_sided, one_sided_inter = _transport_flags(transport, "ditscale.sp.timeline")
    device = device or torch.device("cuda", torch.cuda.current_device())
    return _runtime(mesh, device).obj.timeline(strategy, ulysses_degree, ring_degree, chunks,
                                               one_sided, one_sided_inter)


def run_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, strategy: str,
              machines: int = 1, gpus_per_machine: int, chunks: int = 1, ulysses_degree: int = 0,
              ring_degree: int = 0, joint_q: Optional[torch.Tensor] = None,
              joint_k: Optional[torch.Tensor] = None, joint_v: Optional[torch.Tensor] = None,
              layers: int = 1, timeout_s: float = 60.0, comm_sms: int = 0):
    """Every rank of a strategy's one-sided schedule in this process, on q's GPU: the real GPU
    executor per rank (own streams), its puts and signals by copy engines and stream memory
    operations between the ranks' buffers. ``q, k, v``: the FULL ``[B, S, H, D]`` inputs
    (``joint_*``: ``[B, T, H, D]``). No process group: checks strategies and the copy-engine
    engine on one GPU against dense attention (not a speed measurement: the ranks share the GPU).
    Runs ``layers`` layers; returns ``(out_first, out_last, text_out, info)``: the full ``[B, S, H,
    D]`` outputs of the first and last layer, each rank's text output stacked ``[ranks, B, T, H,
    D]`` (None without text) and a description (engine, arena bytes). ``comm_sms`` > 0 runs
    every rank's compute stream in an SM partition (see the module docstring). A rank's stream waits
    block a CUDA hardware queue: with more than two ranks set ``CUDA_DEVICE_MAX_CONNECTIONS=32``
    before CUDA starts, or the ranks' queues may be shared and block each other."""
    joint = [joint_q, joint_k, joint_v]
    if any(t is not None for t in joint) and any(t is None for t in joint):
        raise ValueError("ditscale.sp.run_local: joint_q, joint_k and joint_v go together")
    if strategy not in STRATEGIES:
        raise ValueError(f"ditscale.sp.run_local: strategy {strategy!r} is not one of "
                         f"{STRATEGIES}")
    _require()
    if not hasattr(torch.ops.ditscale, "sp_run_local"):
        raise RuntimeError("ditscale.sp.run_local: the extension was built without the CUDA "
                           "sequence-parallel runtime")
    first, last, text_out, info = torch.ops.ditscale.sp_run_local(
        strategy, int(ulysses_degree), int(ring_degree), int(chunks), int(machines),
        int(gpus_per_machine), q, k, v, joint_q, joint_k, joint_v, int(layers), float(timeout_s),
        int(comm_sms))
    return first, last, (text_out if joint_q is not None else None), info


def replay_compute(strategy: str, *, machines: int, gpus_per_machine: int, rank: int = 0,
                   batch: int = 1, seq: int, text: int = 0, heads: int, kv_heads: int = 0,
                   head_dim: int = 128, chunks: int = 1, ulysses_degree: int = 0,
                   ring_degree: int = 0, transport: str = "nccl", iters: int = 5,
                   warmup: int = 1, comm_sms: int = 0) -> Tuple[List[float], str]:
    """One rank's compute of a strategy, replayed alone on the current GPU: the GPU executor runs
    the rank's schedule with every transfer skipped, so its attention calls, merges and copies
    run as they would if communication were free (random bf16 inputs; the output is
    meaningless). No process group, one GPU: what a schedule's cuts cost in compute, measured
    (``comm_sms`` > 0: on the SM partition that leaves that many SMs).
    Returns (ms of each timed layer, the per-unit timeline of one traced layer as text)."""
    one_sided, _ = _transport_flags(transport, "ditscale.sp.replay_compute")
    _require()
    ms, text_tl = torch.ops.ditscale.sp_replay_compute(
        strategy, int(ulysses_degree), int(ring_degree), int(chunks), one_sided, int(machines),
        int(gpus_per_machine), int(rank), int(batch), int(seq), int(text), int(heads),
        int(kv_heads), int(head_dim), int(iters), int(warmup), int(comm_sms))
    return ms.tolist(), text_tl
