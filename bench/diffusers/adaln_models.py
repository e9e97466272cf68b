#!/usr/bin/env python3
"""Stock diffusers transformers against ``ditscale.diffusers.apply_fused_adaln`` on one GPU:
bf16, forward+backward of a few blocks at the models' typical token counts, eager and under
regional torch.compile (every block compiled, as diffusers' ``compile_repeated_blocks`` does),
time and peak memory in one run.

    python -m bench.diffusers.adaln_models [--models wan2.1-1.3b,flux] [--tokens 1024,32760]
        [--blocks 4] [--modes eager,compile] [--out-dir DIR]

Writes DIR/adaln-models.md (+ .json). The rounds, columns and why attention runs on one SDPA
backend (``--sdpa``, default flash): docs/diffusers/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import gc
import sys

from bench.diffusers import cli
from bench.diffusers import models as M
from bench.diffusers.timing import (GiB, OTHER, kernel_breakdown, measure_pair, rel_l2,
                                    synced_step_edges)


def blocks_of(model):
    """The repeated block lists of a diffusers transformer (the regions to compile)."""
    names = ("transformer_blocks", "single_transformer_blocks", "blocks")
    return [b for n in names for b in getattr(model, n, [])]


def build(name, blocks, fused, compiled, dtype, dev):
    import ditscale.diffusers as dd

    model, _ = M.make(name, blocks, dtype, dev)
    model.train()
    if fused:
        dd.apply_fused_adaln(model)
    if compiled:
        for b in blocks_of(model):
            b.compile()
    return model


class Variant:
    """A built model (stock or fused, eager or compiled), its inputs and ``step()``: forward,
    ``out.backward(dy)``, gradients zeroed (``set_to_none``)."""

    def __init__(self, name, tokens, blocks, fused, compiled, dtype, dev):
        import torch

        self.model = build(name, blocks, fused, compiled, dtype, dev)
        self.kw = M.inputs(name, self.model, tokens, 1, dtype, dev, seed=1)
        self.kw["hidden_states"].requires_grad_(True)
        with torch.no_grad():
            probe = self.model(**self.kw)[0]  # (its shape only)
        self.dy = torch.randn(probe.shape, generator=torch.Generator(device=dev).manual_seed(2),
                              device=dev, dtype=probe.dtype)

    def step(self):
        out = self.model(**self.kw)[0]
        out.backward(self.dy)
        self.model.zero_grad(set_to_none=True)
        self.kw["hidden_states"].grad = None

    def output(self):
        import torch

        with torch.no_grad():
            return self.model(**self.kw)[0].float().cpu()


def peak_gib(v: Variant) -> float:
    """The peak memory of one step of ``v`` above what was allocated before it."""
    import torch

    v.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    v.step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GiB


def compare_pair(name, tokens, compiled, args, dtype, dev):
    """Stock and fused built side by side (the same seed: the same weights), each one's peak
    memory alone, then their steps timed in alternating rounds (timing.measure_pair: the clock
    ramp and host noise hit both alike), and with --profile their kernel time by category."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    stock = fused = None
    try:
        with (contextlib.nullcontext() if args.sdpa == "default"
              else sdpa_kernel([backends[args.sdpa]])):
            stock = Variant(name, tokens, args.blocks, False, compiled, dtype, dev)
            fused = Variant(name, tokens, args.blocks, True, compiled, dtype, dev)
            mem = [peak_gib(v) for v in (stock, fused)]
            r = measure_pair(stock.step, fused.step, warmup=args.warmup, rounds=args.reps,
                             reps=3, max_s=args.max_s)
            kernels = ([dict(kernel_breakdown(v.step), **synced_step_edges(v.step))
                        for v in (stock, fused)] if args.profile else None)
            outs = [v.output() for v in (stock, fused)]
    finally:
        del stock, fused
        gc.collect()  # a patched block's forward is bound to the block: a cycle
        torch.cuda.empty_cache()
    row = dict(stock_ms=r["a_ms"], fused_ms=r["b_ms"], speedup=1.0 / r["ratio"],
               stock_peak_gib=mem[0], fused_peak_gib=mem[1],
               mem_ratio=mem[1] / max(mem[0], 1e-9), rel_l2=rel_l2(outs[1], outs[0]),
               rounds=r["rounds"])
    if kernels:
        row["stock_kernels"], row["fused_kernels"] = kernels
    return row, (f"stock {r['a_ms']:8.2f} ms fused {r['b_ms']:8.2f} ms  {row['speedup']:.3f}x  "
                 f"mem {row['mem_ratio']:.2f}x  rel_l2 {row['rel_l2']:.1e}")


