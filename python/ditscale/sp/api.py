"""ditscale.sp.attention: the public entry of sequence-parallel attention (docs/sp.md). Checks
the call (configuration, tensors, autograd), runs SDPA when one rank holds everything, and hands
a mesh of more ranks to the custom op ``torch.ops.ditscale_sp.attention`` (custom_op.py), whose
kernel dispatches to the GPU or CPU runtime (dispatch.py), and whose Autograd kernel applies
grad.py's backward where the call has one. The chain, no cycle:
api -> custom_op -> grad -> dispatch -> gpu_runtime | cpu_runtime.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch

from .config import ENV_COMM_SMS, ENV_TOPOLOGY, Config, config_text, make_config
from .custom_op import attention_op, mesh_args
from .grad import refuse_grad
from .meshes import Mesh, check_transport_on_mesh


def _local_attention(q, k, v, joint_q, joint_k, joint_v):
    """One rank holds everything: SDPA over [joint; image]."""
    T = 0 if joint_q is None else joint_q.shape[1]
    if T:
        q, k, v = (torch.cat([a, b], 1) for a, b in ((joint_q, q), (joint_k, k), (joint_v, v)))
    if k.shape[2] != q.shape[2]:
        g = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return (o[:, T:], o[:, :T]) if T else (o, None)


# make_config's results for attention: (config, overrides, the variables it reads) -> Config.
# make_config costs ~25 us (two validated dataclass copies), a lookup here ~2 us.
_CONFIG_MEMO: Dict[Tuple, Config] = {}
_CONFIG_MEMO_SIZE = 256
_CONFIG_ENV = (ENV_TOPOLOGY, ENV_COMM_SMS)


def _attention_config(where: str, config: Optional[Config], overrides: dict) -> Config:
    """make_config(where, config, **overrides), memoised while the environment variables it
    reads keep their values (torch.compile traces make_config itself)."""
    if torch.compiler.is_compiling():
        return make_config(where, config, **overrides)
    key = (config, tuple((type(v), v) for v in overrides.values()),
           tuple(os.environ.get(n) for n in _CONFIG_ENV))
    try:
        cfg = _CONFIG_MEMO.get(key)
    except TypeError:  # an unhashable argument: make_config names it
        return make_config(where, config, **overrides)
    if cfg is None:
        cfg = make_config(where, config, **overrides)
        if len(_CONFIG_MEMO) < _CONFIG_MEMO_SIZE:
            _CONFIG_MEMO[key] = cfg
    return cfg


def _check_tensors(where: str, q, k, v, joint) -> None:
    """q [B, S, H, D], k and v [B, S, Hk, D] (H a multiple of Hk), joint (text q, k, v)
    [B, T, H, D], [B, T, Hk, D] x 2: one device and one dtype."""
    named = [("q", q), ("k", k), ("v", v)]
    if joint is not None:
        named += [("joint_q", joint[0]), ("joint_k", joint[1]), ("joint_v", joint[2])]
    for name, t in named:
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{where}: {name} must be a 4-d tensor [batch, tokens, heads, "
                             f"head_dim], got {getattr(t, 'shape', type(t).__name__)}")
        if t.device != q.device or t.dtype != q.dtype:
            raise ValueError(f"{where}: {name} is {t.dtype} on {t.device}, q is {q.dtype} on "
                             f"{q.device}: every tensor of the call on one device, of one dtype")
    B, S, H, D = q.shape
    Hk = k.shape[2]
    want = [("k", k, (B, S, Hk, D)), ("v", v, (B, S, Hk, D))]
    if joint is not None:
        T = joint[0].shape[1]
        want += [("joint_q", joint[0], (B, T, H, D)), ("joint_k", joint[1], (B, T, Hk, D)),
                 ("joint_v", joint[2], (B, T, Hk, D))]
    for name, t, shape in want:
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected {shape} "
                             f"(q {tuple(q.shape)}, k {tuple(k.shape)})")
    if Hk < 1 or H % Hk:
        raise ValueError(f"{where}: the {H} query heads are not a multiple of the {Hk} "
                         f"key/value heads")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Optional[Mesh],
              config: Optional[Config] = None, strategy: Optional[str] = None,
              joint_q: Optional[torch.Tensor] = None, joint_k: Optional[torch.Tensor] = None,
              joint_v: Optional[torch.Tensor] = None, chunks: Optional[int] = None,
              ulysses_chunks: Optional[int] = None, transport: Optional[str] = None,
              ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None,
              topology: Optional[str] = None, comm_sms: Optional[int] = None):
    """Sequence-parallel attention of this rank's image-token shard (see ditscale.sp).
    Returns ``out`` [B, S_local, H, D], or ``(out, joint_out)`` when ``joint_q`` is given.
    ``config`` (default Config(): strategy "auto") and the field overrides: see Config.
    A mesh of one rank runs SDPA here (differentiable, traced by torch.compile as SDPA); more
    ranks run the custom op ``torch.ops.ditscale_sp.attention`` (custom_op.py, then
    dispatch.py): CUDA tensors on the GPU runtime, CPU tensors on the CPU executor over gloo
    (two-sided transports only). On more than one rank, gradients flow for strategy "ulysses"
    on CPU tensors (grad.py); elsewhere inputs that require grad while grad mode is on are
    refused (NotImplementedError naming the strategies with a backward)."""
    where = "ditscale.sp.attention"
    joint = joint_q is not None
    if (joint_k is None) != (joint_q is None) or (joint_v is None) != (joint_q is None):
        raise ValueError(f"{where}: joint_q, joint_k and joint_v go together")
    cfg = _attention_config(where, config, dict(
        strategy=strategy, chunks=chunks, ulysses_chunks=ulysses_chunks, transport=transport,
        ulysses_degree=ulysses_degree, ring_degree=ring_degree, topology=topology,
        comm_sms=comm_sms))
    check_transport_on_mesh(cfg.transport, mesh, where)
    _check_tensors(where, q, k, v, (joint_q, joint_k, joint_v) if joint else None)
    if mesh is None or mesh.size == 1:  # nothing to transport: any transport
        out, jout = _local_attention(q, k, v, joint_q, joint_k, joint_v)
        return (out, jout) if joint else out
    refuse_grad(where, mesh.size, (q, k, v, joint_q, joint_k, joint_v), cfg)
    if cfg.one_sided and not q.is_cuda:
        raise ValueError(f"{where}: transport {cfg.transport!r} is one-sided (NVSHMEM: CUDA "
                         f"tensors only); {q.device.type} tensors run the two-sided transport "
                         f"'nccl' (over gloo)")
    out, jout = attention_op(q, k, v, joint_q, joint_k, joint_v, *mesh_args(mesh),
                             config_text(cfg))
    return (out, jout) if joint else out
