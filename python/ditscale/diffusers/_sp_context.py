"""The context of one parallelized transformer (its mesh and ``ditscale.sp.Config``), the token
shard of this rank, and the gather that puts the full sequence back on every rank: what every
hook and processor of a sequence-parallel plan (``_sp_plan``) uses.

Tokens are split as ``ditscale.sp.shard_range`` splits them (the first ``S % N`` ranks hold one
token more), the split every sp schedule uses; sequence lengths need not divide by the ranks.
Both differentiate: the shard's backward is the gradient of the slice (zero elsewhere), the
gather's backward this rank's slice of the gathered output's gradient (docs/diffusers.md,
"Training").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import sp

@dataclass
class SpContext:
    """One parallelized transformer: ``mesh`` (ranks x GPUs) and ``config`` (strategy "auto" or
    a named one, with its fields)."""

    mesh: sp.Mesh
    config: sp.Config

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def rank(self) -> int:
        return self.mesh.rank

    def local_range(self, tokens: int) -> Tuple[int, int]:
        """(begin, count) of this rank's tokens of a sequence of ``tokens``."""
        if tokens < self.size:
            raise ValueError(f"ditscale.diffusers: {tokens} image/video tokens cannot be split "
                             f"over {self.size} ranks (every rank needs at least one)")
        return sp.shard_range(tokens, self.size, self.rank)

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of ``x`` along ``dim`` (a token dimension), contiguous."""
        if self.size == 1:
            return x
        begin, count = self.local_range(x.shape[dim])
        return x.narrow(dim, begin, count).contiguous()

    def gather(self, x: torch.Tensor, dim: int, tokens: int) -> torch.Tensor:
        """The full sequence of ``tokens`` along ``dim`` from every rank's shard ``x`` (this
        rank's ``local_range(tokens)``), on every rank. Backward: this rank's slice of the
        gradient (every rank computes the same loss of the gathered output, so the gradient
        is the same on every rank and summing it would count it ``size`` times)."""
        if self.size == 1:
            return x
        dim = dim % x.dim()
        counts = [sp.shard_range(tokens, self.size, r)[1] for r in range(self.size)]
        if x.shape[dim] != counts[self.rank]:
            raise ValueError(f"ditscale.diffusers: rank {self.rank} holds {x.shape[dim]} tokens, "
                             f"its shard of {tokens} is {counts[self.rank]}")
        return _Gather.apply(x, dim, counts, self.rank, self.mesh.group)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  joint_q: Optional[torch.Tensor] = None, joint_k: Optional[torch.Tensor] = None,
                  joint_v: Optional[torch.Tensor] = None):
        """``ditscale.sp.attention`` on this context's mesh and configuration. q, k, v:
        [B, S_local, H, D] (this rank's image tokens); joint_*: [B, T, H, D] (all text tokens,
        the same on every rank). Returns out [B, S_local, H, D], or (out, joint_out)."""
        return sp.attention(q, k, v, mesh=self.mesh, config=self.config, joint_q=joint_q,
                            joint_k=joint_k, joint_v=joint_v)


class _Gather(torch.autograd.Function):
    """x [.., S_r, ..] (``counts[rank]`` along ``dim``) -> [.., S, ..] of every rank's x; the
    backward slices this rank's ``counts[rank]`` rows out of the full gradient."""

    @staticmethod
    def forward(ctx, x, dim: int, counts, rank: int, group):
        ctx.dim, ctx.begin, ctx.count = dim, sum(counts[:rank]), counts[rank]
        width = counts[0]  # the largest shard: pad the others to it, gather, trim
        if x.shape[dim] < width:
            pad = list(x.shape)
            pad[dim] = width - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad)], dim)
        parts = [torch.empty_like(x) for _ in counts]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat([p.narrow(dim, 0, c) for p, c in zip(parts, counts)], dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.begin, ctx.count).contiguous(), None, None, None, None


def make_context(where: str, mesh: Optional[sp.Mesh], strategy: str,
                 options: dict) -> SpContext:
    """Checks the mesh and the options of parallelize (None: the default process group's mesh,
    or one rank without torch.distributed)."""
    if mesh is None:
        mesh = sp.Mesh.from_process_group()
    elif not isinstance(mesh, sp.Mesh):
        raise TypeError(f"{where}: mesh must be a ditscale.sp.Mesh or None, got "
                        f"{type(mesh).__name__}")
    config = sp.make_config(where, None, strategy=strategy, **options)
    return SpContext(mesh, config)
