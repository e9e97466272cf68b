"""The backward of one rank's CPU program (cpu_executor.py) whose ops write every region once but
for merges of attention outputs into another's rows (the Ulysses schedules, ulysses-overlap,
torus): the forward program transposed, op by op in reverse order, on float32 gradient buffers
shaped like the forward's.

- Copy / Pack / Unpack ``dst <- src``: ``g[src] += g[dst]``;
- Send of ``src`` to a peer: a Recv of the peer's gradient, added to ``g[src]``;
- Recv into ``dst`` from a peer: a Send of ``g[dst]`` back to it (the same tag, offset by
  :data:`GRAD_TAG_BASE`);
- Attention ``dst, dst_lse <- (src, key, value)``: the block's backward from the saved
  (q, k, v, out, lse) (cpu_kernels.attention_lse_backward), added to ``g[src], g[key],
  g[value]``; out, lse are the rows' final ones (those of the accumulator it is merged into);
- Merge of a partial into an accumulator's rows: ``g[partial] += g[acc rows]`` (with the final
  LSE, each block's backward takes the merged output's dO, as the ring's does; no LSE
  gradient); a partial's gradient is zeroed once its attention used it (its buffer is reused).

Transfers are posted at once; a gradient buffer is read or added to only after every Recv posted
into it has landed (added in posting order: deterministic). A transfer that does not complete
within the timeout fails naming the op. docs/sp.md ("Gradients").
"""

from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .cpu_executor import COPIES, TAG_BASE, Op, Program, Region
from .cpu_kernels import attention_lse_backward

# Gradient transfers' tags: the forward op's tag plus this (forward tags are < 2^18).
GRAD_TAG_BASE = TAG_BASE + (1 << 20)
_INPUTS = ("q", "k", "v", "text_q", "text_k", "text_v")


def _reads(op: Op) -> Tuple[Region, ...]:
    return tuple(r for r in (op.src, op.key, op.value, op.src_lse) if r is not None)


def _overlaps(a: Region, b: Region) -> bool:
    return a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2] and \
        a[3] < b[3] + b[4] and b[3] < a[3] + a[4]


def _within(a: Region, b: Region) -> bool:
    return a[0] == b[0] and b[1] <= a[1] and a[1] + a[2] <= b[1] + b[2] and \
        b[3] <= a[3] and a[3] + a[4] <= b[3] + b[4]


def _refuse(prog: Program, op: Op, where: str, what: str):
    raise ValueError(f"{where}: {prog.description}: op #{op.index} '{op.label}' {what}; its "
                     f"backward is not implemented")


def _partials(prog: Program, ops: Sequence[Op], where: str) -> Dict[int, Op]:
    """{attention op index: the Merge folding its output (a partial) into rows of another
    attention's output (an accumulator)}: each Merge's source is the latest attention's exact
    (out, lse), merged once; its destination rows lie in one earlier accumulator's out and the
    same rows of its lse."""
    latest: Dict[Tuple[Region, Region], Op] = {}
    found: Dict[int, Op] = {}
    for op in ops:
        if op.kind == "Attention":
            latest[(op.dst, op.dst_lse)] = op
        elif op.kind == "Merge":
            part = latest.pop((op.src, op.src_lse), None)
            if part is None:
                _refuse(prog, op, where, "merges what is not an attention's output")
            found[part.index] = op
    accs = [op for op in ops if op.kind == "Attention" and op.index not in found]
    def offset(r: Region, base: Region):  # r's rows and heads relative to base's
        return r[1] - base[1], r[2], r[3] - base[3], r[4]

    for m in found.values():
        if not any(a.index < m.index and _within(m.dst, a.dst) and
                   _within(m.dst_lse, a.dst_lse) and
                   offset(m.dst, a.dst) == offset(m.dst_lse, a.dst_lse) for a in accs):
            _refuse(prog, m, where, "merges into what is not an attention's output")
    return found


