#!/usr/bin/env python3
"""The parallel VAE decode on N ranks for real: every rank of a torchrun group decodes the same
latents three ways, the stock decode (each rank alone, the whole video), diffusers' tiling (each
rank alone) and ``parallelize_vae`` over the group (each rank its band, the output gathered on
every rank); time (the slowest rank's), per-rank peak activations and the error against the
stock decode.

    python -m torch.distributed.run --nproc-per-node N -m bench.diffusers.vae_decode_multi \
        [--cases wan2.1-480p,wan2.1-720p,hunyuan-video,flux] [--modes stock,tiling,parallel]
        [--reps 2] [--dtype bf16|fp32] [--timeout-s 300] [--out-dir DIR]

Without torchrun it runs as one rank. NCCL on CUDA devices (cuda:LOCAL_RANK), gloo on
the CPU. Targets (docs/diffusers/vae.md): at least 1.8x the stock decode at N = 2 and 6x at
N = 8, with the error of a world-size-1 decode (exact: the same function). Cases:
bench.diffusers.vae_bands.CASES. Writes DIR/vae-decode-multi-N.md on rank 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

from bench import reporter
from bench.common import int_list, name_list
from bench.diffusers import vae_bands as vb
from bench.timing import time_fn

MODES = ("stock", "tiling", "parallel")
COLUMNS = ["case", "mode", "ranks", *reporter.TIMING_COLUMNS, "speed-up", "peak act. MiB",
           "act. ratio", "rel. error", "note"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=lambda s: name_list(s, "--cases", vb.CASES),
                   default=["wan2.1-480p", "wan2.1-720p", "hunyuan-video", "flux"])
    p.add_argument("--modes", type=lambda s: name_list(s, "--modes", dict.fromkeys(MODES)),
                   default=list(MODES))
    p.add_argument("--reps", type=lambda t: int_list(t, "--reps", 1, 100)[0], default=2)
    p.add_argument("--dtype", default="bf16", choices=vb.DTYPES)
    p.add_argument("--timeout-s", type=lambda t: int_list(t, "--timeout-s", 10, 3600)[0],
                   default=300, help="the process group's timeout (10..3600)")
    p.add_argument("--out-dir", default=".")
    return p.parse_args(argv)


class Group:
    """This process's rank of the benchmark's group (ditscale.models.training.init_distributed:
    torchrun's, or one rank of its own)."""

    def __init__(self, timeout_s: int):
        import torch
        import torch.distributed as dist
        from ditscale.models.training import init_distributed
        self.torch, self.dist = torch, dist
        env = init_distributed("auto", timeout_s=timeout_s)
        self.dev, self.rank, self.size = env.device, env.rank, env.world_size

    def max(self, x: float) -> float:
        t = self.torch.tensor([x], dtype=self.torch.float64, device=self.dev)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def barrier(self) -> None:
        self.dist.barrier()
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()


def measure(g: Group, fn, reps: int):
    """(Timing: the slowest rank's per sample, peak activations MiB: the largest rank's or
    None, the output of one more call)."""
    torch = g.torch
    clock = "cuda" if g.dev.type == "cuda" else "wall"
    t = time_fn(fn, warmup=1, reps=reps, min_reps=1, clock=clock, before_each=g.barrier,
                reduce=g.max)
    peak = None
    if g.dev.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    out = fn()
    if g.dev.type == "cuda":
        torch.cuda.synchronize()
        peak = g.max((torch.cuda.max_memory_allocated() - before) / 2**20)
    return t, peak, out


def _rel(g: Group, out, ref) -> float:
    """The largest rank's ||out - ref|| / ||ref|| (float32)."""
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return g.max(err)


def case_rows(g: Group, name: str, args) -> List[list]:
    """One row per mode of ``name`` (stock first: the reference of the others)."""
    import torch
    from ditscale.diffusers.parallel_vae import parallelize_vae
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    case = vb.CASES[name]
    vae = vb._vae(case, g.dev, dtype)
    z = torch.randn(case.latents, generator=torch.Generator().manual_seed(0)).to(g.dev, dtype)
    decode = lambda: vae.decode(z).sample  # noqa: E731
    rows = []
    with torch.no_grad():
        t0, peak0, ref = measure(g, decode, args.reps)
        for mode in args.modes:
            if mode == "stock":
                t, peak, out = t0, peak0, ref
            elif mode == "tiling":
                vae.enable_tiling()
                t, peak, out = measure(g, decode, args.reps)
                vae.disable_tiling()
            else:
                handle = parallelize_vae(vae)
                t, peak, out = measure(g, decode, args.reps)
                handle.remove()
            rows.append(_row(name, mode, g.size, t, t0, peak, peak0, _rel(g, out, ref)))
            del out
    return rows


def _row(name, mode, size, t, t0, peak, peak0, err) -> list:
    speed = t0.median_ms / t.median_ms
    note = "-"
    if mode == "parallel" and size in (2, 8):
        target = 1.8 if size == 2 else 6.0
        note = f"target >= {target}x: {'met' if speed >= target else 'not met'}"
    return [name, mode, size, *reporter.timing_cells(t), f"{speed:.2f}x", vb._mib(peak),
            vb._ratio(peak, peak0), f"{err:.1e}", note]


def main(argv=None) -> int:
    args = parse_args(argv)
    g = Group(args.timeout_s)
    rows = []
    try:
        for name in args.cases:
            rows += case_rows(g, name, args)
            if g.rank == 0:
                print(reporter.table(COLUMNS, rows[-len(args.modes):]), flush=True)
        g.dist.barrier()  # no rank tears its group down while another still uses it
    finally:
        g.dist.destroy_process_group()
    if g.rank == 0:
        notes = (f"{args.dtype}, random weights of each class's published config, {g.size} "
                 f"ranks on {g.dev.type}; time: the slowest rank per sample (a barrier before "
                 f"each); peak: the largest rank's activations (peak allocated during the call "
                 f"minus before it); rel. error against the stock decode (the largest rank's).")
        text = reporter.report(f"Parallel VAE decode on {g.size} ranks", COLUMNS, rows,
                               notes=notes, argv=sys.argv)
        reporter.write(os.path.join(args.out_dir, f"vae-decode-multi-{g.size}.md"), text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
