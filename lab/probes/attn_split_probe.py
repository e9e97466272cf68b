"""What splitting one sequence-parallel attention call costs on one GPU (no communication).

Every pipelined strategy (torus chunks, head chunks, query chunks) replaces a rank's one big
cuDNN attention call by several smaller ones, so that transfers can run under compute. On 2 H200s
the chunked forms measured no faster than plain Ulysses although they hide its ~1-1.8 ms
all-to-all (bench/results/sp-attention_h200x2_2026-12.md). This probe measures, on one GPU
and with the exact call the GPU executor makes (aten._scaled_dot_product_cudnn_attention with
log-sum-exp), what a split costs and why:

  scan     time of q rows x kv rows for q rows around a split point: does cuDNN's kernel run in
           waves (a step every SMs x CTAs-per-SM tiles), and what is a tile?
  splits   one rank's compute sequence for each decomposition of the same work:
             one call; one call + the executor's copies of o and lse into its buffers;
             query chunks (2, 3; split at equal rows or at whole waves);
             kv halves + log-sum-exp merge (ring-like); torus c1 (stationary block first);
             head chunks (2, 4); two query chunks on two streams at once.

Usage (one GPU):
  python -m lab.probes.attn_split_probe --out DIR [--heads 12] [--kv 66048 37376]
Writes DIR/attn-split.json and DIR/attn-split.md (and attn-split-scan.png with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

ATTN = torch.ops.aten._scaled_dot_product_cudnn_attention


def attn(q, k, v):
    """q, k, v: [B, H, T, D] views; returns (o, lse) as the GPU executor receives them."""
    r = ATTN(q, k, v, None, True, 0.0, False, False)
    return r[0], r[1]


def flops(heads, q_rows, kv_rows, d):
    return 4.0 * heads * q_rows * kv_rows * d


class Timer:
    """Times cases round-robin: every round runs each case once, so that the GPU's clock and
    power state (which drift over seconds under a 700 W attention load) reach all cases alike."""

    def __init__(self, warm: int, reps: int):
        self.warm, self.reps = warm, reps

    def __call__(self, cases: dict) -> dict:
        """Median ms of each case's fn() over reps rounds; also the SM clock seen after it."""
        for fn in cases.values():
            for _ in range(self.warm):
                fn()
        torch.cuda.synchronize()
        times = {name: [] for name in cases}
        clocks = {name: [] for name in cases}
        for _ in range(self.reps):
            for name, fn in cases.items():
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b))
                clocks[name].append(sm_clock())
        return {name: (statistics.median(t), statistics.median(clocks[name]) if all(
            c is not None for c in clocks[name]) else None) for name, t in times.items()}


def sm_clock():
    try:
        return torch.cuda.clock_rate()
    except Exception:  # no pynvml / amdsmi: clocks are not reported
        return None


def bhtd(x):
    """[1, T, H, D] buffer -> [1, H, T, D] view (the executor's layout)."""
    return x.permute(0, 2, 1, 3)


def merge_(acc_o, acc_l, o, l):
    """acc = log-sum-exp merge of (acc_o, acc_l) and (o, l); fp32 accumulator [1, H, T, D]."""
    m = torch.maximum(acc_l, l)
    wa = torch.exp(acc_l - m)
    wb = torch.exp(l - m)
    s = wa + wb
    acc_o.mul_((wa / s).unsqueeze(-1)).add_(o.float() * (wb / s).unsqueeze(-1))
    acc_l.copy_(m + torch.log(s))