def _check_reads(prog: Program, ops: Sequence[Op], found: Dict[int, Op], where: str) -> None:
    """No op but a merge reads a log-sum-exp or a partial, nor an accumulator's rows before
    their last merge (then every block's backward takes the rows' final output and LSE)."""
    lse = [op.dst_lse for op in ops if op.kind == "Attention"]
    partial = [prog.ops[i].dst for i in found]
    for op in ops:
        if op.kind == "Merge":
            continue
        for r in _reads(op):
            if any(_overlaps(r, x) for x in lse + partial) or \
                    any(op.index < m.index and _overlaps(r, m.dst) for m in found.values()):
                _refuse(prog, op, where, "reads a partial result or log-sum-exp")


def check_transposable(prog: Program, where: str, ops: Optional[Sequence[Op]] = None) -> None:
    """ValueError unless ``prog`` (or its ``ops``) writes every region at most once (what the
    transposition needs: no value it reads is ever overwritten) but for merges of partial
    attention outputs into accumulators (:func:`_partials`, :func:`_check_reads`) and a partial's
    region written again after its merge."""
    ops = prog.ops if ops is None else ops
    found = _partials(prog, ops, where)
    _check_reads(prog, ops, found, where)
    written: Dict[int, List[Tuple[Region, int]]] = {}  # buffer: (region, merged by op index)
    for op in ops:
        if op.kind == "Merge":  # into an accumulator's rows: checked above
            continue
        merged = found[op.index].index if op.index in found else len(prog.ops)
        for r in (op.dst, op.dst_lse):
            if r is None:
                continue
            if any(_overlaps(r, w) and op.index <= until for w, until in written.get(r[0], ())):
                _refuse(prog, op, where, "overwrites a region written before")
            written.setdefault(r[0], []).append((r, merged))


def finals(prog: Program) -> Dict[int, Tuple[Region, Region]]:
    """{attention op index: (out, lse) regions holding its rows' final merged output and LSE}
    for the partials (the others' are their own dst, dst_lse). Assumes a transposable program."""
    try:
        found = _partials(prog, prog.ops, "")
    except ValueError:
        return {}
    return {i: (m.dst, m.dst_lse) for i, m in found.items()}


def saved_buffers(prog: Program) -> Tuple[int, ...]:
    """The buffers the backward reads: those of the attention ops (q, k, v, and the final out,
    lse of their rows: a merged partial's buffer is not kept)."""
    used, final = set(), finals(prog)
    for op in prog.ops:
        if op.kind == "Attention":
            out, lse = final.get(op.index, (op.dst, op.dst_lse))
            used.update(r[0] for r in (op.src, op.key, op.value, out, lse))
    return tuple(sorted(used))


