"""The ranks' layout of a run with a sequence-parallel degree per micro-batch (``sp_degrees``).

The balanced plan is made over all W ranks with the allowed degrees (``BalancedBatchSampler(...,
sp_degrees=...)``); a micro-batch of degree d is trained by the aligned group of ranks
``(r // d) * d .. + d - 1``, each of which lists it in the same place of its step. The process
groups are made once, at set-up, on every rank (collectives, in one order): for each degree
d > 1 the W / d aligned groups, and a 1-rank group per rank. The transformer is parallelized once
on this rank's largest group; each micro-batch runs inside ``ditscale.diffusers.sequence_group``
on its degree's group (degree 1: the stock path on the 1-rank mesh, also the gradient-sync
pass's). See [docs/train.md](../../../docs/train.md) ("Sequence parallelism per micro-batch").
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .. import _core

MAX_DEGREE: int = _core._sampler_limits()["max_sp_degree"]


def parse_degrees(text: str) -> List[int]:
    """``"1,2,4"`` -> [1, 2, 4] (ascending): integers, then the rules of
    ``ditscale plan --sp-degrees`` (C++ ``SpDegreesError``) except the world size (``check``);
    else ValueError / TypeError naming ``sp_degrees``."""
    out: List[int] = []
    for item in text.split(","):
        try:
            out.append(int(item.strip()))
        except ValueError:
            raise ValueError(f"sp_degrees: {item!r} is not an integer (expected a list such as "
                             f"1,2,4)") from None
    error = _core._sp_degrees_error(out, MAX_DEGREE)  # any world that every degree divides
    if error:
        raise ValueError(error)
    return sorted(out)


def check(degrees: List[int], strategy: str, world: int, device: torch.device) -> None:
    """ValueError (the same on every rank) when ``degrees`` cannot train here: each must divide
    ``world``, and a degree above 1 needs the strategy's backward on several ranks on
    ``device`` (as ``parallel.check``)."""
    from . import parallel

    error = _core._sp_degrees_error(degrees, world)
    if error:
        raise ValueError(error)
    try:
        parallel.check(max(degrees), strategy, world, device)
    except ValueError as e:
        raise ValueError(str(e).replace("sp_degree:", "sp_degrees:", 1)) from None


@dataclass(frozen=True)
class MixedLayout:
    """This rank's place among W ranks with degrees ``degrees``; ``meshes[d]``: the
    ``ditscale.sp.Mesh`` of its group of degree d. The plan is over all W ranks (``dp``,
    ``dp_rank``); ``sp`` is 1 (every rank reports the micro-batches it leads)."""

    rank: int
    world: int
    degrees: List[int]
    meshes: Dict[int, Any] = field(default_factory=dict)
    groups: Dict[int, Any] = field(default_factory=dict)

    sp = 1

    @property
    def dp(self) -> int:
        return self.world

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def model_degree(self) -> int:
        """The degree the transformer is parallelized on (the largest)."""
        return max(self.degrees)

    @property
    def model_mesh(self) -> Optional[Any]:
        return self.meshes.get(self.model_degree)

    def leads(self, degree: int) -> bool:
        """Whether this rank is the first of its group of ``degree`` (reports its samples)."""
        return self.rank % degree == 0

    def on_group(self, model, degree: int):
        """A context running ``model``'s calls on this rank's group of ``degree`` (nothing when
        the model is not parallelized: every degree is 1)."""
        if self.model_degree == 1:
            return contextlib.nullcontext()
        from ..diffusers import sequence_group

        return sequence_group(model, self.meshes[degree])


def make_layout(degrees: List[int], strategy: str, timeout_s: float, device: torch.device,
                wan) -> MixedLayout:
    """Checks, then builds every group of every degree on every rank (torch.distributed
    initialised) and checks ``strategy`` on their meshes for the model ``wan`` (a WanConfig:
    its heads; ``parallel.group_meshes``); returns this rank's layout."""
    import torch.distributed as dist

    from . import parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    check(degrees, strategy, world, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = {}
    for d in sorted(set(degrees) | {1}):
        ranks = [list(range(g * d, (g + 1) * d)) for g in range(world // d)]
        groups[d], _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
    meshes = parallel.group_meshes(groups, strategy, wan, "sp_degrees")
    return MixedLayout(rank, world, list(degrees), meshes, groups)
