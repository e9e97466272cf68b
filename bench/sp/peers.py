"""Baselines that the SwiftFusion attention benchmark compares ditscale against: single-GPU SDPA
(:func:`sdpa_bshd`), plain Ulysses (:func:`ulysses_attention`: all_to_all of q, k, v to head
shards, SDPA, all_to_all back; no chunking, no overlap) and PyTorch context parallelism
(:class:`TorchContextParallel`: ring attention over a 1-D DeviceMesh, load balancing off since
torch defines it only for causal masks).

Every peer takes [text; image] as ONE sequence of L = T + S tokens split evenly over the ranks
(shard_range(L, N, r)), as users run them on an MMDiT without a joint-token API: the FLOPs are
ditscale's, only the data movement differs. Layouts [B, S_local, H, D]; the peers transpose
views for SDPA. Only torch is imported, so the CPU tests (gloo, fp32) run it without ditscale.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """(begin, count) of shard `index` of `total` tokens in `parts` shards; the first
    total % parts shards hold one token more (the same rule as ditscale.sp.shard_range)."""
    if parts <= 0 or not 0 <= index < parts:
        raise ValueError(f"shard_range: index {index} out of range for {parts} parts")
    base, extra = divmod(total, parts)
    begin = index * base + min(index, extra)
    return begin, base + (1 if index < extra else 0)


def sdpa_backends(name: str):
    """The SDPA backend list for `name` ('cudnn', 'flash', 'efficient', 'math', 'auto'): a list of
    torch.nn.attention.SDPBackend, or None for 'auto' (torch's own priority)."""
    from torch.nn.attention import SDPBackend

    table = {
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "flash": [SDPBackend.FLASH_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
        "math": [SDPBackend.MATH],
        "auto": None,
    }
    if name not in table:
        raise ValueError(f"--backend: unknown SDPA backend '{name}' (known: {', '.join(table)})")
    return table[name]


def sdpa_context(name: str):
    """A context manager restricting SDPA to backend `name` ('auto': no restriction)."""
    backends = sdpa_backends(name)
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)


def sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Non-causal SDPA, scale 1/sqrt(D), on [B, S, H, D] tensors; returns [B, S, H, D]."""
    # Looked up at call time on purpose: context_parallel monkey-patches this attribute.
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


def _seq_to_heads(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """[B, s, H, D] sequence shard -> [B, N*s, H/N, D] head shard (full sequence, rank order)."""
    n = _group_size(group)
    b, s, h, d = x.shape
    # Destination rank j gets head group j: put that index first so all_to_all_single's dim-0
    # split sends contiguous blocks.
    send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] is source rank j's sequence shard of our head group; rank order = sequence order.
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _heads_to_seq(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Inverse of _seq_to_heads: [B, N*s, H/N, D] -> [B, s, H, D]."""
    n = _group_size(group)
    b, ns, hn, d = x.shape
    s = ns // n
    send = x.reshape(b, n, s, hn, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] is head group j of our sequence shard.
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, n * hn, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Plain Ulysses over `group`: q, k, v [B, s, H, D] are this rank's sequence shard (equal s on
    every rank, H divisible by the group size); returns the attention output for the same
    shard, [B, s, H, D], over the full N*s-token sequence."""
    n = _group_size(group)
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"ulysses_attention: q, k, v must be [B, s, H, D] of one shape, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[2] % n != 0:
        raise ValueError(f"ulysses_attention: heads {q.shape[2]} not divisible by {n} ranks")
    qh, kh, vh = (_seq_to_heads(t, group) for t in (q, k, v))
    return _heads_to_seq(sdpa_bshd(qh, kh, vh), group)


class TorchContextParallel:
    """PyTorch's ring context parallelism for one fixed (q, k, v).

    context_parallel shards its `buffers` in place when entered and patches
    F.scaled_dot_product_attention to run ring attention on DTensors; each call of this object runs
    one attention layer on the local shards. Use as a context manager (or call close()).

    q, k, v: full [B, H, L, D] tensors, identical on every rank; after entering, each holds this
    rank's contiguous shard (tokens shard_range(L, N, rank) when N divides L: torch.chunk rule).
    """

    def __init__(self, mesh, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rotate_method: str = "allgather"):
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

        # Non-causal attention: torch's load balancer is only valid for causal masks.
        _cp_options.enable_load_balance = False
        set_rotate_method(rotate_method)
        self.q, self.k, self.v = q, k, v
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(
            context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                             no_restore_buffers={q, k, v})
        )

    def __call__(self) -> torch.Tensor:
        """One layer: [B, H, L/N, D] output for the local shard."""
        return F.scaled_dot_product_attention(self.q, self.k, self.v)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def rel_err_parts(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(sum of squared error, sum of squared reference) in fp64, so ranks can add their parts and
    the global relative error is sqrt(sum err / sum ref)."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o, r = out.double(), ref.double()
    return float((o - r).pow(2).sum()), float(r.pow(2).sum())


def attention_flops(batch: int, heads: int, tokens: int, head_dim: int) -> float:
    """Forward FLOPs of dense non-causal attention over `tokens` (= S + T): 4 * B * H * L^2 * D."""
    return 4.0 * batch * heads * float(tokens) ** 2 * head_dim


def local_rows(full: torch.Tensor, ranks: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's even shard of `full` along `dim` (shard_range rule)."""
    b, c = shard_range(full.shape[dim], ranks, rank)
    return full.narrow(dim, b, c)


def broadcast_inputs(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                     seed: int, count: int = 3) -> list[torch.Tensor]:
    """`count` random tensors, identical on every rank (drawn on rank 0, broadcast)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(count):
        t = torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
        if dist.is_initialized():
            dist.broadcast(t, src=0)
        out.append(t)
    return out
