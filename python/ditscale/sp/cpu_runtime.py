"""ditscale.sp.attention on CPU tensors over a gloo process group: the layer's shape agreed by
every rank, strategy="auto" resolved by the planner among the two-sided candidates, this rank's
program of the schedule (``_core.sp_rank_program``) built once per (mesh, configuration, shape),
and its execution (cpu_executor.py). The same schedules as the GPU executor runs.

The shape check: the first call of a layer shape gathers every rank's (batch, image tokens,
heads, kv heads, head_dim, text tokens, dtype) over the group (one all_gather of 7 int64);
everything but the image tokens must agree, and rank r's image tokens must be
``shard_range(S, N, r)``'s count for the total S. Later calls of that shape reuse the result (so
every rank must make the same calls in the same order, as for any collective). The own
backwards' layouts of a program (ring_backward, usp_backward) are agreed the same way, once per
(group, program): :func:`agreed_layout`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _core
from .._teardown import clear_at_exit
from . import cpu_executor
from .config import Config, config_text
from .meshes import Mesh, shard_range
from .planning import best_for_transport, plan, planned_config

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
TIMEOUT_S = 120.0  # a transfer that does not complete in this time (or the group's timeout,
# if shorter) fails the call

# (group, size, rank, local shape) -> total image tokens; (id(group), shape, config) -> Program.
_SEQ_TOTAL: Dict[Tuple, int] = {}
_PROGRAMS: Dict[Tuple, cpu_executor.Program] = {}
_PLANS: Dict[Tuple, dict] = {}
# (backward's name, id(group), id(program)) -> (group, program, the agreed layout or None).
_LAYOUTS: Dict[Tuple, Tuple] = clear_at_exit({})


def process_group(mesh: Mesh):
    """The mesh's process group object (its ``send`` / ``recv`` take group ranks)."""
    if mesh.group is not None:
        return mesh.group
    return dist.distributed_c10d._get_default_group()


def timeout_s(pg) -> float:
    """Seconds a transfer may take: the process group's timeout, at most :data:`TIMEOUT_S` (a
    rank whose peer never comes fails within the group's timeout, as a collective would)."""
    try:
        group_s = pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # no gloo backend options: the default
        return TIMEOUT_S
    return min(TIMEOUT_S, group_s)


def check_gloo(mesh: Mesh, where: str) -> None:
    backend = str(dist.get_backend(mesh.group))
    if "gloo" not in backend:
        raise ValueError(f"{where}: CPU tensors need a gloo process group, the mesh's group "
                         f"has backend {backend!r}")


def seq_total(mesh: Mesh, q: torch.Tensor, k: torch.Tensor, text: int, where: str) -> int:
    """The layer's total image tokens, after checking every rank's shape (see the module)."""
    local = (q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], text,
             _DTYPE_CODES[q.dtype])
    key = (id(process_group(mesh)), mesh.size, mesh.rank, local)
    total = _SEQ_TOTAL.get(key)
    if total is not None:
        return total
    mine = torch.tensor(local, dtype=torch.int64, device=q.device)  # NCCL: a CUDA tensor
    every = [torch.empty_like(mine) for _ in range(mesh.size)]
    dist.all_gather(every, mine, group=mesh.group)
    shapes = [tuple(int(x) for x in t.tolist()) for t in every]
    names = ("batch", "image tokens", "heads", "kv heads", "head_dim", "text tokens", "dtype")
    for r, s in enumerate(shapes):
        for i, name in enumerate(names):
            if i != 1 and s[i] != shapes[0][i]:
                raise ValueError(f"{where}: the ranks disagree on the layer's {name}: rank 0 has "
                                 f"{shapes[0][i]}, rank {r} {s[i]} (q, k, v, joint_*: every "
                                 f"rank passes the same shapes but for its image tokens)")
    total = sum(s[1] for s in shapes)
    for r, s in enumerate(shapes):
        want = shard_range(total, mesh.size, r)[1]
        if s[1] != want:
            raise ValueError(f"{where}: rank {r} holds {s[1]} image tokens, its share of "
                             f"{total} on {mesh.size} ranks is {want} (ditscale.sp.shard_range)")
    _SEQ_TOTAL[key] = total
    return total


