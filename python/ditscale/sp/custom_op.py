"""``torch.ops.ditscale_sp.attention``: the multi-rank ditscale.sp.attention as a registered torch
custom op with a fake (meta) kernel, so that ``torch.compile`` (fullgraph too) traces a model
through it instead of breaking the graph at the attention.

Schema::

    ditscale_sp::attention(Tensor q, Tensor k, Tensor v, Tensor? joint_q, Tensor? joint_k,
                           Tensor? joint_v, str group_name, int machines,
                           int gpus_per_machine, str config) -> (Tensor, Tensor)

- q [B, S_local, H, D], k, v [B, S_local, Hk, D]: this rank's image tokens; joint_* [B, T, H or
  Hk, D] (all text tokens) or None.
- ``group_name``, ``machines``, ``gpus_per_machine``: the mesh (:func:`mesh_args`): its process
  group by name ("" = the default group; a schema cannot carry the group object itself, and a
  registry filled while Dynamo traces would be filled only after the graph has run).
- ``config``: the ditscale.sp.Config as text (:func:`config_text`: ``field=repr(value)`` joined by
  ``;``, every field; :func:`config_of_text` reads it back), after make_config (environment
  applied), so the op is a function of its arguments.
- Returns (out [B, S_local, H, D], joint_out [B, T, H, D]); without joint_q, joint_out is
  [B, 0, H, D]. Both new tensors of q's dtype and device (the fake kernel says so).

The real kernel (CompositeExplicitAutograd: one for every device) is
runtime.distributed_attention: the GPU runtime for CUDA tensors, the CPU executor over gloo for CPU
tensors. The op has no autograd formula (the runtime is an inference path). It is a
``torch.library.Library`` FRAGMENT of the namespace "ditscale_sp", apart from the C++ library
"ditscale" of ditscale._C; not ``torch.library.custom_op``, whose eager calls import
torch._dynamo on first use (seconds) and cost about 10 us more per call.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Dict, Optional, Tuple

import torch

from .. import ops as _ops  # noqa: F401  keys torch.compile's caches to this build of ditscale
from .config import Config
from .meshes import Mesh

_FIELDS = tuple(f.name for f in dataclasses.fields(Config))
_CONFIGS: Dict[str, Config] = {}
# (group name, machines, gpus_per_machine, the group object's id) -> the Mesh the kernel runs on.
_MESHES: Dict[Tuple, Mesh] = {}


def mesh_args(mesh: Mesh) -> Tuple[str, int, int]:
    """The op's arguments for ``mesh``: (its process group's name, "" for the default group;
    machines; gpus_per_machine). No state is kept: under torch.compile they are constants of the
    graph, and the kernel finds the group again by its name."""
    name = "" if mesh.group is None else mesh.group.group_name
    return name, mesh.machines, mesh.gpus_per_machine


def mesh_of(group_name: str, machines: int, gpus_per_machine: int) -> Mesh:
    """The Mesh of :func:`mesh_args`' values (memoised; checked against the group's size)."""
    import torch.distributed as dist
    group = None
    if group_name:
        group = dist.distributed_c10d._resolve_process_group(group_name)
    key = (group_name, machines, gpus_per_machine, id(group))
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = Mesh(machines, gpus_per_machine, group)
        _MESHES[key] = mesh
    return mesh


def config_text(cfg: Config) -> str:
    """``cfg`` as the op's config argument: "strategy='ring';ulysses_degree=0;..."."""
    return ";".join(f"{name}={getattr(cfg, name)!r}" for name in _FIELDS)


def config_of_text(text: str) -> Config:
    """The Config of :func:`config_text`'s text (validated again)."""
    cfg = _CONFIGS.get(text)
    if cfg is None:
        try:
            fields = dict(item.split("=", 1) for item in text.split(";"))
            if set(fields) != set(_FIELDS):
                raise ValueError(f"fields {sorted(fields)} are not {sorted(_FIELDS)}")
            cfg = Config(**{k: ast.literal_eval(v) for k, v in fields.items()})
        except (ValueError, SyntaxError, TypeError) as e:
            raise ValueError(f"ditscale_sp::attention: config {text!r}: {e}") from None
        _CONFIGS[text] = cfg
    return cfg


def _joint_shape(q: torch.Tensor, joint_q: Optional[torch.Tensor]):
    if joint_q is None:
        return (q.shape[0], 0, q.shape[2], q.shape[3])
    return joint_q.shape


_LIB = torch.library.Library("ditscale_sp", "FRAGMENT")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, Tensor? joint_q, Tensor? joint_k, "
            "Tensor? joint_v, str group_name, int machines, int gpus_per_machine, str config) "
            "-> (Tensor, Tensor)")


def _attention_impl(q, k, v, joint_q, joint_k, joint_v, group_name, machines, gpus_per_machine,
                    config):
    from .runtime import distributed_attention
    joint = None if joint_q is None else (joint_q, joint_k, joint_v)
    mesh = mesh_of(group_name, machines, gpus_per_machine)
    out, jout = distributed_attention(q, k, v, joint, mesh, config_of_text(config))
    if jout is None:
        jout = q.new_empty(_joint_shape(q, None))
    return out, jout


# One kernel for every device (distributed_attention dispatches on q's device).
_LIB.impl("attention", _attention_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("ditscale_sp::attention", lib=_LIB)
def _attention_fake(q, k, v, joint_q, joint_k, joint_v, group_name, machines, gpus_per_machine,
                    config):
    return q.new_empty(q.shape), q.new_empty(_joint_shape(q, joint_q))


attention_op = torch.ops.ditscale_sp.attention.default
