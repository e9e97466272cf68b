"""Attention on a partition of the SMs, communication on the rest (one GPU, ~20 s).

  python -m lab.probes.sm_partition_probe --out DIR

A cuDNN attention call holds every SM until it ends, so a kernel issued after it on another
stream (an NCCL transfer, an NVSHMEM put, a pack) waits for its end (attn_overlap_probe.py,
lab/results/sp-overlap_h200_2026-12/). A CUDA green context runs its streams' kernels on a subset of
the SMs; the rest stay free for work of the primary context. This measures, for Flux's attention
call (q = kv = 66,048 tokens, 24 heads x 128, bf16, the GPU executor's cuDNN call):

1. the call's time on a green-context stream of N SMs, for several N, against the whole GPU
   (what a partition costs the compute: ideally 132 / N);
2. with the call on a partition, a probe issued right after it on a high-priority stream of the
   primary context: a small SM kernel (scale 128 MiB), the Ulysses pack of 2 ranks (a strided
   copy of 33,024 tokens x 24 heads x 128, heads split in two), an NCCL send/recv of 64 MiB to
   this rank itself. Time from enqueue to completion, alone and beside the call (beside ~ alone:
   it ran on the free SMs; beside ~ the call: it waited), and the call's time with it.

The green contexts come from the driver API (ctypes, libcuda), as the executor makes them.
Medians of 3 rounds. Writes DIR/sm-partition.json and DIR/sm-partition.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

from bench.common import (FLUX_CALL_HEAD_DIM, FLUX_CALL_HEADS, FLUX_CALL_TOKENS,
                          flux_call_inputs)
from lab.probes._setup import probe_device, self_process_group

CU_DEV_RESOURCE_TYPE_SM = 1
CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING = 1
CU_GREEN_CTX_DEFAULT_STREAM = 1
CU_STREAM_NON_BLOCKING = 1
_RESOURCE_BYTES = 144  # CUdevResource (ABI version 1): type, 92 bytes of padding, a 48-byte union
_SM_COUNT_OFFSET = 96


class GreenContexts:
    """Green contexts of one device through libcuda (the CUDA 12.4+ driver API)."""

    def __init__(self, device: int):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.dev = ctypes.c_int()
        self._check(self.cu.cuDeviceGet(ctypes.byref(self.dev), device), "cuDeviceGet")
        self.whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
        self._check(self.cu.cuDeviceGetDevResource(self.dev, self.whole, CU_DEV_RESOURCE_TYPE_SM),
                    "cuDeviceGetDevResource")
        self.sms, self.min_partition, self.alignment = self._sm_fields(self.whole)
        self.contexts = []  # kept alive for the process

    @staticmethod
    def _check(r: int, what: str) -> None:
        if r != 0:
            raise RuntimeError(f"sm_partition_probe: {what} failed with CUresult {r}")

    @staticmethod
    def _sm_fields(res) -> tuple[int, int, int]:
        f = (ctypes.c_uint * 3).from_buffer_copy(res.raw[_SM_COUNT_OFFSET:_SM_COUNT_OFFSET + 12])
        return int(f[0]), int(f[1]), int(f[2])

    def stream(self, sms: int, fine: bool, priority: int = 0) -> tuple[int, int]:
        """(stream handle, SMs it got) of a new green context of at least ``sms`` SMs
        (``fine``: CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING, finer partitions)."""
        group = ctypes.create_string_buffer(_RESOURCE_BYTES)
        rest = ctypes.create_string_buffer(_RESOURCE_BYTES)
        n = ctypes.c_uint(1)
        flags = CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING if fine else 0
        self._check(self.cu.cuDevSmResourceSplitByCount(group, ctypes.byref(n), self.whole, rest,
                                                        flags, sms), "cuDevSmResourceSplitByCount")
        if n.value != 1:
            raise RuntimeError(f"sm_partition_probe: no group of {sms} SMs")
        desc = ctypes.c_void_p()
        self._check(self.cu.cuDevResourceGenerateDesc(ctypes.byref(desc), group, 1),
                    "cuDevResourceGenerateDesc")
        ctx = ctypes.c_void_p()
        self._check(self.cu.cuGreenCtxCreate(ctypes.byref(ctx), desc, self.dev,
                                             CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate")
        st = ctypes.c_void_p()
        self._check(self.cu.cuGreenCtxStreamCreate(ctypes.byref(st), ctx, CU_STREAM_NON_BLOCKING,
                                                   priority), "cuGreenCtxStreamCreate")
        self.contexts.append(ctx)
        return int(st.value), self._sm_fields(group)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    dev = probe_device(torch, "sm_partition_probe")
    if dev is None:
        return 2
    q, k, v = flux_call_inputs(torch, dev)
    x = torch.randn(32 << 20, device=dev)  # 128 MiB
    half = FLUX_CALL_TOKENS // 2  # a rank's tokens on 2 ranks
    local = torch.randn(1, half, FLUX_CALL_HEADS, FLUX_CALL_HEAD_DIM, device=dev,
                        dtype=torch.bfloat16)
    packed = torch.empty(2, 1, half, FLUX_CALL_HEADS // 2, FLUX_CALL_HEAD_DIM, device=dev,
                         dtype=torch.bfloat16)
    sbuf = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    rbuf = torch.empty_like(sbuf)
    close_group = self_process_group(dist, dev, "ditscale-smpart-")
    gc = GreenContexts(0)
    print(f"device: {gc.sms} SMs, minimum partition {gc.min_partition}, alignment "
          f"{gc.alignment}", flush=True)
    lo_pri, hi_pri = torch.cuda.Stream.priority_range()
    probe_stream = torch.cuda.Stream(priority=hi_pri)
    partitions = {"whole GPU": (torch.cuda.Stream(priority=lo_pri), gc.sms)}
    for sms, fine in ((128, False), (126, True), (124, True), (120, False), (112, False),
                      (96, False)):
        try:
            handle, got = gc.stream(sms, fine)
        except RuntimeError as e:
            print(f"partition of {sms} SMs{' (fine)' if fine else ''}: {e}", flush=True)
            continue
        name = f"green {got} SMs" + (" (fine)" if fine else "")
        if name not in partitions:
            partitions[name] = (torch.cuda.ExternalStream(handle, device=dev), got)

    def attn():
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)

    def pack():
        packed.copy_(local.view(1, half, 2, FLUX_CALL_HEADS // 2,
                                FLUX_CALL_HEAD_DIM).permute(2, 0, 1, 3, 4))

    def nccl_self():
        ops = [dist.P2POp(dist.isend, sbuf, 0), dist.P2POp(dist.irecv, rbuf, 0)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()

    probes = {"SM kernel (scale 128 MiB)": lambda: x.mul_(1.0000001),
              "Ulysses pack, 2 ranks (203 MB)": pack,
              "NCCL send/recv to self 64 MiB": nccl_self}

    def round_(compute, use_attn: bool, probe) -> tuple[float, float]:
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        if use_attn:
            with torch.cuda.stream(compute):
                ev[0].record()
                attn()
                ev[1].record()
        if probe is not None:
            with torch.cuda.stream(probe_stream):
                ev[2].record()
                probe()
                ev[3].record()
        torch.cuda.synchronize()
        return (ev[2].elapsed_time(ev[3]) if probe is not None else 0.0,
                ev[0].elapsed_time(ev[1]) if use_attn else 0.0)

    def median(fn) -> tuple[float, float]:
        return sorted(fn() for _ in range(a.rounds))[a.rounds // 2]

    for st, _ in partitions.values():
        with torch.cuda.stream(st):
            attn()
    for f in probes.values():
        f()
    torch.cuda.synchronize()
    calls = []
    whole_ms = None
    for name, (st, sms) in partitions.items():
        ms = median(lambda: round_(st, True, None))[1]
        whole_ms = whole_ms or ms
        calls.append({"partition": name, "sms": sms, "attention_ms": ms,
                      "slowdown": ms / whole_ms, "ideal": gc.sms / sms})
        print(f"attention on {name:22s}: {ms:7.2f} ms  ({ms / whole_ms:.3f}x the whole GPU; "
              f"{gc.sms}/{sms} = {gc.sms / sms:.3f})", flush=True)
    rows = []
    for pname, probe in probes.items():
        alone = median(lambda: round_(None, False, probe))[0]
        print(f"{pname:32s} alone: {alone:8.3f} ms", flush=True)
        for name, (st, sms) in partitions.items():
            if sms not in (gc.sms, 128, 120, 124):
                continue
            r = median(lambda: round_(st, True, probe))
            rows.append({"probe": pname, "partition": name, "sms": sms, "probe_alone_ms": alone,
                         "probe_ms": r[0], "attention_ms": r[1]})
            print(f"{pname:32s} beside attention on {name:22s}: probe {r[0]:8.3f} ms "
                  f"(attention {r[1]:7.2f} ms)", flush=True)
    close_group()
    doc = {"kind": "ditscale-sp-sm-partition-probe", "version": 1,
           "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(),
           "shape": {"heads": FLUX_CALL_HEADS, "tokens": FLUX_CALL_TOKENS,
                     "head_dim": FLUX_CALL_HEAD_DIM},
           "device_sms": gc.sms, "min_partition": gc.min_partition, "alignment": gc.alignment,
           "calls": calls, "rows": rows}
    write_report(doc, a.out)
    return 0


def write_report(doc: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sm-partition.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        "# Attention on a partition of the SMs (CUDA green contexts), communication beside it",
        "",
        f"{doc['gpu']}, torch {doc['torch']}, cuDNN {doc['cudnn']}; "
        f"`python -m lab.probes.sm_partition_probe` (medians of 3). The cuDNN attention call of Flux "
        f"(q = kv = {doc['shape']['tokens']:,} tokens, {doc['shape']['heads']} heads x "
        f"{doc['shape']['head_dim']}, bf16) on a green-context stream of N of the "
        f"{doc['device_sms']} SMs (partitions of at least {doc['min_partition']} SMs, in steps of "
        f"{doc['alignment']}; 'fine' ignores SM co-scheduling for finer steps).",
        "",
        "| partition | SMs | attention ms | vs whole GPU | ideal (SMs ratio) |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in doc["calls"]:
        lines.append(f"| {c['partition']} | {c['sms']} | {c['attention_ms']:.2f} | "
                     f"{c['slowdown']:.3f}x | {c['ideal']:.3f}x |")
    lines += ["", "A probe issued right after the call, on a high-priority stream of the primary "
              "context (time from enqueue to completion):", "",
              "| probe | attention on | probe alone ms | probe beside ms | attention ms |",
              "|---|---|---:|---:|---:|"]
    for r in doc["rows"]:
        lines.append(f"| {r['probe']} | {r['partition']} | {r['probe_alone_ms']:.3f} | "
                     f"{r['probe_ms']:.3f} | {r['attention_ms']:.2f} |")
    (out / "sm-partition.md").write_text("\n".join(lines) + "\n")
    print((out / "sm-partition.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
