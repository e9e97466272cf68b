"""Every strategy's compute on one rank, replayed alone on one GPU (no communication).

    python -m bench.sp.replay_compute --out DIR [--seq 65536 36864] [--mesh 1x2]

The GPU executor runs one rank's schedule with every transfer skipped (ditscale.sp.replay_compute):
its attention calls, LSE merges and copies, exactly as issued on a real mesh, as if the links were
free. Against the rank's share of one GPU's attention (the same SDPA call on the full sequence
divided by the mesh size, timed in the same run) this is what a schedule's cuts cost in compute,
measured without the mesh: the floor each strategy could reach on a perfect link.

Writes DIR/replay-compute.json and DIR/replay-compute.md; prints the table and, for each
strategy, the per-unit timeline of rank 0 into DIR/timeline-<config>.txt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from bench import reporter
from bench.timing import time_fn

# (strategy, chunks) on the mesh; head chunks are ulysses with chunks > 1; torus with the
# Ulysses degree = the mesh size (its 2 x 1 form: on one machine its default is the ring).
CONFIGS = [("ulysses", 1), ("ulysses-overlap", 1), ("ulysses", 2), ("ring", 1), ("torus", 1),
           ("torus", 2), ("torus", 4)]


def one_gpu_ms(seq: int, text: int, heads: int, d: int, reps: int) -> float:
    q = torch.randn(1, heads, seq + text, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    f = torch.ops.aten._scaled_dot_product_cudnn_attention
    return time_fn(lambda: f(q, k, v, None, True), warmup=1, reps=reps, clock="cuda").median_ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seq", type=int, nargs="+", default=[65536, 36864])
    ap.add_argument("--text", type=int, default=512)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mesh", default="1x2", help="machines x GPUs of the replayed schedule")
    ap.add_argument("--ranks", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all configurations")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("replay_compute: no CUDA device", file=sys.stderr)
        return 2
    from ditscale import sp

    machines, gpus = (int(x) for x in args.mesh.split("x"))
    world = machines * gpus
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq in args.seq:
        ranks = [r for r in args.ranks if r < world]
        cells = {}
        base = []
        # Rounds over every configuration (and the one-GPU call): the SM clock drifts under load.
        for rnd in range(args.rounds):
            base.append(one_gpu_ms(seq, args.text, args.heads, args.head_dim, 1) / world)
            for strategy, chunks in CONFIGS:
                for rank in ranks:
                    try:
                        ms, tl = sp.replay_compute(
                            strategy, machines=machines, gpus_per_machine=gpus, rank=rank,
                            seq=seq, text=args.text, heads=args.heads, head_dim=args.head_dim,
                            chunks=chunks, ulysses_degree=world if strategy == "torus" else 0,
                            iters=1, warmup=1)
                    except RuntimeError as e:  # e.g. more head chunks than heads
                        print(f"  {strategy} c{chunks}: {e}", flush=True)
                        break
                    cells.setdefault((strategy, chunks, rank), []).append(ms[0])
                    if rnd == 0 and rank == 0:
                        name = f"{strategy}-c{chunks}-s{seq}".replace("/", "_")
                        (args.out / f"timeline-{name}.txt").write_text(tl)
        share = statistics.median(base)
        for (strategy, chunks, rank), ms in cells.items():
            m = statistics.median(ms)
            rows.append({"seq": seq, "text": args.text, "mesh": args.mesh, "strategy": strategy,
                         "chunks": chunks, "rank": rank, "ms": m, "ms_rounds": ms,
                         "one_gpu_share_ms": share, "vs_share": m / share})
            print(f"S={seq} {strategy:16s} c{chunks} rank {rank}: {m:8.3f} ms = "
                  f"{m / share:.4f} x the one-GPU share {share:.3f} ms", flush=True)
    doc = {"header": reporter.header(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "heads": args.heads, "head_dim": args.head_dim,
           "rounds": args.rounds, "rows": rows}
    (args.out / "replay-compute.json").write_text(json.dumps(doc, indent=1))
    lines = reporter.header_lines("One rank's compute per strategy, replayed on one GPU") + [
        f"Flux attention, {args.heads} heads x {args.head_dim}, {args.text} text tokens, bf16; "
        f"mesh {args.mesh}; median of {args.rounds} rounds (configurations interleaved); "
        "transfers skipped. 'vs share' = against the one-GPU cuDNN call on the full sequence "
        "divided by the mesh size, timed in the same rounds.", ""]
    table = reporter.table(["S", "strategy", "chunks", "rank", "ms", "vs share"],
                           [[r["seq"], r["strategy"], r["chunks"], r["rank"], r["ms"],
                             f"{r['vs_share']:.4f}"] for r in rows])
    (args.out / "replay-compute.md").write_text("\n".join(lines) + "\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
