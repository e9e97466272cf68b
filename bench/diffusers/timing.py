"""Timing and memory of one model step on a GPU, as a training or inference loop calls it (no
CUDA graphs: Python, autograd and dispatch included), for the diffusers benchmarks.

``measure(step, warmup, reps, max_s)`` -> dict(ms=median CUDA-event time of ``step()``,
ms_min, reps, peak_gib=peak memory allocated during a step above what was allocated before it).
"""

from __future__ import annotations

import statistics
import time

GiB = float(1 << 30)


def measure(step, warmup: int = 3, reps: int = 10, max_s: float = 20.0) -> dict:
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    deadline = time.perf_counter() + max_s
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if i >= 2 and time.perf_counter() > deadline:
            break
    peak = (torch.cuda.max_memory_allocated() - base) / GiB
    return {"ms": statistics.median(times), "ms_min": min(times), "reps": len(times),
            "peak_gib": peak}


def rel_l2(a, b) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
