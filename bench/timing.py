"""The one timer of every benchmark (bench/README.md): warm-up, repetitions, median, min and p90.

``time_fn(fn, warmup=, reps=, clock=)`` times ``calls`` calls of ``fn`` per sample -> ``Timing``
(milliseconds per call). Clocks: ``cuda`` (CUDA events on the current stream: GPU time),
``wall`` (``time.perf_counter``: host time; ``sync`` is called before and after the calls when the
work is asynchronous), ``thread`` (``time.thread_time``: this thread's CPU time). The default is
``cuda`` when a CUDA device is there, else ``wall``. ``time_interleaved`` times several functions
in alternating rounds, so that clock drift and a busy host hit all of them alike. Multi-rank
benchmarks pass ``before_each`` (a barrier) and ``reduce`` (the max over ranks).

torch is imported only for the ``cuda`` clock, so CPU-side scripts import this without it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from ditscale._checks import check_int, check_real

CLOCKS = ("cuda", "wall", "thread")
MAX_REPS = 1_000_000
MAX_S = 86_400.0


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) by linear interpolation between the closest ranks
    (numpy's default rule)."""
    check_real("q", q, 0.0, 100.0)
    if not samples:
        raise ValueError("percentile: no samples")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    """The samples of one timed function, in milliseconds per call, and the clock they used."""

    samples_ms: tuple
    clock: str

    @property
    def reps(self) -> int:
        return len(self.samples_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def p90_ms(self) -> float:
        return percentile(self.samples_ms, 90.0)

    def summary(self) -> dict:
        """median_ms, min_ms, p90_ms, reps and clock: the row every benchmark reports."""
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "p90_ms": self.p90_ms,
                "reps": self.reps, "clock": self.clock}


@dataclass(frozen=True)
class Interleaved:
    """``time_interleaved``'s result: a Timing per function and, per round, each function's
    median of that round."""

    timings: List[Timing]
    round_medians: List[List[float]]

    def ratio(self, base: int, other: int) -> float:
        """The median over the rounds of other's round median / base's: a paired ratio."""
        return statistics.median(r[other] / r[base] for r in self.round_medians)


def default_clock() -> str:
    """``cuda`` when torch sees a CUDA device, else ``wall``."""
    try:
        import torch
    except ImportError:
        return "wall"
    return "cuda" if torch.cuda.is_available() else "wall"


def _sampler(clock: str, sync: Optional[Callable[[], None]]):
    """fn, calls -> milliseconds per call of one sample on `clock`."""
    if clock == "cuda":
        import torch

        def cuda_sample(fn, calls):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / calls

        return cuda_sample
    now = time.perf_counter if clock == "wall" else time.thread_time

    def host_sample(fn, calls):
        if sync is not None:
            sync()
        t0 = now()
        for _ in range(calls):
            fn()
        if sync is not None:
            sync()
        return (now() - t0) * 1e3 / calls

    return host_sample


def _settings(clock, warmup, reps, calls, max_s, min_reps, reps_name):
    """The checked settings: (clock, min_reps, max_s or None)."""
    clock = default_clock() if clock is None else clock
    if clock not in CLOCKS:
        raise ValueError(f"clock: {clock!r} is not one of {', '.join(CLOCKS)}")
    check_int("warmup", warmup, 0, MAX_REPS)
    check_int(reps_name, reps, 1, MAX_REPS)
    check_int("calls", calls, 1, MAX_REPS)
    min_reps = min(3, reps) if min_reps is None else check_int(f"min_{reps_name}", min_reps, 1,
                                                               reps)
    if max_s is not None:
        max_s = check_real("max_s", max_s, 1e-6, MAX_S)
    if clock == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("clock: 'cuda' needs a CUDA device; use 'wall' or 'thread'")
    return clock, min_reps, max_s


def _warmed_up(clock: str, max_s: Optional[float]) -> Optional[float]:
    """After the warm-up: the GPU drained; the deadline of the timed part (or None)."""
    if clock == "cuda":
        import torch

        torch.cuda.synchronize()
    return None if max_s is None else time.perf_counter() + max_s


def time_fn(fn: Callable[[], object], *, warmup: int = 3, reps: int = 10,
            clock: Optional[str] = None, calls: int = 1, max_s: Optional[float] = None,
            min_reps: Optional[int] = None, before_each: Optional[Callable[[], None]] = None,
            reduce: Optional[Callable[[float], float]] = None,
            sync: Optional[Callable[[], None]] = None) -> Timing:
    """``warmup`` calls of fn, then ``reps`` samples of ``calls`` calls each (fewer when
    ``max_s`` seconds have passed and ``min_reps`` samples are taken, default min(3, reps)).
    ``before_each`` runs before each sample, outside the timed span (an L2 flush, a barrier);
    ``reduce`` maps each sample (a max over ranks)."""
    clock, min_reps, max_s = _settings(clock, warmup, reps, calls, max_s, min_reps, "reps")
    for _ in range(warmup):
        fn()
    deadline = _warmed_up(clock, max_s)
    sample = _sampler(clock, sync)
    out = []
    for _ in range(reps):
        if before_each is not None:
            before_each()
        ms = sample(fn, calls)
        out.append(reduce(ms) if reduce is not None else ms)
        if deadline is not None and len(out) >= min_reps and time.perf_counter() > deadline:
            break
    return Timing(tuple(out), clock)


def time_interleaved(fns: Sequence[Callable[[], object]], *, warmup: int = 3, rounds: int = 7,
                     reps: int = 1, clock: Optional[str] = None, calls: int = 1,
                     max_s: Optional[float] = None, min_rounds: Optional[int] = None,
                     before_each: Optional[Callable[[], None]] = None,
                     sync: Optional[Callable[[], None]] = None) -> Interleaved:
    """Each of ``fns`` warmed up ``warmup`` times (in turn), then ``rounds`` rounds in which
    each takes ``reps`` samples of ``calls`` calls in turn (a, a, b, b, a, a, ...)."""
    if not fns:
        raise ValueError("fns: no function to time")
    clock, min_rounds, max_s = _settings(clock, warmup, rounds, calls, max_s, min_rounds,
                                         "rounds")
    check_int("reps", reps, 1, MAX_REPS)
    for _ in range(warmup):
        for fn in fns:
            fn()
    deadline = _warmed_up(clock, max_s)
    sample = _sampler(clock, sync)
    samples = [[] for _ in fns]
    round_medians = []
    for _ in range(rounds):
        medians = []
        for i, fn in enumerate(fns):
            got = []
            for _ in range(reps):
                if before_each is not None:
                    before_each()
                got.append(sample(fn, calls))
            samples[i] += got
            medians.append(statistics.median(got))
        round_medians.append(medians)
        if (deadline is not None and len(round_medians) >= min_rounds
                and time.perf_counter() > deadline):
            break
    return Interleaved([Timing(tuple(s), clock) for s in samples], round_medians)
