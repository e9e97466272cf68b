"""Diagnosis steps of bench_sp_attention.py (--profile, --timeline): where one step's GPU time goes
(torch.profiler, rank 0's top kernels) and when each unit of a ditscale schedule ran on every
rank's GPU (ditscale.sp.timeline). Neither is timed; both run after the timing of a
configuration. `b` is the benchmark's Bench (its process group, mesh and rank)."""

from __future__ import annotations

from typing import Callable


def profile_step(b, cfg, seq: int, step, log: Callable[[str], None]) -> None:
    """One step under torch.profiler: where the GPU time of this configuration goes."""
    torch = b.torch
    from torch.profiler import ProfilerActivity, profile

    b.dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    b.dist.barrier()
    if b.rank != 0:
        return
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    log(f"profile {cfg.name} S={seq}: {total / 1e3:.2f} ms of GPU kernels and copies "
        "(all streams, summed)")
    for t, n, k in rows[:10]:
        log(f"    {t / 1e3:9.3f} ms  x{n:<4d} {k[:110]}")


def timeline_step(b, cfg, seq: int, step, log: Callable[[str], None]) -> None:
    """One traced step: when each unit of the schedule ran on every rank's GPU."""
    sp = b.sp
    mesh = b.mesh(cfg.mesh)
    sp.set_trace(mesh, True)
    try:
        step()
        chunks = cfg.chunks if cfg.strategy == "torus" else None  # as step() ran it
        text = sp.timeline(mesh, cfg.strategy, chunks=chunks, transport=cfg.transport)
    finally:
        sp.set_trace(mesh, False)
    texts = [None] * b.world
    b.dist.all_gather_object(texts, text)
    if b.rank == 0:
        log(f"timeline {cfg.name} S={seq}:")
        for t in texts:
            for line in (t or "(no traced layer)\n").splitlines():
                log("    " + line)