def scan(timer, heads, kv, d, rows_list, dev):
    q = torch.randn(1, max(rows_list), heads, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, kv, heads, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cases = {rows: (lambda rows=rows: attn(bhtd(q[:, :rows]), bhtd(k), bhtd(v)))
             for rows in rows_list}
    out = []
    for rows, (ms, clk) in timer(cases).items():
        tf = flops(heads, rows, kv, d) / (ms * 1e-3) / 1e12
        out.append({"kv": kv, "q_rows": rows, "ms": ms, "tflops": tf, "sm_mhz": clk})
        print(f"  scan kv {kv} q {rows:6d}: {ms:8.3f} ms {tf:6.1f} TFLOP/s  SM {clk} MHz",
              flush=True)
    return out


def splits(timer, heads, n, d, dev, wave_rows):
    """Decompositions of one rank's [heads, n x n] attention (n = q rows = kv rows)."""
    q = torch.randn(1, n, heads, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    out = torch.empty_like(q)  # the executor's accumulator / out buffer
    lse = torch.empty(1, heads, n, device=dev, dtype=torch.float32)
    acc = torch.empty(1, heads, n, d, device=dev, dtype=torch.float32)
    Q, K, V, O = bhtd(q), bhtd(k), bhtd(v), bhtd(out)

    def rows(a, e):
        return slice(None), slice(None), slice(a, e)

    def qchunks(bounds):
        for a, e in zip(bounds[:-1], bounds[1:]):
            o, l = attn(Q[rows(a, e)], K, V)
            O[rows(a, e)].copy_(o)
            lse[:, :, a:e].copy_(l.reshape(1, heads, e - a))

    def aligned(x):  # nearest whole-wave row count
        return max(wave_rows, int(round(x / wave_rows)) * wave_rows)

    half, third = n // 2, n // 3
    cases = {}
    cases["one call"] = lambda: attn(Q, K, V)

    def one_copy():
        o, l = attn(Q, K, V)
        O.copy_(o)
        lse.copy_(l.reshape(1, heads, n))

    cases["one call + o, lse copies (executor)"] = one_copy
    cases["q chunks 2, equal rows"] = lambda: qchunks([0, half, n])
    cases["q chunks 2, whole waves"] = lambda: qchunks([0, aligned(half), n])
    cases["q chunks 3, equal rows"] = lambda: qchunks([0, third, 2 * third, n])
    cases["q chunks 3, whole waves"] = lambda: qchunks([0, aligned(third), 2 * aligned(third), n])

    def kv_halves():
        o, l = attn(Q, K[rows(0, half)], V[rows(0, half)])
        acc.copy_(o)
        al = l.reshape(1, heads, n).clone()
        o, l = attn(Q, K[rows(half, n)], V[rows(half, n)])
        merge_(acc, al, o, l.reshape(1, heads, n))
        O.copy_(acc)

    cases["kv halves + merge (ring-like)"] = kv_halves

    def three_calls(a, merge=True):
        """rows [0, a) x local kv [0, half), rows [a, n) x all kv, rows [0, a) x remote kv
        [half, n) merged into the first: torus c1 (a = half, cut at the shard) and
        ulysses-overlap (a on whole waves)."""
        o, l = attn(Q[rows(0, a)], K[rows(0, half)], V[rows(0, half)])
        acc[rows(0, a)].copy_(o)
        al = l.reshape(1, heads, a).clone()
        o, l = attn(Q[rows(a, n)], K, V)
        O[rows(a, n)].copy_(o)
        o, l = attn(Q[rows(0, a)], K[rows(half, n)], V[rows(half, n)])
        if merge:
            merge_(acc[rows(0, a)], al, o, l.reshape(1, heads, a))
        O[rows(0, a)].copy_(acc[rows(0, a)])

    # torus c1: stationary q x stationary kv, remote q x all kv, stationary q x remote kv.
    cases["torus c1 (3 calls + merge of half the rows)"] = lambda: three_calls(half)

    # ulysses-overlap's calls on a rank of 2 (strategies/ulysses_overlap.cc): local rows = the
    # first half (text + own slice), cut down to whole waves; kv = [local | remote].
    a = max(wave_rows, half // wave_rows * wave_rows)
    overlap = lambda merge=True: three_calls(a, merge)  # noqa: E731
    cases["ulysses-overlap (3 whole-wave calls + merge)"] = overlap
    cases["ulysses-overlap calls without the merge"] = lambda: overlap(False)

    def head_chunks(c):
        hs = heads // c
        for j in range(c):
            hh = slice(j * hs, (j + 1) * hs)
            o, l = attn(Q[:, hh], K[:, hh], V[:, hh])
            O[:, hh].copy_(o)

    if heads % 2 == 0:
        cases["head chunks 2"] = lambda: head_chunks(2)
    if heads % 4 == 0:
        cases["head chunks 4"] = lambda: head_chunks(4)

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def two_streams():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            o1, _ = attn(Q[rows(0, half)], K, V)
        with torch.cuda.stream(s2):
            o2, _ = attn(Q[rows(half, n)], K, V)
        cur.wait_stream(s1)
        cur.wait_stream(s2)
        o1.record_stream(cur)
        o2.record_stream(cur)

    cases["q chunks 2 on two streams at once"] = two_streams

    res = []
    timed = timer(cases)
    base = timed["one call"][0]
    for name, (ms, clk) in timed.items():
        res.append({"n": n, "heads": heads, "case": name, "ms": ms, "vs_one_call": ms / base,
                    "sm_mhz": clk})
        print(f"  n {n} {name:48s} {ms:8.3f} ms  x{ms / base:.4f}  SM {clk} MHz", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--heads", type=int, default=12, help="query heads per rank (Flux: 24 / 2)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv", type=int, nargs="+", default=[66048, 37376],
                    help="rank's q = kv rows: 65,536 / 36,864 image + 512 text tokens")
    ap.add_argument("--scan-kv", type=int, default=66048)
    ap.add_argument("--scan-from", type=int, default=30720)
    ap.add_argument("--scan-to", type=int, default=35840)
    ap.add_argument("--scan-step", type=int, default=128)
    ap.add_argument("--warm", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("attn_split_probe: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    args.out.mkdir(parents=True, exist_ok=True)
    timer = Timer(args.warm, args.reps)
    print(f"{props.name}: {sms} SMs; cuDNN {torch.backends.cudnn.version()}; torch "
          f"{torch.__version__}", flush=True)
    # A wave (if the kernel runs one 128-row tile per CTA and one CTA per SM): sms tiles.
    tile = 128
    per_head = sms // math.gcd(sms, args.heads)  # tiles per head for a whole number of waves
    wave_rows = per_head * tile
    rows = list(range(args.scan_from, args.scan_to + 1, args.scan_step))
    result = {"gpu": props.name, "sms": sms, "cudnn": torch.backends.cudnn.version(),
              "torch": torch.__version__, "heads": args.heads, "head_dim": args.head_dim,
              "assumed_tile_rows": tile, "whole_wave_rows": wave_rows,
              "scan": scan(timer, args.heads, args.scan_kv, args.head_dim, rows, dev),
              "splits": []}
    for n in args.kv:
        result["splits"] += splits(timer, args.heads, n, args.head_dim, dev, wave_rows)
    (args.out / "attn-split.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Splitting one rank's attention call ({props.name}, {sms} SMs, cuDNN "
             f"{result['cudnn']}, torch {torch.__version__})", "",
             f"{args.heads} heads x {args.head_dim}, bf16, non-causal, log-sum-exp on; median of "
             f"{args.reps} rounds (cases interleaved) after {args.warm} warm-ups; whole wave = {wave_rows} rows if a CTA "
             f"is a {tile}-row tile and one CTA fits an SM.", "",
             "| n = q = kv rows | decomposition | ms | vs one call | SM MHz |", "|---|---|---|---|---|"]
    for r in result["splits"]:
        lines.append(f"| {r['n']} | {r['case']} | {r['ms']:.3f} | {r['vs_one_call']:.4f} | "
                     f"{r['sm_mhz']} |")
    lines += ["", f"Scan: kv {args.scan_kv}, q rows {args.scan_from}..{args.scan_to} step "
              f"{args.scan_step}", "", "| q rows | ms | TFLOP/s | SM MHz |", "|---|---|---|---|"]
    for r in result["scan"]:
        lines.append(f"| {r['q_rows']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['sm_mhz']} |")
    (args.out / "attn-split.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([r["q_rows"] for r in result["scan"]], [r["ms"] for r in result["scan"]], ".-")
        ax.set_xlabel("q rows")
        ax.set_ylabel("ms")
        ax.set_title(f"cuDNN attention, {args.heads} heads, kv {args.scan_kv}")
        fig.tight_layout()
        fig.savefig(args.out / "attn-split-scan.png", dpi=120)
    except ImportError:
        pass
    print("\n".join(lines[:8 + len(result["splits"])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
