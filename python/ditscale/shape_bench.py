"""Shape benchmark: time full FSDP2 training steps of the Wan DiT over a grid of (B, S).

    torchrun --nproc-per-node 2 -m ditscale.shape_bench --model wan2.1-1.3b --num-layers 8 \
        --out bench.csv
    python -m ditscale.shape_bench --model tiny --device cpu --shapes 1x64x64,5x64x64 ...
    ditscale fit bench.csv --out cost.json

A step is exactly bench/train/policies.py's (models.training.StepRunner); a point that runs out of
memory is written as a '# infeasible' line and the model rebuilt. The grid, gradient-accumulation
rows and CSV columns: docs/shape_bench.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from .models.training import (
    IMPLS,
    StepRunner,
    SyntheticData,
    build_model,
    init_distributed,
    peak_memory_bytes,
    release_memory,
    reset_peak_memory,
)
from .models.wan_dit import latent_shape, make_config, seq_len_of

# (frames, height, width): images to 81-frame 720p, S = 256 ... 75600 tokens.
DEFAULT_SHAPES = [
    (1, 256, 256), (1, 480, 832), (1, 720, 1280), (17, 480, 832), (33, 480, 832),
    (17, 720, 1280), (49, 480, 832), (33, 720, 1280), (81, 480, 832), (49, 720, 1280),
    (81, 720, 1280),
]
CSV_COLUMNS = [
    "batch_size", "seq_len", "step_time_s", "peak_mem_bytes", "micro_batches", "frames", "height",
    "width",
    "world_size", "step_time_std_s", "compute_s", "sync_s", "optim_s", "tokens_per_s",
]


def parse_shapes(text: str) -> List[Tuple[int, int, int]]:
    """'17x480x832,1x256x256' -> [(17, 480, 832), (1, 256, 256)], validated."""
    out = []
    for i, item in enumerate(t for t in text.split(",") if t.strip()):
        parts = item.strip().lower().split("x")
        try:
            f, h, w = (int(p) for p in parts)
            latent_shape(f, h, w)
        except ValueError as e:
            raise SystemExit(f"--shapes item {i + 1} {item!r}: expected FxHxW with F = 4k+1 and "
                             f"H, W multiples of 16 ({e})")
        out.append((f, h, w))
    if not out:
        raise SystemExit("--shapes: no shape given")
    return out


def manifest_shapes(path: str, shape_model: str, max_shapes: int) -> List[Tuple[int, int, int]]:
    """Distinct training shapes of a manifest's samples, at most max_shapes spread over S."""
    import numpy as np

    import ditscale

    m = ditscale.read_manifest(path, skip_bad_rows=True)
    raw = np.stack([m.num_frames, m.height, m.width, m.fps.astype(np.float64)], axis=1)
    shapes = set()
    for f, h, w, fps in np.unique(raw, axis=0):
        t = ditscale.train_shape(int(f), int(h), int(w), float(fps), shape_model)
        shapes.add((t["frames"], t["height"], t["width"]))
    ordered = sorted(shapes, key=lambda s: (seq_len_of(*s), s))
    if len(ordered) <= max_shapes:
        return ordered
    idx = sorted({round(i * (len(ordered) - 1) / (max_shapes - 1)) for i in range(max_shapes)})
    return [ordered[i] for i in idx]


def batch_grid(seq_len: int, max_tokens: int, points: int, max_batch: int) -> List[int]:
    """Powers of two B <= max_batch with B * S <= max_tokens, thinned to `points` (B = 1 and the
    largest kept, the rest geometrically spread)."""
    cands = [1 << k for k in range(0, 31) if (1 << k) * seq_len <= max_tokens
             and (1 << k) <= max_batch]
    if not cands:
        return [1]  # one sample over the token cap: still measure B = 1 (it may OOM)
    if len(cands) <= points:
        return cands
    if points <= 1:
        return [cands[-1]]
    idx = sorted({round(i * (len(cands) - 1) / (points - 1)) for i in range(points)})
    return [cands[i] for i in idx]


