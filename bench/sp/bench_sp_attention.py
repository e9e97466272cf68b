"""SwiftFusion attention-layer benchmark: ditscale's sequence-parallel strategies against one GPU,
plain Ulysses and PyTorch's ring context parallelism, on the GPUs of one host.

  torchrun --nproc-per-node 2 -m bench.sp.bench_sp_attention --seq 36864 65536 --text 512 \
      [--emulate-machines 2] --json OUT.json

One launch is one link type (NVLink, or M emulated machines over NCCL's socket transport). The
layers are in attention_layers.py, the --profile / --timeline steps in diagnose.py. Shapes, timing,
the correctness check and the results file: docs/sp_benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from bench import reporter
from bench.sp import attention_layers, diagnose, peers
from bench.timing import time_fn

# Multicast/NVLS paths are off on the lent machines; set before any init.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

STRATEGIES = ("ulysses", "ulysses-overlap", "ring", "usp", "swiftfusion-tas", "torus")
PEERS = ("single", "plain-ulysses", "torch-cp")
TRANSPORTS = ("nccl", "nvshmem", "nvshmem-intra")  # as ditscale.sp.TRANSPORTS


@dataclass
class Config:
    impl: str  # "single" | "peer" | "ditscale"
    strategy: str  # ditscale strategy, or the peer's name
    chunks: int = 1
    transport: str = "nccl"
    mesh: str = "auto"  # "auto" or "MxG" (ditscale only)
    comm_sms: int = 0  # SMs kept out of the compute stream (ditscale only; SM partition)

    @property
    def name(self) -> str:
        if self.impl == "single":
            return "1 GPU (SDPA)"
        if self.impl == "peer":
            return {"plain-ulysses": "plain Ulysses", "torch-cp": "PyTorch CP"}[self.strategy]
        s = f"ditscale {self.strategy}"
        if self.strategy == "torus":
            s += f" c{self.chunks}"
        elif self.chunks > 1:  # ulysses in head chunks
            s += f" h{self.chunks}"
        s += f" {self.transport}"
        if self.mesh != "auto":
            s += f" mesh {self.mesh}"
        if self.comm_sms:
            s += f" comm_sms={self.comm_sms}"
        return s


@dataclass
class Run:
    seq: int
    text: int
    config: str
    impl: str
    strategy: str
    chunks: int
    transport: str
    mesh: list
    link: str
    comm_sms: int = 0
    status: str = "ok"  # "ok" | "skipped" | "error"
    ms: Optional[float] = None
    ms_repeats: list = field(default_factory=list)
    tflops: Optional[float] = None
    note: str = ""


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[bench_sp] {msg}", file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[36864, 65536], help="image tokens S")
    p.add_argument("--text", type=int, default=512, help="joint text tokens T")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--emulate-machines", type=int, default=0,
                   help="M > 1: M emulated machines (NCCL socket transport between them)")
    p.add_argument("--strategies", nargs="*", default=list(STRATEGIES), help="ditscale strategies")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4], help="torus chunk counts")
    p.add_argument("--head-chunks", type=int, nargs="+", default=[1],
                   help="ulysses head-chunk counts (1 = plain Ulysses; 2 and 4 measured no "
                   "faster on 2 H200s over NVLink, sp-attention_h200x2_2026-12.md)")
    p.add_argument("--transports", nargs="+", default=None,
                   help="nccl, nvshmem (puts on every link) and/or nvshmem-intra (puts within "
                   "machines, NCCL between them); default: nccl nvshmem on NVLink, nccl "
                   "nvshmem-intra when emulated (NVSHMEM would bypass the emulated link)")
    p.add_argument("--meshes", nargs="+", default=["auto"],
                   help="ditscale meshes: 'auto' (from the process group) and/or MxG, e.g. 2x1 "
                   "to run the 2 NVLink GPUs as two logical machines")
    p.add_argument("--comm-sms", type=int, nargs="+", default=[0],
                   help="ditscale rows with these SMs kept out of the compute stream (0 = whole "
                        "GPU; k > 0: an SM partition, see ditscale.sp)")
    p.add_argument("--peers", nargs="*", default=list(PEERS), help=f"from {PEERS}")
    p.add_argument("--backend", default="cudnn", help="SDPA backend: cudnn|flash|efficient|auto")
    p.add_argument("--cp-rotate", default="allgather", help="PyTorch CP rotate method")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--check-seq", type=int, default=4096, help="image tokens of the check (0: off)")
    p.add_argument("--tol", type=float, default=2e-2, help="max relative error of the check")
    p.add_argument("--time-budget-s", type=float, default=200.0,
                   help="skip runs predicted to end past this many seconds after start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--net-channels-per-peer", type=int, default=0,
                   help="N > 0: ditscale's inter-machine NCCL communicator uses N channels per "
                   "peer over the network (socket) transport ($DITSCALE_SP_NET_CHANNELS_PER_PEER)")
    p.add_argument("--timeline", action="store_true",
                   help="after timing, run one traced step of each ditscale configuration and "
                   "print every rank's per-unit GPU timeline (ditscale.sp.timeline; diagnosis)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one step of each configuration (torch.profiler, "
                   "CUDA kernels) and print rank 0's top kernels by GPU time (diagnosis)")
    p.add_argument("--json", type=Path, default=None, help="results file (rank 0 writes it)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The options, with the link-dependent defaults filled in; p.error on a bad value."""
    p = parser()
    a = p.parse_args(argv)
    emulated = a.emulate_machines > 1
    if a.transports is None:
        a.transports = ["nccl", "nvshmem-intra"] if emulated else ["nccl", "nvshmem"]
    # Emulated-machine layers take ~0.2-0.7 s each (1.3 GB over ~1.8 GiB/s): few iterations.
    a.warmup = a.warmup if a.warmup is not None else (1 if emulated else 3)
    a.iters = a.iters if a.iters is not None else (2 if emulated else 5)
    a.repeats = a.repeats if a.repeats is not None else (2 if emulated else 3)
    check_args(p, a)
    return a


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    emulated = a.emulate_machines > 1
    for s in a.strategies:
        if s not in STRATEGIES:
            p.error(f"--strategies: unknown strategy '{s}' (known: {', '.join(STRATEGIES)})")
    for s in a.peers:
        if s not in PEERS:
            p.error(f"--peers: unknown peer '{s}' (known: {', '.join(PEERS)})")
    for t in a.transports:
        if t not in TRANSPORTS:
            p.error(f"--transports: unknown transport '{t}' ({', '.join(TRANSPORTS)})")
    if emulated and "nvshmem" in a.transports:
        p.error("--transports: nvshmem puts between emulated machines would go over NVLink, "
                "around the emulated link; use nvshmem-intra (puts within machines only)")
    for m in a.meshes:
        if m != "auto" and parse_mesh(m) is None:
            p.error(f"--meshes: '{m}' is neither 'auto' nor MxG (e.g. 2x1)")
    if min(a.seq) <= 0 or a.text < 0 or a.iters < 1 or a.repeats < 1 or a.warmup < 0:
        p.error("--seq must be > 0, --text >= 0, --iters/--repeats >= 1, --warmup >= 0")


