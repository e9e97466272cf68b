"""The planner and simulator of ditscale/sp for one attention layer, through ditscale._core (no
torch, no CUDA, no ditscale._C): plan() ranks every configuration for a mesh and topology,
predict() gives one configuration's simulated time, and strategy="auto" takes plan()'s best.

The layer's sizes (checked here and again in python/src/sp_bindings.cc): batch [1, 65536], seq
[1, 2^40], text [0, 2^40], heads [1, 65536], kv_heads [0, 65536] (0 = heads), head_dim [1, 4096],
dtype_bytes [1, 8].
"""

from __future__ import annotations

import importlib
from typing import Dict, Iterable, Optional

from .. import _core
from .._checks import check_int
from .config import STRATEGIES, Config, config_text, make_config
from .meshes import Mesh

MAX_TOKENS = 2**40


def layer_shape(where: str, batch, seq, text, heads, kv_heads, head_dim,
                dtype_bytes) -> Dict:
    try:
        return dict(batch=check_int("batch", batch, 1, 65536),
                    seq=check_int("seq", seq, 1, MAX_TOKENS),
                    text=check_int("text", text, 0, MAX_TOKENS),
                    heads=check_int("heads", heads, 1, 65536),
                    kv_heads=check_int("kv_heads", kv_heads, 0, 65536),
                    head_dim=check_int("head_dim", head_dim, 1, 4096),
                    dtype_bytes=check_int("dtype_bytes", dtype_bytes, 1, 8))
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None


def _check_mesh(mesh, where: str) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{where}: mesh must be a ditscale.sp.Mesh, got {type(mesh).__name__}")
    return mesh


def nvshmem_available() -> bool:
    """Whether ditscale._C can run one-sided transports here (False without torch or _C). Planning
    runs without torch: the extension is imported here, when asked, not with this module."""
    try:
        torch = importlib.import_module("torch")
        extension = importlib.import_module("ditscale._extension")
    except ImportError:
        return False
    ops = torch.ops.ditscale
    if not extension.is_available() or not hasattr(ops, "sp_nvshmem_unavailable"):
        return False
    return not ops.sp_nvshmem_unavailable()


def plan(mesh: Mesh, *, batch: int, seq: int, text: int, heads: int, head_dim: int,
         kv_heads: int = 0, dtype_bytes: int = 2, topology: Optional[str] = None,
         strategies: Iterable[str] = (), one_sided: Optional[bool] = None,
         sm_partitions: bool = True, config: Optional[Config] = None) -> dict:
    """The planner's ranking for one attention layer on ``mesh`` (simulated with the topology
    of ``config``/``topology``): {"ranked": [{"name", "strategy", "ulysses_degree", "ring_degree",
    "torus_chunks", "one_sided", "one_sided_inter", "transport", "comm_sms", "predicted_layer_s",
    ...}], "skipped": [...], "explanation": ...}. ``strategies``: the strategies to consider
    (default: every one; a config naming a strategy: that one). ``one_sided`` (default: when
    NVSHMEM is available) adds the one-sided candidates: "nvshmem" and, on more than one
    machine, "nvshmem-intra". ``sm_partitions`` adds each candidate with SMs kept for
    communication (``comm_sms``), where the topology has them."""
    where = "ditscale.sp.plan"
    _check_mesh(mesh, where)
    cfg = make_config(where, config, topology=topology)
    strategies = list(strategies)
    for s in strategies:
        if s not in STRATEGIES:
            raise ValueError(f"{where}: strategies: {s!r} is not one of {', '.join(STRATEGIES)}")
    if not strategies and cfg.strategy != "auto":
        strategies = [cfg.strategy]
    if one_sided is None:
        one_sided = nvshmem_available()
    return _core.sp_plan(
        machines=mesh.machines, gpus_per_machine=mesh.gpus_per_machine,
        **layer_shape(where, batch, seq, text, heads, kv_heads, head_dim, dtype_bytes),
        topology=cfg.topology, strategies=strategies, one_sided=bool(one_sided),
        one_sided_intra=bool(one_sided), sm_partitions=bool(sm_partitions))


def predict(mesh: Mesh, *, batch: int, seq: int, text: int, heads: int, head_dim: int,
            kv_heads: int = 0, dtype_bytes: int = 2, config: Optional[Config] = None,
            strategy: Optional[str] = None, chunks: Optional[int] = None,
            ulysses_chunks: Optional[int] = None, transport: Optional[str] = None,
            ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None,
            topology: Optional[str] = None, comm_sms: Optional[int] = None) -> float:
    """The simulator's time of one attention layer (seconds) for a configuration (``config``
    and the field overrides; see Config). The strategy must be named (not "auto")."""
    return predict_candidate(
        mesh, batch=batch, seq=seq, text=text, heads=heads, head_dim=head_dim, kv_heads=kv_heads,
        dtype_bytes=dtype_bytes, config=config, strategy=strategy, chunks=chunks,
        ulysses_chunks=ulysses_chunks, transport=transport, ulysses_degree=ulysses_degree,
        ring_degree=ring_degree, topology=topology, comm_sms=comm_sms)["predicted_layer_s"]


def predict_candidate(mesh: Mesh, *, batch: int, seq: int, text: int, heads: int,
                      head_dim: int, kv_heads: int = 0, dtype_bytes: int = 2,
                      config: Optional[Config] = None, **fields) -> dict:
    """predict()'s simulated candidate as a dict (the record of one plan() entry: name,
    predicted_layer_s, byte counts, the breakdown)."""
    where = "ditscale.sp.predict"
    _check_mesh(mesh, where)
    cfg = make_config(where, config, **fields)
    if cfg.strategy == "auto":
        raise ValueError(f"{where}: strategy: 'auto' is not a configuration; name one of "
                         f"{', '.join(STRATEGIES)} (plan() ranks them all)")
    return _core.sp_predict(
        machines=mesh.machines, gpus_per_machine=mesh.gpus_per_machine,
        **layer_shape(where, batch, seq, text, heads, kv_heads, head_dim, dtype_bytes),
        config=config_text(cfg))


def best_for_transport(ranked, transport: str, mesh: Mesh) -> dict:
    """The fastest plan candidate that runs on ``transport``. On one machine "nvshmem-intra" is
    the plain one-sided schedule (the planner lists it once, as "nvshmem")."""
    want = "nvshmem" if transport == "nvshmem-intra" and mesh.machines == 1 else transport
    for c in ranked:
        if c.get("transport", "nvshmem" if c["one_sided"] else "nccl") == want:
            return c
    raise RuntimeError(f"ditscale.sp.attention: the planner found no configuration for "
                       f"transport {transport!r} on a {mesh.machines} x "
                       f"{mesh.gpus_per_machine} mesh")


def planned_config(cfg: Config, candidate: dict) -> Config:
    """``cfg`` with the planner's choice of ``candidate`` (strategy, degrees, chunks and, where
    ``cfg`` leaves it unset, comm_sms)."""
    strategy = candidate["strategy"]
    chunks = int(candidate["torus_chunks"])
    # The planner's records carry torus_chunks (torus) and ulysses_chunks (ulysses) apart.
    ulysses_chunks = int(candidate["ulysses_chunks"])
    return cfg.replace(
        strategy=strategy, ulysses_degree=int(candidate["ulysses_degree"]),
        ring_degree=int(candidate["ring_degree"]),
        chunks=chunks if strategy == "torus" else None, ulysses_chunks=ulysses_chunks,
        comm_sms=cfg.comm_sms if cfg.comm_sms is not None else int(candidate.get("comm_sms", 0)))
