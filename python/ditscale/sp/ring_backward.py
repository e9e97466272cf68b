"""The ring strategy's own backward on CPU tensors over gloo: this rank's query rows meet every
rank's k, v block in turn, and each block's dK, dV accumulator travels along the ring with the
block, back to its owner (dist.batch_isend_irecv, one message a step). The forward (the ring
program, cpu_executor.py) keeps only this rank's q, k, v (and the joint text inputs), its output
rows and their merged log-sum-exp, which :func:`layout` finds among the program's buffers; no
recomputation. Float32 accumulators, a fixed order of additions (the same bits on every run); a
transfer that does not complete within the group's timeout fails naming ditscale.sp.attention.
The ring steps (:func:`rotate`, over :func:`post` / :func:`complete`) also run usp's ring
(usp_backward.py) and torch_usp.py's (CPU or CUDA tensors: block_kernels).
Shapes and formulas: :func:`gradients`; docs/sp.md ("Gradients").
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import cpu_runtime
from .config import Config
from .cpu_executor import COPIES, TAG_BASE, Program
from .block_kernels import QueryRows, attention_lse_backward
from .meshes import Mesh, shard_range

WHERE = "ditscale.sp.attention"
# Tags of the ring backward's transfers (the forward's are TAG_BASE + [0, 2^18), those of the
# transposed program cpu_backward.GRAD_TAG_BASE + [0, 2^18)): ring step s, then the text rows.
RING_TAG = TAG_BASE + (1 << 21)
TEXT_TAG = RING_TAG + (1 << 20)


@dataclass(frozen=True)
class Layout:
    """Where this rank's output rows are in the ring program: ``acc`` (buffer of the merged
    output) and ``lse`` (buffer of its merged log-sum-exp, the same rows), the image rows from
    ``image`` (S_r of them), the text rows (acc row, text token, count); ``pieces``: every
    rank's text rows (text token, count), by group rank (empty without text)."""

    acc: int
    lse: int
    image: int
    text: Tuple[int, int, int]
    pieces: Tuple[Tuple[int, int], ...]


def _writers(prog: Program, b: int):
    return [op for op in prog.ops if any(r is not None and r[0] == b
                                         for r in (op.dst, op.dst_lse))]


def _acc(prog: Program, heads: int) -> Optional[Tuple[int, int]]:
    """(buffer, first row) of the merged image output: the out buffer itself, or the source of
    the one Copy into it (all rows, all heads)."""
    out = prog.io["out"]
    ops = _writers(prog, out)
    whole = (0, prog.image_tokens[1], 0, heads)
    if len(ops) == 1 and ops[0].kind in COPIES and tuple(ops[0].dst[1:]) == whole:
        src = ops[0].src
        return (src[0], src[1]) if (src[3], src[4]) == (0, heads) else None
    if ops and all(op.kind in ("Attention", "Merge") for op in ops):
        return out, 0
    return None


def _lse(prog: Program, acc: int) -> Optional[int]:
    """The buffer of acc's log-sum-exp: every op writing acc writes it too, on the same rows and
    heads, and nothing else writes it."""
    ops = _writers(prog, acc)
    lse = {op.dst_lse[0] for op in ops if op.dst_lse is not None}
    if not ops or len(lse) != 1:
        return None
    b = lse.pop()
    for op in ops:
        if op.kind not in ("Attention", "Merge") or op.dst_lse is None or \
                tuple(op.dst_lse[1:]) != tuple(op.dst[1:]) or op.dst[0] != acc:
            return None
    return b if {op.index for op in _writers(prog, b)} == {op.index for op in ops} else None


def _origin(prog: Program, op, acc: int) -> int:
    """The rank whose rows a write into text_out brings: this rank's for a copy out of acc, the
    peer of a Recv into it or into the staging buffer it unpacks; -1 for anything else."""
    if op.kind in COPIES and op.src[0] == acc:
        return prog.rank
    if op.kind in COPIES:
        ops = _writers(prog, op.src[0])
        op = ops[0] if len(ops) == 1 else op
    return op.peer if op.kind == "Recv" else -1


def _text(prog: Program, acc: int, ranks: int, heads: int):
    """(this rank's text rows (acc row, token, count), every rank's (token, count)) from the
    writes into text_out (a copy of acc's rows, the peers' rows received), or None unless they
    tile the text."""
    b = prog.io["text_out"]
    if b < 0:
        return (0, 0, 0), ()
    tokens = prog.buffers[b][3]
    pieces: List[Optional[Tuple[int, int]]] = [None] * ranks
    mine = (0, 0, 0)
    for op in _writers(prog, b):
        who = _origin(prog, op, acc)
        if (op.dst[3], op.dst[4]) != (0, heads) or not 0 <= who < ranks or \
                pieces[who] is not None:
            return None
        pieces[who] = (op.dst[1], op.dst[2])
        if who == prog.rank:
            mine = (op.src[1], op.dst[1], op.dst[2])
    pieces = [p if p is not None else (0, 0) for p in pieces]
    covered = sorted(p for p in pieces if p[1] > 0)
    ends = [0] + [t + n for t, n in covered]
    if any(t != e for (t, _), e in zip(covered, ends)) or ends[-1] != tokens:
        return None
    return mine, tuple(pieces)


