"""One ``ditscale.train`` run in this process, and what the benchmark reads from its metrics.

``train_run(name, argv, dataset)`` runs ``ditscale.train.loop.run`` on the flags ``argv`` (a
fresh single-process group each time; ``dataset`` None: the store) and returns a ``RunResult``:
its metrics lines, the peak GPU memory (``torch.cuda.max_memory_allocated``, None on CPU), and
the checkpoints removed afterwards (the benchmark keeps only the metrics). ``throughput`` is the
steady state: the tokens over the step times of the steps after ``warmup``, and the step times
as a ``bench.timing.Timing``. Metrics fields: docs/train.md#logs.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
from typing import List, Optional

import torch

from bench.timing import Timing

_GROUP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass
class RunResult:
    name: str
    metrics: List[dict]
    peak_gib: Optional[float]

    def ids(self) -> List[list]:
        return [m["samples"] for m in self.metrics]

    def losses(self) -> List[float]:
        return [float(m["loss"]) for m in self.metrics]


@dataclasses.dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    samples_per_s: float
    steps: int
    step_time: Timing
    data_wait_s: float          # the steps' total wait for the loader


def read_metrics(out: str) -> List[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_run(name: str, argv: List[str], out: str, dataset=None) -> RunResult:
    """Trains ``argv`` (``ditscale.train`` flags; ``--out`` is added) in this process."""
    from ditscale.train.config import load_config
    from ditscale.train.loop import run

    for k in _GROUP_ENV:            # a new group per run (each run ends its own)
        os.environ.pop(k, None)
    cfg = load_config([*argv, "--out", out])
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if cuda:
        gc.collect()                # the previous run's model and optimizer
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    status = run(cfg, dataset=dataset)
    if status != 0:
        raise RuntimeError(f"train run {name!r} ended with status {status} (see {out})")
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    return RunResult(name, read_metrics(out), peak)


def throughput(r: RunResult, warmup: int) -> Throughput:
    """Steady-state rates over the steps after the first ``warmup`` ones."""
    steps = r.metrics[warmup:]
    if not steps:
        raise ValueError(f"--warmup-steps: {warmup} leaves no step of run {r.name!r} "
                         f"({len(r.metrics)} steps) to measure")
    seconds = sum(m["step_time_s"] for m in steps)
    samples = sum(len(m["samples"]) for m in steps)
    timing = Timing(tuple(m["step_time_s"] * 1e3 for m in steps), "wall")
    return Throughput(sum(m["tokens"] for m in steps) / seconds, samples / seconds,
                      len(steps), timing, sum(m["data_wait_s"] for m in steps))
