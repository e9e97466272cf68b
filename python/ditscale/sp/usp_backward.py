"""The own backward of the Ulysses x ring schedules (strategy usp; swiftfusion-tas builds the same
program with its ranks placed otherwise) on CPU tensors over gloo: the forward's communication
reversed, nothing recomputed. The forward (cpu_executor.py) keeps this rank's head group after
the Ulysses all-to-all: its query rows (text, then image), its text k, v rows and the k, v block
its last ring step attended, in the inputs' dtype (copies of them: lossless), and the merged
output rows and log-sum-exp (float32), all found among the program's buffers by :func:`layout`.
The backward: the program's output phases transposed (cpu_backward.Transposer: dOut all-to-all
sequence -> heads, dTextOut of this rank's text rows summed over the ranks), the ring reversed
over the ring sub-group (ring_backward.rotate: block and dK, dV accumulator go to the rank the
block came from, and reach their owner with the last step), then the input phase transposed
(dQ, dK, dV all-to-all back). Shapes, formulas: ring_backward.gradients; docs/sp.md
("Gradients").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import cpu_backward, cpu_runtime
from .cpu_executor import COPIES, Op, Program
from .block_kernels import attention_lse_backward
from .meshes import Mesh
from .ring_backward import Link, rotate

WHERE = "ditscale.sp.attention"
STRATEGIES = ("usp", "swiftfusion-tas")  # programs with U > 1 and R > 1 that layout() reads
Region = Tuple[int, int, int, int, int]  # buffer, token_begin, tokens, head_begin, heads


@dataclass(frozen=True)
class Layout:
    """Where a Ulysses x ring program's pieces are (regions of its buffers): ``rows``, the query
    rows every attention op reads; ``acc``, ``lse``: their merged output and log-sum-exp;
    ``blocks``: the (key, value) regions of the ring steps' attention ops in order (step 0: this
    rank's block, then ``text`` text kv rows, copied from the ``text_src`` regions of the joint
    k, v inputs: a later ring step may overwrite them); ``next`` / ``prev``: the ring ranks the
    forward sends blocks to / receives them from; ``before`` / ``after``: the ops of the Ulysses
    phases (transposed by cpu_backward)."""

    rows: Region
    acc: Region
    lse: Region
    blocks: Tuple[Tuple[Region, Region], ...]
    text: int
    text_src: Tuple[Optional[Region], Optional[Region]]
    next: int
    prev: int
    before: Tuple[Op, ...]
    after: Tuple[Op, ...]

    def text_kv(self, i: int) -> Region:
        """The text rows of blocks[0]'s key (i = 0) or value (i = 1)."""
        b, t0, n, h0, nh = self.blocks[0][i]
        return (b, t0 + n - self.text, self.text, h0, nh)

    def own_kv(self, i: int) -> Region:
        """This rank's image rows of blocks[0]'s key (i = 0) or value (i = 1)."""
        b, t0, n, h0, nh = self.blocks[0][i]
        return (b, t0, n - self.text, h0, nh)


def _overlap(a: Optional[Region], b: Region) -> bool:
    return a is not None and a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2] and \
        a[3] < b[3] + b[4] and b[3] < a[3] + a[4]


def _split(prog: Program, att: List[Op]):
    """(before, ring sends, ring receives, after, ring writes): the ops other than attention
    and merges by phase. The ring's: packs and copies out of a kv buffer and the sends of what
    they fill (or of the kv buffer itself); after the first attention, the writes into a kv
    buffer and the receives that they unpack (or into the kv buffer itself)."""
    kv = {r[0] for op in att for r in (op.key, op.value)}
    a0 = att[0].index
    out_of = kv | {op.dst[0] for op in prog.ops if op.kind in COPIES and op.src[0] in kv}
    into = kv | {op.src[0] for op in prog.ops
                 if op.kind in COPIES and op.index > a0 and op.dst[0] in kv}
    before, sends, recvs, after, writes = [], [], [], [], []
    for op in prog.ops:
        if op.kind in ("Attention", "Merge"):
            continue
        if op.kind != "Recv" and op.src[0] in out_of:
            (sends if op.kind == "Send" else writes).append(op)
        elif op.index < a0:
            before.append(op)
        elif op.dst is not None and op.dst[0] in into:
            (recvs if op.kind == "Recv" else writes).append(op)
        else:
            after.append(op)
    return before, sends, recvs, after, writes + recvs


