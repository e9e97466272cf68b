#!/usr/bin/env python3
"""Benchmark of the fused AdaLN op on one GPU against eager PyTorch, torch.compile and a copy.

    python -m bench.adaln.bench_adaln [--out bench/results/adaln_h200_2026-12.md] [--quick]

x [B, N, D] bf16 with per-sample modulation, B in {1, 2}, N in {4096, 16384, 65536}, D in
{1536, 3072, 5120}: forward, forward+backward (CUDA-graph replays and as called) and forward
peak memory, in markdown tables printed last and written to --out. The workload, columns and
targets: docs/diffusers/benchmarks.md.
"""

import argparse
import os
import sys
import time

import torch

from bench import reporter
from bench.timing import time_fn
from ditscale import ops

MiB = 1024.0 * 1024.0


class Timer:
    """Median CUDA-event time of fn (bench.timing), with an L2 flush (a 256 MiB memset) before
    each rep.

    fn is captured once into a CUDA graph (after warm-up) and the graph's replays are timed, so
    the numbers are GPU time without Python/autograd launch overhead (which otherwise dominates
    small shapes: a fwd+bwd through autograd costs ~0.5 ms of CPU time whatever the kernels).
    If capture fails, fn is timed directly and `graph_failures` counts it.
    """

    def __init__(self, warmup, reps, max_s):
        self.warmup, self.reps, self.max_s = warmup, reps, max_s
        self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        self.graph_failures = 0

    def _capture(self, fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._keep = fn()
        except Exception as e:  # noqa: BLE001 - report and fall back to direct timing
            print(f"[timer] CUDA graph capture failed ({type(e).__name__}: {e}); timing directly",
                  file=sys.stderr)
            self.graph_failures += 1
            torch.cuda.synchronize()
            return None
        return graph.replay

    def __call__(self, fn, graph=True):
        run = (self._capture(fn) if graph else None) or fn
        t = time_fn(run, warmup=self.warmup, reps=self.reps, max_s=self.max_s,
                    min_reps=min(5, self.reps), clock="cuda", before_each=self.flush.zero_)
        self._keep = None
        return t.median_ms


def peak_above_inputs_mib(fn):
    """Peak memory allocated while fn runs, above what was allocated before, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / MiB


def make_inputs(B, N, D, requires_grad):
    g = torch.Generator(device="cuda").manual_seed(B * 1000003 + N * 31 + D)
    x = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    mod = 0.1 * torch.randn(B, 6, D, device="cuda", dtype=torch.bfloat16, generator=g)
    x.requires_grad_(requires_grad)
    mod.requires_grad_(requires_grad)
    return x, mod


def fwd_bwd_step(f, x, mod, dy):
    """One forward+backward of the AdaLN function f, as a DiT block calls it: scale and shift are
    rows 1 and 0 of the [B, 6, D] modulation; gradients of x and the whole modulation."""

    def run():
        out = f(x, mod[:, 1], mod[:, 0])
        return torch.autograd.grad(out, (x, mod), dy)

    return run


def bench_shape(B, N, D, timer, compiled, with_compile):
    row = {"B": B, "N": N, "D": D}
    # ---- forward (no autograd) ----
    x, mod = make_inputs(B, N, D, False)
    shift, scale = mod[:, 0], mod[:, 1]
    y = torch.empty_like(x)
    impls = {"ours": ops.adaln, "eager": ops.adaln_reference}
    if with_compile:
        impls["compile"] = compiled
    with torch.no_grad():
        # Every forward column is the faster of a CUDA-graph replay and a direct call: a replay
        # pays the graph's launch on the GPU (measured slower than a direct copy_ of the largest
        # tensors), a direct call queued behind the L2 flush does not, and its CPU dispatch hides
        # behind the flush (a 256 MiB memset).
        for name, f in impls.items():
            run = lambda f=f: f(x, scale, shift)  # noqa: E731
            row[f"fwd_{name}"] = min(timer(run), timer(run, graph=False))
        row["fwd_copy"] = min(timer(lambda: y.copy_(x)), timer(lambda: y.copy_(x), graph=False))
        # correctness guard: ours vs eager on this shape (bf16 rounding only)
        ref = ops.adaln_reference(x.float(), scale.float(), shift.float())
        err = ((ops.adaln(x, scale, shift).float() - ref).norm() / ref.norm()).item()
        row["rel_err"] = err
    del y, ref
    # ---- forward + backward ----
    x, mod = make_inputs(B, N, D, True)
    dy = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd(f):
        return fwd_bwd_step(f, x, mod, dy)

    for name, f in impls.items():
        row[f"fb_{name}"] = timer(fwd_bwd(f))
        # as a training step calls it: no CUDA graph, Python + autograd dispatch included
        row[f"fbd_{name}"] = timer(fwd_bwd(f), graph=False)
    row["fb_copy"] = 2.5 * row["fwd_copy"]
    # ---- forward peak memory above the inputs (inputs require grad) ----
    row["out_mib"] = x.numel() * x.element_size() / MiB
    for name, f in impls.items():
        row[f"mem_{name}"] = peak_above_inputs_mib(lambda f=f: f(x, mod[:, 1], mod[:, 0]))
    del x, mod, dy
    torch.cuda.empty_cache()
    return row


def compile_shape(B, N, D, compiled):
    """Runs the compiled forward (no grad) and forward+backward once for one shape."""
    x, mod = make_inputs(B, N, D, False)
    with torch.no_grad():
        compiled(x, mod[:, 1], mod[:, 0])
    x, mod = make_inputs(B, N, D, True)
    out = compiled(x, mod[:, 1], mod[:, 0])
    torch.autograd.grad(out, (x, mod), torch.ones_like(out))
    torch.cuda.synchronize()
    del x, mod, out
    torch.cuda.empty_cache()


def warm_cache(shapes, jobs):
    """Compiles the shapes in `jobs` child processes so the timed run hits inductor's caches."""
    import subprocess

    t0 = time.monotonic()
    procs, bad = [], 0
    for B, N, D in shapes:  # one process per shape, at most `jobs` at a time
        if len(procs) >= jobs:
            bad += procs.pop(0).wait() != 0
        cmd = [sys.executable, os.path.abspath(__file__), "--compile-only",
               "--B", str(B), "--N", str(N), "--D", str(D)]
        procs.append(subprocess.Popen(cmd))
    bad += sum(p.wait() != 0 for p in procs)
    print(f"[warm-cache] compiled {len(shapes)} shapes, {jobs} processes at a time, "
          f"{time.monotonic() - t0:.1f} s, {bad} failed", flush=True)


def fmt(v, nd=3):
    return "n/a" if v is None else f"{v:.{nd}f}"


def ratio(num, den):
    return "n/a" if num is None else f"{num / den:.2f}x"


def _comp(r, k):
    return r.get(f"{k}_compile")


def forward_table(rows):
    gb = lambda r: 2 * r["B"] * r["N"] * r["D"] * 2 / 1e9  # noqa: E731  read x + write y
    out = [
        "### Forward (ms)",
        "",
        "| B | N | D | ours | eager | compile | copy | % of copy | eager/ours | compile/ours "
        "| ours GB/s | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = _comp(r, "fwd")
        out.append(
            f"| {r['B']} | {r['N']} | {r['D']} | {fmt(r['fwd_ours'])} | {fmt(r['fwd_eager'])} "
            f"| {fmt(c)} | {fmt(r['fwd_copy'])} | {100 * r['fwd_copy'] / r['fwd_ours']:.0f}% "
            f"| {r['fwd_eager'] / r['fwd_ours']:.2f}x "
            f"| {ratio(c, r['fwd_ours'])} | {gb(r) / r['fwd_ours'] * 1e3:.0f} "
            f"| {r['rel_err']:.1e} |"
        )
    return out


def fwd_bwd_table(rows):
    out = [
        "### Forward + backward (ms)",
        "",
        "| B | N | D | ours | eager | compile | 2.5x copy | % of limit | eager/ours "
        "| compile/ours |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = _comp(r, "fb")
        out.append(
            f"| {r['B']} | {r['N']} | {r['D']} | {fmt(r['fb_ours'])} | {fmt(r['fb_eager'])} "
            f"| {fmt(c)} | {fmt(r['fb_copy'])} | {100 * r['fb_copy'] / r['fb_ours']:.0f}% "
            f"| {r['fb_eager'] / r['fb_ours']:.2f}x | {ratio(c, r['fb_ours'])} |"
        )
    return out


def as_called_table(rows):
    out = [
        "### Forward + backward as called (ms; no CUDA graph: Python and autograd dispatch "
        "included, how a training step without graphs sees it)",
        "",
        "| B | N | D | ours | eager | compile | eager/ours | compile/ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = _comp(r, "fbd")
        out.append(
            f"| {r['B']} | {r['N']} | {r['D']} | {fmt(r['fbd_ours'])} | {fmt(r['fbd_eager'])} "
            f"| {fmt(c)} | {r['fbd_eager'] / r['fbd_ours']:.2f}x | {ratio(c, r['fbd_ours'])} |"
        )
    return out


def memory_table(rows):
    out = [
        "### Forward peak memory above the inputs (MiB, inputs require grad)",
        "",
        "| B | N | D | output | ours | ours - output | eager | compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['B']} | {r['N']} | {r['D']} | {r['out_mib']:.1f} | {r['mem_ours']:.2f} "
            f"| {r['mem_ours'] - r['out_mib']:.3f} | {r['mem_eager']:.1f} "
            f"| {fmt(r.get('mem_compile'), 1)} |"
        )
    return out


def targets_line(rows, with_compile):
    """The targets: speed at N >= 16384, memory everywhere."""
    mem_extra = max((r["mem_ours"] - r["out_mib"]) * MiB / (r["B"] * r["N"]) for r in rows)
    line = f"Forward memory above the output: max {mem_extra:.2f} bytes/row (target 8)."
    big = [r for r in rows if r["N"] >= 16384]
    if big:
        fwd_pct = min(100 * r["fwd_copy"] / r["fwd_ours"] for r in big)
        vs_eager = min(r["fb_eager"] / r["fb_ours"] for r in big)
        line += (
            f" At N >= 16384: forward >= 85% of copy: min {fwd_pct:.0f}%; fwd+bwd >= 4x eager: "
            f"min {vs_eager:.2f}x"
        )
        if with_compile:
            vs_comp = min(r["fb_compile"] / r["fb_ours"] for r in big)
            vs_comp_d = min(r["fbd_compile"] / r["fbd_ours"] for r in big)
            line += (f"; fwd+bwd >= 2x compile: min {vs_comp:.2f}x (graph replays), "
                     f"{vs_comp_d:.2f}x (as called)")
        line += "."
    return line


def tables(rows, with_compile, header):
    out = [header, ""]
    for table in (forward_table, fwd_bwd_table, as_called_table, memory_table):
        out += table(rows) + [""]
    out.append(targets_line(rows, with_compile))
    return "\n".join(out) + "\n"


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the markdown tables here")
    p.add_argument("--B", type=int, nargs="+", default=[1, 2])
    p.add_argument("--N", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--D", type=int, nargs="+", default=[1536, 3072, 5120])
    p.add_argument("--quick", action="store_true", help="B=1, N=16384, D=3072 only")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--max-s", type=float, default=1.0, help="time cap per measurement")
    p.add_argument(
        "--warm-cache",
        type=int,
        default=0,
        metavar="J",
        help="compile every shape's torch.compile graphs first in J parallel processes (fills "
        "inductor's on-disk caches, so the timed process only traces); compile time is not timed",
    )
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    return p


def run_shapes(a, timer, compiled, with_compile, header):
    """Every shape's row, the tables rewritten to --out after each (a run cut short keeps its
    rows); the final text."""
    rows = []
    text = ""
    t0 = time.monotonic()
    for B in a.B:
        for N in a.N:
            for D in a.D:
                r = bench_shape(B, N, D, timer, compiled, with_compile)
                rows.append(r)
                print(
                    f"[{time.monotonic() - t0:6.1f}s] B={B} N={N} D={D}: fwd ours "
                    f"{r['fwd_ours']:.3f} eager {r['fwd_eager']:.3f} compile "
                    f"{fmt(r.get('fwd_compile'))} copy {r['fwd_copy']:.3f} | fwd+bwd ours "
                    f"{r['fb_ours']:.3f} eager {r['fb_eager']:.3f} compile "
                    f"{fmt(r.get('fb_compile'))} | mem ours {r['mem_ours']:.1f} MiB",
                    flush=True,
                )
                text = tables(rows, with_compile, header)
                if a.out:
                    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
                    with open(a.out, "w") as f:
                        f.write(text)
    return text


def main(argv=None):
    a = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_adaln: no CUDA device", file=sys.stderr)
        return 2
    if not ops.is_available():
        print(f"bench_adaln: {ops.load_error()}", file=sys.stderr)
        return 2
    if a.quick:
        a.B, a.N, a.D = [1], [16384], [3072]
    with_compile = not a.no_compile
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.recompile_limit = 256
    compiled = torch.compile(ops.adaln_reference, dynamic=False) if with_compile else None
    shapes = [(B, N, D) for B in a.B for N in a.N for D in a.D]
    if a.compile_only:
        for B, N, D in shapes:
            compile_shape(B, N, D, compiled)
        return 0
    if with_compile and a.warm_cache > 0:
        warm_cache(shapes, a.warm_cache)
    timer = Timer(a.warmup, a.reps, a.max_s)
    header = "\n".join(reporter.header_lines(
        "Fused AdaLN, bf16, per-sample modulation, LayerNorm")) + "\n" + (
        f"CUDA {torch.version.cuda}; median CUDA-event times (bench.timing) with L2 flushed; "
        "forward: the faster of a CUDA-graph replay and a direct call, forward+backward: "
        "CUDA-graph replays (launch overhead excluded); copy = `y.copy_(x)`."
    )
    text = run_shapes(a, timer, compiled, with_compile, header)
    if timer.graph_failures:
        text += (f"\nCUDA-graph capture failed {timer.graph_failures} times; those cells were "
                 "timed directly (launch overhead included).\n")
        if a.out:
            with open(a.out, "w") as f:
                f.write(text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
