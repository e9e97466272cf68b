"""``torch.ops.ditscale_sp.attention``: the multi-rank ditscale.sp.attention as a torch custom op
with a fake kernel, so that ``torch.compile`` (fullgraph too) traces through it. Schema::

    attention(Tensor q, Tensor k, Tensor v, Tensor? joint_q, Tensor? joint_k, Tensor? joint_v,
              str group_name, int machines, int gpus_per_machine, str config) -> (Tensor, Tensor)

q [B, S_local, H, D], k, v [B, S_local, Hk, D], joint_* [B, T, H or Hk, D] or None; the mesh as
its process group's name ("" = default) and shape (:func:`mesh_args`: constants of a graph); the
Config as its one text (config.config_text, after make_config). Returns new tensors (out, joint_out
[B, T or 0, H, D]). Kernel: dispatch.distributed_attention (one for every device); Autograd:
inputs that require grad run grad.attention (CPU), torch_usp.py (CUDA tensors, eagerly, a
Ulysses x ring decomposition: its forward through PyTorch's transfers, its own backward) or the
second op ``attention_backward`` (under torch.compile, other CUDA calls) where the call has a
backward (grad.has_backward) and are refused elsewhere. A ``torch.library.Library`` fragment, not
``torch.library.custom_op`` (whose eager calls import torch._dynamo and cost ~10 us more).
docs/sp.md ("torch.compile").
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from torch._subclasses.fake_tensor import is_fake

from .. import _extension  # noqa: F401  keys torch.compile's caches to this build of ditscale
from .._teardown import clear_at_exit
from . import block_kernels, dispatch, grad, recompute, torch_backward, torch_usp, torch_usp_layout
from .config import config_of_text
from .dispatch import distributed_attention
from .grad import refuse_grad
from .meshes import Mesh

# (group name, machines, gpus_per_machine, the group object's id) -> the Mesh the kernel runs on.
_MESHES: Dict[Tuple, Mesh] = clear_at_exit({})


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
# The gradients (dq, dk, dv, djoint_q, djoint_k, djoint_v; [B, 0, ., D] without joint inputs)
# from (dout, djoint_out) by recomputation (recompute.py; a schedule with a backward of its own,
# a ring or Ulysses x ring program: its forward again, then that backward): the backward
# torch.compile traces.
_LIB.define("attention_backward(Tensor q, Tensor k, Tensor v, Tensor? joint_q, Tensor? joint_k, "
            "Tensor? joint_v, Tensor dout, Tensor djoint_out, str group_name, int machines, "
            "int gpus_per_machine, str config) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
            "Tensor)")


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


def _no_joint_grad_shapes(q, k):
    """Shapes of (djoint_q, djoint_k, djoint_v) without joint inputs: [B, 0, H or Hk, D]."""
    return ((q.shape[0], 0, q.shape[2], q.shape[3]),) + ((k.shape[0], 0) + k.shape[2:],) * 2


def _attention_backward_impl(q, k, v, joint_q, joint_k, joint_v, dout, djoint_out, group_name,
                             machines, gpus_per_machine, config):
    joint = None if joint_q is None else (joint_q, joint_k, joint_v)
    mesh = mesh_of(group_name, machines, gpus_per_machine)
    if q.device.type == "cpu":  # the schedule's program transposed (recompute.py)
        g = recompute.gradients(q, k, v, joint, dout, djoint_out, mesh, config_of_text(config))
    else:  # PyTorch's collectives and SDPA (torch_backward.py)
        g = torch_backward.gradients(q, k, v, joint, dout, djoint_out, mesh)
    out = [g["q"].to(q.dtype), g["k"].to(k.dtype), g["v"].to(v.dtype)]
    if joint is None:
        return (*out, *(q.new_zeros(s) for s in _no_joint_grad_shapes(q, k)))
    return (*out, *(g[n].to(t.dtype) for n, t in zip(("text_q", "text_k", "text_v"), joint)))


_LIB.impl("attention_backward", _attention_backward_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("ditscale_sp::attention_backward", lib=_LIB)
def _attention_backward_fake(q, k, v, joint_q, joint_k, joint_v, dout, djoint_out, group_name,
                             machines, gpus_per_machine, config):
    grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
    if joint_q is None:
        return (*grads, *(q.new_empty(s) for s in _no_joint_grad_shapes(q, k)))
    return (*grads, *(t.new_empty(t.shape) for t in (joint_q, joint_k, joint_v)))


class _ByOps(torch.autograd.Function):
    """The forward is the op, keeping only the inputs; the backward is the
    ``attention_backward`` op. Under torch.compile (fake tensors) both are traced into the
    graphs; it is also the eager autograd of CUDA calls that torch_usp.py does not take."""

    @staticmethod
    def forward(ctx, q, k, v, joint_q, joint_k, joint_v, group_name, machines,
                gpus_per_machine, config):
        args = (group_name, machines, gpus_per_machine, config)
        ctx.args, ctx.has_joint = args, joint_q is not None
        ctx.save_for_backward(q, k, v, *((joint_q, joint_k, joint_v) if ctx.has_joint else ()))
        return attention_op(q, k, v, joint_q, joint_k, joint_v, *args)

    @staticmethod
    def backward(ctx, dout, djoint_out):
        t = ctx.saved_tensors
        joint = tuple(t[3:6]) if ctx.has_joint else (None, None, None)
        grads = attention_backward_op(t[0], t[1], t[2], *joint, dout, djoint_out, *ctx.args)
        return (*grads[:3], *(grads[3:] if ctx.has_joint else (None,) * 3), None, None, None,
                None)


def _torch_usp_layout(q, k, joint_q, mesh: Mesh, cfg):
    """torch_usp's Layout for a CUDA call that requires grad (strategies ulysses, ring, usp,
    swiftfusion-tas, ulysses-overlap as ulysses, auto resolved to one of them; at least U query
    heads; a dtype and head_dim that block_kernels runs), else None. Alike on every rank (the
    group's shape check is a collective)."""
    if cfg.strategy not in torch_usp_layout.TAKEN or not block_kernels.supports(q):
        return None
    dispatch.check_distributed(q, mesh, torch_usp.WHERE)
    text = 0 if joint_q is None else joint_q.shape[1]
    return torch_usp_layout.layout_for(q, k, text, mesh, cfg)


def _attention_autograd(q, k, v, joint_q, joint_k, joint_v, group_name, machines,
                        gpus_per_machine, config):
    """The op's Autograd kernel: inputs that require grad run grad.attention (a
    torch.autograd.Function, CPU tensors), torch_usp.py (CUDA tensors, eagerly, strategies of
    :func:`_torch_usp_layout`: the forward then runs through PyTorch's point-to-point transfers,
    not the C++ GPU executor, and saves the LSE) or :class:`_ByOps` (under torch.compile, and
    other CUDA calls) where the call has a backward and are refused elsewhere (never a partial
    graph); others run the kernel below autograd."""
    tensors = (q, k, v, joint_q, joint_k, joint_v)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        cfg = config_of_text(config)
        refuse_grad("ditscale_sp::attention", machines * gpus_per_machine, tensors, cfg)
        if torch.compiler.is_compiling() or is_fake(q):
            return _ByOps.apply(*tensors, group_name, machines, gpus_per_machine, config)
        mesh = mesh_of(group_name, machines, gpus_per_machine)
        if q.device.type == "cpu":
            return grad.attention(*tensors, mesh, cfg)
        lay = _torch_usp_layout(q, k, joint_q, mesh, cfg)
        if lay is not None:  # Ulysses x ring through PyTorch's transfers, its own backward
            return torch_usp.attention(*tensors, mesh=mesh, cfg=cfg, layout=lay)
        return _ByOps.apply(*tensors, group_name, machines, gpus_per_machine, config)
    with torch._C._AutoDispatchBelowAutograd():
        return attention_op(q, k, v, joint_q, joint_k, joint_v, group_name, machines,
                            gpus_per_machine, config)


_LIB.impl("attention", _attention_autograd, "Autograd")


@torch.library.register_fake("ditscale_sp::attention", lib=_LIB)
def _attention_fake(q, k, v, joint_q, joint_k, joint_v, group_name, machines, gpus_per_machine,
                    config):
    return q.new_empty(q.shape), q.new_empty(_joint_shape(q, joint_q))


attention_op = torch.ops.ditscale_sp.attention.default
attention_backward_op = torch.ops.ditscale_sp.attention_backward.default
