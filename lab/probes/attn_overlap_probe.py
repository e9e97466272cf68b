"""Does work on another stream run while an attention call runs? (one GPU, ~10 s)

  python -m lab.probes.attn_overlap_probe --out DIR

Every overlapped schedule (ring, torus, ulysses-overlap, head chunks) counts on its transfers
progressing while the compute stream runs an attention call. This launches one attention call
(Flux at S + T = 66,048: 24 heads x 128, bf16; the GPU executor's cuDNN call, and flash for
contrast) on a compute stream of normal priority and, right after it, one probe on another stream
(high priority, as the executor's comm streams, or normal): a small SM kernel, a copy-engine copy
to pinned host memory, an NCCL send/recv (to this rank itself: one process, one GPU). The probe's
time from enqueue to completion, alone and beside the attention call, tells whether it ran beside
it or waited for it (NCCL runs on its own stream, at high priority whatever the probe stream,
which only brackets it); with the probe enqueued first, the attention call's time tells what a kernel
that got its SMs first costs the call. Medians of 3 rounds. Writes DIR/overlap.json and
DIR/overlap.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench.common import (FLUX_CALL_HEAD_DIM, FLUX_CALL_HEADS, FLUX_CALL_TOKENS,
                          flux_call_inputs)
from lab.probes._setup import probe_device, self_process_group

FLUX_CALL_SHAPE = {"heads": FLUX_CALL_HEADS, "tokens": FLUX_CALL_TOKENS,
                   "head_dim": FLUX_CALL_HEAD_DIM}

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--from-log", type=Path, default=None,
                   help="write overlap.json / overlap.md from the printed lines of an earlier run "
                        "(its stdout), without measuring")
    p.add_argument("--gpu", default="NVIDIA H200", help="with --from-log: the GPU it ran on")
    a = p.parse_args(argv)
    if a.from_log is not None:
        doc = parse_log(a.from_log.read_text(), a.gpu)
        doc["source"] = f"rebuilt from the printed lines of {a.from_log.name}"
        write_report(doc, a.out)
        return 0
    import torch
    import torch.distributed as dist

    dev = probe_device(torch, "attn_overlap_probe")
    if dev is None:
        return 2
    q, k, v = flux_call_inputs(torch, dev)
    x = torch.randn(32 << 20, device=dev)  # 128 MiB
    host = torch.empty(64 << 20, dtype=torch.float32, pin_memory=True)
    src = torch.randn(64 << 20, device=dev)  # 256 MiB
    sbuf = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    rbuf = torch.empty_like(sbuf)
    close_group = self_process_group(dist, dev, "ditscale-overlap-")
    lo_pri, hi_pri = torch.cuda.Stream.priority_range()  # (0, -N): lower value = higher
    streams = {"high": torch.cuda.Stream(priority=hi_pri), "normal": torch.cuda.Stream(priority=0)}
    compute = torch.cuda.Stream(priority=lo_pri)

    attentions = {
        "cudnn": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True),
        "flash": lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v),
    }

    def nccl_self():
        ops = [dist.P2POp(dist.isend, sbuf, 0), dist.P2POp(dist.irecv, rbuf, 0)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()

    probes = {
        "SM kernel (scale 128 MiB)": lambda: x.mul_(1.0000001),
        "copy engine D2H 256 MiB": lambda: host.copy_(src, non_blocking=True),
        "NCCL send/recv to self 64 MiB": nccl_self,
    }

    def round_(attn, probe, stream, probe_first: bool) -> tuple[float, float]:
        """(probe ms, attention ms) of one round: the probe enqueued right after the attention
        call, or (probe_first) right before it; either may be None (not run, 0 ms)."""
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

        def run_attn():
            with torch.cuda.stream(compute):
                ev[0].record()
                attn()
                ev[1].record()

        def run_probe():
            with torch.cuda.stream(stream):
                ev[2].record()
                probe()
                ev[3].record()

        order = [run_probe, run_attn] if probe_first else [run_attn, run_probe]
        for step, used in zip(order, ([probe, attn] if probe_first else [attn, probe])):
            if used is not None:
                step()
        torch.cuda.synchronize()
        return (ev[2].elapsed_time(ev[3]) if probe else 0.0,
                ev[0].elapsed_time(ev[1]) if attn else 0.0)

    def median(fn) -> tuple[float, float]:
        return sorted(fn() for _ in range(a.rounds))[a.rounds // 2]

    for f in list(attentions.values()) + list(probes.values()):
        f()
    torch.cuda.synchronize()
    attention_alone = {name: median(lambda: round_(f, None, compute, False))[1]
                       for name, f in attentions.items()}
    for name, ms in attention_alone.items():
        print(f"attention {name:5s} alone: {ms:7.2f} ms", flush=True)
    rows = []
    for pname, probe in probes.items():
        for sname, st in streams.items():
            cases = [("none", None, False)] + [(f"{n} ({w})", f, w == "probe first")
                                               for n, f in attentions.items()
                                               for w in ("probe after", "probe first")]
            for aname, attn, first in cases:
                r = median(lambda: round_(attn, probe, st, first))
                rows.append({"probe": pname, "stream": sname, "attention": aname,
                             "probe_ms": r[0], "attention_ms": r[1]})
                print(f"{pname:30s} {sname:6s} stream, {aname:20s}: probe {r[0]:8.3f} ms"
                      f"  (attention {r[1]:7.2f} ms)", flush=True)
    close_group()
    doc = {"kind": "ditscale-sp-attn-overlap-probe", "version": 1,
           "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "shape": FLUX_CALL_SHAPE,
           "attention_alone_ms": attention_alone, "rows": rows}
    write_report(doc, a.out)
    return 0


_ALONE = re.compile(r"^attention (\w+)\s+alone:\s+([\d.]+) ms")
_ROW = re.compile(r"^(.+?)\s+(high|normal)\s+stream, (.+?)\s*: probe\s+([\d.]+) ms"
                  r"\s+\(attention\s+([\d.]+) ms\)")


def parse_log(text: str, gpu: str) -> dict:
    """The measurements of a run from its printed lines."""
    alone, rows = {}, []
    for line in text.splitlines():
        m = _ALONE.match(line)
        if m:
            alone[m.group(1)] = float(m.group(2))
            continue
        m = _ROW.match(line)
        if m:
            rows.append({"probe": m.group(1).strip(), "stream": m.group(2),
                         "attention": m.group(3).strip(), "probe_ms": float(m.group(4)),
                         "attention_ms": float(m.group(5))})
    if not alone or not rows:
        raise SystemExit("attn_overlap_probe --from-log: no measurement lines in the log")
    return {"kind": "ditscale-sp-attn-overlap-probe", "version": 1, "gpu": gpu,
            "torch": "?", "cudnn": "?", "shape": FLUX_CALL_SHAPE,
            "attention_alone_ms": alone, "rows": rows}


def write_report(doc: dict, out: Path) -> None:
    a_out = out
    rows, attention_alone = doc["rows"], doc["attention_alone_ms"]
    a_out.mkdir(parents=True, exist_ok=True)
    (a_out / "overlap.json").write_text(json.dumps(doc, indent=1) + "\n")
    alone = {(r["probe"], r["stream"]): r["probe_ms"] for r in rows if r["attention"] == "none"}
    md = [f"# Work beside an attention call ({doc['gpu']}, torch {doc['torch']}, cuDNN "
          f"{doc['cudnn']})", "",
          "`python -m lab.probes.attn_overlap_probe`: probe time from enqueue to completion, "
          "enqueued on another stream right after (or right before) an attention call (q = kv = "
          "66,048 tokens, 24 x 128, bf16); 'waited' = the probe took longer than half the "
          "attention call more than alone. Attention alone: " + ", ".join(
              f"{k} {v:.2f} ms" for k, v in attention_alone.items()) + ".", "",
          "| probe | probe stream | attention call | probe ms | alone ms | attention ms | verdict |",
          "|---|---|---|--:|--:|--:|---|"]
    for r in rows:
        if r["attention"] == "none":
            continue
        base = alone[(r["probe"], r["stream"])]
        waited = r["probe_ms"] > base + 0.5 * r["attention_ms"]
        md.append(f"| {r['probe']} | {r['stream']} | {r['attention']} | {r['probe_ms']:.3f} | "
                  f"{base:.3f} | {r['attention_ms']:.2f} | "
                  f"{'waited for the call' if waited else 'ran beside it'} |")
    (a_out / "overlap.md").write_text("\n".join(md) + "\n")
    print(f"wrote {a_out}/overlap.json, overlap.md")


if __name__ == "__main__":
    sys.exit(main())
