"""The CPU executor of ditscale.sp schedules: one rank's program (``_core.sp_rank_program``, the
schedule the GPUs run, cut to this rank) on CPU tensors, its Send / Recv over torch.distributed
(gloo, one process per rank).

The schedule's own execution model (ditscale/sp/schedule.h): one thread per non-empty stream
(compute: the caller's; intra- and inter-machine transfers), a threading.Event per op for its
deps, a group's ops started together, Send / Recv matched on (sender, receiver, tag), so no valid
schedule deadlocks. Buffers are float32 [batch, tokens, heads, width] (cpu_kernels.py), undefined
ones start as NaN; inputs the schedule writes run on a copy; no autograd; one-sided ops (Put,
Signal, Wait) are refused. docs/sp.md ("CPU execution over gloo").
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .cpu_kernels import attention_lse, merge_lse_

Region = Optional[Tuple[int, int, int, int, int]]  # buffer, token_begin, tokens, head_begin, heads

# Added to the schedule's tags (< 2^18: at most 2 * kMaxScheduleOps ops), so that they do not
# match the user's own send / recv on the group (tag 0 by default).
TAG_BASE = 1 << 30
# Op kinds that move data within this rank (the backward schedules transpose them alike).
COPIES = ("Copy", "Pack", "Unpack")
_LOCAL = ("Attention", "Merge", *COPIES)
_TWO_SIDED = ("Send", "Recv")
_INIT = {"undefined": float("nan"), "zero": 0.0, "neg-inf": float("-inf")}
STREAM_NAMES = ("compute", "comm-intra", "comm-inter")


@dataclass(frozen=True)
class Op:
    index: int
    kind: str
    stream: int
    group: int
    deps: Tuple[int, ...]
    peer: int
    tag: int
    src: Region
    dst: Region
    key: Region
    value: Region
    src_lse: Region
    dst_lse: Region
    label: str


@dataclass(frozen=True)
class Program:
    """One rank's program: its image tokens, buffers (name, role, init, tokens, heads, width),
    ops, the input and output buffer indices (-1 = absent) and the units of each stream (lists
    of op indices)."""

    rank: int
    image_tokens: Tuple[int, int]  # (begin, count) of this rank's image tokens in the sequence
    buffers: Tuple[Tuple[str, str, str, int, int, int], ...]
    ops: Tuple[Op, ...]
    io: Dict[str, int]
    units: Tuple[Tuple[Tuple[int, ...], ...], ...]
    description: str
    # Input buffers the schedule also writes (ring without joint text receives into k and v):
    # execute runs them on copies, so the caller's tensors are never written.
    written_inputs: Tuple[str, ...] = ()
    # The resolved strategy and degrees (the backward picks the schedule's own, grad.py).
    strategy: str = ""
    ulysses_degree: int = 1
    ring_degree: int = 1


def load_program(raw: dict, description: str) -> Program:
    """A Program from ``_core.sp_rank_program``'s dict, checked for what this executor needs:
    two-sided transfers only, tags unique per (peer, direction); input buffers the schedule
    writes are listed in ``written_inputs``."""
    ops = tuple(Op(i, *o[:3], tuple(o[3]), *o[4:]) for i, o in enumerate(raw["ops"]))
    io = {name: raw[name] for name in ("q", "k", "v", "out", "text_q", "text_k", "text_v",
                                       "text_out")}
    inputs = {io[n] for n in ("q", "k", "v", "text_q", "text_k", "text_v") if io[n] >= 0}
    seen = set()
    written = set()
    for op in ops:
        if op.kind not in _LOCAL + _TWO_SIDED:
            raise ValueError(f"ditscale.sp (CPU): {description}: op #{op.index} '{op.label}' is "
                             f"a {op.kind}: the CPU executor runs two-sided transports only")
        if op.kind in _TWO_SIDED:
            key = (op.kind, op.peer, op.tag)
            if key in seen:
                raise RuntimeError(f"ditscale.sp (CPU): {description}: tag {op.tag} used twice "
                                   f"for {op.kind} with rank {op.peer} (op #{op.index})")
            seen.add(key)
        written.update(r[0] for r in (op.dst, op.dst_lse) if r is not None and r[0] in inputs)
    return Program(raw["rank"], (raw["image_token_begin"], raw["image_token_count"]),
                   tuple(tuple(b) for b in raw["buffers"]), ops, io, _units(ops), description,
                   tuple(n for n in sorted(io) if io[n] >= 0 and io[n] in written),
                   raw["strategy"], raw["ulysses_degree"], raw["ring_degree"])


def _units(ops: Sequence[Op]) -> Tuple[Tuple[Tuple[int, ...], ...], ...]:
    """Per stream, its ops in order cut into units (a group of consecutive ops, or one op)."""
    streams: List[List[List[int]]] = [[], [], []]
    for op in ops:
        units = streams[op.stream]
        if op.group >= 0 and units and ops[units[-1][-1]].group == op.group:
            units[-1].append(op.index)
        else:
            units.append([op.index])
    return tuple(tuple(tuple(u) for u in units) for units in streams)


class _Run:
    """One execution of a program: its buffers, the completion event of every op, the first
    error of any stream."""

    def __init__(self, prog: Program, pg, tensors: Dict[str, torch.Tensor], batch: int,
                 timeout_s: float):
        self.prog = prog
        self.pg = pg
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.bufs = []
        for i, (_, _, init, tokens, heads, width) in enumerate(prog.buffers):
            given = [n for n, b in prog.io.items() if b == i and n in tensors]
            if given:
                self.bufs.append(tensors[given[0]])
            else:
                self.bufs.append(torch.full((batch, tokens, heads, width), _INIT[init],
                                            dtype=torch.float32))
        self.done = [threading.Event() for _ in prog.ops]
        self.failed = threading.Event()
        self.inference = torch.is_inference_mode_enabled()  # the caller's, for every stream
        self.error: Optional[BaseException] = None
        self.lock = threading.Lock()

    def view(self, r: Region) -> torch.Tensor:
        b, t0, nt, h0, nh = r
        return self.bufs[b][:, t0:t0 + nt, h0:h0 + nh]

    def fail(self, e: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = e
        self.failed.set()

    def wait_deps(self, op: Op) -> bool:
        """Waits for op's deps; False when another stream failed meanwhile."""
        for d in op.deps:
            while not self.done[d].wait(0.05):
                if self.failed.is_set():
                    return False
        return True

    def start(self, op: Op):
        """Runs a local op, or posts a transfer: (work, landing tensor) or None."""
        if op.kind == "Send":
            data = self.view(op.src).contiguous()
            return self.pg.send([data], op.peer, TAG_BASE + op.tag), data
        if op.kind == "Recv":
            dst = self.view(op.dst)
            land = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=torch.float32)
            return self.pg.recv([land], op.peer, TAG_BASE + op.tag), land
        if op.kind == "Attention":
            out, lse = attention_lse(self.view(op.src), self.view(op.key), self.view(op.value))
            self.view(op.dst).copy_(out)
            self.view(op.dst_lse).copy_(lse)
        elif op.kind == "Merge":
            merge_lse_(self.view(op.dst), self.view(op.dst_lse), self.view(op.src),
                       self.view(op.src_lse))
        else:  # Pack, Unpack, Copy
            self.view(op.dst).copy_(self.view(op.src))
        return None

    def finish(self, op: Op, posted) -> None:
        work, land = posted
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise RuntimeError(f"ditscale.sp (CPU): rank {self.prog.rank}: {op.kind} "
                               f"'{op.label}' with rank {op.peer} (tag {op.tag}) did not complete "
                               f"within {self.timeout_s:g} s: {e}") from None
        if op.kind == "Recv":
            dst = self.view(op.dst)
            if land is not dst:
                dst.copy_(land)

    def run_stream(self, stream: int) -> None:
        # Grad and inference modes are thread-local: every stream runs without autograd (the
        # executor has no backward: a graph of its copies alone would give wrong gradients) and
        # in the caller's inference mode, whose buffers (inference tensors) it writes. no_grad goes
        # inside: inference_mode(False) turns grad mode on.
        try:
            with torch.inference_mode(self.inference), torch.no_grad():  # this order: see above
                self._run_units(stream)
        except BaseException as e:  # re-raised by the caller's thread
            self.fail(e)

    def _run_units(self, stream: int) -> None:
        for unit in self.prog.units[stream]:
            ops = [self.prog.ops[i] for i in unit]
            for op in ops:
                if not self.wait_deps(op):
                    return
            posted = [(op, self.start(op)) for op in ops]
            for op, p in posted:
                if p is not None:
                    self.finish(op, p)
            for op in ops:
                self.done[op.index].set()
            if self.failed.is_set():
                return


