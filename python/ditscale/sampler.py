"""Distributed, deterministic, resumable batch sampler over AdaptiveLoad plans.

Every data-parallel rank builds ``BalancedBatchSampler(manifest, rank, world_size, ...)`` with the
same arguments; each computes the same global plan (no communication) and yields its own share::

    sampler = ditscale.BalancedBatchSampler("train.csv", rank, world_size, seed=1234)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    sampler.set_epoch(epoch)
    for batch, last in zip(loader, sampler.last_micro_batch_flags()):
        ...  # forward + backward; optimizer step when `last` (gradient accumulation)

Steps per rank, the tail policies, resuming with DataLoader workers and the argument ranges:
docs/balance.md (section "In PyTorch").
"""

from __future__ import annotations

import numbers
import os
import warnings
from typing import Iterator, List, Mapping, Optional, Sequence, Tuple

from . import _core
from ._checks import INT64_MAX, UINT64_MAX, check_int

_MODES = ("micro_batch", "step")
_LIMITS = _core._sampler_limits()
MAX_WORLD_SIZE: int = _LIMITS["max_world_size"]
DROPPED_WARN_FRACTION: float = _LIMITS["dropped_warn_fraction"]
# The fields of state_dict() and their ranges (rank's upper bound is world_size - 1).
_STATE_FIELDS = {
    "epoch": (0, _LIMITS["max_epoch"]),
    "step": (0, INT64_MAX),
    "micro_batch": (0, INT64_MAX),
    "seed": (0, UINT64_MAX),
    "world_size": (1, MAX_WORLD_SIZE),
    "rank": (0, None),
    "plan_fingerprint": (1, UINT64_MAX),
}


