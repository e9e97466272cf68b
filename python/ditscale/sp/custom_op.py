"""``torch.ops.ditscale_sp.attention``: the multi-rank ditscale.sp.attention as a torch custom op
with a fake kernel, so that ``torch.compile`` (fullgraph too) traces through it. Schema::

    attention(Tensor q, Tensor k, Tensor v, Tensor? joint_q, Tensor? joint_k, Tensor? joint_v,
              str group_name, int machines, int gpus_per_machine, str config) -> (Tensor, Tensor)

q [B, S_local, H, D], k, v [B, S_local, Hk, D], joint_* [B, T, H or Hk, D] or None; the mesh as
its process group's name ("" = default) and shape (:func:`mesh_args`: constants of a graph); the
Config as its one text (config.config_text, after make_config). Returns new tensors (out, joint_out
[B, T or 0, H, D]). Kernel: dispatch.distributed_attention (one for every device); Autograd: refuses
inputs that require grad (no backward yet). A ``torch.library.Library`` fragment, not
``torch.library.custom_op`` (whose eager calls import torch._dynamo and cost ~10 us more).
docs/sp.md ("torch.compile").
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _extension  # noqa: F401  keys torch.compile's caches to this build of ditscale
from .config import config_of_text
from .dispatch import distributed_attention
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


def refuse_grad(where: str, ranks: int, tensors) -> None:
    """Refuses inputs (q, k, v, joint_q, joint_k, joint_v; None skipped) that autograd would
    record: the op has no backward yet, and a graph through it would give wrong gradients."""
    if not torch.is_grad_enabled():
        return
    named = zip(("q", "k", "v", "joint_q", "joint_k", "joint_v"), tensors)
    needs = [name for name, t in named if t is not None and t.requires_grad]
    if needs:
        raise NotImplementedError(
            f"{where}: {', '.join(needs)} require grad on a mesh of {ranks} ranks: "
            f"sequence-parallel training is not supported yet (the multi-rank attention has no "
            f"backward); run it under torch.no_grad() or torch.inference_mode(), or detach the "
            f"inputs (one rank: autograd works)")


def _attention_autograd(q, k, v, joint_q, joint_k, joint_v, group_name, machines,
                        gpus_per_machine, config):
    """The op's Autograd kernel: inputs that require grad are refused (never a partial graph);
    others run the kernel below autograd."""
    refuse_grad("ditscale_sp::attention", machines * gpus_per_machine,
                (q, k, v, joint_q, joint_k, joint_v))
    with torch._C._AutoDispatchBelowAutograd():
        return attention_op(q, k, v, joint_q, joint_k, joint_v, group_name, machines,
                            gpus_per_machine, config)


_LIB.impl("attention", _attention_autograd, "Autograd")


@torch.library.register_fake("ditscale_sp::attention", lib=_LIB)
def _attention_fake(q, k, v, joint_q, joint_k, joint_v, group_name, machines, gpus_per_machine,
                    config):
    return q.new_empty(q.shape), q.new_empty(_joint_shape(q, joint_q))


attention_op = torch.ops.ditscale_sp.attention.default
