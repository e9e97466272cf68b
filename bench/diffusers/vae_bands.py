#!/usr/bin/env python3
"""The parallel VAE on one device: the stock decode against ``parallelize_vae`` at world size 1,
and one rank's band at N ranks run alone (the prediction of a decode on N GPUs without N GPUs).

    python -m bench.diffusers.vae_bands [--cases wan2.1-480p,wan2.1-720p,hunyuan-video,flux]
        [--ranks 2,4,8] [--band-ranks 0,1] [--reps 2] [--dtype bf16|fp32] [--device cuda|cpu]
        [--out-dir DIR]

A band at N ranks runs as rank r of a fake process group of N ranks (torch's ``fake`` backend)
with the parallel VAE's all-gathers answered by this rank's own part, N times, as a view (no
kernel, no communication), so the time and peak memory are one rank's compute with its halo rows
and the copy of the gathered output, and none of the communication. Timed: ``--band-ranks``
(default 0 and 1: the widest band and an interior band with two halos); the slowest is the
predicted decode time at N. Activations: the peak allocated during the call minus what was
allocated before it (weights and latents). Targets (docs/diffusers/vae.md): slowest band within
15% of stock / N, peak activations at N = 8 at most 0.2x the stock decode's. Writes
DIR/vae-bands.md (and on a GPU the top kernels of each measured call to
DIR/vae-bands-kernels.txt); cases: :data:`CASES`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from bench import reporter
from bench.common import int_list, name_list
from bench.timing import time_fn

FLUX = dict(latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
            shift_factor=0.1159)
TINY_WAN = dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                latents_std=[1.0] * 4)
TINY_VIDEO = dict(block_out_channels=(8, 8, 16, 16), latent_channels=4, layers_per_block=1,
                  norm_num_groups=4)
TINY_KL = dict(latent_channels=4, block_out_channels=(8, 16, 16), norm_num_groups=4,
               layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 3,
               up_block_types=("UpDecoderBlock2D",) * 3)


@dataclass(frozen=True)
class Case:
    """A VAE class with a config (its published one when empty) and the latents it decodes."""

    cls: str
    latents: Tuple[int, ...]  # [B, C, (F,) H, W]
    config: Dict = field(default_factory=dict)
    output: str = ""  # what the latents decode to


CASES = {
    "wan2.1-480p": Case("AutoencoderKLWan", (1, 16, 21, 60, 104), {}, "480x832, 81 frames"),
    "wan2.1-720p": Case("AutoencoderKLWan", (1, 16, 21, 90, 160), {}, "720x1280, 81 frames"),
    "hunyuan-video": Case("AutoencoderKLHunyuanVideo", (1, 16, 16, 68, 120), {},
                          "544x960, 61 frames"),
    "cogvideox": Case("AutoencoderKLCogVideoX", (1, 16, 13, 60, 90), {}, "480x720, 49 frames"),
    "flux": Case("AutoencoderKL", (1, 16, 256, 256), FLUX, "2048x2048"),
    "tiny-wan": Case("AutoencoderKLWan", (1, 4, 3, 16, 12), TINY_WAN, "128x96, 9 frames"),
    "tiny-kl": Case("AutoencoderKL", (1, 4, 16, 12), TINY_KL, "64x48"),
    "tiny-hunyuan": Case("AutoencoderKLHunyuanVideo", (1, 4, 3, 16, 12), dict(
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, **TINY_VIDEO), "128x96, 9 frames"),
    "tiny-cogvideox": Case("AutoencoderKLCogVideoX", (1, 4, 3, 16, 12), dict(
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, **TINY_VIDEO), "128x96, 9 frames"),
}
DTYPES = ("bf16", "fp32")


def parse_cases(text: str) -> List[str]:
    return name_list(text, "--cases", CASES)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=parse_cases,
                    default=parse_cases("wan2.1-480p,wan2.1-720p,hunyuan-video,flux"))
    ap.add_argument("--ranks", type=lambda t: int_list(t, "--ranks", 2, 64), default=[2, 4, 8])
    ap.add_argument("--band-ranks", type=lambda t: int_list(t, "--band-ranks", 0, 63),
                    default=[0, 1])
    ap.add_argument("--reps", type=lambda t: int_list(t, "--reps", 1, 100)[0], default=2)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda when there, else cpu")
    ap.add_argument("--out-dir", default=".")
    return ap.parse_args(argv)


@dataclass(frozen=True)
class Measure:
    """One decode function's timing, peak activations (MiB) and GPU busy time of one call
    (ms); the last two None on the CPU."""

    t: object  # bench.timing.Timing
    peak: Optional[float]
    busy: Optional[float]
    kernels: str = ""  # the top kernels of one call by device time (torch.profiler's table)

    def busy_text(self) -> str:
        """"GPU busy X ms (Y%)": the kernels' time of one call against its median."""
        if self.busy is None:
            return ""
        return f"GPU busy {self.busy:.0f} ms ({100 * self.busy / self.t.median_ms:.0f}%)"


class Meter:
    """Measures a decode function (warm-up 1, ``reps`` samples)."""

    def __init__(self, dev, reps: int):
        self.dev, self.reps = dev, reps

    def __call__(self, fn) -> Measure:
        import torch
        t = time_fn(fn, warmup=1, reps=self.reps, min_reps=1)
        if self.dev.type != "cuda":
            return Measure(t, None, None)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        return Measure(t, peak, *_busy(fn))


