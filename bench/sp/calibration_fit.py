"""The fits of the sequence-parallel simulator's calibration (pure Python, unit-tested on synthetic
data): link latency and bandwidth, the attention wave model, the interference of a transfer beside
compute, and the topology JSON built from them. What is measured and how it is fitted:
[docs/sp_benchmarks.md](../../docs/sp_benchmarks.md); the measuring CLI is bench/sp/calibrate.py."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from ditscale import _core

KIB, MIB = 1024, 1024**2

# Intra-machine latency the preset assumes (NCCL cannot split it from its per-op sync cost).
PRESET_INTRA_LATENCY_US = 5.0


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