def _merged(prog: Program, att: List[Op]) -> bool:
    """Attention 0 writes the accumulator, each later one a partial merged into it right
    after; nothing else writes the accumulator or its LSE."""
    a0 = att[0]
    merges = [op for op in prog.ops if op.kind == "Merge"]
    if len(merges) != len(att) - 1 or any(op.src != a0.src for op in att):
        return False
    for a, m in zip(att[1:], merges):
        if (m.src, m.src_lse, m.dst, m.dst_lse) != (a.dst, a.dst_lse, a0.dst, a0.dst_lse) or \
                m.index < a.index:
            return False
    acc = {a0.dst[0], a0.dst_lse[0]}
    writers = [op for op in prog.ops if any(r is not None and r[0] in acc
                                            for r in (op.dst, op.dst_lse))]
    return {op.index for op in writers} == {a0.index, *(m.index for m in merges)} and \
        (a0.dst[2], a0.dst[4]) == (a0.src[2], a0.src[4])


def _peer(ops: Sequence[Op]) -> int:
    peers = {op.peer for op in ops}
    return peers.pop() if len(peers) == 1 else -1


def _phases_ok(prog: Program, lay: Layout, att: List[Op], writes: Sequence[Op]) -> bool:
    """The Ulysses phases transposable and apart from the ring's buffers; the saved regions
    (query rows, text kv rows, the last block) never overwritten after they are read."""
    kv = {r[0] for op in att for r in (op.key, op.value)}
    ring = kv | {lay.rows[0], lay.acc[0], lay.lse[0]} | {op.dst[0] for op in att}
    try:
        cpu_backward.check_transposable(prog, WHERE, lay.before)
        cpu_backward.check_transposable(prog, WHERE, lay.after)
    except ValueError:
        return False
    after_written = {op.dst[0] for op in lay.after if op.dst is not None}
    if after_written & ring or any(op.kind in (*COPIES, "Send") and
                                   op.src[0] not in after_written | {lay.acc[0]}
                                   for op in lay.after):
        return False
    if any(op.dst is not None and op.dst[0] in (lay.acc[0], lay.lse[0]) for op in lay.before):
        return False
    return all(op.index < att[-1].index for op in writes if op.dst[0] in kv)


def _text_src(prog: Program, before: Sequence[Op], blocks, text: int):
    """The regions of the joint k, v inputs that the text rows of blocks[0] are copied from (one
    Copy each), or None when they are not so; (None, None) without text."""
    if not text:
        return None, None
    found = []
    for i, name in enumerate(("text_k", "text_v")):
        b, t0, n, h0, nh = blocks[0][i]
        rows = (b, t0 + n - text, text, h0, nh)
        ops = [op for op in before if _overlap(op.dst, rows)]
        if len(ops) != 1 or ops[0].kind != "Copy" or ops[0].dst != rows or \
                ops[0].src[0] != prog.io[name]:
            return None
        found.append(ops[0].src)
    return tuple(found)


def _text_tokens(prog: Program) -> int:
    b = prog.io["text_k"]
    return prog.buffers[b][3] if b >= 0 else 0


def layout(prog: Program) -> Optional[Layout]:
    """The Layout of a Ulysses x ring program (:data:`STRATEGIES`, U > 1, R > 1), None when the
    program is not shaped so (its backward then recomputes the layer, recompute.py)."""
    if prog.strategy not in STRATEGIES or prog.ulysses_degree < 2 or prog.ring_degree < 2:
        return None
    att = [op for op in prog.ops if op.kind == "Attention"]
    if len(att) != prog.ring_degree or not _merged(prog, att):
        return None
    before, sends, recvs, after, writes = _split(prog, att)
    steps = 2 * (len(att) - 1)
    nxt, prev = _peer(sends), _peer(recvs)
    text = _text_tokens(prog)
    if len(sends) != steps or len(recvs) != steps or min(nxt, prev) < 0 or \
            att[0].key[2] <= text or att[0].key[2] != att[0].value[2]:
        return None
    blocks = tuple((op.key, op.value) for op in att)
    text_src = _text_src(prog, before, blocks, text)
    if text_src is None:
        return None
    lay = Layout(att[0].src, att[0].dst, att[0].dst_lse, blocks, text, text_src, nxt, prev,
                 tuple(before), tuple(after))
    return lay if _phases_ok(prog, lay, att, writes) else None


def layout_of(prog: Program, mesh: Mesh) -> Optional[Layout]:
    """:func:`layout` where every rank of the mesh finds its own, else None on every rank
    (cpu_runtime.agreed_layout: one all_reduce at a program's first call in the group)."""
    return cpu_runtime.agreed_layout("usp", mesh, prog, layout)