def default_sdpa_kernels(dev) -> str:
    """The attention kernels PyTorch's default SDPA choice runs (forward and backward of one
    [1, 12, 1024, 128] bf16 call, Wan 1.3B's heads), by name: what ``--sdpa default`` measured."""
    import torch

    q, k, v = (torch.randn(1, 12, 1024, 128, device=dev, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
        torch.cuda.synchronize(dev)
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    keys = ("sdpa", "flash", "fmha", "cudnn", "attention")
    return ", ".join(sorted(n[:60] for n in names if any(w in n.lower() for w in keys)))


def run(args):
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    if args.sdpa == "default":
        print(f"[adaln_models] --sdpa default runs: {default_sdpa_kernels(dev)}", flush=True)
    return cli.sweep("adaln_models", args, M.TOKENS,
                     lambda name, tokens, compiled: compare_pair(name, tokens, compiled, args,
                                                                 torch.bfloat16, dev))


def table(rows) -> str:
    columns = ("model", "tokens", "mode", "stock ms", "fused ms", "speed-up", "stock peak GiB",
               "fused peak GiB", "mem ratio", "rel. L2")
    return cli.markdown(rows, columns, lambda r: (
        r["model"], str(r["tokens"]), r["mode"], f"{r['stock_ms']:.2f}", f"{r['fused_ms']:.2f}",
        f"{r['speedup']:.3f}x", f"{r['stock_peak_gib']:.2f}", f"{r['fused_peak_gib']:.2f}",
        f"{r['mem_ratio']:.2f}", f"{r['rel_l2']:.1e}")) + kernel_table(rows)


def kernel_table(rows) -> str:
    """With --profile: GPU kernel ms per step by category, stock -> fused, and the bound on
    what fusing the norms can save: the stock step's non-GEMM, non-attention kernel time."""
    rows = [r for r in rows if "stock_kernels" in r]
    if not rows:
        return ""
    cats = [c for c in rows[0]["stock_kernels"]
            if c not in ("total", "top_other", "top_ours", "idle", "top_gaps", "lead", "tail")]
    head = ("\nGPU kernel time per step (torch.profiler), stock -> fused, ms (idle: no kernel "
            "running, within and between the profiled steps; lead / tail: the GPU waiting on the "
            "host before a step's first kernel and after its last one, each step run alone as "
            "timed):\n\n| model | tokens | mode | " + " | ".join(cats) + " | kernels total | idle "
            f"| lead | tail | step (as called) | stock {OTHER} / step |\n|"
            + "---|" * (len(cats) + 9) + "\n")
    lines = []
    for r in rows:
        s, f = r["stock_kernels"], r["fused_kernels"]
        cells = " | ".join(f"{s[c]:.2f} -> {f[c]:.2f}" for c in cats)
        lines.append(f"| {r['model']} | {r['tokens']} | {r['mode']} | {cells} | "
                     f"{s['total']:.2f} -> {f['total']:.2f} | "
                     f"{s.get('idle', 0.0):.2f} -> {f.get('idle', 0.0):.2f} | "
                     f"{s.get('lead', 0.0):.2f} -> {f.get('lead', 0.0):.2f} | "
                     f"{s.get('tail', 0.0):.2f} -> {f.get('tail', 0.0):.2f} | "
                     f"{r['stock_ms']:.2f} -> "
                     f"{r['fused_ms']:.2f} | {100 * s[OTHER] / r['stock_ms']:.1f}% |")
    return head + "\n".join(lines) + "\n" + gap_lists(rows)


def gap_lists(rows) -> str:
    """The fused step's ditscale kernels (ms per step, calls) and longest idle gaps per row (ms,
    the kernels before and after)."""
    out = []
    for r in rows:
        ours = r["fused_kernels"].get("top_ours") or []
        if ours:
            out.append(f"\nditscale kernels, fused {r['model']} {r['tokens']} {r['mode']} "
                       "(ms per step, calls per step):\n")
            out += [f"- {ms:.3f} ms x{calls}: {name}" for name, ms, calls in ours]
        gaps = r["fused_kernels"].get("top_gaps") or []
        if gaps:
            out.append(f"\nLongest idle gaps, fused {r['model']} {r['tokens']} {r['mode']}:\n")
            out += [f"- {ms:.3f} ms: {before} -> {after}" for ms, before, after in gaps]
    return "\n".join(out) + ("\n" if out else "")


def parse(argv):
    ap = cli.parser(__doc__, "wan2.1-1.3b,wan2.1-14b,flux", 4, 20.0)
    ap.add_argument("--sdpa", default="flash", choices=["flash", "cudnn", "efficient", "default"],
                    help="the SDPA backend of every attention (see the module docstring); "
                         "default: PyTorch's own choice (cuDNN for these shapes on an H200 "
                         "with torch 2.11), the backend users get")
    ap.add_argument("--profile", action="store_true",
                    help="also the GPU kernel time per step by category (torch.profiler)")
    return cli.parse(ap, argv)


def main(argv=None) -> int:
    args = parse(argv)
    rows = run(args)
    return cli.write(args.out_dir, "adaln-models", rows, table(rows),
                     "Stock diffusers transformers vs apply_fused_adaln, forward+backward")


if __name__ == "__main__":
    sys.exit(main())