def _busy(fn):
    """(ms, table): the summed device time of the kernels and copies of one call of ``fn``
    (torch.profiler; below the call's CUDA-event time by the time the GPU waited for the
    host), and its top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    return (sum(e.self_device_time_total for e in events) / 1e3,
            events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70))


def _vae(case: Case, dev, dtype):
    import diffusers
    import torch
    torch.manual_seed(0)
    with torch.device(dev):
        vae = getattr(diffusers, case.cls)(**case.config)
    return vae.to(dtype).eval()


def _group(world: int, rank: int):
    """A fake process group of ``world`` ranks as ``rank`` (the previous one destroyed)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def _own_parts(bands, x, where):
    """The all-gather of one rank alone: its own ``x`` as every rank's part (a view)."""
    return x.reshape((1,) + tuple(x.shape)).expand((bands.size,) + tuple(x.shape))


@contextlib.contextmanager
def band_alone(vae, world: int, rank: int):
    """``vae`` parallelized as ``rank`` of a fake group of ``world`` ranks, its all-gathers
    answered by its own part (:func:`_own_parts`), for the ``with`` block."""
    import ditscale.sp as sp
    from ditscale.diffusers.parallel_vae import comm, parallelize_vae
    _group(world, rank)
    handle = parallelize_vae(vae, mesh=sp.Mesh.from_process_group())
    gather, comm._all_gather = comm._all_gather, _own_parts
    try:
        yield
    finally:
        comm._all_gather = gather
        handle.remove()


def _parallel(vae, z, world: int, rank: int, meter: Meter):
    """(Measure, output or None) of ``rank``'s decode in a fake group of ``world`` ranks (the
    output at world size 1)."""
    with band_alone(vae, world, rank):
        m = meter(lambda: vae.decode(z).sample)
        out = vae.decode(z).sample if world == 1 else None
    return m, out


def _mib(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b in (None, 0) else f"{a / b:.3f}x"


def case_rows(name: str, args, dev, dtype, kernels: list) -> List[list]:
    """The stock row, the world-size-1 row, and one row per N (its slowest timed band); appends
    (case, what, Measure) of the stock decode and each band to ``kernels``."""
    import torch
    case = CASES[name]
    vae = _vae(case, dev, dtype)
    z = torch.randn(case.latents, generator=torch.Generator().manual_seed(0)).to(dev, dtype)
    meter = Meter(dev, args.reps)
    with torch.no_grad():
        m0 = meter(lambda: vae.decode(z).sample)
        ref = vae.decode(z).sample
        m1, out = _parallel(vae, z, 1, 0, meter)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        kernels.append((name, "stock", m0))
        rows = [_row(name, "stock", "-", m0, m0, 1, m0.busy_text()),
                _row(name, "parallelize_vae, N=1", "0", m1, m0, 1, f"rel. error {err:.1e}",
                     m1.busy_text())]
        for world in args.ranks:
            bands = [r for r in args.band_ranks if r < world]
            runs = {r: _parallel(vae, z, world, r, meter)[0] for r in bands}
            slow = max(runs, key=lambda r: runs[r].t.median_ms)
            m = runs[slow]
            peaks = [x.peak for x in runs.values() if x.peak is not None]
            m = Measure(m.t, max(peaks) if peaks else None, m.busy, m.kernels)
            kernels.append((name, f"band at N={world}, rank {slow}", m))
            rows.append(_row(name, f"band at N={world}", str(slow), m, m0, world,
                             f"speed-up {m0.t.median_ms / m.t.median_ms:.2f}x",
                             m.busy_text()))
    return rows


def _row(name, what, rank, m: Measure, m0: Measure, world: int, *notes: str) -> list:
    """A table row: ``m`` against the stock decode ``m0`` / ``world``; the non-empty notes."""
    ratio = m.t.median_ms / (m0.t.median_ms / world)
    return [name, what, rank, *reporter.timing_cells(m.t),
            f"{ratio:.3f}x" + (" of stock/N" if world > 1 else ""), _mib(m.peak),
            _ratio(m.peak, m0.peak), "; ".join(n for n in notes if n) or "-"]


def kernel_tables(kernels: list) -> str:
    """The top kernels of each measured call, as text."""
    return "".join(f"== {name}: {what} ({m.busy_text()})\n{m.kernels}\n" for name, what, m in
                   kernels if m.kernels)


def run(args):
    """(the report, the kernel tables)."""
    import torch
    import torch.distributed as dist
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows, kernels = [], []
    try:
        for name in args.cases:
            rows += case_rows(name, args, dev, dtype, kernels)
            print(reporter.table(COLUMNS, rows[-2 - len(args.ranks):]), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    outputs = "; ".join(f"{n}: {CASES[n].cls} {CASES[n].output}, latents "
                        f"{list(CASES[n].latents)}" for n in args.cases)
    notes = (f"{args.dtype}, random weights of each class's published config. Bands: one "
             f"rank's decode alone (its all-gathers answered by its own part: no "
             f"communication), ranks "
             f"{args.band_ranks} timed, the slowest shown; time vs stock/N and activations "
             f"(peak allocated during the call minus before it) vs the stock decode's. "
             f"Cases: {outputs}.")
    return (reporter.report("Parallel VAE decode: stock, world size 1, one rank's band at N",
                            COLUMNS, rows, notes=notes, argv=sys.argv), kernel_tables(kernels))


COLUMNS = ["case", "what", "rank", *reporter.TIMING_COLUMNS, "time ratio", "peak act. MiB",
           "act. ratio", "note"]


def main(argv=None) -> int:
    args = parse_args(argv)
    text, kernels = run(args)
    reporter.write(os.path.join(args.out_dir, "vae-bands.md"), text)
    if kernels:
        reporter.write(os.path.join(args.out_dir, "vae-bands-kernels.txt"), kernels)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
