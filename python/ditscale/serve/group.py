"""The control plane of the rank group: rank 0 tells every rank what to run.

Messages go over a gloo process group of their own (CPU tensors: no device synchronization,
and no interleaving with the data plane's NCCL / gloo traffic), rank 0 the source:

- ``send(msg)`` / ``recv()``: one picklable message (``{"op": "run", "spec": RunSpec}``,
  ``{"op": "heartbeat"}``, ``{"op": "stop"}``) from rank 0 to all; an idle rank 0 sends a
  heartbeat every ``heartbeat_s`` seconds, so that a waiting rank never sits in a collective
  longer than the group's timeout, and a rank that died is noticed while idle too;
- ``step(flag)``: rank 0's per-step decision (an int) to all;
- ``gather(obj)``: every rank's status after a batch, on every rank.

Any failure of these collectives (a peer gone: gloo's connection reset; the timeout) raises
:class:`GroupBroken`: the server cannot go on, and says so. World size 1: no process group,
every call local.
"""

from __future__ import annotations

import datetime
from typing import Any, List

import torch


class GroupBroken(RuntimeError):
    """A collective of the control plane failed: a rank died or stopped answering."""


class ControlGroup:
    def __init__(self, timeout_s: float):
        import torch.distributed as dist

        self.dist = dist
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = None
        if self.world > 1:
            self.group = dist.new_group(backend="gloo",
                                        timeout=datetime.timedelta(seconds=timeout_s))

    def _guard(self, what: str, fn):
        try:
            return fn()
        except Exception as e:  # gloo raises RuntimeError / DistBackendError on a lost peer
            raise GroupBroken(f"the control plane's {what} failed on rank {self.rank}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                              f"(a rank died or stopped answering)") from e

    def send(self, msg: Any) -> None:
        if self.world > 1:
            self._guard("broadcast", lambda: self.dist.broadcast_object_list(
                [msg], src=0, group=self.group))

    def recv(self) -> Any:
        box = [None]
        self._guard("broadcast", lambda: self.dist.broadcast_object_list(
            box, src=0, group=self.group))
        return box[0]

    def step(self, flag: int) -> int:
        if self.world == 1:
            return flag
        t = torch.tensor([flag], dtype=torch.int64)
        self._guard("step broadcast", lambda: self.dist.broadcast(t, src=0, group=self.group))
        return int(t.item())

    def gather(self, obj: Any) -> List[Any]:
        if self.world == 1:
            return [obj]
        out: List[Any] = [None] * self.world
        self._guard("status gather", lambda: self.dist.all_gather_object(
            out, obj, group=self.group))
        return out
