#!/usr/bin/env python3
"""Sequence-parallel inference of a Flux.1-like MMDiT: one denoising step per strategy.

    torchrun --nproc-per-node 2 examples/sp_inference.py --resolution 3072 4096 --strategies all \\
        [--emulate-machines 2] [--weights /ckpt/FLUX.1-dev/transformer] \\
        [--num-double 19 --num-single 38] [--steps-timed 2] [--json sp.json]
    python examples/sp_inference.py --device cpu --tiny          (CPU smoke test, one process)
    torchrun --nproc-per-node 2 examples/sp_inference.py --device cpu --tiny   (gloo, strategy
                                                                   "allgather" only)

Each strategy's output is compared with rank 0's single-device run (max_rel <= --tol); a table
is printed at the end. The steps, timing and columns: docs/models.md (section The example).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ditscale.models.mmdit import (
    build_mmdit,
    gather_tokens,
    image_ids,
    make_mmdit_config,
    pack_latents,
    shard_tokens,
)

SP_STRATEGIES = ("ulysses", "ulysses-overlap", "ring", "usp", "swiftfusion-tas", "torus")
ALL_STRATEGIES = SP_STRATEGIES + ("auto", "allgather")


def log(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(msg, flush=True)


def parse_resolution(text: str) -> Tuple[int, int]:
    """'3072' -> (3072, 3072); '1024x768' -> (1024, 768) (height x width, pixels)."""
    parts = text.lower().split("x")
    try:
        h, w = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--resolution: {text!r} is not N or HxW")
    if len(parts) > 2 or h <= 0 or w <= 0 or h % 16 or w % 16:
        raise argparse.ArgumentTypeError(f"--resolution: {text!r}: sizes must be positive "
                                         "multiples of 16 (VAE 8 x patch 2)")
    return h, w


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--resolution", nargs="+", type=parse_resolution, default=None,
                   help="pixel sizes, N or HxW (default 3072 4096; --tiny: 256)")
    p.add_argument("--strategies", nargs="+", default=["all"],
                   help=f"'all' or names from {ALL_STRATEGIES}")
    p.add_argument("--emulate-machines", type=int, default=0,
                   help="emulate M machines on this host (ditscale.sp.emulate_machines)")
    p.add_argument("--weights", default=None, help="diffusers Flux transformer checkpoint")
    p.add_argument("--tiny", action="store_true", help="the 'tiny' config (CPU smoke test)")
    p.add_argument("--num-double", type=int, default=None)
    p.add_argument("--num-single", type=int, default=None)
    p.add_argument("--steps-timed", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-single", action="store_true", help="skip the single-GPU step")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--chunks", type=int, default=2, help="torus chunks")
    p.add_argument("--transport", choices=("nccl", "nvshmem", "nvshmem-intra"), default="nccl")
    p.add_argument("--tol", type=float, default=None,
                   help="max_rel tolerance (default 3e-2 bf16, 1e-4 fp32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.tol is None:
        args.tol = 3e-2 if args.dtype == "bf16" else 1e-4
    if args.resolution is None:
        args.resolution = [(256, 256)] if args.tiny else [(3072, 3072), (4096, 4096)]
    for s in args.strategies:
        if s != "all" and s not in ALL_STRATEGIES:
            p.error(f"--strategies: unknown {s!r}; known: all, {', '.join(ALL_STRATEGIES)}")
    if args.steps_timed < 1 or args.warmup < 0:
        p.error("--steps-timed must be >= 1 and --warmup >= 0")
    return args


# ---------------------------------------------------------------------------------------------
# Distributed setup and attention functions.


def init(args) -> Tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("sp_inference: --device cuda but no GPU is visible (use --device cpu --tiny)")
        torch.cuda.set_device(device)
    if world > 1:
        if args.emulate_machines:
            import ditscale.sp as sp

            sp.emulate_machines(args.emulate_machines)  # before the process group exists
        kw = {"backend": "nccl" if args.device == "cuda" else "gloo",
              # rank 0 runs the single-GPU steps alone while the others wait in a barrier
              "timeout": datetime.timedelta(minutes=30)}
        if args.device == "cuda":
            kw["device_id"] = device
        dist.init_process_group(**kw)
    return rank, world, device


def gather_kv_attention(q, k, v, joint_q=None, joint_k=None, joint_v=None, total=None):
    """Reference SP attention: all-gather the image k/v shards, SDPA over [text; all image]."""
    k_all, v_all = gather_tokens(k, total), gather_tokens(v, total)
    t = joint_q.shape[1]
    qq, kk, vv = (torch.cat([a, b], dim=1) for a, b in
                  ((joint_q, q), (joint_k, k_all), (joint_v, v_all)))
    o = F.scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2),
                                       vv.transpose(1, 2)).transpose(1, 2)
    return o[:, t:], o[:, :t]


def make_attention(name: str, mesh, args, total: int):
    if name == "allgather":
        return functools.partial(gather_kv_attention, total=total)
    import ditscale.sp as sp

    kw = {"mesh": mesh, "strategy": name, "transport": args.transport}
    if name == "torus":
        kw["chunks"] = args.chunks
    return functools.partial(sp.attention, **kw)


# ---------------------------------------------------------------------------------------------
# Timing.


class StepTimer:
    """Seconds of one call: CUDA events on the current stream (host clock on CPU)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def run_steps(fn, args, timer, label: str, rank: int):
    out = None
    for i in range(args.warmup):
        out, s = timer(fn)
        log(f"  {label}: warm-up {i + 1}/{args.warmup} {s * 1e3:.1f} ms", rank)
    times = []
    for i in range(args.steps_timed):
        out, s = timer(fn)
        times.append(s)
        log(f"  {label}: step {i + 1}/{args.steps_timed} {s * 1e3:.1f} ms", rank)
    return out, sum(times) / len(times)


