"""The ranks of a prepare run: torch.distributed over gloo, objects only.

Ranks exchange only small Python objects (probe results, shard records, errors) and never
tensors, so the group is gloo on CPU and GPU alike (torchrun sets the rendezvous variables).
``gather`` is the one collective: every rank contributes ``(value, error)``; when any rank
failed, every rank raises the same error, so no rank is left waiting for one that died
(a rank that never arrives ends the collective at the group timeout with an error).
"""

from __future__ import annotations

import datetime
import os
from typing import Any, List, Optional, Tuple

import torch.distributed as dist


class RankError(RuntimeError):
    """A step failed on some rank; the message names the rank and its error."""


def setup(timeout_s: float) -> Tuple[int, int, bool]:
    """(rank, world_size, created): joins torchrun's group when WORLD_SIZE > 1, or uses a group
    the caller already made; ``created``: this call made it (and ``teardown`` ends it)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, False
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), True


def teardown(created: bool) -> None:
    if created:
        dist.destroy_process_group()


def gather(world: int, value: Any, error: Optional[str] = None) -> List[Any]:
    """Every rank's value, in rank order; RankError on every rank if any rank gave an error."""
    if world == 1:
        pairs = [(value, error)]
    else:
        pairs: List[Any] = [None] * world
        dist.all_gather_object(pairs, (value, error))
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(pairs) if e is not None]
    if errors:
        raise RankError("; ".join(errors))
    return [v for v, _ in pairs]


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()
