"""Calibrates the sequence-parallel simulator (ditscale/sp/topology.h) on the lent machine.

  # measure (torchrun, one launch per link type: NCCL_HOSTID must be set before NCCL starts)
  torchrun --nproc-per-node 2 -m bench.sp.calibrate measure --out raw-nvlink.json
  torchrun --nproc-per-node 2 -m bench.sp.calibrate measure --emulate-machines 2 --p2p-only \
      --out raw-emulated.json
  # fit (one process, CPU is enough): topology JSON files for `ditscale sp simulate --cluster`
  python -m bench.sp.calibrate fit raw-nvlink.json [raw-emulated.json] --out-dir DIR

What is measured, how it is fitted (bench/sp/calibration_fit.py) and the files `fit` writes:
docs/sp_benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

from bench import reporter
from bench.common import find_cli, flux_call_inputs
from bench.sp.calibration_fit import (  # noqa: F401 (fit_link ... are this tool's API too)
    ATTENTION_TILE_TOKENS, attention_model_s, fit_attention, fit_link, fits_from_raw,
    interference_from_times, topology_from_fits, wave_factor)
from bench.sp.simulator_cli import check_with_cli, flux_height_width, simulate  # noqa: F401
from bench.timing import time_fn

KIB, MIB, GIB = 1024, 1024**2, 1024**3

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
