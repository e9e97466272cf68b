"""A segment: the plan of an epoch, or of what is left of it after a resume on another world size.

An epoch starts as one segment over every store sample. A checkpoint records the segment (its
world size and the ids it excludes) and how many of its steps were trained. Resuming on the same
world size rebuilds the same segment and continues at that step (the sampler's state, checked
against the plan's fingerprint). Resuming on another world size starts a new segment over the
samples not yet consumed in the epoch (``BalancedBatchSampler`` refuses another world size, so
a new sampler is built over those manifest rows as a ``pyarrow.Table`` and its ids mapped back
to store ids): every sample of the epoch is trained exactly once across the change. Such a rest
is planned with tail "keep" where the run's tail is "drop" (a rank may get no micro-batch in the
last step), so that no sample of it is dropped and a rest smaller than the world size still
plans. With ``sp_degrees`` a micro-batch of degree d is listed by the d ranks of its group and
counted once, by the group's first rank. See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from ..sampler import BalancedBatchSampler


def _remaining_table(manifest_path: str, keep: np.ndarray):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    table = pacsv.read_csv(manifest_path, convert_options=pacsv.ConvertOptions(
        column_types={"path": pa.string(), "caption": pa.string(), "fps": pa.float64()}))
    return table.take(pa.array(keep, type=pa.int64()))


class Segment:
    """The plan of epoch ``epoch`` over the store ids not in ``excluded`` (sorted int64), for
    ``rank`` of ``world_size``; ``sampler_kw`` are BalancedBatchSampler's planning arguments."""

    def __init__(self, manifest_path: str, num_samples: int, epoch: int, rank: int,
                 world_size: int, excluded: Optional[np.ndarray] = None, **sampler_kw):
        self.epoch, self.rank, self.world_size = epoch, rank, world_size
        self.excluded = np.zeros(0, np.int64) if excluded is None else np.asarray(excluded,
                                                                                 np.int64)
        if len(self.excluded):
            if sampler_kw.get("tail", "drop") == "drop":
                sampler_kw = dict(sampler_kw, tail="keep")
            self.id_map = np.setdiff1d(np.arange(num_samples, dtype=np.int64), self.excluded)
            manifest = _remaining_table(manifest_path, self.id_map)
        else:
            self.id_map, manifest = None, manifest_path
        self.sampler = BalancedBatchSampler(manifest, rank, world_size, epoch=epoch,
                                            mode="step", **sampler_kw)
        self.num_steps = self.sampler.num_steps
        self.counts = self.sampler.micro_batches_per_step()

    def _ids(self, ids) -> List[int]:
        if self.id_map is None:
            return [int(i) for i in ids]
        return [int(i) for i in self.id_map[np.asarray(ids, np.int64)]]

    def cell(self, step: int, rank: int) -> List[List[int]]:
        """Rank ``rank``'s micro-batches (store ids) of step ``step``."""
        return [self._ids(mb) for mb in self.sampler.cell(step, rank)]

    def my_cell(self, step: int) -> List[List[int]]:
        return self.cell(step, self.rank)

    def my_degrees(self, step: int) -> List[int]:
        """The sequence-parallel degree of each micro-batch of ``my_cell(step)``."""
        return self.sampler.cell_degrees(step, self.rank)

    def step_ids(self, step: int) -> List[int]:
        """Every store id trained in step ``step`` over all ranks (rank order), each once: a
        micro-batch of degree d counted on the first rank of its group only."""
        return [i for r in range(self.world_size)
                for d, mb in zip(self.sampler.cell_degrees(step, r), self.cell(step, r))
                if r % d == 0 for i in mb]

    def consumed(self, steps: int) -> np.ndarray:
        """Sorted store ids of the epoch consumed once ``steps`` steps of this segment ran."""
        ids = [i for k in range(steps) for i in self.step_ids(k)]
        return np.union1d(self.excluded, np.asarray(ids, np.int64))

    def state_dict(self, steps: int) -> dict:
        """The sampler's state after ``steps`` steps of the segment."""
        return self.sampler.state_dict(consumed_steps=steps)

    def load_state_dict(self, state: dict) -> int:
        """Checks ``state`` against this segment's plan (same world size, seed, manifest rows,
        cost model: ``ditscale.Error`` otherwise); returns the step to continue at."""
        self.sampler.load_state_dict(state)
        return int(state["step"])