def parse_mesh(spec: str) -> Optional[tuple[int, int]]:
    parts = spec.lower().split("x")
    if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts):
        return None
    return int(parts[0]), int(parts[1])


def configs(a: argparse.Namespace, have_sp: bool) -> list[Config]:
    out = []
    if "single" in a.peers:
        out.append(Config("single", "single"))
    for pname in ("plain-ulysses", "torch-cp"):
        if pname in a.peers:
            out.append(Config("peer", pname))
    if not have_sp:
        return out
    for mesh in a.meshes:
        for transport in a.transports:
            for s in a.strategies:
                for c in (a.chunks if s == "torus" else
                          a.head_chunks if s == "ulysses" else [1]):
                    for k in a.comm_sms:
                        out.append(Config("ditscale", s, c, transport, mesh, k))
    return out


class Bench:
    def __init__(self, a: argparse.Namespace):
        import torch
        import torch.distributed as dist

        self.a, self.torch, self.dist = a, torch, dist
        self.emulated = a.emulate_machines > 1
        self.link = "emulated" if self.emulated else "nvlink"
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.sp = None
        self.sp_error = ""
        try:
            import ditscale.sp as sp

            self.sp = sp
        except Exception as e:  # the peers still run without ditscale.sp
            self.sp_error = f"{type(e).__name__}: {e}"
        if self.emulated:
            if hasattr(self.sp, "emulate_machines"):
                self.sp.emulate_machines(a.emulate_machines)
            else:
                self._emulate_machines_fallback(a.emulate_machines)
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60),
                                device_id=self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dtype = torch.bfloat16
        self.t0 = time.monotonic()
        self.runs: list[Run] = []
        self.checks: dict[str, dict] = {}
        self.meshes: dict[str, object] = {}
        self.backend_for: dict[str, str] = {}  # per-config SDPA backend after a fallback

    def _emulate_machines_fallback(self, m: int) -> None:
        # Same rule as sp.emulate_machines: NCCL_HOSTID per block of nproc/m local ranks.
        n = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        if n % m:
            raise SystemExit(f"--emulate-machines {m}: {n} processes are not a multiple of {m}")
        os.environ["NCCL_HOSTID"] = f"ditscale-emulated-{self.local_rank // (n // m)}"

    # ---------------------------------------------------------------- helpers
    def mesh(self, spec: str):
        if spec not in self.meshes:
            if spec == "auto":
                self.meshes[spec] = self.sp.Mesh.from_process_group(group=None)
            else:
                m, g = parse_mesh(spec)
                self.meshes[spec] = self.sp.Mesh(machines=m, gpus_per_machine=g, group=None)
        return self.meshes[spec]

    def mesh_dims(self, cfg: Config) -> list:
        if cfg.impl == "ditscale":
            m = self.mesh(cfg.mesh)
            return [int(m.machines), int(m.gpus_per_machine)]
        if cfg.impl == "single":
            return [1, 1]
        return [self.a.emulate_machines or 1, self.world // (self.a.emulate_machines or 1)]

    def agree(self, flag: bool) -> bool:
        """True on every rank iff `flag` is true on every rank."""
        t = self.torch.tensor([0 if flag else 1], device=self.device)
        self.dist.all_reduce(t)
        return int(t.item()) == 0

    def max_over_ranks(self, x: float) -> float:
        t = self.torch.tensor([x], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def time_layer(self, step: Callable[[], object]) -> list[float]:
        """ms per step of each repeat (bench.timing: `iters` steps per sample, a barrier before
        each, the max over ranks)."""
        torch, a = self.torch, self.a

        def barrier():
            self.dist.barrier(device_ids=[self.local_rank])
            torch.cuda.synchronize()

        t = time_fn(step, warmup=a.warmup, reps=a.repeats, calls=a.iters, clock="cuda",
                    before_each=barrier, reduce=self.max_over_ranks)
        return list(t.samples_ms)

    # ------------------------------------------------------- per-config layer
    def make_layer(self, cfg: Config, seq: int, full: Optional[tuple] = None):
        """(step, outputs, close) for one configuration at `seq` image tokens (attention_layers:
        full None for timing, or the check's (q, k, v) [B, T+S, H, D], identical on all ranks)."""
        return attention_layers.make_layer(self, cfg, seq, full)

    # ------------------------------------------------------------- the runs
    def check(self, cfg: Config) -> dict:
        """Runs cfg once at --check-seq against fp32 SDPA; every rank gets the same verdict."""
        torch, a = self.torch, self.a
        s, t = a.check_seq, a.text
        full = peers.broadcast_inputs((a.batch, t + s, a.heads, a.head_dim), self.dtype,
                                      self.device, a.seed + 1)
        with peers.sdpa_context("auto"):
            ref = peers.sdpa_bshd(*(x.float() for x in full))
        close = None
        try:
            step, outputs, close = self.make_layer(cfg, s, full)
            step()
            err = ref_sq = 0.0
            for out, start, count in outputs():
                e, r = peers.rel_err_parts(out.float(), ref.narrow(1, start, count))
                err, ref_sq = err + e, ref_sq + r
        finally:
            if close:
                close()
        parts = torch.tensor([err, ref_sq], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(parts)
        rel = math.sqrt(parts[0].item() / max(parts[1].item(), 1e-300))
        return {"seq": s, "text": t, "rel_err": rel, "ok": rel <= a.tol, "tol": a.tol}

    def checked(self, cfg: Config) -> dict:
        try:
            c = self.check(cfg)
        except Exception as e:
            c = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            if self.rank == 0:
                traceback.print_exc()
        self.agree(True)  # resynchronise after a failure on every rank
        return c

    def budget_allows(self, est_s: float) -> bool:
        left = self.a.time_budget_s - (time.monotonic() - self.t0)
        ok = est_s <= left
        t = self.torch.tensor([1 if ok else 0], device=self.device)
        self.dist.broadcast(t, src=0)  # rank 0 decides, so every rank skips the same runs
        return bool(t.item())

    def run_all(self) -> None:
        a = self.a
        cfgs = configs(a, self.sp is not None)
        if self.sp is None:
            log(f"ditscale.sp not importable ({self.sp_error}): running the peers only")
        last_ms: dict[str, tuple[int, float]] = {}
        for seq in sorted(a.seq):
            for cfg in cfgs:
                self.one(cfg, seq, last_ms)
        log(f"done in {time.monotonic() - self.t0:.1f} s")

    def check_once(self, cfg: Config) -> None:
        """The check of `cfg`, kept in self.checks; a peer whose cuDNN path fails is checked
        (and then timed) with the flash backend."""
        a = self.a
        self.checks[cfg.name] = self.checked(cfg)
        if ("error" in self.checks[cfg.name] and cfg.impl in ("single", "peer")
                and a.backend == "cudnn"):
            # torch's CP dispatches per SDPA op; if its cuDNN path fails, measure with flash
            # (recorded in the run's note) rather than not at all.
            log(f"{cfg.name} with cuDNN failed ({self.checks[cfg.name]['error']}); "
                "retrying with the flash backend")
            self.backend_for[cfg.name] = "flash"
            self.checks[cfg.name] = self.checked(cfg)
        c = self.checks[cfg.name]
        log(f"check {cfg.name}: " + (f"rel err {c['rel_err']:.2e} "
                                     f"{'ok' if c['ok'] else 'FAIL'}" if "rel_err" in c
                                     else c["error"]))

    def one(self, cfg: Config, seq: int, last_ms: dict) -> None:
        a, torch = self.a, self.torch
        run = Run(seq, a.text, cfg.name, cfg.impl, cfg.strategy, cfg.chunks, cfg.transport,
                  [], self.link, cfg.comm_sms)
        try:
            run.mesh = self.mesh_dims(cfg)
        except Exception as e:
            run.status, run.note = "error", f"mesh: {type(e).__name__}: {e}"
            self.record(run)
            return
        # Cost estimate from the last size of this configuration (time ~ (S+T)^2 at worst).
        calls = a.warmup + a.iters * a.repeats
        est = 0.0
        if cfg.name in last_ms:
            s0, ms0 = last_ms[cfg.name]
            est = calls * ms0 / 1e3 * ((seq + a.text) / (s0 + a.text)) ** 2
        if not self.budget_allows(est):
            run.status, run.note = "skipped", f"time budget (est. {est:.0f} s)"
            self.record(run)
            return
        if a.check_seq > 0 and cfg.name not in self.checks:
            self.check_once(cfg)
        if cfg.name in self.backend_for:
            run.note = f"SDPA backend {self.backend_for[cfg.name]}"
        close = None
        ok = True
        try:
            step, _, close = self.make_layer(cfg, seq)
            run.ms_repeats = self.time_layer(step)
            run.ms = statistics.median(run.ms_repeats)
            if a.profile:
                diagnose.profile_step(self, cfg, seq, step, log)
            if a.timeline and cfg.impl == "ditscale":
                diagnose.timeline_step(self, cfg, seq, step, log)
            flops = peers.attention_flops(a.batch, a.heads, seq + a.text, a.head_dim)
            run.tflops = flops / (run.ms * 1e-3) / 1e12
            last_ms[cfg.name] = (seq, run.ms)
        except Exception as e:
            ok = False
            run.status, run.note = "error", f"{type(e).__name__}: {e}"
            if self.rank == 0:
                traceback.print_exc()
        finally:
            if close:
                close()
        if not self.agree(ok) and run.status == "ok":
            run.status, run.note = "error", "failed on another rank"
        torch.cuda.empty_cache()
        self.record(run)

    def record(self, run: Run) -> None:
        self.runs.append(run)
        msg = f"{self.link} S={run.seq}+{run.text} {run.config} mesh {run.mesh}: "
        if run.status == "ok":
            reps = " ".join(f"{x:.2f}" for x in run.ms_repeats)
            msg += f"{run.ms:.2f} ms ({run.tflops:.0f} TFLOP/s; repeats {reps})"
        else:
            msg += f"{run.status}: {run.note}"
        log(msg)
        self.write()

    def write(self) -> None:
        if self.rank != 0 or self.a.json is None:
            return
        torch, a = self.torch, self.a
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        doc = {
            "kind": "ditscale-sp-attention-bench",
            "version": 1,
            "header": reporter.header(),
            "link": self.link,
            "emulate_machines": a.emulate_machines,
            "net_channels_per_peer": a.net_channels_per_peer,
            "world_size": self.world,
            "host": socket.gethostname(),
            "gpu": torch.cuda.get_device_name(self.device),
            "torch": torch.__version__,
            "nccl": nccl,
            "ditscale_sp": self.sp is not None,
            "ditscale_sp_error": self.sp_error,
            "shape": {"batch": a.batch, "text": a.text, "heads": a.heads,
                      "head_dim": a.head_dim, "dtype": "bf16", "causal": False},
            "timing": {"warmup": a.warmup, "iters": a.iters, "repeats": a.repeats,
                       "statistic": "median over repeats of max over ranks of ms per layer"},
            "backend": a.backend,
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",
                                                   "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                   "NVSHMEM_DISABLE_NVLS", "NCCL_HOSTID",
                                                   "DITSCALE_SP_ONE_SIDED_ENGINE")},
            "elapsed_s": time.monotonic() - self.t0,
            "runs": [asdict(r) for r in self.runs],
            "checks": self.checks,
        }
        a.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.json.with_suffix(a.json.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(a.json)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.net_channels_per_peer > 0:  # read when ditscale's communicators are created
        os.environ["DITSCALE_SP_NET_CHANNELS_PER_PEER"] = str(a.net_channels_per_peer)
    import torch

    if not torch.cuda.is_available():
        log("no CUDA device: skipping the attention benchmark")
        return 0
    b = Bench(a)
    try:
        b.run_all()
    finally:
        b.dist.destroy_process_group()
    bad = [c for c, v in b.checks.items() if not v.get("ok")]
    if bad:
        log(f"check FAILED for: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
