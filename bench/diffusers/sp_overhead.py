#!/usr/bin/env python3
"""What ``ditscale.diffusers.parallelize`` costs on one GPU: the parallelized transformer at world
size 1 against the stock module, bf16 inference (the forward of a denoising step), eager and
under ``torch.compile`` of the whole module, at the models' typical token counts.

    python -m bench.diffusers.sp_overhead [--models flux,wan2.1-1.3b] [--blocks 2]
        [--modes eager,compile] [--out-dir DIR]

World size 1: a one-rank process group (gloo on a file store: no NCCL communicator is needed
for one rank) so that ``parallelize`` builds its mesh as under torchrun; the attention then runs
on the rank itself (ditscale.sp's one-rank path). The stock and the parallelized models are
built with the same seed (the same weights) and run on the same inputs. Columns: stock and
parallelized ms (median CUDA-event time of a forward as called), overhead (parallelized / stock
- 1; the integration's target is < 2%), and the outputs' relative L2 difference. The table is
printed last and written to DIR/sp-overhead.md (+ .json).
"""

from __future__ import annotations

import gc
import datetime
import os
import sys
import tempfile

from bench.diffusers import cli
from bench.diffusers import models as M
from bench.diffusers.timing import measure, rel_l2

DEFAULT_TOKENS = {"flux": (4096, 16384), "wan2.1-1.3b": (32760, 75600),
                  "wan2.1-14b": (32760,), "hunyuan-video": (32760,), "cogvideox-5b": (17550,),
                  "sd3.5-medium": (16384,)}


def one_variant(name, tokens, args, parallel, compiled, dtype, dev):
    import torch

    import ditscale.diffusers as dd

    model, _ = M.make(name, args.blocks, dtype, dev)
    model.eval()
    if parallel:
        dd.parallelize(model, strategy=args.strategy)
    run_model = torch.compile(model) if compiled else model
    kw = M.inputs(name, model, tokens, 1, dtype, dev, seed=1)

    def step():
        with torch.no_grad():
            return run_model(**kw)[0]

    r = measure(step, warmup=args.warmup, reps=args.reps, max_s=args.max_s)
    r["out"] = step().float().cpu()
    del model, run_model, kw
    torch._dynamo.reset()
    gc.collect()  # a patched block's forward is bound to the block: a cycle
    torch.cuda.empty_cache()
    return r


def run(args):
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = tempfile.NamedTemporaryFile(prefix="sp_overhead_", delete=False)
    store.close()
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))

    def compare(name, tokens, compiled):
        s = one_variant(name, tokens, args, False, compiled, torch.bfloat16, dev)
        p = one_variant(name, tokens, args, True, compiled, torch.bfloat16, dev)
        row = dict(stock_ms=s["ms"], parallel_ms=p["ms"], overhead=p["ms"] / s["ms"] - 1.0,
                   rel_l2=rel_l2(p["out"], s["out"]), reps=min(s["reps"], p["reps"]))
        return row, (f"stock {s['ms']:8.2f} ms parallelized {p['ms']:8.2f} ms  overhead "
                     f"{100 * row['overhead']:+.2f}%  rel_l2 {row['rel_l2']:.1e}")

    try:
        return cli.sweep("sp_overhead", args, DEFAULT_TOKENS, compare)
    finally:
        dist.destroy_process_group()
        os.unlink(store.name)


def table(rows) -> str:
    head = ("| model | tokens | mode | stock ms | parallelized ms | overhead | rel. L2 |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(cli.error_line(r, 7))
        else:
            lines.append(f"| {r['model']} | {r['tokens']} | {r['mode']} | {r['stock_ms']:.2f} | "
                         f"{r['parallel_ms']:.2f} | {100 * r['overhead']:+.2f}% | "
                         f"{r['rel_l2']:.1e} |")
    return head + "\n".join(lines) + "\n"


def parse(argv):
    ap = cli.parser(__doc__, "flux,wan2.1-1.3b,hunyuan-video,cogvideox-5b,sd3.5-medium", 2, 15.0)
    ap.add_argument("--strategy", default="auto")
    return cli.parse(ap, argv)


def main(argv=None) -> int:
    args = parse(argv)
    rows = run(args)
    return cli.write(args.out_dir, "sp-overhead", rows, table(rows))


if __name__ == "__main__":
    sys.exit(main())
