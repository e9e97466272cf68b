"""Meshes of ranks (machines x GPUs per machine), the ranks' image-token shards, and emulated
machines. torch.distributed is imported only when a process group is asked about, so meshes
(and planning) work without torch."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from .._checks import check_int

MAX_MACHINES = 65536  # machines, gpus_per_machine (python/src/sp_bindings.cc)

# Set by emulate_machines(): the number of emulated machines of this process (0 = none).
_EMULATED_MACHINES = int(os.environ.get("DITSCALE_EMULATED_MACHINES", "0") or 0)


def emulated_machines() -> int:
    """The machine count emulate_machines() set up for this process (0 when not emulating)."""
    return _EMULATED_MACHINES


def _dist():
    """torch.distributed when a process group is initialised, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def check_transport_on_mesh(transport: str, mesh: Optional["Mesh"], where: str) -> None:
    """Refuses NVSHMEM between emulated machines: it would use NVLink, not the emulated link."""
    if (transport == "nvshmem" and emulated_machines() > 1 and mesh is not None
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
    """machines x gpus_per_machine ranks; rank = machine * gpus_per_machine + local GPU.
    ``machines`` and ``gpus_per_machine``: [1, 65536]."""

    machines: int
    gpus_per_machine: int
    group: Optional[Any] = None  # a torch.distributed.ProcessGroup (None: the default group)
    hosts: Tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self):
        if (isinstance(self.machines, int) and isinstance(self.gpus_per_machine, int)
                and (self.machines < 1 or self.gpus_per_machine < 1)):
            raise ValueError(f"Mesh: machines ({self.machines}) and gpus_per_machine "
                             f"({self.gpus_per_machine}) must be >= 1")
        check_int("Mesh: machines", self.machines, 1, MAX_MACHINES)
        check_int("Mesh: gpus_per_machine", self.gpus_per_machine, 1, MAX_MACHINES)
        dist = _dist()
        if dist is not None:
            world = dist.get_world_size(self.group)
            if world != self.size:
                raise ValueError(f"Mesh {self.machines} x {self.gpus_per_machine} has "
                                 f"{self.size} ranks, the process group {world}")

    @property
    def size(self) -> int:
        return self.machines * self.gpus_per_machine

    @property
    def rank(self) -> int:
        dist = _dist()
        return dist.get_rank(self.group) if dist is not None else 0

    @classmethod
    def from_process_group(cls, group=None) -> "Mesh":
        """The mesh of an initialised process group: ranks on the same host (NCCL_HOSTID when
        set, as emulate_machines does, else the host name) form a machine. Ranks of a machine
        must be consecutive and every machine must have as many as the others."""
        dist = _dist()
        if dist is None:
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