@dataclass(frozen=True)
class Usp:
    """What the backward needs besides the saved tensors: the program, its layout, the process
    group, the mesh and the transfer timeout in seconds."""

    prog: Program
    layout: Layout
    pg: object
    mesh: Mesh
    timeout_s: float

    @property
    def link(self) -> Link:
        return Link(self.mesh, self.timeout_s, "usp backward")


def state(mesh: Mesh, run) -> Optional[Usp]:
    """The backward's state for the forward ``run`` (cpu_runtime.attention_kept's program,
    group, timeout, buffers), or None when the program is not a Ulysses x ring one."""
    prog, pg, seconds, _ = run
    lay = layout_of(prog, mesh)
    return None if lay is None else Usp(prog, lay, pg, mesh, seconds)


def _take(bufs, r: Region, dtype: torch.dtype) -> torch.Tensor:
    """Region r of the run's buffers in dtype, never a view of a larger buffer."""
    b, t0, n, h0, nh = r
    view = bufs[b][:, t0:t0 + n, h0:h0 + nh]
    out = view.to(dtype)
    if out.data_ptr() == view.data_ptr() and view.shape != bufs[b].shape:
        out = out.clone()
    return out


def saved(usp: Usp, inputs, bufs) -> Tuple[torch.Tensor, ...]:
    """What the forward keeps: (query rows, out rows, lse rows, the last block's k, v[, text k,
    v rows]); inputs = (q, k, v, joint q, k, v or None) give the dtypes."""
    lay, qt, kt = usp.layout, inputs[0].dtype, inputs[1].dtype
    kept = [_take(bufs, lay.rows, qt), _take(bufs, lay.acc, torch.float32),
            _take(bufs, lay.lse, torch.float32)]
    kept += [_take(bufs, r, kt) for r in lay.blocks[-1]]
    if lay.text:
        kept += [_take(bufs, r, kt) for r in lay.text_src]
    return tuple(kept)


def _phase(run: cpu_backward.Transposer, ops: Sequence[Op], what: str) -> None:
    try:
        for op in reversed(ops):
            run.step(op)
    except RuntimeError as e:
        raise RuntimeError(f"{WHERE}: usp backward, {what}: {e}") from None


@torch.no_grad()
def backward(usp: Usp, kept: Sequence[torch.Tensor], dout: torch.Tensor,
             djout: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The float32 gradients {"q", "k", "v"[, "text_q", "text_k", "text_v"]} of this rank's
    inputs from :func:`saved`'s tensors and dOut [B, S_r, H, D] (dTextOut [B, T, H, D]). A
    rank's joint gradients are those of its head group's rows (summed over the ranks: the
    dense ones)."""
    lay, prog = usp.layout, usp.prog
    run = cpu_backward.Transposer(prog, usp.pg, {}, dout.shape[0], usp.timeout_s)
    run.seed({"out": dout, **({"text_out": djout} if lay.text else {})})
    _phase(run, lay.after, "dOut to the head groups")
    try:
        d_rows = run.grad(lay.acc).contiguous()  # every rank's dTextOut of the text rows landed
    except RuntimeError as e:
        raise RuntimeError(f"{WHERE}: usp backward, dOut to the head groups: {e}") from None
    q, out, lse, k, v = (t.float().contiguous() for t in kept[:5])
    rows = (d_rows, q, out, lse)
    dq = torch.zeros_like(q)
    if lay.text:  # the text kv rows, local (every rank of the ring holds them)
        dq, dtk, dtv = attention_lse_backward(*rows[:2], *(t.float() for t in kept[5:7]),
                                              *rows[2:])
        run.grad(lay.text_kv(0)).add_(dtk)
        run.grad(lay.text_kv(1)).add_(dtv)
    # Reversed ring: the block of step s came from ``prev``; step R-1's is held first.
    counts = [r[0][2] for r in reversed(lay.blocks[:-1])]
    counts[-1] -= lay.text
    dq_ring, grad = rotate(usp.link, rows, torch.cat([k, v], 3), lay.prev, lay.next, counts,
                           home=False)
    D = k.shape[3]
    run.grad(lay.rows).add_(dq + dq_ring)
    run.grad(lay.own_kv(0)).add_(grad[..., :D])
    run.grad(lay.own_kv(1)).add_(grad[..., D:])
    _phase(run, lay.before, "dQ, dK, dV to the sequence shards")
    try:
        run.finish()
    except RuntimeError as e:
        raise RuntimeError(f"{WHERE}: usp backward, dQ, dK, dV to the sequence shards: "
                           f"{e}") from None
    return {name: g.contiguous() for name, g in run.inputs().items()}
