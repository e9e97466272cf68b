"""Packs by copy engine vs by kernel, alone and beside a cuDNN attention call (one GPU, ~10 s).

  python -m lab.probes.pack_copy_probe --out DIR

The GPU executor packs and unpacks the head slices of an all-to-all on its comm streams with
cudaMemcpy2DAsync (a copy engine) instead of a strided-copy kernel, so that a pack issued while an
attention call holds every SM need not wait for the call (lab/results/sp-overlap_h200_2026-12/).
This times both forms of the Ulysses pack of Flux at 65,536 + 512 tokens on 2 ranks (a rank's 33,024
tokens x 12 of 24 heads x 128, bf16: 101 MB read, 101 MB written; one 2D copy of 33,024 rows of
3 KiB with a 6 KiB source pitch) and the same for 4 ranks (6 of 24 heads), alone and issued on a
high-priority stream right after a cuDNN call (q = kv = 66,048 tokens, 24 x 128) on another
stream. Reports ms and GB/s (bytes read + written over time) and the attention call's time.
Median of 5. Writes DIR/pack-copy.json and DIR/pack-copy.md.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import sys
from pathlib import Path

from bench.common import (FLUX_CALL_HEAD_DIM, FLUX_CALL_HEADS, FLUX_CALL_TOKENS,
                          flux_call_inputs)
from lab.probes._setup import probe_device

def _cudart():
    """The CUDA runtime torch loaded (its cudaMemcpy2DAsync)."""
    import torch  # noqa: F401  (loads libcudart)
    for name in ("libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                              ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                                              ctypes.c_int, ctypes.c_void_p]
            lib.cudaMemcpy2DAsync.restype = ctypes.c_int
            return lib
        except OSError:
            continue
    raise SystemExit("pack_copy_probe: libcudart not found")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    import torch

    dev = probe_device(torch, "pack_copy_probe")
    if dev is None:
        return 2
    rt = _cudart()
    H, D, total = FLUX_CALL_HEADS, FLUX_CALL_HEAD_DIM, FLUX_CALL_TOKENS
    q, k, v = flux_call_inputs(torch, dev)
    lo, hi = torch.cuda.Stream.priority_range()
    compute, comm = torch.cuda.Stream(priority=lo), torch.cuda.Stream(priority=hi)

    def attention():
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)

    rows = []
    for ranks in (2, 4):
        tokens, heads = total // ranks, H // ranks
        src = torch.randn(tokens, H, D, device=dev, dtype=torch.bfloat16)
        dst = torch.empty(tokens, heads, D, device=dev, dtype=torch.bfloat16)
        row_bytes, pitch = heads * D * 2, H * D * 2
        nbytes = 2 * tokens * row_bytes

        def kernel_pack():
            dst.copy_(src[:, heads:2 * heads])

        def ce_pack():
            rc = rt.cudaMemcpy2DAsync(dst.data_ptr(), row_bytes, src.data_ptr() + row_bytes, pitch,
                                      row_bytes, tokens, 3, torch.cuda.current_stream().cuda_stream)
            if rc != 0:
                raise RuntimeError(f"cudaMemcpy2DAsync failed: {rc}")

        ce_pack()
        torch.cuda.synchronize()
        ref = src[:, heads:2 * heads]
        assert torch.equal(dst, ref), "the 2D copy does not give the head slice"
        for name, fn in (("kernel (torch strided copy)", kernel_pack),
                         ("copy engine (cudaMemcpy2DAsync)", ce_pack)):
            for beside in (False, True):
                times = []
                for _ in range(a.rounds):
                    torch.cuda.synchronize()
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                    if beside:
                        with torch.cuda.stream(compute):
                            ev[2].record()
                            attention()
                            ev[3].record()
                    with torch.cuda.stream(comm):
                        ev[0].record()
                        fn()
                        ev[1].record()
                    torch.cuda.synchronize()
                    times.append((ev[0].elapsed_time(ev[1]),
                                  ev[2].elapsed_time(ev[3]) if beside else 0.0))
                times.sort()
                ms, attn_ms = times[len(times) // 2]
                rows.append({"ranks": ranks, "form": name, "beside_attention": beside,
                             "ms": ms, "GBps": nbytes / ms / 1e6, "attention_ms": attn_ms,
                             "bytes_moved": nbytes})
                print(f"{ranks} ranks  {name:34s} {'beside cuDNN' if beside else 'alone':13s} "
                      f"{ms:8.3f} ms {nbytes / ms / 1e6:8.1f} GB/s"
                      f"{f'  (attention {attn_ms:.2f} ms)' if beside else ''}", flush=True)
    doc = {"kind": "ditscale-sp-pack-copy-probe", "version": 1,
           "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "pack-copy.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = [f"# Ulysses pack: copy engine vs kernel ({doc['gpu']}, torch {doc['torch']})", "",
          "`python -m lab.probes.pack_copy_probe`: a rank's head slice of Flux at 66,048 tokens, "
          "bf16; GB/s = bytes read + written over the time; 'beside' = issued on a "
          "high-priority stream right after a cuDNN attention call on another stream.", "",
          "| ranks | form | alone ms | GB/s | beside cuDNN ms | attention ms |",
          "|--:|---|--:|--:|--:|--:|"]
    for r in rows:
        if r["beside_attention"]:
            continue
        b = next(x for x in rows if x["ranks"] == r["ranks"] and x["form"] == r["form"]
                 and x["beside_attention"])
        md.append(f"| {r['ranks']} | {r['form']} | {r['ms']:.3f} | {r['GBps']:.0f} | "
                  f"{b['ms']:.3f} | {b['attention_ms']:.2f} |")
    (a.out / "pack-copy.md").write_text("\n".join(md) + "\n")
    print(f"wrote {a.out}/pack-copy.json, pack-copy.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
