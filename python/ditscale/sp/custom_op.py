"""``torch.ops.ditscale_sp.attention``: the multi-rank ditscale.sp.attention as a torch custom op
with a fake kernel, so that ``torch.compile`` (fullgraph too) traces through it. Schema::

    attention(Tensor q, Tensor k, Tensor v, Tensor? joint_q, Tensor? joint_k, Tensor? joint_v,
              str group_name, int machines, int gpus_per_machine, str config) -> (Tensor, Tensor)

q [B, S_local, H, D], k, v [B, S_local, Hk, D], joint_* [B, T, H or Hk, D] or None; the mesh as
its process group's name ("" = default) and shape (:func:`mesh_args`: constants of a graph); the
Config as its one text (config.config_text, after make_config). Returns new tensors (out, joint_out
[B, T or 0, H, D]). Kernel: dispatch.distributed_attention (one for every device); Autograd:
inputs that require grad run grad.attention where the call has a backward (grad.GRAD_STRATEGIES
on CPU tensors) and are refused elsewhere. A ``torch.library.Library`` fragment, not
``torch.library.custom_op`` (whose eager calls import torch._dynamo and cost ~10 us more).
docs/sp.md ("torch.compile").
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _extension  # noqa: F401  keys torch.compile's caches to this build of ditscale
from . import grad
from .config import config_of_text
from .dispatch import distributed_attention
from .grad import refuse_grad
from .meshes import Mesh

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
    group = None
    if group_name:
        group = dist.distributed_c10d._resolve_process_group(group_name)
    key = (group_name, machines, gpus_per_machine, id(group))
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = Mesh(machines, gpus_per_machine, group)
        _MESHES[key] = mesh
    return mesh


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
    joint = None if joint_q is None else (joint_q, joint_k, joint_v)
    mesh = mesh_of(group_name, machines, gpus_per_machine)
    out, jout = distributed_attention(q, k, v, joint, mesh, config_of_text(config))
    if jout is None:
        jout = q.new_empty(_joint_shape(q, None))
    return out, jout


# One kernel for every device (distributed_attention dispatches on q's device).
_LIB.impl("attention", _attention_impl, "CompositeExplicitAutograd")


def _attention_autograd(q, k, v, joint_q, joint_k, joint_v, group_name, machines,
                        gpus_per_machine, config):
    """The op's Autograd kernel: inputs that require grad run grad.attention (a
    torch.autograd.Function) where the call has a backward and are refused elsewhere (never a
    partial graph); others run the kernel below autograd."""
    tensors = (q, k, v, joint_q, joint_k, joint_v)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        cfg = config_of_text(config)
        refuse_grad("ditscale_sp::attention", machines * gpus_per_machine, tensors, cfg)
        return grad.attention(*tensors, mesh_of(group_name, machines, gpus_per_machine), cfg)
    with torch._C._AutoDispatchBelowAutograd():
        return attention_op(q, k, v, joint_q, joint_k, joint_v, group_name, machines,
                            gpus_per_machine, config)


_LIB.impl("attention", _attention_autograd, "Autograd")


@torch.library.register_fake("ditscale_sp::attention", lib=_LIB)
def _attention_fake(q, k, v, joint_q, joint_k, joint_v, group_name, machines, gpus_per_machine,
                    config):
    return q.new_empty(q.shape), q.new_empty(_joint_shape(q, joint_q))


attention_op = torch.ops.ditscale_sp.attention.default
