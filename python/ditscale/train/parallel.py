"""The ranks' layout of a run: data parallelism x sequence parallelism (``sp_degree``).

The W ranks form W / sp_degree sequence-parallel (SP) groups of sp_degree consecutive ranks:
rank r is in group r // sp_degree, which is also its data-parallel index (the rank the
sampler's plan is made for, over W / sp_degree data-parallel ranks). Every rank of an SP group
trains the same micro-batches with the transformer's tokens split over the group
(``ditscale.diffusers.parallelize`` on the group's mesh); FSDP2 still shards the parameters over
all W ranks. The SP process groups are made once, at set-up, on every rank (a collective);
the checks run before, alike on every rank, and after, when the groups' meshes (machines x
ranks per machine) are known: ``sp_strategy`` must build a schedule on every group's mesh for the
model's heads (:func:`group_meshes`, agreed by every rank). See
[docs/train.md](../../../docs/train.md) ("Sequence parallelism").
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch


@dataclass(frozen=True)
class Layout:
    """This rank's place: ``rank`` of ``world``, SP groups of ``sp`` ranks; ``group``: its SP
    process group and ``mesh`` its ``ditscale.sp.Mesh`` (None when sp == 1)."""

    rank: int
    world: int
    sp: int
    group: Optional[Any] = None
    mesh: Optional[Any] = None

    @property
    def dp(self) -> int:
        """Data-parallel size: the world size the sampler's plan is made for."""
        return self.world // self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def model_degree(self) -> int:
        """The degree the transformer is parallelized on (``parallel_mixed``: the largest)."""
        return self.sp

    @property
    def model_mesh(self) -> Optional[Any]:
        return self.mesh


def check(sp_degree: int, strategy: str, world: int, device: torch.device) -> None:
    """ValueError (the same on every rank) when ``sp_degree`` cannot train here: it must divide
    ``world``, and above 1 the strategy must have a backward on several ranks on ``device``."""
    if world % sp_degree:
        raise ValueError(f"sp_degree: {sp_degree} does not divide the world size {world} (the "
                         f"ranks form world / sp_degree groups of sp_degree consecutive ranks)")
    if sp_degree == 1:
        return
    from ..sp.grad import GRAD_DEVICES, GRAD_STRATEGIES

    if strategy not in GRAD_STRATEGIES or device.type not in GRAD_DEVICES:
        raise ValueError(f"sp_degree: {sp_degree} > 1 needs sequence-parallel attention with a "
                         f"backward on several ranks, which exists on CPU (gloo) and CUDA (NCCL) "
                         f"tensors (sp_strategy {strategy!r}, device {device.type}); set "
                         f"sp_degree = 1 (--sp-degree 1)")


def check_tokens(store, sp_degree: int, field: str = "sp_degree") -> None:
    """ValueError naming the first store sample with fewer than ``sp_degree`` tokens (each rank
    of an SP group needs one): the training shapes of the manifest rows through the store's
    shape model (one ``seq_len`` per distinct raw shape)."""
    if sp_degree == 1:
        return
    import numpy as np

    from .. import _core

    m = _core.read_manifest(store.manifest_path)
    rows = np.stack([np.asarray(m.num_frames, np.float64), np.asarray(m.height, np.float64),
                     np.asarray(m.width, np.float64), np.asarray(m.fps, np.float64)], axis=1)
    shapes, first = np.unique(rows, axis=0, return_index=True)
    bad = []
    for (f, h, w, fps), i in zip(shapes.astype(np.int64).tolist(), first.tolist()):
        tokens = _core.seq_len(f, h, w, float(rows[i, 3]), store.shape_model)
        if tokens < sp_degree:
            bad.append((i, f, h, w, tokens))
    if bad:
        i, f, h, w, tokens = min(bad)
        raise ValueError(f"{field}: {sp_degree} > the {tokens} tokens of store sample {i} "
                         f"(num_frames {f}, {h}x{w}): every rank of a sequence-parallel group "
                         f"needs one")


