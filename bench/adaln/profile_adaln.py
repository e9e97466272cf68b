#!/usr/bin/env python3
"""Per-kernel GPU times of one forward+backward of the fused AdaLN op and of torch.compile.

    python -m bench.adaln.profile_adaln [--shapes 1:16384:1536 1:65536:1536 ...] [--out FILE]

Same workload as bench_adaln.py (x [B, N, D] bf16, scale/shift as chunks of a [B, 6, D] tensor,
both requiring grad, LayerNorm, eps 1e-6). Each forward+backward is captured into a CUDA graph
and replayed under torch.profiler (CUPTI), with L2 flushed before every replay; the table lists
every kernel of one replay (mean over the replays) and their sum. It also times two references
for the backward's own speed-of-light: y.copy_(x) (read one, write one) and
torch.add(x, dy, out=dx) (read two, write one: the backward's mix of reads and writes).
The tables are printed and written to --out (markdown).
"""

import argparse
import datetime
import os
import sys

import torch

from ditscale import ops

from bench import reporter
from bench.adaln.bench_adaln import Timer, fwd_bwd_step, make_inputs


def parse_shape(text):
    try:
        b, n, d = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape '{text}' is not B:N:D") from None
    if b < 1 or n < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"shape '{text}': B, N and D must be positive")
    return b, n, d


def kernel_times(run, flush, reps):
    """{kernel name: (launches per replay, microseconds per replay)} of `run` (a graph replay)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.bitwise_not_()  # the flush kernel is the only bitwise_not in the trace
            run()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = ev.cuda_time_total
        if t <= 0 or "bitwise_not" in ev.key:
            continue
        calls, us = out.get(ev.key, (0, 0.0))
        out[ev.key] = (calls + ev.count / reps, us + t / reps)
    return out


def profile_shape(B, N, D, timer, compiled, reps):
    x, mod = make_inputs(B, N, D, True)
    dy = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)
    rows = {}
    for name, f in (("ours", ops.adaln), ("compile", compiled)):
        replay = timer._capture(fwd_bwd_step(f, x, mod, dy))
        if replay is None:
            raise RuntimeError(f"{name}: CUDA graph capture failed")
        for _ in range(timer.warmup):
            replay()
        rows[name] = kernel_times(replay, timer.flush, reps)
        timer._keep = None
    y = torch.empty_like(x)
    dx = torch.empty_like(x)
    with torch.no_grad():
        xd = x.detach()
        copy_ms = timer(lambda: y.copy_(xd))
        add_ms = timer(lambda: torch.add(xd, dy, out=dx))
    nbytes = x.numel() * x.element_size()
    return rows, copy_ms, add_ms, nbytes


def short(name, width=90):
    name = " ".join(name.split())
    return name if len(name) <= width else name[: width - 3] + "..."


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=parse_shape, nargs="+",
                   default=[(1, 16384, 1536), (1, 65536, 1536)])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", help="write the markdown here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_adaln: no CUDA device, nothing to do")
        return 0
    # With programmatic dependent launch a kernel starts early and waits for the one before it,
    # so its span would include that wait; per-kernel times need it off (read at the first op).
    pdl_note = "programmatic dependent launch on (DITSCALE_ADALN_TUNING set by the caller)"
    if "DITSCALE_ADALN_TUNING" not in os.environ:
        os.environ["DITSCALE_ADALN_TUNING"] = "pdl=0"
        pdl_note = ("programmatic dependent launch off (DITSCALE_ADALN_TUNING=pdl=0: with it, a "
                    "kernel's span would include its wait for the previous kernel); "
                    "bench_adaln.py times the default, PDL on")
    timer = Timer(warmup=3, reps=args.reps, max_s=1.0)
    compiled = torch.compile(ops.adaln_reference, dynamic=False)
    lines = [f"## Kernels of one forward+backward (CUDA-graph replay, L2 flushed), "
             f"{torch.cuda.get_device_name()}",
             "",
             f"torch {torch.__version__}, {datetime.date.today()}; "
             f"`python -m bench.adaln.profile_adaln`; microseconds per replay, mean of "
             f"{args.reps} replays (torch.profiler); {pdl_note}.",
             ""]
    for B, N, D in args.shapes:
        print(f"[profile] B={B} N={N} D={D}", flush=True)
        rows, copy_ms, add_ms, nbytes = profile_shape(B, N, D, timer, compiled, args.reps)
        lines += [f"### B={B} N={N} D={D}", "",
                  f"copy (read 1, write 1) {copy_ms * 1e3:.1f} us = "
                  f"{2 * nbytes / copy_ms / 1e6:.0f} GB/s; add (read 2, write 1) "
                  f"{add_ms * 1e3:.1f} us = {3 * nbytes / add_ms / 1e6:.0f} GB/s; "
                  f"limits: forward = copy, backward = add, forward+backward = copy + add "
                  f"= {(copy_ms + add_ms) * 1e3:.1f} us", ""]
        for name, kernels in rows.items():
            total = sum(us for _, us in kernels.values())
            lines += [f"{name}: {total:.1f} us in {sum(c for c, _ in kernels.values()):.0f} "
                      f"kernels ({(copy_ms + add_ms) * 1e3 / total:.0%} of the copy + add limit)",
                      "", "| kernel | launches | us |", "|---|---|---|"]
            for key, (calls, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
                lines.append(f"| {short(key)} | {calls:.0f} | {us:.1f} |")
            lines.append("")
        torch.cuda.empty_cache()
    text = "\n".join(reporter.header_lines("Kernels of one fused AdaLN forward+backward")
                     + lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