@torch.no_grad()
def execute(prog: Program, pg, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            joint: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
            timeout_s: float = 120.0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Runs ``prog`` on this rank: q [B, S_local, H, d], k, v [B, S_local, Hk, d] (this rank's
    image tokens), ``joint`` = (text q, k, v) [B, T, H or Hk, d] or None; ``pg`` the process
    group (ranks of the program = its ranks). Returns (out [B, S_local, H, d], text_out
    [B, T, H, d] or None), float32, never requiring grad. A transfer that does not complete
    within ``timeout_s`` is a RuntimeError naming the op."""
    out, text_out, _ = execute_kept(prog, pg, q, k, v, joint, timeout_s)
    return out, text_out


@torch.no_grad()
def execute_kept(prog: Program, pg, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 timeout_s: float = 120.0):
    """:func:`execute`, also returning every buffer of the run (a list by buffer index: the
    backward keeps those its attention ops read, cpu_backward.py)."""
    f32 = {"q": q, "k": k, "v": v}
    if joint is not None:
        f32.update(text_q=joint[0], text_k=joint[1], text_v=joint[2])
    tensors = {n: t.float().contiguous() for n, t in f32.items() if prog.io[n] >= 0}
    for n in prog.written_inputs:
        if tensors[n] is f32[n]:
            tensors[n] = tensors[n].clone()
    run = _Run(prog, pg, tensors, q.shape[0], timeout_s)
    threads = [threading.Thread(target=run.run_stream, args=(s,), daemon=True,
                                name=f"ditscale-sp-{STREAM_NAMES[s]}")
               for s in (1, 2) if prog.units[s]]
    for t in threads:
        t.start()
    run.run_stream(0)
    for t in threads:
        while t.is_alive() and not run.failed.is_set():
            t.join(0.05)
    if run.error is not None:
        raise run.error
    out = run.bufs[prog.io["out"]]
    text_out = run.bufs[prog.io["text_out"]] if prog.io["text_out"] >= 0 else None
    return out, text_out, run.bufs
