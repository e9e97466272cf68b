#!/usr/bin/env python3
"""Stock diffusers transformers against ``ditscale.diffusers.apply_fused_adaln`` on one GPU:
bf16, forward+backward of a few blocks at the models' typical token counts, eager and under
regional torch.compile (every block compiled, as diffusers' ``compile_repeated_blocks`` does),
time and peak memory in one run.

    python -m bench.diffusers.adaln_models [--models wan2.1-1.3b,flux] [--tokens 1024,32760]
        [--blocks 4] [--modes eager,compile] [--out-dir DIR]

Per (model, tokens, mode) the stock and the patched model are built with the same seed (the same
weights) and run on the same inputs; a step is forward, ``out.backward(dy)`` and zeroing the
gradients (``set_to_none``), timed as called (median CUDA-event time). Columns: stock and fused
ms, speed-up (stock / fused), peak memory above the model and inputs (GiB) and its ratio
(fused / stock), and the output's relative L2 difference to stock. The markdown table is printed
last and written to DIR/adaln-models.md with the raw rows in DIR/adaln-models.json.

Attention runs on one SDPA backend for stock and fused alike (``--sdpa``, default flash): with
torch 2.11's cuDNN backend the backward of Flux's joint attention reads out of bounds
(compute-sanitizer: ``cudnn::fusion::compute_dot_do_o_specialized``, stock model, 4,608 tokens,
24 x 128 heads) and fails with CUBLAS_STATUS_EXECUTION_FAILED.
"""

from __future__ import annotations

import gc
import sys

from bench.diffusers import cli
from bench.diffusers import models as M
from bench.diffusers.timing import OTHER, kernel_breakdown, measure, rel_l2


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


def one_variant(name, tokens, blocks, fused, compiled, args, dtype, dev):
    import torch

    model = build(name, blocks, fused, compiled, dtype, dev)
    kw = M.inputs(name, model, tokens, 1, dtype, dev, seed=1)
    kw["hidden_states"].requires_grad_(True)
    with torch.no_grad():
        probe = model(**kw)[0]  # (its shape only)
    dy = torch.randn(probe.shape, generator=torch.Generator(device=dev).manual_seed(2),
                     device=dev, dtype=probe.dtype)

    def step():
        out = model(**kw)[0]
        out.backward(dy)
        model.zero_grad(set_to_none=True)
        kw["hidden_states"].grad = None

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[args.sdpa]
    with sdpa_kernel([backend]):
        r = measure(step, warmup=args.warmup, reps=args.reps, max_s=args.max_s)
        if args.profile:
            r["kernels"] = kernel_breakdown(step)
        with torch.no_grad():
            r["out"] = model(**kw)[0].float().cpu()
    del model, kw
    gc.collect()  # a patched block's forward is bound to the block: a cycle
    torch.cuda.empty_cache()
    return r


def run(args):
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dtype = torch.bfloat16

    def compare(name, tokens, compiled):
        s = one_variant(name, tokens, args.blocks, False, compiled, args, dtype, dev)
        f = one_variant(name, tokens, args.blocks, True, compiled, args, dtype, dev)
        row = dict(stock_ms=s["ms"], fused_ms=f["ms"], speedup=s["ms"] / f["ms"],
                   stock_peak_gib=s["peak_gib"], fused_peak_gib=f["peak_gib"],
                   mem_ratio=f["peak_gib"] / max(s["peak_gib"], 1e-9),
                   rel_l2=rel_l2(f["out"], s["out"]), reps=min(s["reps"], f["reps"]))
        if args.profile:
            row["stock_kernels"], row["fused_kernels"] = s["kernels"], f["kernels"]
        return row, (f"stock {s['ms']:8.2f} ms fused {f['ms']:8.2f} ms  {row['speedup']:.3f}x  "
                     f"mem {row['mem_ratio']:.2f}x  rel_l2 {row['rel_l2']:.1e}")

    return cli.sweep("adaln_models", args, M.TOKENS, compare)

def table(rows) -> str:
    head = ("| model | tokens | mode | stock ms | fused ms | speed-up | stock peak GiB | "
            "fused peak GiB | mem ratio | rel. L2 |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(cli.error_line(r, 10))
            continue
        lines.append(f"| {r['model']} | {r['tokens']} | {r['mode']} | {r['stock_ms']:.2f} | "
                     f"{r['fused_ms']:.2f} | {r['speedup']:.3f}x | {r['stock_peak_gib']:.2f} | "
                     f"{r['fused_peak_gib']:.2f} | {r['mem_ratio']:.2f} | {r['rel_l2']:.1e} |")
    return head + "\n".join(lines) + "\n" + kernel_table(rows)


def kernel_table(rows) -> str:
    """With --profile: GPU kernel ms per step by category, stock -> fused, and the bound on
    what fusing the norms can save: the stock step's non-GEMM, non-attention kernel time."""
    rows = [r for r in rows if "stock_kernels" in r]
    if not rows:
        return ""
    cats = [c for c in rows[0]["stock_kernels"] if c != "total"]
    head = ("\nGPU kernel time per step (torch.profiler), stock -> fused, ms:\n\n| model | tokens "
            "| mode | " + " | ".join(cats) + " | kernels total | step (as called) | stock "
            f"{OTHER} / step |\n|" + "---|" * (len(cats) + 6) + "\n")
    lines = []
    for r in rows:
        s, f = r["stock_kernels"], r["fused_kernels"]
        cells = " | ".join(f"{s[c]:.2f} -> {f[c]:.2f}" for c in cats)
        lines.append(f"| {r['model']} | {r['tokens']} | {r['mode']} | {cells} | "
                     f"{s['total']:.2f} -> {f['total']:.2f} | {r['stock_ms']:.2f} -> "
                     f"{r['fused_ms']:.2f} | {100 * s[OTHER] / r['stock_ms']:.1f}% |")
    return head + "\n".join(lines) + "\n"


def parse(argv):
    ap = cli.parser(__doc__, "wan2.1-1.3b,wan2.1-14b,flux", 4, 20.0)
    ap.add_argument("--sdpa", default="flash", choices=["flash", "cudnn", "efficient"],
                    help="the SDPA backend of every attention (see the module docstring)")
    ap.add_argument("--profile", action="store_true",
                    help="also the GPU kernel time per step by category (torch.profiler)")
    return cli.parse(ap, argv)


def main(argv=None) -> int:
    args = parse(argv)
    rows = run(args)
    return cli.write(args.out_dir, "adaln-models", rows, table(rows))


if __name__ == "__main__":
    sys.exit(main())
