"""The backward of the multi-rank attention through PyTorch's collectives and SDPA, on any device
whose process group has ``all_to_all_single`` (NCCL for CUDA tensors, gloo for CPU ones): the
layer recomputed as Ulysses, whatever schedule ran the forward (attention is the same function),
with autograd on the local attention.

Per rank r of N (B batch, S image tokens in all, S_j = shard_range(S, N, j)'s count, H query
heads of which rank j owns H_j = shard_range(H, N, j)'s; GQA: k, v repeated to H heads first and
their gradients summed back over each group):

    q, k, v, dOut [B, S_r, H, D]  --all-to-all-->  [B, S, H_r, D]   (all tokens, own heads)
    joint q, k, v [B, T, H, D] (the same on every rank) -> own heads [B, T, H_r, D]
    dJointOut [B, T, H, D] (each rank its own)  --all-to-all, summed over ranks-->  [B, T, H_r, D]
    SDPA over [joint; image] and its gradients by autograd (float32 on the CPU)
    dq, dk, dv [B, S, H_r, D]  --all-to-all-->  [B, S_r, H, D]
    d joint: own heads, zero elsewhere (summed over the ranks: the dense gradient)

Memory: the whole sequence of this rank's head group of q, k, v and their gradients, as Ulysses'
forward holds. A collective that a peer never enters fails within the process group's timeout.
docs/sp.md ("Gradients").
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .meshes import Mesh, shard_range

Joint = Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _counts(n: int, world: int) -> List[int]:
    return [shard_range(n, world, j)[1] for j in range(world)]


def _begins(counts: List[int]) -> List[int]:
    return [sum(counts[:j]) for j in range(len(counts))]


def _all_to_all(chunks: List[torch.Tensor], shapes: List[Tuple[int, ...]],
                group) -> List[torch.Tensor]:
    """Sends ``chunks[j]`` to rank j; returns what rank j sent here, shaped ``shapes[j]``."""
    send = torch.cat([c.reshape(-1) for c in chunks])
    recv_sizes = [int(torch.Size(s).numel()) for s in shapes]
    recv = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, [c.numel() for c in chunks], group=group)
    return [part.view(s) for part, s in zip(recv.split(recv_sizes), shapes)]


def to_heads(x: torch.Tensor, tokens: List[int], heads: List[int], rank: int,
             group) -> torch.Tensor:
    """[B, S_r, H, D] (this rank's tokens, every head) -> [B, S, H_r, D] (every token, its
    heads)."""
    B, _, _, D = x.shape
    hb = _begins(heads)
    chunks = [x[:, :, hb[j]:hb[j] + heads[j]].contiguous() for j in range(len(heads))]
    shapes = [(B, tokens[j], heads[rank], D) for j in range(len(tokens))]
    return torch.cat(_all_to_all(chunks, shapes, group), 1)


def to_tokens(x: torch.Tensor, tokens: List[int], heads: List[int], rank: int,
              group) -> torch.Tensor:
    """The inverse of :func:`to_heads`: [B, S, H_r, D] -> [B, S_r, H, D]."""
    B, _, _, D = x.shape
    tb = _begins(tokens)
    chunks = [x[:, tb[j]:tb[j] + tokens[j]].contiguous() for j in range(len(tokens))]
    shapes = [(B, tokens[rank], heads[j], D) for j in range(len(heads))]
    return torch.cat(_all_to_all(chunks, shapes, group), 2)


def _summed_heads(x: torch.Tensor, heads: List[int], rank: int, group) -> torch.Tensor:
    """Every rank's [B, T, H, D] -> the sum over the ranks of this rank's heads [B, T, H_r, D]."""
    B, T, _, D = x.shape
    hb = _begins(heads)
    chunks = [x[:, :, hb[j]:hb[j] + heads[j]].contiguous() for j in range(len(heads))]
    parts = _all_to_all(chunks, [(B, T, heads[rank], D)] * len(heads), group)
    return torch.stack(parts).sum(0)


def repeat_kv(k: torch.Tensor, g: int) -> torch.Tensor:
    """k [B, T, Hk, D] -> [B, T, Hk * g, D], kv head h as heads h*g .. h*g+g-1 (also the
    recomputation's and torch_usp's)."""
    return k if g == 1 else k.repeat_interleave(g, dim=2)


def fold_kv(dk: torch.Tensor, g: int) -> torch.Tensor:
    """The gradient of :func:`repeat_kv`: [B, T, Hk * g, D] -> [B, T, Hk, D] (sum of a
    group)."""
    B, T, H, D = dk.shape
    return dk if g == 1 else dk.reshape(B, T, H // g, g, D).sum(3)


def _local(q, k, v, dout) -> List[torch.Tensor]:
    """(dq, dk, dv) of SDPA over [B, L, h, D] tensors (same head count), by autograd."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves))
        return list(torch.autograd.grad(out.transpose(1, 2), leaves, dout))


def gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: Joint,
              dout: torch.Tensor, djout: Optional[torch.Tensor],
              mesh: Mesh) -> Dict[str, torch.Tensor]:
    """The gradients {"q", "k", "v", and with joint inputs "text_q", "text_k", "text_v"} of this
    rank's inputs, in float32 on the CPU and in the inputs' dtype elsewhere (see the module)."""
    group, rank, world = mesh.group, mesh.rank, mesh.size
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    B, Sr, H, D = q.shape
    g = H // k.shape[2]
    tokens = [int(t) for t in _token_counts(Sr, group, world, q.device)]
    heads = _counts(H, world)
    own = slice(_begins(heads)[rank], _begins(heads)[rank] + heads[rank])
    image = [to_heads(t.to(dtype), tokens, heads, rank, group)
             for t in (q, repeat_kv(k, g), repeat_kv(v, g), dout)]
    T = 0 if joint is None else joint[0].shape[1]
    if T:
        tq, tk, tv = joint
        text = [t[:, :, own].to(dtype) for t in (tq, repeat_kv(tk, g), repeat_kv(tv, g))]
        dtext = _summed_heads(djout.to(dtype), heads, rank, group)
        parts = [torch.cat([a, b], 1) for a, b in zip(text + [dtext], image)]
    else:
        parts = image
    if heads[rank]:
        local = _local(*parts)
    else:  # fewer heads than ranks: nothing to compute here
        local = [torch.zeros_like(p) for p in parts[:3]]
    result = {}
    for name, grad in zip(("q", "k", "v"), local):
        back = to_tokens(grad[:, T:].contiguous(), tokens, heads, rank, group)
        result[name] = back if name == "q" else fold_kv(back, g)
    for name, grad in zip(("text_q", "text_k", "text_v"), local if T else ()):
        full = grad.new_zeros(B, T, H, D)
        full[:, :, own] = grad[:, :T]
        result[name] = full if name == "text_q" else fold_kv(full, g)
    return result


def _token_counts(local: int, group, world: int, device) -> List[int]:
    """Every rank's image tokens (one all_gather of an int64 per call: not memoised, since a key
    only this rank knows, its own count, could send one rank into the collective alone)."""
    mine = torch.tensor([local], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]