def check_state_dict(state) -> dict:
    """A sampler state as saved by ``state_dict()``: every field present, an integer and in its
    range, no other field; else ValueError/TypeError naming the field, its value and the
    expected type or range."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state dict: expected a mapping, got {type(state).__name__}")
    unknown = sorted(str(k) for k in state if k not in _STATE_FIELDS)
    if unknown:
        raise ValueError(f"state dict: unknown field(s) {', '.join(unknown)}; expected "
                         f"{', '.join(_STATE_FIELDS)}")
    out = {}
    for name, (lo, hi) in _STATE_FIELDS.items():
        if name not in state:
            raise ValueError(f"state dict: missing field '{name}'")
        if hi is None:
            hi = out["world_size"] - 1
        value = state[name]
        if not isinstance(value, numbers.Integral) and hasattr(value, "item"):
            value = value.item()  # a one-element tensor or numpy scalar
        out[name] = check_int(f"state.{name}", value, lo, hi)
    return out


# The columns a manifest needs (ditscale/balance/manifest.h); only these are read from a table.
_MANIFEST_COLUMNS = ("path", "num_frames", "height", "width", "fps")
_DATASET_BATCH_ROWS = 65536


def _dataset_stream(dataset):
    """A pyarrow.RecordBatchReader over the manifest columns of a datasets.Dataset, in its row
    order (select / shuffle / filter index mappings applied), batch by batch."""
    import pyarrow as pa

    names = [n for n in dataset.column_names if n in _MANIFEST_COLUMNS]
    sub = dataset.select_columns(names).with_format("arrow")
    schema = sub.data.schema
    batches = (b.cast(schema) for t in sub.iter(batch_size=_DATASET_BATCH_ROWS)
               for b in t.to_batches())
    return pa.RecordBatchReader.from_batches(schema, batches)


def read_arrow_manifest(data, skip_bad_rows: bool = False) -> "_core.Manifest":
    """The manifest rows of a ``pyarrow.Table``, a ``datasets.Dataset`` or any object with
    ``__arrow_c_stream__`` (``pyarrow.RecordBatchReader``, ...), read in C++ by the Parquet
    reader's rules (columns path, num_frames, height, width, fps; their Arrow types; a null is a
    missing value) without writing a file: only the five columns are handed over, batch by
    batch. Errors name ``<pyarrow.Table>`` (``<datasets.Dataset>``, ...) and the 1-based row:
    ``<pyarrow.Table>:2: column 'fps': missing fps for a video (num_frames > 1)``; a build
    without Arrow C++ raises ``ditscale.Error`` ("built without Parquet support"). ``datasets``
    is imported only when a Dataset is given."""
    kind = type(data)
    name = f"<{kind.__module__.split('.')[0]}.{kind.__name__}>"
    if kind.__module__.split(".")[0] == "datasets":
        import datasets

        if not isinstance(data, datasets.Dataset):
            raise TypeError(f"manifest: expected a datasets.Dataset (map-style), got {name}")
        return _core._read_arrow_manifest(_dataset_stream(data), "<datasets.Dataset>",
                                          bool(skip_bad_rows))
    if kind.__module__.split(".")[0] == "pyarrow" and kind.__name__ == "Table":
        keep = [i for i, n in enumerate(data.column_names) if n in _MANIFEST_COLUMNS]
        return _core._read_arrow_manifest(data.select(keep), "<pyarrow.Table>",
                                          bool(skip_bad_rows))
    if not hasattr(data, "__arrow_c_stream__"):
        raise TypeError(f"manifest: expected a path, a pyarrow.Table, a datasets.Dataset or an "
                        f"object with __arrow_c_stream__, got {kind.__name__}")
    return _core._read_arrow_manifest(data, name, bool(skip_bad_rows))


def _manifest_arg(manifest, skip_bad_rows: bool, format: str):
    """The manifest argument as the binding takes it: a path (str) or a Manifest read here."""
    if isinstance(manifest, (str, os.PathLike)):
        return os.fspath(manifest)
    if isinstance(manifest, _core.Manifest):
        return manifest
    if format:
        raise ValueError(f"format={format!r} applies to a manifest path, not to "
                         f"{type(manifest).__name__}")
    return read_arrow_manifest(manifest, skip_bad_rows)


class BalancedBatchSampler:
    """Yields, for this rank, lists of sample ids (0-based manifest data-row numbers).

    Args:
      manifest: path of an Open-Sora-style CSV (``path,num_frames,height,width,fps``, other
        columns ignored), JSONL or Parquet (``.parquet`` / ``.pq``) manifest; or the rows
        themselves as a ``pyarrow.Table``, a ``datasets.Dataset`` (read by
        ``read_arrow_manifest``, no file written) or a ``ditscale.Manifest``.
      rank, world_size: this data-parallel rank and the number of ranks.
      model: model preset (``ditscale.model_presets()``) or a JSON model file.
      policy: ``"equal-token"``, ``"adaptive"`` or ``"balanced"``.
      seed, epoch: the plan is a pure function of (arguments, seed, epoch).
      cost: cost-model JSON (``ditscale fit`` writes one); None: the model's analytical H200 cost.
      bench: shape-benchmark CSV (``batch_size,seq_len,step_time_s[,peak_mem_bytes]``) to fit
        the cost (and memory) model from, as ``ditscale fit`` does; at most one of cost, bench.
      m_mem_tokens: memory constraint M_mem (tokens per micro-batch); None: from the memory model
        and ``gpu_mem_gib`` with ``mem_safety`` of it kept free.
      m_comp: compute constraint M_comp; None: chosen by the planner.
      rank_budget_s: balanced policy's per-rank predicted cost per step; None: planner default.
      tail: ``"drop"``, ``"pad"`` or ``"keep"`` (see the module docs).
      skip_bad_rows: skip and count bad manifest rows instead of raising ``ditscale.Error``.
      mode: ``"micro_batch"`` (one item per micro-batch, for ``DataLoader(batch_sampler=...)``)
        or ``"step"`` (one item per step: the list of this rank's micro-batches).
      format: ``"csv"``, ``"jsonl"``, ``"parquet"`` or ``""`` (from the file extension); for a
        path only.
      sp_degrees: None, or the sequence-parallel degrees the balanced planner may give a
        micro-batch (e.g. ``[1, 2, 4]``, as ``ditscale plan --sp-degrees``): a micro-batch of
        degree d is trained by the aligned group of ranks ``(rank // d) * d .. + d - 1``, each of
        which yields it; ``micro_batch_degrees()`` / ``cell_degrees()`` tell the degrees.

    Ranges (``ditscale/balance/sampler.h``): world_size in [1, 1048576], rank in
    [0, world_size - 1], seed in [0, 2^64 - 1], epoch in [0, 2^63 - 1], m_mem_tokens in
    [1, 2^50], gpu_mem_gib in [0.001, 1048576], mem_safety in [0, 0.99], m_comp in [0, 1e300] and
    rank_budget_s in [0, 1e9] (0 or None: chosen by the planner); sp_degrees: distinct powers of
    two in [1, 8], each dividing world_size, policy "balanced" only.

    Raises ``ValueError`` / ``TypeError`` for an argument out of range or of the wrong type,
    ``ditscale.Error`` for bad files (``file:line: column 'x': ...`` for manifest errors) and
    plans without a step.
    """

    def __init__(
        self,
        manifest,
        rank: int,
        world_size: int,
        *,
        model: str = "wan2.1-1.3b",
        policy: str = "balanced",
        seed: int = 0,
        epoch: int = 0,
        cost: Optional[str] = None,
        bench: Optional[str] = None,
        m_mem_tokens: Optional[int] = None,
        gpu_mem_gib: float = 141.0,
        mem_safety: float = 0.1,
        m_comp: Optional[float] = None,
        rank_budget_s: Optional[float] = None,
        tail: str = "drop",
        skip_bad_rows: bool = False,
        mode: str = "micro_batch",
        format: str = "",
        sp_degrees: Optional[Sequence[int]] = None,
    ):
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        # Numbers go to the binding as given: it checks their type and range (one rule with the
        # C++ side, no int()/float() that would turn 1.5 into 1 or True into 1).
        self._impl = _core._BalancedBatchSampler(
            _manifest_arg(manifest, skip_bad_rows, format),
            rank,
            world_size,
            model=os.fspath(model),
            policy=policy,
            seed=seed,
            epoch=epoch,
            cost=None if cost is None else os.fspath(cost),
            bench=None if bench is None else os.fspath(bench),
            m_mem_tokens=m_mem_tokens,
            gpu_mem_gib=gpu_mem_gib,
            mem_safety=mem_safety,
            m_comp=m_comp,
            rank_budget_s=rank_budget_s,
            tail=tail,
            skip_bad_rows=bool(skip_bad_rows),
            format=format,
            sp_degrees=sp_degrees,
        )
        self.mode = mode
        self.tail = tail
        self._resume_pending = False
        self._warn_if_dropped()

    def _warn_if_dropped(self) -> None:
        """UserWarning when the tail policy dropped more than DROPPED_WARN_FRACTION of the
        epoch's samples."""
        impl = self._impl
        planned = impl.num_planned_samples
        dropped = impl.dropped_samples
        if planned == 0 or dropped <= DROPPED_WARN_FRACTION * planned:
            return
        warnings.warn(
            f"BalancedBatchSampler: epoch {impl.epoch} drops {dropped} of {planned} samples "
            f"({dropped / planned:.1%}, more than {DROPPED_WARN_FRACTION:.0%}): tail={self.tail!r} "
            f"drops the micro-batches that cannot fill a last step on all {impl.world_size} "
            f"ranks; use tail='keep' or 'pad', fewer ranks or more samples",
            UserWarning,
            stacklevel=3,
        )

    # ---- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        """Continues from the current position; a finished epoch starts over (call set_epoch
        between epochs for a new order, as with torch's DistributedSampler)."""
        self._rewind_if_done()
        if self.mode == "step":
            return self._steps()
        return (ids for ids, _ in self._micro_batches())

    def __len__(self) -> int:
        return self._impl.num_steps if self.mode == "step" else self._impl.num_micro_batches

    def iter_steps(self) -> Iterator[List[List[int]]]:
        """One item per step: this rank's micro-batches of the step (possibly empty with
        tail="keep")."""
        self._rewind_if_done("step")
        return self._steps()

    def iter_micro_batches(self) -> Iterator[Tuple[List[int], bool]]:
        """One item per micro-batch: (ids, is_last_micro_batch_of_step)."""
        self._rewind_if_done("micro_batch")
        return self._micro_batches()

    def last_micro_batch_flags(self) -> List[bool]:
        """For each micro-batch that the next iteration will yield (from the current position,
        after the rewind of a finished epoch), whether it ends its step: call optimizer.step()
        after those."""
        counts = self._impl.micro_batches_per_step()
        state = self._impl.state()
        if not self._resume_pending and self._done("micro_batch"):
            state = {"step": 0, "micro_batch": 0}
        flags: List[bool] = []
        for k in range(state["step"], len(counts)):
            start = state["micro_batch"] if k == state["step"] else 0
            flags.extend(i + 1 == counts[k] for i in range(start, counts[k]))
        return flags

    def micro_batch_degrees(self) -> List[int]:
        """For each micro-batch that the next iteration will yield (as
        ``last_micro_batch_flags``), its sequence-parallel degree d: this rank trains it with the
        ranks ``(rank // d) * d .. + d - 1``, which yield it in the same place of their order
        (all 1 without ``sp_degrees``)."""
        state = self._impl.state()
        if not self._resume_pending and self._done("micro_batch"):
            state = {"step": 0, "micro_batch": 0}
        degrees: List[int] = []
        for k in range(state["step"], self._impl.num_steps):
            cell = self._impl.cell_degrees(k, self._impl.rank)
            degrees.extend(cell[state["micro_batch"] if k == state["step"] else 0:])
        return degrees

    def _done(self, mode: Optional[str] = None) -> bool:
        if (mode or self.mode) == "step":
            return self._impl.remaining_steps == 0
        return self._impl.remaining_micro_batches == 0

    def _rewind_if_done(self, mode: Optional[str] = None) -> None:
        if not self._resume_pending and self._done(mode):
            self._impl.reset()
        self._resume_pending = False

    def _steps(self):
        impl = self._impl
        while True:
            step = impl.next_step()
            if step is None:
                return
            yield step

    def _micro_batches(self):
        impl = self._impl
        while True:
            item = impl.next_micro_batch()
            if item is None:
                return
            yield item

    # ---- epochs and state ---------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Plans epoch ``epoch`` (GIL released while planning) and starts at its first step. On
        the current epoch it keeps the position, so it may follow load_state_dict."""
        epoch = check_int("epoch", epoch, 0, _LIMITS["max_epoch"])
        if epoch == self._impl.epoch:
            self._impl.set_epoch(epoch)
            return
        self._impl.set_epoch(epoch)
        self._resume_pending = False  # a restored position survives only the same epoch
        self._warn_if_dropped()

    def reset(self) -> None:
        """Rewinds to the first step of the current epoch."""
        self._impl.reset()
        self._resume_pending = False

    def state_dict(
        self,
        consumed_steps: Optional[int] = None,
        consumed_micro_batches: Optional[int] = None,
    ) -> dict:
        """The position to resume from: {epoch, step, micro_batch, seed, world_size, rank,
        plan_fingerprint}.

        Without arguments: where this sampler stands (exact with num_workers=0). With
        ``consumed_steps=k`` or ``consumed_micro_batches=n``: after the first k steps (n
        micro-batches of this rank) of the current epoch, what the training loop has really
        consumed when a DataLoader with workers prefetches ahead.
        """
        state = self._impl.state()
        if consumed_steps is not None and consumed_micro_batches is not None:
            raise ValueError("give consumed_steps or consumed_micro_batches, not both")
        if consumed_steps is not None:
            k = check_int("consumed_steps", consumed_steps, 0, self._impl.num_steps)
            state["step"], state["micro_batch"] = k, 0
        elif consumed_micro_batches is not None:
            n = check_int("consumed_micro_batches", consumed_micro_batches, 0,
                          self._impl.num_micro_batches)
            step, left = 0, n
            counts = self._impl.micro_batches_per_step()
            while step < len(counts) and left >= counts[step]:
                left -= counts[step]
                step += 1
            state["step"], state["micro_batch"] = step, left
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores a position saved by state_dict (re-planning its epoch if needed). Refuses
        (ValueError/TypeError naming the field) a missing, unknown, non-integer or out-of-range
        field, and (ditscale.Error) a state of another world size, seed or plan (fingerprint),
        or another rank's mid-step state; a refused state leaves the sampler as it was. The next
        iteration continues from the restored position."""
        checked = check_state_dict(state)
        epoch_before = self._impl.epoch
        self._impl.load_state(checked)
        self._resume_pending = True
        if self._impl.epoch != epoch_before:
            self._warn_if_dropped()

    # ---- properties ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._impl.rank

    @property
    def world_size(self) -> int:
        return self._impl.world_size

    @property
    def epoch(self) -> int:
        return self._impl.epoch

    @property
    def num_steps(self) -> int:
        """Steps in the epoch, equal on every rank."""
        return self._impl.num_steps

    @property
    def num_micro_batches(self) -> int:
        """This rank's micro-batches in the epoch (may differ between ranks: balanced policy)."""
        return self._impl.num_micro_batches

    @property
    def dropped_samples(self) -> int:
        return self._impl.dropped_samples

    @property
    def padded_micro_batches(self) -> int:
        return self._impl.padded_micro_batches

    @property
    def plan_summary(self) -> dict:
        """The plan of the current epoch: policy, num_steps, M_mem, M_comp, p, budget, dropped
        and padded counts, predicted compute_cv (mean over steps of std/mean across ranks of the
        predicted cost) and predicted epoch time, and the manifest's row counts."""
        return self._impl.summary()

    def micro_batches_per_step(self) -> List[int]:
        """c(k, rank) for every step k of the current epoch."""
        return self._impl.micro_batches_per_step()

    def cell(self, step: int, rank: int) -> List[List[int]]:
        """Micro-batches of any (step, rank) of the current plan, without moving the cursor;
        step in [0, num_steps - 1], rank in [0, world_size - 1] (else ValueError)."""
        return self._impl.cell(step, rank)

    def cell_degrees(self, step: int, rank: int) -> List[int]:
        """The sequence-parallel degree of each micro-batch of ``cell(step, rank)``."""
        return self._impl.cell_degrees(step, rank)

    @property
    def sp_degrees(self) -> List[int]:
        """The plan's allowed sequence-parallel degrees, ascending ([]: none)."""
        return self._impl.sp_degrees

    def __repr__(self) -> str:
        return (
            f"<ditscale.BalancedBatchSampler rank {self.rank}/{self.world_size} epoch "
            f"{self.epoch}: {self.num_steps} steps, {self.num_micro_batches} micro-batches, "
            f"mode {self.mode!r}>"
        )
