"""One-GPU diagnostics of the GPU executor of ditscale.sp, no process group (experiments, not
the API: ditscale._experimental): run_local (every rank of a one-sided schedule in this process)
and replay_compute (one rank's compute with its transfers skipped: the runtime's compute-only
mode). Need torch and ditscale._C built with CUDA. docs/sp.md ("Experiments")."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .._checks import check_int, check_real
from ..sp.config import Config, make_config
from ..sp.gpu_runtime import require, run_text
from ..sp.meshes import MAX_MACHINES, Mesh
from ..sp.planning import layer_shape


def _named_config(where: str, config: Optional[Config], fields: dict) -> Config:
    cfg = make_config(where, config, **fields)
    if cfg.strategy == "auto":
        raise ValueError(f"{where}: strategy: 'auto' is not a configuration (no planner here); "
                         f"name one of ditscale.sp.STRATEGIES")
    return cfg


def _checked(where: str, fn, *args):
    try:
        return fn(*args)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None


def run_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              config: Optional[Config] = None, strategy: Optional[str] = None,
              machines: int = 1, gpus_per_machine: int, chunks: Optional[int] = None,
              ulysses_chunks: Optional[int] = None, ulysses_degree: Optional[int] = None,
              ring_degree: Optional[int] = None, joint_q: Optional[torch.Tensor] = None,
              joint_k: Optional[torch.Tensor] = None, joint_v: Optional[torch.Tensor] = None,
              layers: int = 1, timeout_s: float = 60.0, comm_sms: Optional[int] = None):
    """Every rank of a strategy's one-sided schedule in this process, on q's GPU: the real GPU
    executor per rank (own streams), its puts and signals by copy engines and stream memory
    operations between the ranks' buffers. ``q, k, v``: the FULL ``[B, S, H, D]`` inputs
    (``joint_*``: ``[B, T, H, D]``). No process group: checks strategies and the copy-engine
    engine on one GPU against dense attention (not a speed measurement: the ranks share the GPU).
    Runs ``layers`` layers ([1, 1000]) and fails after ``timeout_s`` ((0, 3600] s) when the ranks
    do not finish; returns ``(out_first, out_last, text_out, info)``: the full ``[B, S, H, D]``
    outputs of the first and last layer, each rank's text output stacked ``[ranks, B, T, H, D]``
    (None without text) and a description (engine, arena bytes). The configuration (``config``
    and the overrides; its transport is one-sided by construction) must name a strategy.
    A rank's stream waits block a CUDA hardware queue: with more than two ranks set
    ``CUDA_DEVICE_MAX_CONNECTIONS=32`` before CUDA starts, or the ranks' queues may be shared
    and block each other."""
    where = "run_local"
    joint = [joint_q, joint_k, joint_v]
    if any(t is not None for t in joint) and any(t is None for t in joint):
        raise ValueError(f"{where}: joint_q, joint_k and joint_v go together")
    cfg = _named_config(where, config, dict(
        strategy=strategy, chunks=chunks, ulysses_chunks=ulysses_chunks,
        ulysses_degree=ulysses_degree, ring_degree=ring_degree, comm_sms=comm_sms))
    mesh = _checked(where, Mesh, machines, gpus_per_machine)
    layers = _checked(where, check_int, "layers", layers, 1, 1000)
    timeout_s = _checked(where, check_real, "timeout_s", timeout_s, 1e-3, 3600.0)
    require()
    if not hasattr(torch.ops.ditscale, "sp_run_local"):
        raise RuntimeError(f"{where}: the extension was built without the CUDA "
                           "sequence-parallel runtime")
    first, last, text_out, info = torch.ops.ditscale.sp_run_local(
        run_text(cfg), mesh.machines, mesh.gpus_per_machine, q, k, v, joint_q, joint_k, joint_v,
        layers, timeout_s)
    return first, last, (text_out if joint_q is not None else None), info


def replay_compute(strategy: Optional[str] = None, *, config: Optional[Config] = None,
                   machines: int, gpus_per_machine: int, rank: int = 0, batch: int = 1,
                   seq: int, text: int = 0, heads: int, kv_heads: int = 0, head_dim: int = 128,
                   chunks: Optional[int] = None, ulysses_chunks: Optional[int] = None,
                   ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None,
                   transport: Optional[str] = None, iters: int = 5, warmup: int = 1,
                   comm_sms: Optional[int] = None) -> Tuple[List[float], str]:
    """One rank's compute of a strategy, replayed alone on the current GPU: the GPU executor runs
    the rank's schedule with every transfer skipped, so its attention calls, merges and copies
    run as they would if communication were free (random bf16 inputs; the output is
    meaningless). No process group, one GPU: what a schedule's cuts cost in compute, measured
    (``comm_sms`` > 0: on the SM partition that leaves that many SMs). ``iters`` [1, 10000]
    timed layers after ``warmup`` [0, 10000]; the layer's sizes as for plan().
    Returns (ms of each timed layer, the per-unit timeline of one traced layer as text)."""
    where = "replay_compute"
    cfg = _named_config(where, config, dict(
        strategy=strategy, chunks=chunks, ulysses_chunks=ulysses_chunks,
        ulysses_degree=ulysses_degree, ring_degree=ring_degree, transport=transport,
        comm_sms=comm_sms))
    mesh = _checked(where, Mesh, machines, gpus_per_machine)
    shape = layer_shape(where, batch, seq, text, heads, kv_heads, head_dim, 2)
    rank = _checked(where, check_int, "rank", rank, 0, MAX_MACHINES * MAX_MACHINES)
    iters = _checked(where, check_int, "iters", iters, 1, 10000)
    warmup = _checked(where, check_int, "warmup", warmup, 0, 10000)
    require()
    ms, text_tl = torch.ops.ditscale.sp_replay_compute(
        run_text(cfg), mesh.machines, mesh.gpus_per_machine, rank, shape["batch"], shape["seq"],
        shape["text"], shape["heads"], shape["kv_heads"], shape["head_dim"], iters, warmup)
    return ms.tolist(), text_tl
