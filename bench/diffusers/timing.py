"""Timing and memory of one model step on a GPU, as a training or inference loop calls it (no
CUDA graphs: Python, autograd and dispatch included), for the diffusers benchmarks: one step
(:func:`measure`), a stock step against its variant in alternating rounds (:func:`measure_pair`),
the host waits around a step (:func:`synced_step_edges`) and the kernel time by category
(:func:`kernel_breakdown`). Timing is bench.timing's (the suite's one timer).
"""

from __future__ import annotations

from bench.timing import time_fn, time_interleaved

GiB = float(1 << 30)


def measure(step, warmup: int = 3, reps: int = 10, max_s: float = 20.0) -> dict:
    """dict(ms=median CUDA-event time of ``step()``, ms_min, ms_p90, reps, peak_gib=peak memory
    allocated during a step above what was allocated before it)."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time_fn(step, warmup=0, reps=reps, max_s=max_s, clock="cuda")
    peak = (torch.cuda.max_memory_allocated() - base) / GiB
    return {"ms": t.median_ms, "ms_min": t.min_ms, "ms_p90": t.p90_ms, "reps": t.reps,
            "peak_gib": peak}


def measure_pair(a, b, warmup: int = 3, rounds: int = 8, reps: int = 5,
                 max_s: float = 20.0) -> dict:
    """Two steps that do the same work by different code (a stock module and its variant), timed
    in alternating rounds of ``reps`` calls each (a, b, a, b, ...) after a warm-up of both, so
    that the GPU's clock ramp and a busy host hit both alike -> dict(a_ms, b_ms: medians over
    every call; ratio: the median over the rounds of b's round median / a's, rounds)."""
    res = time_interleaved([a, b], warmup=warmup, rounds=rounds, reps=reps, max_s=max_s,
                           clock="cuda")
    ta, tb = res.timings
    return {"a_ms": ta.median_ms, "b_ms": tb.median_ms, "ratio": res.ratio(0, 1),
            "rounds": len(res.round_medians)}


# Kernel-name fragments (lower case) of each category, tried in this order.
KERNEL_CATEGORIES = (
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("adaln, rotary (ditscale)", ("adaln", "rotary_kernel")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "sm90_", "splitk")),
)
OTHER = "elementwise, norms, reductions"


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, parts in KERNEL_CATEGORIES:
        if any(p in low for p in parts):
            return category
    return OTHER


def short_kernel_name(name: str, limit: int = 140) -> str:
    """A kernel's name without the namespaces that every ATen kernel repeats."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "c10::"):
        name = name.replace(noise, "")
    return name[:limit]


def kernel_breakdown(step, steps: int = 2) -> dict:
    """The GPU kernel time of ``step()`` per call by category (attention, GEMM, ditscale's AdaLN
    kernels, everything else: the elementwise, norm and reduction kernels that AdaLN fusion can
    remove at most), from torch.profiler, in ms; ``top_other``: the 8 largest kernels of the last
    category (name, ms), ``top_ours``: ditscale's 10 largest (name with its template arguments,
    ms, calls per step), ``idle`` (ms per step when no kernel runs) and ``top_gaps`` (the longest
    of those gaps: ms, the kernels before and after)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = {c: 0.0 for c, _ in KERNEL_CATEGORIES}
    out[OTHER] = 0.0
    other, ours = {}, {}
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    for e in kernels:
        us = getattr(e, "device_time", None)
        if us is None:
            us = e.cuda_time
        category = kernel_category(e.name)
        out[category] += us / 1e3 / steps
        if category == OTHER:
            key = short_kernel_name(e.name)
            other[key] = other.get(key, 0.0) + us / 1e3 / steps
        elif category == KERNEL_CATEGORIES[1][0]:
            ms, calls = ours.get(short_kernel_name(e.name, 160), (0.0, 0))
            ours[short_kernel_name(e.name, 160)] = (ms + us / 1e3 / steps, calls + 1)
    out["total"] = sum(out.values())
    out["top_other"] = sorted(other.items(), key=lambda kv: -kv[1])[:8]
    out["top_ours"] = [(name, ms, calls // steps) for name, (ms, calls)
                       in sorted(ours.items(), key=lambda kv: -kv[1][0])[:10]]
    out.update(idle_gaps(kernels, steps))
    return out


def idle_gaps(kernels, steps: int) -> dict:
    """The GPU's idle time between the profiled kernels: ``idle`` (ms per step: the span from the
    first kernel's start to the last one's end less the time some kernel ran) and ``top_gaps``,
    the 8 longest gaps as (ms, kernel before, kernel after). Kernels on several streams may
    overlap; a gap is time when none runs."""
    spans = sorted((e.time_range.start, e.time_range.end, short_kernel_name(e.name, 60))
                   for e in kernels)
    if not spans:
        return {"idle": 0.0, "top_gaps": []}
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = spans[0]
    for start, end, name in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append(((start - cur_end) / 1e3, cur_name, name))
            cur_start = start
        if end >= cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    span = cur_end - spans[0][0]
    return {"idle": (span - busy) / 1e3 / steps,
            "top_gaps": sorted(gaps, key=lambda g: -g[0])[:8]}


MARKERS = ("spin", "sleep")  # torch.cuda._sleep's kernel: the markers of synced_step_edges


def synced_step_edges(step, steps: int = 3) -> dict:
    """What a timed step (``bench.timing``'s cuda clock: the GPU idle when it starts,
    synchronised after it) spends with the GPU waiting on the host at its two ends, which
    ``idle`` (measured over back-to-back steps) does not see: each step runs alone between two
    marker kernels (``torch.cuda._sleep``, launched just before and just after ``step()``), and
    ``marker_edges`` reads the profile -> dict(lead, tail: ms per step)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            torch.cuda._sleep(1000)
            step()
            torch.cuda._sleep(1000)
        torch.cuda.synchronize()
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == DeviceType.CUDA]
    return marker_edges(spans)


def marker_edges(spans) -> dict:
    """From (start us, end us, name) kernel spans where each step's kernels sit between a pair of
    marker kernels (a name containing one of MARKERS): ``lead``, the mean ms from the opening
    marker's end to the step's first kernel (the host's work before its first launch), and
    ``tail``, from the step's last kernel end to the closing marker's start (host work after its
    last launch);
    a step without kernels counts its whole gap as lead."""
    spans = sorted(spans)
    marks = [i for i, (_, _, name) in enumerate(spans)
             if any(m in name.lower() for m in MARKERS)]
    if len(marks) < 2 or len(marks) % 2:
        raise ValueError(f"marker_edges: {len(marks)} marker kernels, expected pairs")
    leads, tails = [], []
    for a, b in zip(marks[::2], marks[1::2]):
        inner = spans[a + 1:b]
        if not inner:
            leads.append(spans[b][0] - spans[a][1])
            tails.append(0.0)
            continue
        leads.append(max(0.0, inner[0][0] - spans[a][1]))
        tails.append(max(0.0, spans[b][0] - max(e for _, e, _ in inner)))
    n = len(leads)
    return {"lead": sum(leads) / n / 1e3, "tail": sum(tails) / n / 1e3}


def rel_l2(a, b) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