def layout(prog: Program, ranks: int, heads: int) -> Optional[Layout]:
    """The Layout of a ring program's output rows, None when the program is not shaped so (its
    backward then recomputes the layer, recompute.py)."""
    found = _acc(prog, heads)
    if found is None:
        return None
    acc, image = found
    lse = _lse(prog, acc)
    text = _text(prog, acc, ranks, heads)
    if lse is None or text is None:
        return None
    return Layout(acc, lse, image, *text)


def kept(lay: Layout, bufs: Sequence[torch.Tensor], image_tokens: int):
    """(out rows [B, T_r + S_r, H, D], lse rows [B, T_r + S_r, H, 1]) of a run's buffers,
    float32 copies of the rows only (the forward saves them)."""
    a, _, n = lay.text
    rows = []
    for b in (lay.acc, lay.lse):
        parts = [bufs[b][:, a:a + n], bufs[b][:, lay.image:lay.image + image_tokens]]
        rows.append(torch.cat(parts, 1))
    return tuple(rows)


@dataclass(frozen=True)
class Link:
    """The transfers of one backward schedule: the mesh (peers are its group ranks), the
    timeout in seconds of each, and the schedule's name in errors ("ring backward")."""

    mesh: Mesh
    timeout_s: float
    name: str


@dataclass(frozen=True)
class Ring:
    """What the backward needs besides the saved tensors: the layout, the mesh, the layer's
    total image tokens and the transfer timeout in seconds."""

    layout: Layout
    mesh: Mesh
    seq: int
    timeout_s: float

    @property
    def link(self) -> Link:
        return Link(self.mesh, self.timeout_s, "ring backward")


def state(q, k, joint, mesh: Mesh, run) -> Optional[Ring]:
    """The backward's state for the forward ``run`` (cpu_runtime.attention_kept's program,
    group, timeout, buffers) of q [B, S_r, H, D], k, or None when its program is not ring-shaped
    (:func:`layout`) on some rank of the group: agreed by every rank (one all_reduce at a
    program's first call, cpu_runtime.agreed_layout), so that every rank then recomputes."""
    prog, _, seconds, _ = run
    lay = cpu_runtime.agreed_layout("ring", mesh, prog,
                                    lambda p: layout(p, mesh.size, q.shape[2]))
    if lay is None:
        return None
    text = 0 if joint is None else joint[0].shape[1]
    seq = cpu_runtime.seq_total(mesh, q, k, text, WHERE)  # memoised by the forward's check
    return Ring(lay, mesh, seq, seconds)


@dataclass
class Posted:
    """Transfers in flight (:func:`post`), completed by :func:`complete`; ``staged``: (host
    buffer, device tensor) of receives staged through the host (gloo)."""

    works: list
    peers: List[int]
    sends: int
    what: str
    staged: List[Tuple[torch.Tensor, torch.Tensor]]


def _staged(link: Link, sends, recvs):
    """(sends, recvs, staged) with device tensors copied through the host where the group is
    gloo's (which moves host memory only): sends as host copies, receives into host buffers that
    :func:`complete` copies to the device."""
    if dist.get_backend(link.mesh.group) != "gloo":
        return sends, recvs, []
    sends = [(p, t.cpu() if t.device.type != "cpu" else t, tag) for p, t, tag in sends]
    staged, host = [], []
    for p, t, tag in recvs:
        if t.device.type != "cpu":
            staged.append((torch.empty(t.shape, dtype=t.dtype), t))
            t = staged[-1][0]
        host.append((p, t, tag))
    return sends, host, staged


def post(link: Link, sends, recvs, what: str) -> Optional[Posted]:
    """Posts ``sends`` [(group rank, tensor, tag)] and ``recvs`` (the same, landing in the
    tensor) at once; None when there are none. Neither tensor may be touched before
    :func:`complete`. CUDA tensors go through NCCL, or through the host over gloo."""
    mesh = link.mesh
    sends, recvs, staged = _staged(link, sends, recvs)
    ops = [dist.P2POp(dist.isend, t, group=mesh.group, tag=tag, group_peer=p)
           for p, t, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, group=mesh.group, tag=tag, group_peer=p)
            for p, t, tag in recvs]
    if not ops:
        return None
    peers = [p for p, _, _ in sends] + [p for p, _, _ in recvs]
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as e:
        raise RuntimeError(f"{WHERE}: rank {mesh.rank}: {link.name}, {what}: the transfers "
                           f"with ranks {sorted(set(peers))} could not be posted: {e}") from None
    return Posted(works, peers, len(sends), what, staged)


