#!/usr/bin/env python3
"""The sequence-parallel attention's backward on one device: what the differentiable op costs at
degree 1, and one rank's share of the backward at degree d run alone (the input of the simulator
for d = 2, 4, 8 without d GPUs).

    python -m bench.sp.grad_share [--shapes wan2.1-1.3b:32760,wan2.1-14b:32760]
        [--degrees 2,4,8] [--reps 10] [--device cuda|cpu] [--out-dir DIR]

- degree 1: ``ditscale.sp.attention`` forward + backward on a mesh of one rank against
  ``F.scaled_dot_product_attention`` forward + backward (the target: < 3% more; the op runs SDPA
  itself, so the difference is its Python entry);
- degree d: the local part of the backward of torch_backward.py on one rank, the attention of
  H / d heads over all S tokens recomputed forward and differentiated (time, peak memory), with
  the bytes each rank's all-to-alls move (4 tensors to head groups, 3 back: 7 x B S H D / d x
  (d - 1) / d elements); ideal time: the degree-1 backward / d.

Writes DIR/sp-grad-share.md. Shapes: ``name:S`` with the heads and head_dim of the model
(:data:`MODELS`), batch 1, bf16 on CUDA, fp32 on the CPU (a dry run of the script).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from typing import List, Tuple

from bench import reporter
from bench.timing import time_fn, time_interleaved
from ditscale._checks import check_int

MODELS = {"wan2.1-1.3b": (12, 128), "wan2.1-14b": (40, 128), "flux": (24, 128),
          "hunyuan-video": (24, 128), "tiny": (4, 16)}  # (heads, head_dim)
MAX_TOKENS = 1 << 20


def parse_shapes(text: str) -> List[Tuple[str, int]]:
    """"name:S,..." -> [(name, S)], names from MODELS, S in [1, 2^20]."""
    out = []
    for item in text.split(","):
        name, _, tokens = item.partition(":")
        if name not in MODELS:
            raise argparse.ArgumentTypeError(f"--shapes: {name!r} is not one of "
                                             f"{', '.join(MODELS)}")
        try:
            s = check_int("--shapes tokens", int(tokens), 1, MAX_TOKENS)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        out.append((name, s))
    return out


def parse_degrees(text: str) -> List[int]:
    out = []
    for item in text.split(","):
        try:
            d = check_int("--degrees", int(item), 2, 64)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        out.append(d)
    return out


def _qkv(S, H, D, dtype, dev, seed=0):
    import torch
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(1, S, H, D, device=dev, generator=g).to(dtype).requires_grad_()
            for _ in range(3)]


def degree_one(name, S, args, dev, dtype):
    """Timing rows of sp.attention vs SDPA, forward + backward, one rank."""
    import torch
    import torch.nn.functional as F

    import ditscale.sp as sp
    H, D = MODELS[name]
    q, k, v = _qkv(S, H, D, dtype, dev)
    grad = torch.randn_like(q)
    mesh = sp.Mesh(1, 1)

    def ours():
        torch.autograd.backward(sp.attention(q, k, v, mesh=mesh), grad)

    def sdpa():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2)).transpose(1, 2)
        torch.autograd.backward(out, grad)

    result = time_interleaved([ours, sdpa], rounds=args.reps, clock=args.clock)
    t_ours, t_sdpa = result.timings
    return [[name, S, "sp.attention fwd+bwd", *reporter.timing_cells(t_ours),
             f"{100 * (result.ratio(1, 0) - 1):+.2f}% (paired rounds)"],
            [name, S, "SDPA fwd+bwd", *reporter.timing_cells(t_sdpa), "-"]]


def rank_share(name, S, d, args, dev, dtype, base_ms):
    """One rank's local backward at degree d: (row, peak MiB)."""
    import torch

    from ditscale.sp import torch_backward
    H, D = MODELS[name]
    h = max(1, -(-H // d))  # the largest head group of H over d ranks
    q, k, v = (t.detach() for t in _qkv(S, h, D, dtype, dev))
    dout = torch.randn_like(q)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time_fn(lambda: torch_backward._local(q, k, v, dout), reps=args.reps, clock=args.clock)
    peak = (f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if dev.type == "cuda"
            else "-")
    moved = 7 * S * H * D * (d - 1) / d / d * q.element_size() / 2**20
    ideal = base_ms / d
    return [name, S, f"backward share, d={d} ({h} heads)", *reporter.timing_cells(t),
            f"{t.median_ms / ideal:.2f}x ideal; a2a {moved:.0f} MiB; peak {peak}"]


def _saved_rows(q, k, v):
    """(out, lse) of the block, the forward's saved tensors (computed once, outside the timing)."""
    from ditscale.sp import block_kernels
    return block_kernels.attention_lse(q, k, v)


def own_share(name, S, d, args, dev, dtype, recompute_ms):
    """One rank's own backward at degree d from the saved LSE, nothing recomputed: Ulysses (its
    head group over all S tokens, one block) and ring (all H heads, S / d query rows against the
    d blocks of S / d tokens in turn, dK, dV accumulated in float32). Rows vs the recomputing
    share (:func:`rank_share`)."""
    import torch

    from ditscale.sp import block_kernels
    H, D = MODELS[name]
    rows = []
    h = max(1, -(-H // d))
    s = -(-S // d)
    for what, heads, tokens, blocks in (("ulysses", h, S, 1), ("ring", H, s, d)):
        q, k, v = (t.detach() for t in _qkv(tokens, heads, D, dtype, dev, seed=1))
        out, lse = _saved_rows(q, k, v)
        dout = torch.randn_like(q)

        def step():  # as ring_backward.rotate: the rows prepared once, then each block
            acc = torch.zeros(k.shape[:3] + (2 * D,), device=dev)
            rows = block_kernels.QueryRows(dout, q, out, lse, heads)
            for _ in range(blocks):  # one rank's ring steps: the same block size each
                gk, gv = rows.add(k, v)
                acc[..., :D] += gk
                acc[..., D:] += gv
            rows.dq()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time_fn(step, reps=args.reps, clock=args.clock)
        peak = (f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if dev.type == "cuda"
                else "-")
        rows.append([name, S, f"own backward share, d={d}, {what}", *reporter.timing_cells(t),
                     f"{t.median_ms / recompute_ms:.2f}x recompute share; peak {peak}"])
    return rows


def run(args) -> str:
    import torch
    import torch.distributed as dist

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    store = tempfile.NamedTemporaryFile(prefix="sp_grad_share_", delete=False)
    store.close()
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
    dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    rows = []
    try:
        for name, S in args.shapes:
            pair = degree_one(name, S, args, dev, dtype)
            rows += pair
            base_ms = pair[1][3]  # SDPA fwd+bwd, median: the degree-1 backward's upper bound
            for d in args.degrees:
                share = rank_share(name, S, d, args, dev, dtype, base_ms)
                rows += [share, *own_share(name, S, d, args, dev, dtype, share[3])]
    finally:
        dist.destroy_process_group()
        if os.path.exists(store.name):  # the file store removes its file at the end
            os.unlink(store.name)
    columns = ["model", "S", "what", *reporter.TIMING_COLUMNS, "vs SDPA / share"]
    notes = ("Batch 1; bf16 on CUDA (fp32 on the CPU); the degree-d rows time the local "
             "attention of one rank's head group over all S tokens, forward (recomputed) and "
             "backward, the ideal being the SDPA forward + backward / d; a2a: the MiB this rank "
             "sends in the backward's all-to-alls (not timed here). The own-backward rows start "
             "from the saved output and LSE (nothing recomputed): Ulysses one head group over "
             "all S tokens, ring all heads of S / d query rows against d blocks of S / d "
             "tokens.")
    return reporter.report("sp.attention backward: degree 1 and one rank's share", columns, rows,
                           notes=notes, argv=sys.argv)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=parse_shapes,
                    default=parse_shapes("wan2.1-1.3b:32760,wan2.1-14b:32760"))
    ap.add_argument("--degrees", type=parse_degrees, default=parse_degrees("2,4,8"))
    ap.add_argument("--reps", type=int, default=10, choices=range(1, 1001), metavar="[1, 1000]",
                    help="samples of each timing (rounds at degree 1)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args(argv)
    args.clock = "cuda" if args.device == "cuda" else "wall"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    text = run(args)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "sp-grad-share.md")
    with open(path, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
