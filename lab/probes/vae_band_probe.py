#!/usr/bin/env python3
"""Where one rank's band of a parallel VAE decode spends its time against 1/N of the stock
decode: the whole call (time, GPU busy, top kernels) and its convolutions grouped by weight shape
(one row per kind of layer: device time of the stock decode / N against the band's), for each
layout of the band's padded convolution inputs, forced (``ncdhw``: the stock one;
``channels-last``: channels innermost, the layout cuDNN computes in, so it skips its own
transposes; the library's for Wan), and the host's issue time of the call.

    python -m lab.probes.vae_band_probe [--case wan2.1-480p] [--world 8] [--ranks 0,1]
        [--layouts ncdhw,channels-last] [--device cuda|cpu] [--out DIR]

The band runs as bench.diffusers.vae_bands runs it (one rank in a fake group, its all-gathers
answered by its own part). Writes DIR/vae-band-probe.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

from bench.common import int_list, name_list
from bench.diffusers import vae_bands as vb

LAYOUTS = ("ncdhw", "channels-last")



def _empty_for(layout: str):
    """band_input._empty for ``layout``."""
    import torch
    formats = {5: torch.channels_last_3d, 4: torch.channels_last}

    def empty(x, shape, channels_last=False):
        if layout == "ncdhw":
            return x.new_empty(shape)
        return torch.empty(shape, dtype=x.dtype, device=x.device,
                           memory_format=formats[len(shape)])
    return empty


def conv_times(fn) -> dict:
    """{weight shape: (calls, device ms)} of the cuDNN convolutions of one call of ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    out = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "aten::cudnn_convolution" and e.input_shapes:
            key = "x".join(map(str, e.input_shapes[1]))
            out[key][0] += e.count
            out[key][1] += e.device_time_total / 1e3
    return dict(out)


def conv_table(stock: dict, bands: dict, world: int) -> str:
    """Markdown: per weight shape, stock ms / N against each layout's band ms."""
    names = list(bands)
    lines = ["| weight | calls | stock/N ms | " + " | ".join(f"{n} ms (ratio)" for n in names)
             + " |", "|---|---|---|" + "---|" * len(names)]
    for key, (calls, ms) in sorted(stock.items(), key=lambda kv: -kv[1][1]):
        cells = []
        for n in names:
            b = bands[n].get(key, (0, 0.0))[1]
            cells.append(f"{b:.1f} ({b / (ms / world):.2f}x)" if ms else f"{b:.1f}")
        lines.append(f"| {key} | {calls} | {ms / world:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args) -> str:
    import torch
    from ditscale.diffusers.parallel_vae import band_input
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    case = vb.CASES[args.case]
    vae = vb._vae(case, dev, torch.bfloat16)
    z = torch.randn(case.latents, generator=torch.Generator().manual_seed(0)).to(dev,
                                                                              torch.bfloat16)
    meter = vb.Meter(dev, args.reps)
    parts, convs = [], {}
    with torch.no_grad():
        m0 = meter(lambda: vae.decode(z).sample)
        stock = conv_times(lambda: vae.decode(z).sample)
        parts.append(f"stock: {m0.t.median_ms:.1f} ms, {m0.busy_text()}, host issue "
                     f"{host_ms(lambda: vae.decode(z).sample):.0f} ms\n")
        original = band_input._empty
        try:
            for layout in args.layouts:
                band_input._empty = _empty_for(layout)
                runs = {r: vb._parallel(vae, z, args.world, r, meter)[0] for r in args.ranks}
                slow = max(runs, key=lambda r: runs[r].t.median_ms)
                m = runs[slow]
                ratio = m.t.median_ms / (m0.t.median_ms / args.world)
                parts.append(f"## {layout}: rank {slow} of {args.world}: {m.t.median_ms:.1f} ms "
                             f"= {ratio:.3f}x of stock/N, {m.busy_text()}, peak "
                             f"{vb._mib(m.peak)} MiB\n\n```\n{m.kernels}\n```\n")
                convs[layout], host = _band_convs(vae, z, args.world, slow)
                parts[-1] = parts[-1].replace("\n\n```", f", host issue {host:.0f} ms\n\n```", 1)
                print(parts[-1], flush=True)
        finally:
            band_input._empty = original
    return (f"# VAE band probe: {args.case} at N = {args.world}\n\n" + "".join(parts)
            + "\n## cuDNN convolutions by weight shape\n\n" + conv_table(stock, convs, args.world)
            + "\n")


def host_ms(fn) -> float:
    """Milliseconds until ``fn()`` returns, before the device finishes (the host's issue time;
    the call is host-bound where this nears its wall time)."""
    import time

    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    sync()
    return 1e3 * (t1 - t0)


def _band_convs(vae, z, world: int, rank: int) -> dict:
    """(conv_times, host_ms) of ``rank``'s band (as vb._parallel runs it)."""
    with vb.band_alone(vae, world, rank):
        fn = lambda: vae.decode(z).sample  # noqa: E731
        return conv_times(fn), host_ms(fn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="wan2.1-480p", choices=sorted(vb.CASES))
    p.add_argument("--world", type=int, default=8, choices=range(2, 65), metavar="2..64")
    p.add_argument("--ranks", type=lambda s: int_list(s, "--ranks", 0, 63), default=[0, 1])
    p.add_argument("--layouts", type=lambda s: name_list(s, "--layouts", dict.fromkeys(LAYOUTS)),
                   default=list(LAYOUTS))
    p.add_argument("--reps", type=int, default=2, choices=range(1, 21), metavar="1..20")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    text = run(args)
    with open(os.path.join(args.out, "vae-band-probe.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