def _wait(link: Link, work, what: str, who: str) -> None:
    """Waits for one work within the timeout, else names ``who`` in the error."""
    try:
        work.wait(datetime.timedelta(seconds=link.timeout_s))
    except RuntimeError as e:
        raise RuntimeError(f"{WHERE}: rank {link.mesh.rank}: {link.name}, {what}: {who} did not "
                           f"complete within {link.timeout_s:g} s (a rank that skips the "
                           f"backward?): {e}") from None


def complete(link: Link, posted: Optional[Posted]) -> None:
    """Waits for :func:`post`'s transfers (receives first), each within the timeout. A backend
    that coalesces the batch (NCCL) gives one work for all of them."""
    if posted is None:
        return
    n, works, peers = posted.sends, posted.works, posted.peers
    if len(works) != len(peers):  # coalesced
        for work in works:
            _wait(link, work, posted.what, f"the transfers with ranks {sorted(set(peers))}")
    else:
        for i in [*range(n, len(works)), *range(n)]:
            kind = "send to" if i < n else "receive from"
            _wait(link, works[i], posted.what, f"the {kind} rank {peers[i]}")
    for host, device in posted.staged:
        device.copy_(host)


def exchange(link: Link, sends, recvs, what: str) -> None:
    """:func:`post`, then :func:`complete`."""
    complete(link, post(link, sends, recvs, what))


def summed_pieces(link: Link, djout: torch.Tensor, pieces, tag: int) -> torch.Tensor:
    """dO of this rank's piece of the text output, float32: every rank's dTextOut ``djout``
    [B, T, H, D] of it, summed in rank order. ``pieces[r]`` = ((token, count), (head, count)) of
    group rank r's piece; each rank sends every other rank that rank's piece."""
    me = link.mesh.rank
    (t0, n), (h0, m) = pieces[me]
    djout = djout.float()
    sends = [(r, djout[:, t:t + c, h:h + k].contiguous(), tag)
             for r, ((t, c), (h, k)) in enumerate(pieces) if r != me and c > 0]
    B, D = djout.shape[0], djout.shape[3]
    got = {r: djout.new_empty(B, n, m, D) for r in range(len(pieces)) if r != me and n > 0}
    exchange(link, sends, [(r, t, tag) for r, t in got.items()], "text rows' dOut")
    total = djout.new_zeros(B, n, m, D)
    for r in range(len(pieces) if n else 0):
        total += djout[:, t0:t0 + n, h0:h0 + m] if r == me else got[r]
    return total


def _moved(link: Link, tensor: torch.Tensor, to: int, frm: int, count: int, tag: int,
           what: str):
    """(the tensor landing from ``frm``, [B, count, ...], transfers posted): ``tensor`` sent to
    ``to`` (if it has rows)."""
    land = tensor.new_empty(tensor.shape[0], count, *tensor.shape[2:])
    return land, post(link, [(to, tensor, tag)] if tensor.shape[1] else [],
                      [(frm, land, tag)] if count else [], what)


def rotate(link: Link, rows, block: torch.Tensor, to: int, frm: int, counts: Sequence[int],
           home: bool):
    """(dQ of the rows, the dK | dV accumulator [B, ., Hk, 2D] of the block held at the end)
    float32, over ``len(counts)`` steps (``home``) or one more (not ``home``); ``rows`` = (dO, Q,
    O, LSE) (dO, O, LSE float32; Q in the kernels' dtype), ``block`` the k | v [B, S_j, Hk, 2D]
    held first (Q's dtype). Step s: the held block's dK, dV (block_kernels) are added to its
    float32 accumulator, received from rank ``frm`` (zero at step 0); block and accumulator go
    on to rank ``to`` (two messages), the next ones (``counts[s]`` tokens) come from ``frm``.
    With ``home`` the last step sends only the accumulator (to the block's owner). Overlap: the
    block's transfer is posted before the step's attention backward, and the accumulator's
    completes during the next step's; the additions keep their order (the same bits)."""
    D = block.shape[3] // 2
    n = len(counts)
    query = QueryRows(*rows[:2], *rows[2:], kv_heads=block.shape[2])  # prepared once
    acc = torch.zeros_like(block, dtype=torch.float32)  # the held block's, as received
    acc_posted = None
    for s in range(n + (0 if home else 1)):
        travels = s < n and not (home and s == n - 1)
        if travels:  # does not depend on this step's gradients: in flight during them
            nxt, block_posted = _moved(link, block, to, frm, counts[s], RING_TAG + 2 * s,
                                       f"block of step {s}")
        gk, gv = query.add(block[..., :D], block[..., D:])
        complete(link, acc_posted)
        grad = acc  # received: added into in place, then sent on
        grad[..., :D] += gk
        grad[..., D:] += gv
        if s == n:
            return query.dq(), grad
        acc, acc_posted = _moved(link, grad, to, frm, counts[s], RING_TAG + 2 * s + 1,
                                 f"dK, dV of step {s}")
        if travels:
            complete(link, block_posted)
            block = nxt
    complete(link, acc_posted)
    return query.dq(), acc