class Transposer:
    """One backward run: gradient buffers (zeros on first use), posted transfers. ``step`` each
    op in reverse order, then ``finish``; usp_backward.py steps the ops of a program's Ulysses
    phases only and adds its ring's gradients in between (``grad``)."""

    def __init__(self, prog: Program, pg, saved: Dict[int, torch.Tensor], batch: int,
                 timeout_s: float):
        self.prog, self.pg, self.saved = prog, pg, saved
        self.batch = batch
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.grads: Dict[int, torch.Tensor] = {}
        self.finals = finals(prog)
        self.pending: Dict[int, List[Tuple[Op, object, torch.Tensor]]] = {}
        self.sends: List[Tuple[Op, object, torch.Tensor]] = []

    def grad(self, r: Region) -> torch.Tensor:
        """The gradient of region r (every Recv into its buffer landed first)."""
        b, t0, nt, h0, nh = r
        self._land(b)
        if b not in self.grads:
            _, _, _, tokens, heads, width = self.prog.buffers[b]
            self.grads[b] = torch.zeros(self.batch, tokens, heads, width)
        return self.grads[b][:, t0:t0 + nt, h0:h0 + nh]

    def value(self, r: Region) -> torch.Tensor:
        b, t0, nt, h0, nh = r
        return self.saved[b][:, t0:t0 + nt, h0:h0 + nh]

    def _post(self, op: Op, post, tensor: torch.Tensor):
        """``post([tensor], peer, tag)`` (the process group's send or recv), a failure named."""
        try:
            return post([tensor], op.peer, GRAD_TAG_BASE + op.tag)
        except RuntimeError as e:
            raise RuntimeError(f"ditscale.sp (CPU backward): rank {self.prog.rank}: gradient of "
                               f"{op.kind} '{op.label}' with rank {op.peer} (tag {op.tag}) "
                               f"could not be posted: {e}") from None

    def _wait(self, op: Op, work) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise RuntimeError(f"ditscale.sp (CPU backward): rank {self.prog.rank}: gradient of "
                               f"{op.kind} '{op.label}' with rank {op.peer} (tag {op.tag}) did "
                               f"not complete within {self.timeout_s:g} s: {e}") from None

    def _land(self, b: int) -> None:
        for op, work, land in self.pending.pop(b, ()):
            self._wait(op, work)
            self.grad(op.src).add_(land)

    def step(self, op: Op) -> None:
        if op.kind in COPIES or op.kind == "Merge":  # a merge: the partial's dO is the acc's
            self.grad(op.src).add_(self.grad(op.dst))
        elif op.kind == "Recv":  # the gradient of what arrived goes back to its sender
            data = self.grad(op.dst).contiguous()
            self.sends.append((op, self._post(op, self.pg.send, data), data))
        elif op.kind == "Send":  # the gradient of what was sent comes back
            b, _, nt, _, nh = op.src
            land = torch.empty(self.batch, nt, nh, self.prog.buffers[b][5])
            work = self._post(op, self.pg.recv, land)
            self.pending.setdefault(b, []).append((op, work, land))
        elif op.kind == "Attention":  # from the rows' final output and LSE (merged or not)
            out, lse = self.finals.get(op.index, (op.dst, op.dst_lse))
            dq, dk, dv = attention_lse_backward(
                self.grad(op.dst), self.value(op.src), self.value(op.key), self.value(op.value),
                self.value(out), self.value(lse))
            self.grad(op.src).add_(dq)
            self.grad(op.key).add_(dk)
            self.grad(op.value).add_(dv)
            if op.index in self.finals:  # a partial: its region may have been written before
                self.grad(op.dst).zero_()
        else:
            raise ValueError(f"ditscale.sp (CPU backward): op #{op.index} '{op.label}' is a "
                             f"{op.kind}: no backward")

    def seed(self, grads_out: Dict[str, torch.Tensor]) -> None:
        """The gradients of the program's outputs ("out", "text_out")."""
        for name, g in grads_out.items():
            b = self.prog.io[name]
            if b >= 0:
                self.grads[b] = g.float().contiguous().clone()

    def finish(self) -> None:
        for b in sorted(self.pending):
            self._land(b)
        for op, work, _ in self.sends:
            self._wait(op, work)

    def inputs(self) -> Dict[str, torch.Tensor]:
        """The gradients of the program's inputs ("q", "k", ...: those it has), after finish."""
        result = {}
        for name in _INPUTS:
            b = self.prog.io[name]
            if b >= 0:
                _, _, _, tokens, heads, width = self.prog.buffers[b]
                result[name] = self.grad((b, 0, tokens, 0, heads))
        return result


@torch.no_grad()
def backward(prog: Program, pg, saved: Dict[int, torch.Tensor],
             grads_out: Dict[str, torch.Tensor], batch: int,
             timeout_s: float) -> Dict[str, torch.Tensor]:
    """The gradients (float32) of prog's inputs ("q", "k", "v", "text_q", ...: those the program
    has) from those of its outputs (``grads_out``: "out", "text_out") and the forward's
    ``saved`` buffers (by index: :func:`saved_buffers`)."""
    run = Transposer(prog, pg, saved, batch, timeout_s)
    run.seed(grads_out)
    for op in reversed(prog.ops):
        run.step(op)
    run.finish()
    return run.inputs()

