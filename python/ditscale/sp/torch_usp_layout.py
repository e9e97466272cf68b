"""The decomposition torch_usp.py runs a layer with: Ulysses degree U x ring degree R, this rank's
coordinates (u, i) and its peers, the head and token splits. Taken from the schedule that the
executors run for the same shapes and configuration (``cpu_runtime.program``, built from shapes
only through C++), so that it equals the GPU executor's: ulysses = (N, 1), ring = (1, N), usp /
swiftfusion-tas = the program's degrees and rank placement (read off its transfers), auto as
resolved by the planner; ulysses-overlap as ulysses (the same decomposition). Rank placement:
``rank = i * U + u`` (ring outer) or ``u * R + i`` (Ulysses outer). Image tokens: shard_range
over the N ranks by rank; ring chunk i = the shards of its U ranks in u order. kv heads split
over u by shard_range (query heads: g per kv head); with fewer kv heads than U, the kv heads
are first repeated to the query heads (kv_rep).
docs/sp.md ("Gradients").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import cpu_runtime
from .config import Config
from .cpu_executor import Program
from .meshes import Mesh, shard_range

WHERE = "ditscale.sp.attention"
STRATEGIES = ("ulysses", "ring", "usp", "swiftfusion-tas")  # and auto resolved to one of them
# Strategies whose decomposition is Ulysses' (their schedule pipelines its head chunks with the
# attention, a forward-only difference): taken as ulysses.
AS_ULYSSES = ("ulysses-overlap",)
TAKEN = STRATEGIES + AS_ULYSSES + ("auto",)
Range = Tuple[int, int]  # (begin, count)


@dataclass(frozen=True)
class Layout:
    """One rank's decomposition (see the module); ranks are the mesh's group ranks."""

    mesh: Mesh
    U: int
    R: int
    outer: bool  # Ulysses outer (rank = u * R + i), else ring outer (rank = i * U + u)
    tokens: Tuple[int, ...]  # image tokens of every group rank
    kv: Tuple[Range, ...]  # the (repeated) kv heads of every Ulysses index
    g: int  # query heads per (repeated) kv head
    kv_rep: int  # repeats of each kv head (1, or heads / kv heads when kv heads < U)
    text: Tuple[Range, ...]  # the text query rows of every ring index
    timeout_s: float

    def rank_of(self, u: int, i: int) -> int:
        return u * self.R + i if self.outer else i * self.U + u

    def coords_of(self, r: int) -> Tuple[int, int]:
        """(u, i) of group rank r."""
        return _coords(r, self.U, self.R, self.outer)

    @property
    def coords(self) -> Tuple[int, int]:
        return self.coords_of(self.mesh.rank)

    def heads(self, u: int) -> Range:
        """The query heads of Ulysses index u."""
        b, n = self.kv[u]
        return b * self.g, n * self.g

    def chunk(self, i: int) -> int:
        """Image tokens of ring index i."""
        return sum(self.tokens[self.rank_of(u, i)] for u in range(self.U))


def _coords(rank: int, U: int, R: int, outer: bool) -> Tuple[int, int]:
    return divmod(rank, R) if outer else divmod(rank, U)[::-1]


def _send_peers(prog: Program, pred) -> set:
    return {op.peer for op in prog.ops
            if op.kind == "Send" and pred(prog.buffers[op.src[0]][0])}


def placement(prog: Program, U: int, R: int) -> Optional[bool]:
    """Whether the program places its ranks Ulysses outer (True) or ring outer (False), from the
    peers of its q, k, v all-to-all and of its ring transfers; None when neither fits."""
    if U == 1 or R == 1:
        return False
    a2a = _send_peers(prog, lambda n: n.startswith("stage.a2a.in"))
    ring = _send_peers(prog, lambda n: n in ("gathered.k", "gathered.v"))
    for outer in (False, True):
        u, i = _coords(prog.rank, U, R, outer)
        at = (lambda uu, ii: uu * R + ii) if outer else (lambda uu, ii: ii * U + uu)
        if a2a == {at(x, i) for x in range(U)} - {prog.rank} and ring == {at(u, (i + 1) % R)}:
            return outer
    return None


def _program(q, k, text: int, mesh: Mesh, cfg: Config):
    """(program, kv_rep): the schedule's program for the layer, or for its kv heads repeated to
    the query heads where the schedule refuses fewer kv heads than its Ulysses degree; None when
    neither builds (fewer query heads than U, too few tokens...)."""
    seq = cpu_runtime.seq_total(mesh, q, k, text, WHERE)
    B, _, H, D = q.shape
    shape = dict(batch=B, seq=seq, text=text, heads=H, kv_heads=k.shape[2], head_dim=D,
                 dtype_bytes=q.element_size())
    for rep in sorted({1, H // k.shape[2]}):
        try:
            return cpu_runtime.program(mesh, cfg, {**shape, "kv_heads": k.shape[2] * rep},
                                       WHERE), rep
        except ValueError:
            continue
    return None


def _as_ulysses(cfg: Config, strategy: str) -> Config:
    """cfg, or plain Ulysses with cfg's transport and topology for a strategy of AS_ULYSSES."""
    if strategy not in AS_ULYSSES:
        return cfg
    return Config(strategy="ulysses", transport=cfg.transport, comm_sms=cfg.comm_sms,
                  topology=cfg.topology)


def timeout_s(mesh: Mesh, device: torch.device) -> float:
    """Seconds a transfer may take: the group's timeout on the device's backend (at most
    cpu_runtime.TIMEOUT_S)."""
    pg = cpu_runtime.process_group(mesh)
    try:
        group_s = pg._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return cpu_runtime.timeout_s(pg)
    return min(cpu_runtime.TIMEOUT_S, group_s)


def layout_for(q: torch.Tensor, k: torch.Tensor, text: int, mesh: Mesh,
               cfg: Config) -> Optional[Layout]:
    """The Layout of the layer q [B, S_r, H, D], k [B, S_r, Hk, D] with ``text`` joint tokens, or
    None when its (resolved) strategy is not one of :data:`TAKEN` or no schedule splits it.
    A collective (the group's shape check): every rank of the mesh calls it."""
    if cfg.strategy not in TAKEN:
        return None
    found = _program(q, k, text, mesh, _as_ulysses(cfg, cfg.strategy))
    if found is not None and found[0].strategy in AS_ULYSSES:  # auto resolved so
        found = _program(q, k, text, mesh, _as_ulysses(cfg, found[0].strategy))
    if found is None or found[0].strategy not in STRATEGIES:
        return None
    prog, rep = found
    U, R = prog.ulysses_degree, prog.ring_degree
    outer = placement(prog, U, R)
    if outer is None:
        return None
    N = mesh.size
    seq = cpu_runtime.seq_total(mesh, q, k, text, WHERE)
    kv = k.shape[2] * rep
    return Layout(mesh, U, R, outer, tuple(shard_range(seq, N, r)[1] for r in range(N)),
                  tuple(shard_range(kv, U, u) for u in range(U)), q.shape[2] // kv, rep,
                  tuple(shard_range(text, R, i) for i in range(R)),
                  timeout_s(mesh, q.device))
