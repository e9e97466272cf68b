"""Calibrates the sequence-parallel simulator (ditscale/sp/topology.h) on the lent machine.

Two steps:

  # measure (torchrun, one launch per link type: NCCL_HOSTID must be set before NCCL starts)
  torchrun --nproc-per-node 2 -m bench.sp.calibrate measure --out raw-nvlink.json
  torchrun --nproc-per-node 2 -m bench.sp.calibrate measure --emulate-machines 2 --p2p-only \
      --out raw-emulated.json
  # fit (one process, CPU is enough): topology JSON files for `ditscale sp simulate --cluster`
  python -m bench.sp.calibrate fit raw-nvlink.json [raw-emulated.json] --out-dir DIR

What is measured (every rank at once, each on its own GPU; the max over ranks is kept, since a
layer waits for its slowest rank):
  * NCCL send/recv between rank r and rank (r + N/2) % N (the other emulated machine when
    emulated): bidirectional (both send at once, as in ring steps and all-to-alls: the per-direction
    bandwidth that the simulator's full-duplex links model) and unidirectional, 4 KiB .. 256 MiB.
  * cuDNN attention (aten._scaled_dot_product_cudnn_attention with log-sum-exp, as the GPU
    executor calls it), hd 128, bf16, non-causal, for q/kv block sizes 512 .. 66,048.
  * HBM: a 1 GiB device copy (bytes moved = read + write, as MemorySeconds counts them).
  * a bf16 GEMM (Flux MLP shape) for linear_tflops; back-to-back tiny kernels for the launch gap.
  * a two-way send/recv (64 MiB emulated, 1 GiB NVLink) alone and beside a long attention call on
    both ranks (--no-interference skips it): the share of its rate lost while the GPUs compute
    (interference_from_times), inter_compute_interference of the emulated link's topology.

What is fitted (see fit_link / fit_attention):
  * link: latency = the time of the smallest messages; bandwidth = 1 / slope of time over bytes
    for messages >= 4 MiB (the protocol regime that the layers' 10-400 MB transfers run in).
  * attention: t = launch + F * Wave(q) / (attention_flops * Eff(q) * Eff(kv)),
    Eff(t) = t / (t + h), Wave = ceil(W) / W for W = heads * ceil(q / 128) / SMs (the partial
    last wave of CTAs costs a full one; lab/results/sp-attn-split_h200_2026-12/):
    attention_flops in closed form for each h, h by a log-grid search refined by golden section,
    minimising the squared RELATIVE error (times span four orders of magnitude).
The NCCL small-message time on NVLink becomes two_sided_sync_us (+ the preset's 5 us intra
latency: NCCL alone cannot separate the two); the socket's extra small-message time over that is
inter_latency_us. Keys not measured (two_sided_sm_fraction, one_sided_overhead_us; and
inter_compute_interference when the raw file predates its measurement) come from the "h200-local"
base preset.

Outputs of `fit` in --out-dir:
  topology-h200.json                  NVLink within a machine, the socket between emulated ones
  topology-h200-nvlink-machines.json  the 2 NVLink GPUs seen as 2 "machines" (the NIC is NVLink),
                                      for runs with a logical 2x1 mesh on one host
  calibration.json                    every fit, its residual, and the measured points
Both topology files are checked with the ditscale CLI when it is found (ditscale on PATH,
$DITSCALE_CLI, or build*/tools/ditscale).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ditscale import _core

from bench import reporter
from bench.common import find_cli, flux_call_inputs
from bench.timing import time_fn

KIB, MIB, GIB = 1024, 1024**2, 1024**3

# Intra-machine latency the preset assumes (NCCL cannot split it from its per-op sync cost).
PRESET_INTRA_LATENCY_US = 5.0

# ---------------------------------------------------------------------------------------------
# Fitting (pure Python, unit-tested on synthetic data)
# ---------------------------------------------------------------------------------------------


def _lstsq2(rows: Sequence[tuple[float, float]], rhs: Sequence[float]) -> tuple[float, float]:
    """Least squares for 2 unknowns: minimise sum (r0*a + r1*b - y)^2 (normal equations)."""
    s00 = sum(r[0] * r[0] for r in rows)
    s01 = sum(r[0] * r[1] for r in rows)
    s11 = sum(r[1] * r[1] for r in rows)
    y0 = sum(r[0] * y for r, y in zip(rows, rhs))
    y1 = sum(r[1] * y for r, y in zip(rows, rhs))
    det = s00 * s11 - s01 * s01
    if abs(det) <= 1e-300 * max(1.0, s00 * s11):
        raise ValueError("degenerate fit: need at least two distinct message sizes")
    return (y0 * s11 - y1 * s01) / det, (s00 * y1 - s01 * y0) / det


def interference_from_times(alone_s: float, beside_s: float, attention_s: float) -> float:
    """The share f of a transfer's rate lost while compute runs, from its time alone (x), beside
    compute that started with it (t) and that compute's time (a): the transfer runs at (1 - f)
    for min(a, t), then at full rate, so t = x + f * min(a, t). Clamped to [0, 0.95] (the
    simulator takes [0, 1))."""
    if not (alone_s > 0 and beside_s > 0 and attention_s > 0):
        raise ValueError(f"times must be > 0, got alone {alone_s}, beside {beside_s}, "
                         f"attention {attention_s}")
    return min(0.95, max(0.0, (beside_s - alone_s) / min(attention_s, beside_s)))


def fit_link(sizes_bytes: Sequence[float], seconds: Sequence[float],
             large_bytes: float = 4 * MIB, small_bytes: float = 64 * KIB) -> dict:
    """Latency and bandwidth of a link from (message size, time per message) points.

    latency_s: the median time of messages <= small_bytes (the smallest message if none);
    bandwidth_Bps: 1 / slope of a relative-error-weighted line t = a + x / bw through the
    messages >= large_bytes (all messages when fewer than two are that large).
    Also returns the rms relative error of t = latency + x / bw over all points."""
    pts = sorted(zip(sizes_bytes, seconds))
    if len(pts) < 2 or any(t <= 0 for _, t in pts):
        raise ValueError("fit_link: need >= 2 points with positive times")
    small = sorted(t for x, t in pts if x <= small_bytes) or [pts[0][1]]
    latency = small[len(small) // 2]
    large = [(x, t) for x, t in pts if x >= large_bytes]
    if len({x for x, _ in large}) < 2:
        large = pts
    # Minimise sum ((a + b x) / t - 1)^2: linear in (a, b).
    a, b = _lstsq2([(1.0 / t, x / t) for x, t in large], [1.0] * len(large))
    if b <= 0:
        raise ValueError("fit_link: time does not grow with size (check the measurements)")
    bw = 1.0 / b
    rms = math.sqrt(sum(((latency + x / bw) / t - 1) ** 2 for x, t in pts) / len(pts))
    return {"latency_s": latency, "bandwidth_Bps": bw, "intercept_s": a, "rms_rel_err": rms,
            "points": len(pts)}


# The attention model is the simulator's own (Topology::WaveFactor / AttentionSeconds in
# ditscale/sp/topology.cc, bound as ditscale._core.sp_wave_factor / sp_attention_seconds): one
# formula for the fit and the prediction. The wave model's tile (query rows per CTA of cuDNN's
# forward kernel; measured on the H200: lab/results/sp-attn-split_h200_2026-12/, steps every 11
# tiles x 12 heads = 132 CTAs = the SM count) is Topology's default, passed explicitly.
ATTENTION_TILE_TOKENS = 128


def wave_factor(q: float, batch_heads: float, slots: int,
                tile: int = ATTENTION_TILE_TOKENS) -> float:
    """ceil(W) / W, W = batch_heads * ceil(q / tile) / slots (Topology::WaveFactor); 1 when
    slots, batch_heads or q is 0."""
    return _core.sp_wave_factor(q, batch_heads, slots, tile)


def attention_model_s(flops: float, q: float, kv: float, attention_flops: float,
                      half_tokens: float, launch_s: float, batch_heads: float = 0,
                      slots: int = 0) -> float:
    """The simulator's attention time in seconds (Topology::AttentionSeconds):
    launch_s + flops * Wave(q) / (attention_flops * Eff(q) * Eff(kv)), Eff(t) = t / (t + h)."""
    return _core.sp_attention_seconds(flops, q, kv, attention_flops, half_tokens, launch_s,
                                      batch_heads, slots, ATTENTION_TILE_TOKENS)


def _attention_fit_at(samples: Sequence[dict], h: float, launch_s: float,
                      slots: int = 0) -> tuple[float, float]:
    """(attention_flops, sum of squared relative errors) for a fixed half_tokens h."""
    # x = F * Wave(q) / (Eff(q) * Eff(kv)): the model's time at 1 FLOP/s without launch, so that
    # t = L + c x with c = 1 / attention_flops.
    xs = [attention_model_s(s["flops"], s["q_tokens"], s["kv_tokens"], 1.0, h, 0.0,
                            s.get("heads", 0), slots) for s in samples]
    ts = [s["seconds"] for s in samples]
    # Minimise sum ((L + c x) / t - 1)^2 over c = 1 / attention_flops.
    num = sum((x / t) * (1 - launch_s / t) for x, t in zip(xs, ts))
    den = sum((x / t) ** 2 for x, t in zip(xs, ts))
    c = num / den
    if c <= 0:
        return float("inf"), float("inf")
    err = sum(((launch_s + c * x) / t - 1) ** 2 for x, t in zip(xs, ts))
    return 1.0 / c, err


def fit_attention(samples: Sequence[dict], launch_s: float = 5e-6,
                  h_range: tuple[float, float] = (1.0, 65536.0), slots: int = 0) -> dict:
    """Fits attention_flops and attention_half_tokens to measured attention blocks.

    samples: dicts with q_tokens, kv_tokens, flops, seconds (and heads: batch 1, for the wave
    model when slots > 0). Returns attention_flops (FLOP/s), attention_half_tokens,
    attention_slots, rms_rel_err and max_rel_err."""
    samples = [s for s in samples if s.get("seconds", 0) > 0]
    if len(samples) < 2:
        raise ValueError("fit_attention: need >= 2 measured blocks")
    lo, hi = math.log(h_range[0]), math.log(h_range[1])
    grid = [lo + (hi - lo) * i / 400 for i in range(401)]
    errs = [_attention_fit_at(samples, math.exp(g), launch_s, slots)[1] for g in grid]
    i = min(range(len(grid)), key=errs.__getitem__)
    a, b = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    # Golden-section refinement in log h around the best grid point.
    phi = (math.sqrt(5) - 1) / 2
    c, d = b - phi * (b - a), a + phi * (b - a)
    fc = _attention_fit_at(samples, math.exp(c), launch_s, slots)[1]
    fd = _attention_fit_at(samples, math.exp(d), launch_s, slots)[1]
    for _ in range(60):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - phi * (b - a)
            fc = _attention_fit_at(samples, math.exp(c), launch_s, slots)[1]
        else:
            a, c, fc = c, d, fd
            d = a + phi * (b - a)
            fd = _attention_fit_at(samples, math.exp(d), launch_s, slots)[1]
    h = math.exp((a + b) / 2)
    flops, _ = _attention_fit_at(samples, h, launch_s, slots)
    rel = [attention_model_s(s["flops"], s["q_tokens"], s["kv_tokens"], flops, h, launch_s,
                             s.get("heads", 0), slots) / s["seconds"] - 1 for s in samples]
    return {"attention_flops": flops, "attention_half_tokens": h, "launch_s": launch_s,
            "attention_slots": slots, "attention_tile_tokens": ATTENTION_TILE_TOKENS,
            "rms_rel_err": math.sqrt(sum(r * r for r in rel) / len(rel)),
            "max_rel_err": max(abs(r) for r in rel), "points": len(samples)}


def topology_from_fits(fits: dict, name: str, gpus_per_machine: int,
                       nvlink_as_machines: bool = False) -> dict:
    """A cluster JSON for `ditscale sp simulate --cluster` (keys of ditscale/sp/topology.h; GB/s
    = 1e9 B/s, microseconds) from the fits of `fit` (keys intra, inter, attention, hbm_Bps,
    linear_flops, launch_s; any may be missing and then the base preset's value stays)."""
    t = {"base": "h200-local", "name": name, "gpus_per_machine": gpus_per_machine}
    intra, inter, att = fits.get("intra"), fits.get("inter"), fits.get("attention")
    sync_us = None
    if intra:
        t["intra_bandwidth_GBps"] = round(intra["bandwidth_Bps"] / 1e9, 3)
        t["intra_latency_us"] = PRESET_INTRA_LATENCY_US
        sync_us = max(0.0, intra["latency_s"] * 1e6 - PRESET_INTRA_LATENCY_US)
        t["two_sided_sync_us"] = round(sync_us, 2)
    # One "NIC" per GPU both for NVLink split into logical machines (every GPU has its own
    # NVLink ports) and for emulated machines (every GPU pair has its own loopback sockets; the
    # calibration measures one pair).
    t["nics_per_machine"] = 0
    if nvlink_as_machines:
        # The "NIC" is NVLink: none of the socket link's loss while the GPUs compute.
        t["inter_compute_interference"] = 0.0
        if intra:
            t["nic_bandwidth_GBps"] = t["intra_bandwidth_GBps"]
            t["inter_latency_us"] = t["intra_latency_us"]
    elif inter:
        t["nic_bandwidth_GBps"] = round(inter["bandwidth_Bps"] / 1e9, 4)
        uni = inter.get("unidirectional")
        if uni and uni["bandwidth_Bps"] > 1.1 * inter["bandwidth_Bps"]:
            # One way is faster than each direction of a two-way exchange (loopback sockets
            # share their copies between directions): the NIC's rate is the one-way one, and
            # both directions together are limited to twice the two-way rate.
            t["nic_bandwidth_GBps"] = round(uni["bandwidth_Bps"] / 1e9, 4)
            t["nic_duplex_GBps"] = round(2 * inter["bandwidth_Bps"] / 1e9, 4)
        if "compute_interference" in inter:
            t["inter_compute_interference"] = round(inter["compute_interference"], 3)
        base_sync = sync_us if sync_us is not None else 15.0
        t["inter_latency_us"] = round(max(0.0, inter["latency_s"] * 1e6 - base_sync), 2)
    if att:
        t["attention_tflops"] = round(att["attention_flops"] / 1e12, 2)
        t["attention_half_tokens"] = round(att["attention_half_tokens"], 1)
        t["attention_slots"] = int(att.get("attention_slots", 0))
        t["attention_tile_tokens"] = int(att.get("attention_tile_tokens", ATTENTION_TILE_TOKENS))
    if fits.get("linear_flops"):
        t["linear_tflops"] = round(fits["linear_flops"] / 1e12, 1)
    if fits.get("hbm_Bps"):
        t["hbm_bandwidth_GBps"] = round(fits["hbm_Bps"] / 1e9, 1)
    if fits.get("launch_s"):
        t["launch_overhead_us"] = round(fits["launch_s"] * 1e6, 2)
    return t


# ---------------------------------------------------------------------------------------------
# The simulator CLI (also used by report.py)
# ---------------------------------------------------------------------------------------------


def flux_height_width(image_tokens: int) -> tuple[int, int]:
    """Pixels (H, W) of a Flux image of `image_tokens` = (H/16) * (W/16), as square as possible."""
    if image_tokens <= 0:
        raise ValueError(f"image tokens must be > 0, got {image_tokens}")
    h = max(d for d in range(1, math.isqrt(image_tokens) + 1) if image_tokens % d == 0)
    return 16 * h, 16 * (image_tokens // h)


def simulate(cli: str, cluster: str, machines: int, gpus_per_machine: int, strategy: str,
             image_tokens: int, chunks: int = 1, one_sided: bool = False,
             batch: int = 1, transport: str = "", comm_sms: int = 0) -> dict:
    """`ditscale sp simulate ... --json` for the Flux attention layer with `image_tokens`
    (512 text tokens, 24 x 128 heads). `transport` (nccl | nvshmem | nvshmem-intra), when given,
    overrides `one_sided`; `comm_sms` > 0: SMs kept for communication (an SM partition). Raises
    RuntimeError with the CLI's message on failure."""
    h, w = flux_height_width(image_tokens)
    cmd = [cli, "sp", "simulate", "--cluster", str(cluster), "--machines", str(machines),
           "--gpus-per-machine", str(gpus_per_machine), "--model", "flux", "--height", str(h),
           "--width", str(w), "--batch", str(batch), "--strategy", strategy, "--json"]
    if strategy == "torus":
        cmd += ["--chunks", str(chunks)]
    if transport:
        cmd += ["--transport", transport]
    elif one_sided:
        cmd.append("--one-sided")
    if comm_sms:
        cmd += ["--comm-sms", str(comm_sms)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return json.loads(r.stdout)


# ---------------------------------------------------------------------------------------------
# Measuring (GPU, torchrun)
# ---------------------------------------------------------------------------------------------

ATTENTION_BLOCKS = [  # (q tokens, kv tokens, heads)
    (512, 512, 24), (1024, 1024, 24), (2048, 2048, 24), (4096, 4096, 24), (8192, 8192, 24),
    (16384, 16384, 24), (33024, 33024, 24), (66048, 66048, 24), (33024, 66048, 24),
    (66048, 33024, 24), (4096, 66048, 24), (66048, 66048, 12), (37376, 37376, 12),
    (18688, 37376, 24),
]


class Measurer:
    def __init__(self, a: argparse.Namespace):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.a = torch, dist, a
        lr = int(os.environ.get("LOCAL_RANK", "0"))
        if a.emulate_machines > 1:
            try:
                import ditscale.sp as sp

                sp.emulate_machines(a.emulate_machines)
            except (ImportError, AttributeError):
                # Same rule as sp.emulate_machines: one NCCL_HOSTID per block of nproc/M ranks.
                n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                if n % a.emulate_machines:
                    raise SystemExit(f"--emulate-machines {a.emulate_machines}: {n} processes "
                                     "are not a multiple of it")
                os.environ["NCCL_HOSTID"] = f"ditscale-emulated-{lr // (n // a.emulate_machines)}"
        torch.cuda.set_device(lr)
        self.dev = torch.device("cuda", lr)
        self.local_rank = lr
        # NCCL's stream at high priority, as the executor's comm streams: what a transfer beside
        # compute gets depends on it (p2p_under_compute); alone it makes no difference.
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=self.dev,
                                pg_options=opts)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world < 2 and not a.no_p2p:
            raise SystemExit("calibrate measure: run under torchrun with >= 2 processes "
                             "(or pass --no-p2p)")
        self.peer = (self.rank + self.world // 2) % self.world

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[calibrate] {msg}", file=sys.stderr, flush=True)

    def max_over_ranks(self, x: float) -> float:
        t = self.torch.tensor([x], dtype=self.torch.float64, device=self.dev)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def timed(self, fn, iters: int, warmup: int = 2) -> float:
        """Seconds per call of fn (bench.timing: CUDA events, barrier first), max over ranks."""
        torch = self.torch

        def barrier():
            self.dist.barrier(device_ids=[self.local_rank])
            torch.cuda.synchronize()

        t = time_fn(fn, warmup=warmup, reps=1, calls=iters, clock="cuda", before_each=barrier,
                    reduce=self.max_over_ranks)
        return t.median_ms / 1e3

    def exchange(self, sbuf, rbuf) -> None:
        """One two-way send/recv with the peer (both directions at once), waited for."""
        dist = self.dist
        ops = [dist.P2POp(dist.isend, sbuf, self.peer), dist.P2POp(dist.irecv, rbuf, self.peer)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()

    def p2p(self, sizes: list[int], budget_bytes: int) -> dict:
        torch, dist = self.torch, self.dist
        out = {"bidirectional": [], "unidirectional": []}
        big = torch.empty(max(sizes), dtype=torch.uint8, device=self.dev)
        rbig = torch.empty_like(big)
        sender = self.rank < self.peer
        for n in sizes:
            sbuf, rbuf = big[:n], rbig[:n]
            iters = max(3, min(50, budget_bytes // n))

            def one_way():
                if sender:
                    dist.send(sbuf, self.peer)
                else:
                    dist.recv(rbuf, self.peer)

            t2 = self.timed(lambda: self.exchange(sbuf, rbuf), iters)
            t1 = self.timed(one_way, iters)
            out["bidirectional"].append({"bytes": n, "s": t2})
            out["unidirectional"].append({"bytes": n, "s": t1})
            self.log(f"p2p {n / MIB:9.3f} MiB: bidir {t2 * 1e6:10.1f} us "
                     f"({n / t2 / 1e9:7.2f} GB/s per direction), one-way {t1 * 1e6:10.1f} us")
        return out

    def p2p_under_compute(self, nbytes: int, repeats: int = 3) -> dict:
        """The two-way send/recv of `nbytes` timed alone and while both ranks run a long cuDNN
        attention call on a compute stream of normal priority (NCCL's stream is high priority, as
        in the executor): the share of the transfer's rate lost while the GPUs compute, the
        simulator's inter_compute_interference. Times are medians over `repeats`, max over
        ranks."""
        torch = self.torch
        sbuf = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        rbuf = torch.empty_like(sbuf)
        q, k, v = flux_call_inputs(torch, self.dev)
        side = torch.cuda.Stream(device=self.dev)

        def attention():
            torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)

        def once(beside: bool) -> tuple[float, float]:
            """(transfer s, attention s) of one round; attention s is 0 when not run. Two spans
            on two streams at once, so events of its own rather than bench.timing's one span."""
            self.dist.barrier(device_ids=[self.local_rank])
            torch.cuda.synchronize()
            a0, a1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            x0, x1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if beside:
                with torch.cuda.stream(side):
                    a0.record(side)
                    attention()
                    a1.record(side)
            x0.record()
            self.exchange(sbuf, rbuf)
            x1.record()
            torch.cuda.synchronize()
            return (self.max_over_ranks(x0.elapsed_time(x1) / 1e3),
                    self.max_over_ranks(a0.elapsed_time(a1) / 1e3) if beside else 0.0)

        self.exchange(sbuf, rbuf)
        with torch.cuda.stream(side):
            attention()
        torch.cuda.synchronize()
        alone = sorted(once(False)[0] for _ in range(repeats))[repeats // 2]
        rounds = sorted(once(True) for _ in range(repeats))
        beside, att = rounds[repeats // 2]
        f = interference_from_times(alone, beside, att)
        self.log(f"p2p {nbytes / MIB:.0f} MiB two-way: alone {alone * 1e3:.2f} ms, beside an "
                 f"attention call of {att * 1e3:.1f} ms {beside * 1e3:.2f} ms -> interference "
                 f"{f:.3f}")
        del q, k, v
        return {"bytes": nbytes, "alone_s": alone, "beside_s": beside, "attention_s": att,
                "interference": f}

    def all_gather(self, chunk_bytes: int, iters: int) -> dict:
        """all_gather_into_tensor of `chunk_bytes` per rank: NCCL may drive a link with more
        channels in a collective than in send/recv, so the speed-of-light takes the better one."""
        torch, dist = self.torch, self.dist
        src = torch.empty(chunk_bytes, dtype=torch.uint8, device=self.dev)
        dst = torch.empty(chunk_bytes * self.world, dtype=torch.uint8, device=self.dev)
        t = self.timed(lambda: dist.all_gather_into_tensor(dst, src), iters)
        # Each rank receives (N-1) chunks; per direction of one port that is (N-1)*chunk / t.
        bw = (self.world - 1) * chunk_bytes / t
        self.log(f"all_gather {chunk_bytes / MIB:.0f} MiB per rank: {t * 1e3:.2f} ms, "
                 f"{bw / 1e9:.2f} GB/s received per rank")
        return {"chunk_bytes": chunk_bytes, "s": t, "received_Bps": bw}

    def attention(self) -> list[dict]:
        torch = self.torch
        out = []
        d = 128
        for q_t, kv_t, h in ATTENTION_BLOCKS:
            q = torch.randn(1, h, q_t, d, device=self.dev, dtype=torch.bfloat16)
            k = torch.randn(1, h, kv_t, d, device=self.dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            flops = 4.0 * h * q_t * kv_t * d

            def run():
                torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)

            est = flops / 500e12
            iters = max(2, min(20, int(0.25 / max(est, 1e-6))))
            try:
                t = self.timed(run, iters)
            except RuntimeError as e:
                self.log(f"attention {q_t}x{kv_t} h{h}: cuDNN failed ({e}); skipped")
                continue
            out.append({"q_tokens": q_t, "kv_tokens": kv_t, "heads": h, "head_dim": d,
                        "flops": flops, "seconds": t})
            self.log(f"attention q {q_t:6d} kv {kv_t:6d} h {h:2d}: {t * 1e3:8.3f} ms "
                     f"{flops / t / 1e12:6.1f} TFLOP/s")
            del q, k, v
        return out

    def hbm(self) -> dict:
        torch = self.torch
        src = torch.empty(GIB, dtype=torch.uint8, device=self.dev)
        dst = torch.empty_like(src)
        t = self.timed(lambda: dst.copy_(src), 10)
        self.log(f"HBM copy 1 GiB: {2 * GIB / t / 1e9:.0f} GB/s (read + write)")
        return {"bytes_moved": 2 * GIB, "s": t}

    def gemm(self) -> dict:
        torch = self.torch
        m, k, n = 16384, 3072, 12288
        a = torch.randn(m, k, device=self.dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=self.dev, dtype=torch.bfloat16)
        t = self.timed(lambda: a @ b, 20)
        self.log(f"GEMM {m}x{k}x{n}: {2 * m * k * n / t / 1e12:.0f} TFLOP/s")
        return {"flops": 2.0 * m * k * n, "s": t}

    def launch(self) -> float:
        x = self.torch.zeros(1, device=self.dev)
        t = self.timed(lambda: x.add_(1), 2000, warmup=50)
        self.log(f"back-to-back tiny kernels: {t * 1e6:.2f} us each")
        return t


def cmd_measure(a: argparse.Namespace) -> int:
    import socket

    import torch

    if not torch.cuda.is_available():
        print("[calibrate] no CUDA device: skipping the measurement", file=sys.stderr)
        return 0
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    m = Measurer(a)
    t0 = time.monotonic()
    emulated = a.emulate_machines > 1
    doc = {"kind": "ditscale-sp-calibration-raw", "version": 1, "header": reporter.header(),
           "link": "emulated" if emulated else "nvlink", "world_size": m.world,
           "emulate_machines": a.emulate_machines, "host": socket.gethostname(),
           "gpu": torch.cuda.get_device_name(m.dev), "torch": torch.__version__,
           "sms": torch.cuda.get_device_properties(m.dev).multi_processor_count,
           "nccl": ".".join(str(x) for x in torch.cuda.nccl.version())}
    if not a.no_p2p:
        # Up to the sizes a layer moves (S = 65,536: ~100 MB per tensor and peer): on the socket
        # link a 400 MB layer exchange ran at ~2.0 GB/s where 64 MiB messages ran at 2.25-2.38
        # (sp-attention_h200x2_2026-12.md), and the simulator's meas/pred rose with S.
        top = 256 * MIB
        sizes = [4 * KIB * 4**i for i in range(12) if 4 * KIB * 4**i <= top]
        doc["p2p"] = m.p2p(sizes, budget_bytes=(512 * MIB if emulated else GIB))
        doc["all_gather"] = m.all_gather(top, 3 if emulated else 10)
        if not a.no_interference:
            doc["p2p_under_compute"] = m.p2p_under_compute(64 * MIB if emulated else GIB)
    if not a.p2p_only:
        doc["attention"] = m.attention()
        doc["hbm"] = m.hbm()
        doc["gemm"] = m.gemm()
        doc["launch_s"] = m.launch()
    doc["elapsed_s"] = time.monotonic() - t0
    if m.rank == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
        m.log(f"wrote {a.out} ({doc['elapsed_s']:.1f} s)")
    m.dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------
# fit
# ---------------------------------------------------------------------------------------------


def fits_from_raw(raws: Sequence[dict], attention_slots: Optional[int] = None) -> dict:
    """The fits of `fit` from raw measurement documents (any subset of nvlink / emulated).
    attention_slots: CTAs per wave of the attention model; None = the raw document's SM count
    ("sms", recorded since the wave model; 0 = no wave model when absent)."""
    fits: dict = {}
    for raw in raws:
        link = raw.get("link")
        if link not in ("nvlink", "emulated"):
            raise ValueError(f"raw calibration: field 'link' must be nvlink or emulated, "
                             f"got {link!r}")
        if "p2p" in raw:
            pts = raw["p2p"]["bidirectional"]
            f = fit_link([p["bytes"] for p in pts], [p["s"] for p in pts])
            uni = raw["p2p"].get("unidirectional")
            if uni:
                f["unidirectional"] = fit_link([p["bytes"] for p in uni], [p["s"] for p in uni])
            if raw.get("all_gather"):
                f["all_gather_Bps"] = raw["all_gather"]["received_Bps"]
            if raw.get("p2p_under_compute"):
                f["compute_interference"] = raw["p2p_under_compute"]["interference"]
            fits["intra" if link == "nvlink" else "inter"] = f
        if raw.get("launch_s"):
            fits["launch_s"] = raw["launch_s"]
        if raw.get("attention"):
            slots = attention_slots if attention_slots is not None else int(raw.get("sms", 0))
            fits["attention"] = fit_attention(raw["attention"], fits.get("launch_s", 5e-6),
                                              slots=slots)
            fits["attention_points"] = raw["attention"]
        if raw.get("hbm"):
            fits["hbm_Bps"] = raw["hbm"]["bytes_moved"] / raw["hbm"]["s"]
        if raw.get("gemm"):
            fits["linear_flops"] = raw["gemm"]["flops"] / raw["gemm"]["s"]
        for key in ("gpu", "host", "torch", "nccl"):
            fits.setdefault(key, raw.get(key))
    return fits


def check_with_cli(cli: Optional[str], path: Path, machines: int, gpm: int) -> str:
    """'' when `ditscale sp simulate --cluster path` accepts the file, else the error."""
    if cli is None:
        return "ditscale CLI not found (not checked)"
    try:
        simulate(cli, str(path), machines, gpm, "ulysses", 4096)
        return ""
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        return str(e)


def cmd_fit(a: argparse.Namespace) -> int:
    if a.attention_slots is not None and a.attention_slots < 0:
        print(f"calibrate fit: --attention-slots must be >= 0 (0 = no wave model), got "
              f"{a.attention_slots}", file=sys.stderr)
        return 2
    raws = []
    for p in a.raw:
        try:
            raws.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            print(f"calibrate fit: {p}: {e}", file=sys.stderr)
            return 2
    fits = fits_from_raw(raws, a.attention_slots)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cli = find_cli(a.ditscale)
    files = {
        "topology-h200.json": (topology_from_fits(fits, "h200-calibrated", a.gpus_per_machine),
                               2, 1),
        "topology-h200-nvlink-machines.json": (
            topology_from_fits(fits, "h200-nvlink-as-machines", 1, nvlink_as_machines=True), 2,
            1),
    }
    status = 0
    checked = {}
    for name, (topo, machines, gpm) in files.items():
        (out / name).write_text(json.dumps(topo, indent=1) + "\n")
        err = check_with_cli(cli, out / name, machines, gpm)
        checked[name] = err or "ok"
        if err and cli is not None:
            print(f"calibrate fit: {out / name} rejected by the CLI: {err}", file=sys.stderr)
            status = 1
    summary = {"kind": "ditscale-sp-calibration", "version": 1, "fits": fits,
               "topology_files": checked, "sources": [str(p) for p in a.raw]}
    (out / "calibration.json").write_text(json.dumps(summary, indent=1) + "\n")
    for key, label in (("intra", "NVLink"), ("inter", "socket (emulated machines)")):
        if key in fits:
            f = fits[key]
            print(f"{label}: {f['bandwidth_Bps'] / 1e9:.2f} GB/s per direction "
                  f"(bidirectional), small-message {f['latency_s'] * 1e6:.1f} us, "
                  f"rms rel err {f['rms_rel_err']:.1%}")
    if "attention" in fits:
        f = fits["attention"]
        print(f"cuDNN attention: {f['attention_flops'] / 1e12:.0f} TFLOP/s asymptotic, "
              f"half-efficiency block {f['attention_half_tokens']:.0f} tokens, waves of "
              f"{f['attention_slots']} CTAs x {f['attention_tile_tokens']} rows, "
              f"rms rel err {f['rms_rel_err']:.1%} (max {f['max_rel_err']:.1%})")
    if fits.get("hbm_Bps"):
        print(f"HBM copy: {fits['hbm_Bps'] / 1e9:.0f} GB/s; GEMM "
              f"{fits.get('linear_flops', 0) / 1e12:.0f} TFLOP/s")
    print(f"wrote {out}/topology-h200.json, topology-h200-nvlink-machines.json, calibration.json "
          f"(CLI check: {checked})")
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="measure on the GPUs (under torchrun)")
    m.add_argument("--out", required=True)
    m.add_argument("--emulate-machines", type=int, default=0)
    m.add_argument("--p2p-only", action="store_true", help="only the send/recv sweep")
    m.add_argument("--no-p2p", action="store_true", help="skip the send/recv sweep")
    m.add_argument("--no-interference", action="store_true",
                   help="skip timing a send/recv beside an attention call")
    f = sub.add_parser("fit", help="fit the simulator's parameters, write topology JSON files")
    f.add_argument("raw", nargs="+", help="raw JSON files from `measure`")
    f.add_argument("--out-dir", required=True)
    f.add_argument("--gpus-per-machine", type=int, default=2)
    f.add_argument("--ditscale", default=None, help="path of the ditscale CLI")
    f.add_argument("--attention-slots", type=int, default=None,
                   help="CTAs per wave of the attention model (default: the raw file's SM count "
                        "'sms'; 0 = no wave model). Raw files measured before 'sms' was recorded "
                        "need it given (H200: 132)")
    a = p.parse_args(argv)
    return cmd_measure(a) if a.cmd == "measure" else cmd_fit(a)


if __name__ == "__main__":
    sys.exit(main())