def _program_error(strategy: str, mesh, wan, where: str) -> str:
    """The error of building this rank's schedule of ``strategy`` on ``mesh`` (as the attention
    does: ``sp.cpu_runtime.program``, the C++ builders) for a self-attention layer of the
    model (``wan``: its heads and head_dim, no joint tokens) of one token per rank, the fewest
    :func:`check_tokens` allows (tokens do not change what builds); '' when it builds."""
    from ..sp import cpu_runtime, make_config

    shape = dict(batch=1, seq=mesh.size, text=0, heads=wan.num_heads, kv_heads=wan.num_heads,
                 head_dim=wan.head_dim, dtype_bytes=4)
    try:
        cpu_runtime.program(mesh, make_config(where, None, strategy=strategy), shape, where)
    except ValueError as e:
        return str(e)
    return ""


def strategy_error(strategy: str, mesh, wan) -> str:
    """Why ``sp_strategy`` cannot train on ``mesh`` (this rank's group, machines x ranks per
    machine), '' when it can: e.g. usp's Ulysses degree (the ranks per machine) above the
    model's heads. Names the strategies that run there."""
    where = (f"sp_strategy: {strategy!r} cannot run on the sequence-parallel group of "
             f"{mesh.size} ranks")
    error = _program_error(strategy, mesh, wan, where)
    if not error:
        return ""
    from ..sp.grad import GRAD_STRATEGIES

    runs = [s for s in GRAD_STRATEGIES if s != strategy and not _program_error(s, mesh, wan, "")]
    return (f"{error} (a mesh of machines x ranks per machine; the model has {wan.num_heads} "
            f"attention heads; strategies that run there: {', '.join(runs) or 'none'})")


def group_meshes(groups: Dict[int, Any], strategy: str, wan, field: str) -> Dict[int, Any]:
    """{degree: the ``ditscale.sp.Mesh`` of this rank's group of that degree} of ``groups``
    (degree -> process group; collectives, in the dict's order), after checking that
    ``strategy`` runs on each of more than one rank (:func:`strategy_error`). A failure on any
    rank is the same ValueError on every rank (one all_gather_object over the world)."""
    import torch.distributed as dist

    from .. import sp

    meshes, error = {}, ""
    for d, group in groups.items():
        try:
            meshes[d] = sp.Mesh.from_process_group(group)
        except ValueError as e:  # e.g. machines of different sizes in the group
            error = error or f"{field}: {d}: rank {dist.get_rank()}'s group: {e}"
            continue
        if d > 1 and not error:
            error = strategy_error(strategy, meshes[d], wan)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), "")
    if first:
        raise ValueError(first)
    return meshes


def make_layout(sp_degree: int, strategy: str, timeout_s: float, device: torch.device,
                wan) -> Layout:
    """Checks, then builds every SP group on every rank (torch.distributed initialised) and
    checks ``strategy`` on their meshes for the model ``wan`` (a WanConfig: its heads);
    returns this rank's layout."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    check(sp_degree, strategy, world, device)
    if sp_degree == 1:
        return Layout(rank, world, 1)
    ranks = [list(range(g * sp_degree, (g + 1) * sp_degree)) for g in range(world // sp_degree)]
    group, _ = dist.new_subgroups_by_enumeration(
        ranks, timeout=datetime.timedelta(seconds=timeout_s))
    mesh = group_meshes({sp_degree: group}, strategy, wan, "sp_degree")[sp_degree]
    return Layout(rank, world, sp_degree, group, mesh)


def parallelize(model, layout, strategy: str):
    """``model`` (a diffusers Wan transformer, before FSDP) sequence-parallel over this rank's
    group of ``layout.model_degree`` ranks (nothing when 1); returns it. ``layout``: a
    ``Layout`` or a ``parallel_mixed.MixedLayout``."""
    if layout.model_degree == 1:
        return model
    from ..diffusers import parallelize as sp_parallelize

    return sp_parallelize(model, mesh=layout.model_mesh, strategy=strategy)