def max_over_ranks(x: float, device, world: int) -> float:
    if world == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def compare(out: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
    o, r = out.double(), ref.double()
    return {"max_rel": float((o - r).abs().max() / r.abs().max().clamp_min(1e-30)),
            "rel_l2": float((o - r).norm() / r.norm().clamp_min(1e-30))}


# ---------------------------------------------------------------------------------------------


def make_inputs(cfg, h_px: int, w_px: int, seed: int, device, dtype):
    """Same on every rank: generated on the CPU from the seed, then moved."""
    g = torch.Generator().manual_seed(seed + 1)
    gh, gw = h_px // 16, w_px // 16
    latents = torch.randn(1, cfg.latent_channels, 2 * gh, 2 * gw, generator=g)
    return {
        "img": pack_latents(latents).to(device, dtype),
        "ids": image_ids(gh, gw, device=device),
        "text": torch.randn(1, cfg.text_len, cfg.text_dim, generator=g).to(device, dtype),
        "pooled": torch.randn(1, cfg.pooled_dim, generator=g).to(device, dtype),
        "t": torch.full((1,), 0.5, device=device),
        "g": torch.full((1,), 3.5, device=device) if cfg.guidance_embeds else None,
    }


def select_strategies(args, device, world: int, rank: int):
    """(the strategies to run, the ditscale.sp mesh or None when only "allgather" runs)."""
    strategies = list(args.strategies)
    if "all" in strategies:
        strategies = list(SP_STRATEGIES) if device.type == "cuda" else ["allgather"]
    if world == 1:
        strategies = []
    mesh = None
    if any(s != "allgather" for s in strategies):
        try:
            import ditscale.sp as sp
        except ImportError as e:
            sys.exit(f"sp_inference: strategies {strategies} need ditscale.sp: {e}")
        mesh = sp.Mesh.from_process_group()
        log(f"mesh: {mesh.machines} machine(s) x {mesh.gpus_per_machine} GPU(s)", rank)
    return strategies, mesh


def load_model(cfg, args, device, dtype, world: int, rank: int):
    """The model of ``cfg``: random weights from --seed, or --weights loaded into it."""
    t0 = time.perf_counter()
    model = build_mmdit(cfg, device=device, dtype=dtype,
                        seed=None if args.weights else args.seed)
    if args.weights:
        from ditscale.models.flux_weights import load_diffusers_flux

        stats = load_diffusers_flux(model, args.weights)
        log(f"loaded {stats['tensors']} tensors ({stats['bytes'] / 2**30:.2f} GiB) from "
            f"{stats['files']} file(s) of {args.weights}", rank)
    log(f"model {cfg.name}: {cfg.num_double} double + {cfg.num_single} single blocks, hidden "
        f"{cfg.hidden}, {model.num_params() / 1e9:.3f} B params, {args.dtype} on {device.type}, "
        f"{world} rank(s); built in {time.perf_counter() - t0:.1f} s", rank)
    return model


def run_single(forward, inp, tag: str, total: int, args, timer, rank: int, world: int, rows):
    """Rank 0's single-device run (the reference): (its output or None, its latency or None)."""
    ref: Optional[torch.Tensor] = None
    single_s = None
    if rank == 0:
        log(f"[{tag}] single {timer.device.type} (SDPA)", rank)
        ref, single_s = run_steps(lambda: forward(inp["img"], inp["ids"]), args, timer,
                                  "single", rank)
        rows.append({"resolution": tag, "tokens": total, "strategy": "single",
                     "ranks": 1, "latency_s": single_s, "speedup": 1.0})
        if timer.device.type == "cuda":
            torch.cuda.empty_cache()
    if world > 1:
        dist.barrier()
    return ref, single_s


def run_strategy(name: str, forward, inp, tag: str, total: int, mesh, args, timer, rank: int,
                 world: int, ref, single_s) -> Dict:
    """One strategy on every rank's shard: its row (latency, speed-up, error against ref)."""
    device = timer.device
    log(f"[{tag}] {name} on {world} ranks", rank)
    img = shard_tokens(inp["img"], rank, world)
    ids = shard_tokens(inp["ids"], rank, world, dim=0)
    row = {"resolution": tag, "tokens": total, "strategy": name, "ranks": world}
    try:
        attn = make_attention(name, mesh, args, total)
        out, local_s = run_steps(lambda: forward(img, ids, attn), args, timer, name, rank)
        row["latency_s"] = max_over_ranks(local_s, device, world)
        full = gather_tokens(out, total)
        if single_s is not None:
            row["speedup"] = single_s / row["latency_s"]
        if rank == 0 and ref is not None:
            row.update(compare(full, ref))
            row["ok"] = row["max_rel"] <= args.tol
    except Exception as e:  # a strategy the API rejects: report it, run the others
        row["error"] = f"{type(e).__name__}: {e}"
        log(f"  {name}: error: {row['error']}", rank)
    return row


def write_json(path: str, cfg, rows: List[Dict], args, world: int, device) -> None:
    with open(path, "w") as f:
        json.dump({"config": {k: getattr(cfg, k) for k in (
            "name", "num_double", "num_single", "hidden", "num_heads", "text_len")},
            "ranks": world, "dtype": args.dtype, "device": device.type,
            "tol": args.tol, "rows": rows}, f, indent=2)
    print(f"wrote {path}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = init(args)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    over = {k: v for k, v in (("num_double", args.num_double), ("num_single", args.num_single))
            if v is not None}
    cfg = make_mmdit_config("tiny" if args.tiny else "flux.1-dev", **over)
    strategies, mesh = select_strategies(args, device, world, rank)
    model = load_model(cfg, args, device, dtype, world, rank)

    timer = StepTimer(device)
    rows: List[Dict] = []
    for h_px, w_px in args.resolution:
        inp = make_inputs(cfg, h_px, w_px, args.seed, device, dtype)
        total = inp["img"].shape[1]
        tag = f"{h_px}x{w_px}"
        log(f"[{tag}] {total} image tokens + {cfg.text_len} text tokens", rank)

        def forward(img, ids, attn=None):
            with torch.inference_mode():
                return model(img, ids, inp["text"], inp["pooled"], inp["t"], inp["g"], attn=attn)

        ref, single_s = None, None
        if not args.no_single:
            ref, single_s = run_single(forward, inp, tag, total, args, timer, rank, world, rows)
        for name in strategies:
            rows.append(run_strategy(name, forward, inp, tag, total, mesh, args, timer, rank,
                                     world, ref, single_s))
            dist.barrier()

    if rank == 0:
        print_table(rows, args, world)
        if args.json:
            write_json(args.json, cfg, rows, args, world, device)
    failed = any(r.get("ok") is False or "error" in r for r in rows)
    if world > 1:
        flag = torch.tensor([1.0 if failed else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
        dist.destroy_process_group()
    return 1 if failed else 0


def print_table(rows: List[Dict], args, world: int) -> None:
    print(f"\n{'resolution':>11} {'tokens':>7} {'strategy':>16} {'ranks':>5} {'latency ms':>11} "
          f"{'speed-up':>9} {'max_rel':>9} {'rel_l2':>9}  check", flush=True)
    for r in rows:
        lat = f"{r['latency_s'] * 1e3:11.1f}" if "latency_s" in r else f"{'-':>11}"
        sp = f"{r['speedup']:8.2f}x" if "speedup" in r else f"{'-':>9}"
        mr = f"{r['max_rel']:9.2e}" if "max_rel" in r else f"{'-':>9}"
        l2 = f"{r['rel_l2']:9.2e}" if "rel_l2" in r else f"{'-':>9}"
        check = ("error: " + r["error"]) if "error" in r else (
            "-" if "ok" not in r else ("ok" if r["ok"] else f"FAIL (tol {args.tol:g})"))
        print(f"{r['resolution']:>11} {r['tokens']:>7} {r['strategy']:>16} {r['ranks']:>5} "
              f"{lat} {sp} {mr} {l2}  {check}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