def _resolved(mesh: Mesh, cfg: Config, shape: dict) -> Config:
    """cfg with strategy "auto" replaced by the planner's best two-sided candidate."""
    if cfg.strategy != "auto":
        return cfg
    key = (mesh.machines, mesh.gpus_per_machine, tuple(sorted(shape.items())), cfg.topology)
    best = _PLANS.get(key)
    if best is None:
        ranked = plan(mesh, config=cfg, one_sided=False, **shape)["ranked"]
        best = best_for_transport(ranked, "nccl", mesh)
        _PLANS[key] = best
    return planned_config(cfg, best)


def program(mesh: Mesh, cfg: Config, shape: dict, where: str) -> cpu_executor.Program:
    """This rank's program for the resolved cfg and the layer ``shape`` (planning's keys)."""
    cfg = _resolved(mesh, cfg, shape)
    fields = (cfg.strategy, cfg.ulysses_degree, cfg.ring_degree, cfg.torus_chunks,
              cfg.ulysses_chunks)
    key = (mesh.machines, mesh.gpus_per_machine, mesh.rank, tuple(sorted(shape.items())), fields)
    prog = _PROGRAMS.get(key)
    if prog is not None:
        return prog
    try:
        raw = _core.sp_rank_program(
            machines=mesh.machines, gpus_per_machine=mesh.gpus_per_machine, **shape,
            config=config_text(cfg.replace(transport="nccl")), rank=mesh.rank)
    except _core.Error as e:
        raise ValueError(f"{where}: {cfg.strategy} on a {mesh.machines} x "
                         f"{mesh.gpus_per_machine} mesh: {e}") from None
    description = (f"{cfg.strategy} U={raw['ulysses_degree']} R={raw['ring_degree']} on "
                   f"{mesh.machines} x {mesh.gpus_per_machine}, rank {mesh.rank}")
    prog = cpu_executor.load_program(raw, description)
    _PROGRAMS[key] = prog
    return prog


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              joint: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]], mesh: Mesh,
              cfg: Config, where: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out, text_out or None) in q's dtype: the schedule of cfg run on this rank."""
    out, text_out, _ = attention_kept(q, k, v, joint, mesh, cfg, where)
    return out, text_out


def program_for(q, k, joint, mesh: Mesh, cfg: Config, where: str) -> cpu_executor.Program:
    """This rank's program of cfg for the layer of q [B, S_r, H, D], k [B, S_r, Hk, D] and the
    joint text (q, k, v [B, T, ., D]) or None, after the group's shape check."""
    check_gloo(mesh, where)
    text = 0 if joint is None else joint[0].shape[1]
    shape = dict(batch=q.shape[0], seq=seq_total(mesh, q, k, text, where), text=text,
                 heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
                 dtype_bytes=q.element_size())
    return program(mesh, cfg, shape, where)


def attention_kept(q, k, v, joint, mesh: Mesh, cfg: Config, where: str):
    """:func:`attention`, also returning (program, process group, timeout in s, the run's
    buffers) for the backward (grad.py)."""
    prog = program_for(q, k, joint, mesh, cfg, where)
    if prog.image_tokens[1] != q.shape[1]:  # shard_range's split is every schedule's
        raise RuntimeError(f"{where}: rank {mesh.rank} holds {q.shape[1]} image tokens, the "
                           f"schedule ({prog.description}) gives it {prog.image_tokens[1]} of "
                           f"{shape['seq']}")
    pg = process_group(mesh)
    seconds = timeout_s(pg)
    out, text_out, bufs = cpu_executor.execute_kept(prog, pg, q, k, v, joint, seconds)
    out = out.to(q.dtype)
    text_out = None if text_out is None else text_out.to(q.dtype)
    return out, text_out, (prog, pg, seconds, bufs)


def agreed_layout(name: str, mesh: Mesh, prog: cpu_executor.Program,
                  find: Callable[[cpu_executor.Program], Any]) -> Any:
    """``find(prog)`` (the layout of the backward ``name`` in this rank's program, or None)
    where every rank of the mesh's group found one, else None on every rank (the ranks must take
    the same backward: a rank without the layout makes every rank recompute). One all_reduce
    over the group at a program's first call, memoised per (group, program) like the shape
    check (cpu_runtime keeps the programs, one per shape), so every rank must make the same
    calls in the same order."""
    pg = process_group(mesh)
    key = (name, id(pg), id(prog))
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is pg and hit[1] is prog:
        return hit[2]
    found = find(prog)
    every = torch.tensor([0 if found is None else 1], dtype=torch.int64)
    dist.all_reduce(every, op=dist.ReduceOp.MIN, group=mesh.group)
    result = found if every.item() else None
    _LAYOUTS[key] = (pg, prog, result)
    return result