def accum_shapes(shapes: Sequence[Tuple[int, int, int]], n: int) -> List[Tuple[int, int, int]]:
    """n of the shapes (sorted by S) for the gradient-accumulation points, spread over the S range
    (the smallest and the largest first kept when n >= 2)."""
    if n <= 0 or not shapes:
        return []
    if n >= len(shapes):
        return list(shapes)
    if n == 1:
        return [shapes[len(shapes) // 2]]
    idx = sorted({round(i * (len(shapes) - 1) / (n - 1)) for i in range(n)})
    return [shapes[i] for i in idx]


def sweep_plan(shapes: Sequence[Tuple[int, int, int]], grids: Sequence[Sequence[int]],
               accum_points: int, accum_k: int = 2) -> List[Tuple[Tuple[int, int, int], int, int]]:
    """The measurement order: (shape, B, k micro-batches). Passes over the shapes (S ascending),
    one B per shape per pass (B ascending across passes); the accumulation points (k = accum_k at
    the shape's smallest B) follow the first pass."""
    passes = [[(s, g[p], 1) for s, g in zip(shapes, grids) if p < len(g)]
              for p in range(max(map(len, grids), default=0))]
    if not passes:
        return []
    first_b = {s: g[0] for s, g in zip(shapes, grids) if g}
    accum = [(s, first_b[s], accum_k) for s in accum_shapes(list(shapes), accum_points)]
    return passes[0] + accum + [x for p in passes[1:] for x in p]


def _fmt_s(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _agree_max(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ditscale.shape_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-1.3b", help="DiT config (wan2.1-1.3b, wan2.1-14b, "
                    "tiny)")
    ap.add_argument("--num-layers", type=int, default=None, help="override the block count")
    ap.add_argument("--model-impl", default="ditscale", choices=list(IMPLS),
                    help="ditscale's WanDiT or diffusers' WanTransformer3DModel")
    ap.add_argument("--shapes", default=None, help="FxHxW list, e.g. 1x256x256,17x480x832")
    ap.add_argument("--manifest", default=None, help="take the shapes from this manifest")
    ap.add_argument("--shape-model", default="wan2.1-1.3b",
                    help="ditscale model preset or JSON model file mapping manifest rows to shapes")
    ap.add_argument("--max-shapes", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=None, help="drop shapes with more tokens")
    ap.add_argument("--max-tokens", type=int, default=131072, help="cap on B*S per rank")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--points-per-shape", type=int, default=3)
    ap.add_argument("--accum-points", type=int, default=2,
                    help="shapes also timed as a step of 2 micro-batches (gradient accumulation; "
                    "rows with micro_batches=2 let `ditscale fit` fit the per-micro-batch "
                    "overhead a_mb); 0: none")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="bench.csv")
    ap.add_argument("--no-fused-adaln", action="store_true")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                    help="compute dtype (default bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pg-timeout-s", type=float, default=60.0)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop starting new points after this many seconds")
    ap.add_argument("--fail-above-tokens", type=int, default=None,
                    help="testing: treat micro-batches of more tokens as out of memory")
    return ap


def check_fused(args) -> bool:
    """Whether the sweep uses the fused AdaLN; SystemExit when it is asked for but unavailable."""
    if args.no_fused_adaln:
        return False
    from . import ops

    if not ops.is_available():
        raise SystemExit(f"fused AdaLN requested but {ops.load_error()}; "
                         "pass --no-fused-adaln")
    if args.model_impl == "diffusers":
        from .models.diffusers_wan import fused_adaln_function

        try:
            fused_adaln_function()
        except RuntimeError as e:
            raise SystemExit(str(e)) from e
    return True


def select_shapes(args) -> List[Tuple[int, int, int]]:
    """--shapes, the manifest's shapes or DEFAULT_SHAPES, at most --max-seq-len tokens, S
    ascending."""
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    elif args.manifest:
        shapes = manifest_shapes(args.manifest, args.shape_model, args.max_shapes)
    else:
        shapes = list(DEFAULT_SHAPES)
    if args.max_seq_len:
        shapes = [s for s in shapes if seq_len_of(*s) <= args.max_seq_len]
    shapes.sort(key=lambda s: (seq_len_of(*s), s))
    return shapes


class Sweep:
    """Times the plan's points on one model (rank 0 writes the CSV), rebuilding the model after
    an out-of-memory and skipping what that makes infeasible."""

    def __init__(self, args, cfg, env, dtype, fused: bool, out, log):
        self.args, self.cfg, self.env, self.dtype, self.fused = args, cfg, env, dtype, fused
        self.dev, self.out, self.log = env.device, out, log
        self.data = SyntheticData(cfg, self.dev, dtype, seed=args.seed)
        self.model, self.opt, self.runner = self.fresh()
        self.failed_b1_at = None  # a B = 1 OOM: every larger shape is infeasible too
        self.failed_shapes = set()  # shapes with an OOM: their larger B are skipped
        self.done = self.measured = self.infeasible = 0

    def fresh(self):
        a = self.args
        model, opt = build_model(self.cfg, self.dev, fused_adaln=self.fused, dtype=self.dtype,
                                 seed=a.seed, impl=a.model_impl)
        return model, opt, StepRunner(model, opt, self.dev, cfg=self.cfg, dtype=self.dtype)

    def write(self, text: str) -> None:
        if self.out:
            self.out.write(text)
            self.out.flush()

    def write_header(self, world_size: int) -> None:
        cfg, a, dev = self.cfg, self.args, self.dev
        self.write(f"# ditscale shape benchmark: model {cfg.name} layers {cfg.num_layers} dim "
                   f"{cfg.dim} heads {cfg.num_heads} ffn {cfg.ffn_dim} impl {a.model_impl}\n"
                   f"# world_size {world_size} device {dev.type} "
                   f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'} dtype "
                   f"{self.dtype} fused_adaln {int(self.fused)} warmup {a.warmup} "
                   f"steps {a.steps}\n" + ",".join(CSV_COLUMNS) + "\n")

    def run(self, plan) -> None:
        t_start = time.perf_counter()
        for (f, h, w), b, k in plan:
            s = seq_len_of(f, h, w)
            self.done += 1
            if (f, h, w) in self.failed_shapes or (self.failed_b1_at is not None
                                                   and s >= self.failed_b1_at):
                if self.out:
                    self.out.write(f"# infeasible,{b},{s},{f},{h},{w},skipped after a smaller "
                                   f"OOM{'' if k == 1 else f' (micro_batches {k})'}\n")
                self.infeasible += 1
                continue
            elapsed = _agree_max(time.perf_counter() - t_start, self.dev)
            if self.args.time_budget_s is not None and elapsed > self.args.time_budget_s:
                self.log(f"time budget {self.args.time_budget_s:.0f} s reached; stopping before "
                         f"point {self.done}")
                break
            line = self.point((f, h, w), b, k)
            el = time.perf_counter() - t_start
            eta = el / self.done * (len(plan) - self.done)
            self.log(f"[{self.done:>3d}/{len(plan)}] {line} | {_fmt_s(el)} elapsed, "
                     f"ETA {_fmt_s(eta)}")
        if self.out:
            self.out.write(f"# done: {self.measured} measured, {self.infeasible} infeasible, "
                           f"{time.perf_counter() - t_start:.1f} s\n")

    def time_steps(self, f, h, w, b, k):
        """(step, compute, sync, optim) seconds of each timed step, or None on out of memory."""
        a = self.args
        # k micro-batches of distinct samples; the loss scale averages over all k * B samples
        # as bench/train/policies.py's accumulated steps do.
        mbs = [self.data.for_pixels(list(range(i * b, (i + 1) * b)), f, h, w) for i in range(k)]
        reset_peak_memory(self.dev)
        rows = []
        for i in range(a.warmup + a.steps):
            st = self.runner.step(mbs, 1.0 / (k * b), fail_above_tokens=a.fail_above_tokens)
            if st.oom:
                return None
            if i >= a.warmup:
                rows.append((st.step_s, st.compute_s, st.sync_s, st.optim_s))
        return rows

    def point(self, shape, b: int, k: int) -> str:
        """Times one point, writes its row (or its infeasible line); the progress line."""
        f, h, w = shape
        s = seq_len_of(f, h, w)
        rows = self.time_steps(f, h, w, b, k)
        if rows is None:
            self.infeasible += 1
            del self.runner, self.model, self.opt
            release_memory(self.dev)
            self.model, self.opt, self.runner = self.fresh()
            self.write(f"# infeasible,{b},{s},{f},{h},{w},out-of-memory"
                       f"{'' if k == 1 else f' (micro_batches {k})'}\n")
            if b == 1 and k == 1:
                self.failed_b1_at = s
            self.failed_shapes.add(shape)
            return f"B={b:<4d} S={s:<6d} ({f}x{h}x{w}) out of memory: infeasible"
        self.measured += 1
        times = [r[0] for r in rows]
        mean = sum(times) / len(times)
        std = math.sqrt(sum((x - mean) ** 2 for x in times) / len(times))
        step = _agree_max(mean, self.dev)
        peak = _agree_max(float(peak_memory_bytes(self.dev)), self.dev)
        comp, sync, optim = (sum(r[j] for r in rows) / len(rows) for j in (1, 2, 3))
        n = self.env.world_size
        peak_field = str(int(peak)) if peak > 0 else ""
        self.write(f"{b},{s},{step:.6g},{peak_field},{k},{f},{h},{w},{n},{std:.3g},{comp:.6g},"
                   f"{sync:.6g},{optim:.6g},{k * b * s * n / step:.6g}\n")
        mem = f", peak {peak / 2**30:.1f} GiB" if peak > 0 else ""
        acc = "" if k == 1 else f" x{k} micro-batches"
        return (f"B={b:<4d} S={s:<6d} ({f}x{h}x{w}){acc} step {step:.4f} s "
                f"(+-{100 * std / mean:.1f}%){mem}, {k * b * s / step:,.0f} tok/s/rank")


def main(argv: Sequence[str] = None) -> int:
    args = parser().parse_args(argv)
    if args.accum_points < 0:
        raise SystemExit(f"--accum-points must be >= 0, got {args.accum_points}")
    env = init_distributed(args.device, args.pg_timeout_s)
    dev, is0 = env.device, env.rank == 0
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    cfg = make_config(args.model, args.num_layers)
    fused = check_fused(args)
    shapes = select_shapes(args)
    # Passes over the shapes (S ascending), one B per shape per pass (B ascending across
    # passes): every shape gets its B = 1 point before any shape gets a second one, so a time
    # budget still leaves a grid that spans the S range.
    grids = [batch_grid(seq_len_of(*s), args.max_tokens, args.points_per_shape, args.max_batch)
             for s in shapes]
    plan = sweep_plan(shapes, grids, args.accum_points)
    if not plan:
        raise SystemExit("nothing to measure (check --shapes / --max-seq-len)")

    def log(msg: str) -> None:
        if is0:
            print(msg, flush=True)

    log(f"shape_bench: {args.model_impl} {cfg.name} ({cfg.num_layers} layers, dim {cfg.dim}), "
        f"world size {env.world_size}, {dev.type}, {dtype}, fused AdaLN "
        f"{'on' if fused else 'off'}; {len(shapes)} shapes, {len(plan)} points -> {args.out}")
    out = open(args.out, "w") if is0 else None
    try:
        sweep = Sweep(args, cfg, env, dtype, fused, out, log)
        sweep.write_header(env.world_size)
        sweep.run(plan)
    finally:
        if out:
            out.close()
    log(f"wrote {args.out}: {sweep.measured} points measured, {sweep.infeasible} infeasible")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