def _ring(ring: Ring, rows, k: torch.Tensor, v: torch.Tensor):
    """(dQ of the rows, dK, dV of this rank's image block) over the N ring steps; ``rows`` =
    (dO, Q, O, LSE) of this rank's rows, k, v float32. At step s rank r holds rank
    (r - s) mod N's block, adds its dK, dV to the block's accumulators and sends block and
    accumulators to rank r + 1; after step N - 1 only the accumulators travel, to their owner."""
    mesh, D = ring.mesh, k.shape[3]
    me, N = mesh.rank, mesh.size
    counts = [shard_range(ring.seq, N, (me - s - 1) % N)[1] for s in range(N)]
    dq, grad = rotate(ring.link, rows, torch.cat([k, v], 3), (me + 1) % N, (me - 1) % N,
                      counts, home=True)
    return dq, grad[..., :D], grad[..., D:]


@torch.no_grad()
def gradients(ring: Ring, saved: Sequence[torch.Tensor], dout: torch.Tensor,
              djout: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The float32 gradients {"q", "k", "v", with joint text "text_q", "text_k", "text_v"} of
    this rank's inputs from ``saved`` = (q, k, v, [text q, k, v,] out rows, lse rows) and dOut
    [B, S_r, H, D] (dTextOut [B, T, H, D] with joint text).

    Rank r of N holds q [B, S_r, H, D], k, v [B, S_r, Hk, D] and computed the text rows
    [t_r, t_r + T_r) of the T text tokens. Its rows = [text rows; image rows]: Q, O, dO
    [B, T_r + S_r, H, D], LSE [B, T_r + S_r, H, 1] (the final merged one); dO of the text rows is
    every rank's dTextOut of them, summed in rank order. Per k, v block
    (cpu_kernels.attention_lse_backward, GQA folded), scale = 1 / sqrt(D)::

        P = exp(Q K^T scale - LSE)        D_row = rowsum(dO * O)
        dV = P^T dO    dS = P * (dO V^T - D_row)    dQ += scale dS K    dK = scale dS^T Q

    The blocks: the joint text k, v (local; a rank's text k, v gradient is that of its rows,
    their sum over the ranks the dense one), then the N ring steps of :func:`_ring`."""
    q, k, v = (t.float() for t in saved[:3])
    joint = tuple(t.float() for t in saved[3:6]) if len(saved) == 8 else None
    out, lse = saved[-2:]
    _, t0, n = ring.layout.text
    dq_rows, q_rows = dout.float(), q
    if joint is not None:
        heads = (0, djout.shape[2])
        pieces = [(p, heads) for p in ring.layout.pieces]
        dq_rows = torch.cat([summed_pieces(ring.link, djout, pieces, TEXT_TAG), dq_rows], 1)
        q_rows = torch.cat([joint[0][:, t0:t0 + n], q], 1)
    rows = (dq_rows.contiguous(), q_rows.contiguous(), out, lse)
    result = {}
    dq = torch.zeros_like(q_rows)
    if joint is not None:  # the text block, local (every rank holds the text k, v)
        dq, result["text_k"], result["text_v"] = attention_lse_backward(*rows[:2], *joint[1:],
                                                                         *rows[2:])
    dq_ring, result["k"], result["v"] = _ring(ring, rows, k.contiguous(), v.contiguous())
    dq += dq_ring
    result["q"] = dq[:, n:]
    if joint is not None:
        result["text_q"] = torch.zeros_like(joint[0])
        result["text_q"][:, t0:t0 + n] = dq[:, :n]
    # Contiguous, as the backward op's fake kernel promises (a compiled graph views them).
    return {name: g.contiguous() for name, g in result.items()}


def saved(ring: Ring, inputs, bufs) -> Tuple[torch.Tensor, ...]:
    """What the forward keeps: the inputs (q, k, v, joint q, k, v; None skipped), then the
    output and lse rows of the run's buffers (:func:`kept`)."""
    rows = kept(ring.layout, bufs, inputs[0].shape[1])
    return (*(t for t in inputs if t is not None), *rows)


def backward(ring: Ring, saved_: Sequence[torch.Tensor], dout: torch.Tensor,
             djout: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """:func:`gradients` of :func:`saved`'s tensors (dTextOut used with joint inputs only)."""
    return gradients(ring, saved_, dout, djout if len(saved_) == 8 else None)
