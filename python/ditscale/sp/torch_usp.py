"""The multi-rank attention as Ulysses x ring over PyTorch's point-to-point transfers, with a
backward of its own from the saved log-sum-exp (no recomputation), on any device whose process
group has them: NCCL for CUDA tensors (the op's eager autograd path, custom_op.py: the forward
then runs here, not on the C++ GPU executor), gloo for CPU tensors (tests call :func:`attention`).
The decomposition is the executors' (torch_usp_layout.py).

Rank (u, i) of U x R, B batch, D head_dim, h_u = its query heads, C_i = ring chunk i's tokens,
T_i = its text query rows (of T)::

    forward:  q, k, v [B, S_r, ., D] --all-to-all in the Ulysses sub-group--> [B, C_i, h_u, D]
              rows = [text q rows T_i; C_i]; blocks: own k|v, text k|v (local), then R - 1 ring
              steps (k|v from ring index i - s); block_kernels.MergedRows, merged in float32
              (cpu_kernels.merge_lse_) in that order; out rows -> sequence; text rows to every rank
    backward: dOut -> heads; dO of the text rows = every rank's dJointOut of them, rank order;
              text block, then the ring reversed (ring_backward.rotate: dK|dV accumulators travel
              with the blocks back to their owner), float32; dQ, dK, dV -> sequence

Saved: the head group's query rows, its own k, v block and text k, v (inputs' dtype), the merged
out rows and LSE (float32); nothing of the peers. Every transfer completes within the group's
timeout or fails naming ditscale.sp.attention and the rank. docs/sp.md ("Gradients").
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import torch_usp_layout
from .block_kernels import MergedRows, attention_lse_backward
from .config import Config
from .cpu_executor import TAG_BASE
from .meshes import Mesh
from .ring_backward import Link, complete, exchange, post, rotate, summed_pieces
from .torch_backward import fold_kv, repeat_kv
from .torch_usp_layout import Layout

WHERE = torch_usp_layout.WHERE
_TAG = TAG_BASE + (1 << 22)  # + phase << 16 (+ ring step); ring_backward's are below
_PHASES = ("q", "k", "v", "ring", "text out", "out", "dout", "text dout", "dq", "dk", "dv")


def _tag(phase: str, step: int = 0) -> int:
    return _TAG + (_PHASES.index(phase) << 16) + step


def _link(lay: Layout, name: str) -> Link:
    return Link(lay.mesh, lay.timeout_s, name)


def to_heads(lay: Layout, x: torch.Tensor, split, phase: str, name: str) -> torch.Tensor:
    """[B, S_r, heads, D] (this rank's tokens) -> [B, C_i, n_u, D] (ring chunk i's tokens in u
    order, this rank's heads ``split(u)`` = (begin, count))."""
    u, i = lay.coords
    B, _, _, D = x.shape
    sends, recvs, parts = [], [], []
    for uu in range(lay.U):
        peer = lay.rank_of(uu, i)
        if uu == u:
            b, n = split(u)
            parts.append(x[:, :, b:b + n])
            continue
        b, n = split(uu)
        sends.append((peer, x[:, :, b:b + n].contiguous(), _tag(phase)))
        parts.append(x.new_empty(B, lay.tokens[peer], split(u)[1], D))
        recvs.append((peer, parts[-1], _tag(phase)))
    exchange(_link(lay, name), sends, recvs, f"{phase} to the head groups")
    return torch.cat(parts, 1)


def to_tokens(lay: Layout, y: torch.Tensor, split, phase: str, name: str) -> torch.Tensor:
    """The inverse of :func:`to_heads`: [B, C_i, n_u, D] -> [B, S_r, heads, D]."""
    u, i = lay.coords
    B, _, _, D = y.shape
    sends, recvs, parts, row = [], [], [], 0
    for uu in range(lay.U):
        peer = lay.rank_of(uu, i)
        n = lay.tokens[peer]
        if uu == u:
            parts.append(y[:, row:row + n])
        else:
            sends.append((peer, y[:, row:row + n].contiguous(), _tag(phase)))
            parts.append(y.new_empty(B, lay.tokens[lay.mesh.rank], split(uu)[1], D))
            recvs.append((peer, parts[-1], _tag(phase)))
        row += n
    exchange(_link(lay, name), sends, recvs, f"{phase} to the sequence shards")
    return torch.cat(parts, 2)


def _ring_peers(lay: Layout):
    u, i = lay.coords
    return lay.rank_of(u, (i + 1) % lay.R), lay.rank_of(u, (i - 1) % lay.R)


def _ring_forward(lay: Layout, rows: torch.Tensor, k, v, text_kv):
    """(out, lse) float32 of the query rows over the own block, the text block, then the R - 1
    blocks of the ring (from ring index i - s at step s), merged in that order
    (block_kernels.MergedRows: the rows prepared once). Each block's transfer to the next ring
    rank is in flight during its attention."""
    _, i = lay.coords
    nxt, prev = _ring_peers(lay)
    link = _link(lay, "torch_usp forward")
    block, D = torch.cat([k, v], 3), k.shape[3]
    merged = MergedRows(rows, k.shape[2])
    for s in range(lay.R):
        posted = None
        if s + 1 < lay.R:
            land = block.new_empty(block.shape[0], lay.chunk((i - s - 1) % lay.R),
                                   *block.shape[2:])
            posted = post(link, [(nxt, block, _tag("ring", s + 1))],
                          [(prev, land, _tag("ring", s + 1))], f"ring step {s + 1} of {lay.R}")
        if s == 0:
            merged.add(k, v)
            if text_kv is not None:
                merged.add(*text_kv)
        else:
            merged.add(block[..., :D], block[..., D:])
        complete(link, posted)
        block = land if posted is not None else block
    return merged.result()


def _pieces(lay: Layout):
    """(group rank, text rows, query heads) of every rank's text output piece."""
    N = lay.mesh.size
    return [(r, lay.text[lay.coords_of(r)[1]], lay.heads(lay.coords_of(r)[0])) for r in range(N)]


def _gather_text(lay: Layout, mine: torch.Tensor, shape) -> torch.Tensor:
    """joint_out ``shape`` [B, T, H, D] from every rank's piece (its text rows, its heads)."""
    me = lay.mesh.rank
    full = mine.new_zeros(shape)
    sends, recvs, got = [], [], []
    for r, (t0, nt), (h0, nh) in _pieces(lay):
        if r == me:
            full[:, t0:t0 + nt, h0:h0 + nh] = mine
        elif nt:
            buf = mine.new_empty(shape[0], nt, nh, shape[3])
            recvs.append((r, buf, _tag("text out")))
            got.append((buf, t0, nt, h0, nh))
    if mine.shape[1]:
        sends = [(r, mine.contiguous(), _tag("text out")) for r in range(lay.mesh.size)
                 if r != me]
    exchange(_link(lay, "torch_usp forward"), sends, recvs, "text output to every rank")
    for buf, t0, nt, h0, nh in got:
        full[:, t0:t0 + nt, h0:h0 + nh] = buf
    return full


def _forward(lay: Layout, q, k, v, joint):
    """(out [B, S_r, H, D], joint_out [B, T, H, D], the tensors the backward keeps)."""
    u, i = lay.coords
    kv_split = lay.kv.__getitem__
    name = "torch_usp forward"
    qh = to_heads(lay, q, lay.heads, "q", name)
    kh, vh = (to_heads(lay, repeat_kv(t, lay.kv_rep), kv_split, p, name)
              for t, p in ((k, "k"), (v, "v")))
    B, _, H, D = q.shape
    T = 0 if joint is None else joint[0].shape[1]
    (t0, nt), (h0, nh), (k0, nk) = lay.text[i], lay.heads(u), lay.kv[u]
    rows, text_kv = qh, None
    if T:
        rows = torch.cat([joint[0][:, t0:t0 + nt, h0:h0 + nh].to(q.dtype), qh], 1)
        text_kv = tuple(repeat_kv(t, lay.kv_rep)[:, :, k0:k0 + nk].to(k.dtype).contiguous()
                        for t in joint[1:])
    out, lse = _ring_forward(lay, rows, kh, vh, text_kv)
    image = to_tokens(lay, out[:, nt:].to(q.dtype), lay.heads, "out", name)
    jout = q.new_empty(B, 0, H, D)
    if T:
        jout = _gather_text(lay, out[:, :nt].to(q.dtype), (B, T, H, D))
    return image, jout, (rows, kh, vh, *(text_kv or ()), out, lse)


def _ring_backward(lay: Layout, rows, k: torch.Tensor, v: torch.Tensor):
    """(dQ of the rows, dK, dV of the own block), float32: the ring reversed (rotate)."""
    if lay.R == 1:
        return attention_lse_backward(*rows[:2], k, v, *rows[2:])
    D = k.shape[3]
    block = torch.cat([k, v], 3)  # the inputs' dtype (the kernels'), accumulators float32
    _, i = lay.coords
    nxt, prev = _ring_peers(lay)
    counts = [lay.chunk((i - s - 1) % lay.R) for s in range(lay.R)]
    dq, grad = rotate(_link(lay, "torch_usp backward"), rows, block, nxt, prev, counts, home=True)
    return dq, grad[..., :D], grad[..., D:]


def _text_grads(lay: Layout, dq_text, dtk, dtv, shape):
    """{"text_q", "text_k", "text_v"} [B, T, H or Hk, D]: this rank's rows and heads, zero
    elsewhere (their sum over the ranks is the dense gradient)."""
    u, i = lay.coords
    (t0, nt), (h0, nh), (k0, nk) = lay.text[i], lay.heads(u), lay.kv[u]
    B, T, H, D = shape
    tq = dq_text.new_zeros(B, T, H, D)
    tq[:, t0:t0 + nt, h0:h0 + nh] = dq_text
    result = {"text_q": tq}
    kv = sum(n for _, n in lay.kv)
    for name, g in (("text_k", dtk), ("text_v", dtv)):
        full = g.new_zeros(B, T, kv, D)
        full[:, :, k0:k0 + nk] = g
        result[name] = fold_kv(full, lay.kv_rep)
    return result


@torch.no_grad()
def _backward(lay: Layout, saved: Sequence[torch.Tensor], dout: torch.Tensor,
              djout: Optional[torch.Tensor], T: int):
    """The float32 gradients {"q", "k", "v"[, "text_q", "text_k", "text_v"]} (see the module)."""
    nt = lay.text[lay.coords[1]][1]
    name = "torch_usp backward"
    rows_q, kh, vh, out, lse = (*saved[:3], *saved[-2:])
    do = to_heads(lay, dout, lay.heads, "dout", name).float()
    if T:
        pieces = [(rows, heads) for _, rows, heads in _pieces(lay)]
        text = summed_pieces(_link(lay, name), djout, pieces, _tag("text dout"))
        do = torch.cat([text, do], 1)
    rows = (do.contiguous(), rows_q, out, lse)  # Q in the kernels' dtype (the inputs')
    dq = torch.zeros_like(rows[1], dtype=torch.float32)
    if T:  # the text block, local (every rank holds its heads' text k, v)
        dq, dtk, dtv = attention_lse_backward(*rows[:2], saved[3], saved[4], *rows[2:])
    gq, gk, gv = _ring_backward(lay, rows, kh, vh)
    dq += gq
    result = {"q": to_tokens(lay, dq[:, nt:].contiguous(), lay.heads, "dq", name)}
    for key, g in (("k", gk), ("v", gv)):
        back = to_tokens(lay, g.contiguous(), lay.kv.__getitem__, "d" + key, name)
        result[key] = fold_kv(back, lay.kv_rep)
    if T:
        result.update(_text_grads(lay, dq[:, :nt], dtk, dtv, (*dout.shape[:1], T,
                                                               *dout.shape[2:])))
    return result


_NAMES = ("q", "k", "v", "text_q", "text_k", "text_v")


class _TorchUsp(torch.autograd.Function):
    """(out, joint_out [B, T or 0, H, D]) of q, k, v, joint_q/k/v (or None) on a Layout."""

    @staticmethod
    def forward(ctx, q, k, v, joint_q, joint_k, joint_v, lay: Layout):
        joint = None if joint_q is None else (joint_q, joint_k, joint_v)
        ctx.lay, ctx.text = lay, 0 if joint is None else joint_q.shape[1]
        ctx.dtypes = tuple(None if t is None else t.dtype
                           for t in (q, k, v, joint_q, joint_k, joint_v))
        out, jout, saved = _forward(lay, q, k, v, joint)
        ctx.save_for_backward(*saved)
        return out, jout

    @staticmethod
    def backward(ctx, dout, djout):
        if torch.is_grad_enabled():  # create_graph=True: the backward is not differentiable
            raise NotImplementedError(f"{WHERE}: no double backward on more than one rank "
                                      f"(create_graph=True)")
        g = _backward(ctx.lay, ctx.saved_tensors, dout, djout, ctx.text)
        result = [g[n].to(dt) if need and n in g else None
                  for n, dt, need in zip(_NAMES, ctx.dtypes, ctx.needs_input_grad)]
        return (*result, None)


def attention(q, k, v, joint_q=None, joint_k=None, joint_v=None, *, mesh: Mesh, cfg: Config,
              layout: Optional[Layout] = None):
    """(out [B, S_r, H, D], joint_out [B, T or 0, H, D]) of this rank's shards, differentiable
    (see the module); ``layout``: torch_usp_layout.layout_for's (found here when None). Every
    rank of the mesh calls it alike (a collective)."""
    from .api import _check_tensors
    joint = None if joint_q is None else (joint_q, joint_k, joint_v)
    _check_tensors(WHERE, q, k, v, joint)
    if layout is None:
        layout = torch_usp_layout.layout_for(q, k, 0 if joint is None else joint_q.shape[1],
                                             mesh, cfg)
    if layout is None:
        raise ValueError(f"{WHERE}: strategy {cfg.strategy!r} on {mesh.size} ranks: no Ulysses "
                         f"x ring decomposition of this layer (strategies "
                         f"{', '.join(torch_usp_layout.STRATEGIES)}, at least U query heads)")
    return _TorchUsp.apply(q, k, v, joint_q, joint_k, joint_v, layout)
