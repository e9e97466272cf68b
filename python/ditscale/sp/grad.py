"""Gradients of the multi-rank ditscale.sp.attention: which calls have a backward
(:data:`GRAD_STRATEGIES` on CPU tensors over gloo), the refusal of the others, and the
torch.autograd.Function the op's Autograd kernel applies (custom_op.py).

A plain ring (ring, auto resolved to it, degree-1 usp / swiftfusion-tas / torus) has its own
backward (ring_backward.py: inputs, output rows and LSE saved; dK, dV along the ring), a Ulysses
x ring program (usp, swiftfusion-tas) too (usp_backward.py: the head group's rows saved; the
Ulysses phases transposed, the ring reversed). A transposable program (ulysses, ulysses-overlap,
torus of Ulysses degree > 1) saves what its attention ops read and runs transposed
(cpu_backward.py). Any other (none today) saves this rank's input shards and recomputes the
layer as Ulysses (recompute.py). A rank's joint-input gradient is that of the heads or text
rows it computed (zero elsewhere): summed over the ranks, the dense gradient of the sum of every
rank's loss. docs/sp.md ("Gradients").
"""

from __future__ import annotations

import torch

from . import cpu_backward, cpu_runtime, recompute, torch_backward
from .config import Config
from .dispatch import check_distributed
from .meshes import Mesh

# Differentiable on more than one rank (CPU tensors, gloo): every strategy.
GRAD_STRATEGIES = ("ulysses", "ulysses-overlap", "ring", "usp", "swiftfusion-tas", "torus",
                   "auto")
_NAMES = ("q", "k", "v", "joint_q", "joint_k", "joint_v")


GRAD_DEVICES = ("cpu", "cuda")  # CPU over gloo; CUDA over NCCL (torch_usp.py, torch_backward.py)


def has_backward(cfg: Config, q: torch.Tensor) -> bool:
    """Whether the multi-rank op differentiates cfg on q's device (eagerly and under
    torch.compile)."""
    return cfg.strategy in GRAD_STRATEGIES and q.device.type in GRAD_DEVICES


def refuse_grad(where: str, ranks: int, tensors, cfg: Config) -> None:
    """Refuses inputs (q, k, v, joint_q, joint_k, joint_v; None skipped) that autograd would
    record when the call has no backward (never a partial graph)."""
    if not torch.is_grad_enabled():
        return
    needs = [n for n, t in zip(_NAMES, tensors) if t is not None and t.requires_grad]
    if not needs or has_backward(cfg, tensors[0]):
        return
    raise NotImplementedError(
        f"{where}: {', '.join(needs)} require grad on a mesh of {ranks} ranks: "
        f"sequence-parallel training is not supported yet for strategy {cfg.strategy!r} on "
        f"{tensors[0].device.type} tensors (gradients: every strategy on CPU tensors over "
        f"gloo and CUDA tensors over NCCL, eagerly and under torch.compile); run it under "
        f"torch.no_grad() or torch.inference_mode(), or detach the inputs (one rank: autograd "
        f"works)")


_WHERE = recompute.WHERE
_NAMES_OUT = ("q", "k", "v", "text_q", "text_k", "text_v")


class _Attention(torch.autograd.Function):
    """(out, joint_out [B, T or 0, H, D]) of q, k, v, joint_q/k/v (or None), with a backward."""

    @staticmethod
    def forward(ctx, q, k, v, joint_q, joint_k, joint_v, mesh: Mesh, cfg: Config):
        check_distributed(q, mesh, _WHERE)
        joint = None if joint_q is None else (joint_q, joint_k, joint_v)
        inputs = (q, k, v, joint_q, joint_k, joint_v)
        ctx.dtypes = tuple(None if t is None else t.dtype for t in inputs)
        out, jout, kept = cpu_runtime.attention_kept(q, k, v, joint, mesh, cfg, _WHERE)
        ctx.own = recompute.own(q, k, joint, mesh, kept)
        if ctx.own is not None:  # the schedule's own backward (ring_backward, usp_backward)
            module, state = ctx.own
            ctx.save_for_backward(*module.saved(state, inputs, kept[3]))
            return out, _joint_out(q, jout)
        planned = recompute.plan(q, k, joint, mesh, cfg)
        ctx.rcfg, ctx.kv_groups = planned if planned is not None else (None, 1)
        ctx.recompute = ctx.rcfg is not cfg
        prog, pg, seconds, bufs = kept
        if ctx.recompute:  # only this rank's inputs: the backward recomputes the rest
            ctx.save_for_backward(*(t for t in inputs if t is not None))
            ctx.mesh, ctx.has_joint = mesh, joint is not None
        else:
            kept = cpu_backward.saved_buffers(prog)
            ctx.save_for_backward(*(bufs[i] for i in kept))
            ctx.kept, ctx.prog, ctx.pg, ctx.seconds = kept, prog, pg, seconds
        return out, _joint_out(q, jout)

    @staticmethod
    def backward(ctx, dout, djout):
        if torch.is_grad_enabled():  # create_graph=True: the backward is not differentiable
            raise NotImplementedError("ditscale.sp.attention: no double backward on more than "
                                      "one rank (create_graph=True)")
        if ctx.own is not None:  # the schedule's own (ring_backward.py, usp_backward.py)
            module, state = ctx.own
            return _results(ctx, module.backward(state, ctx.saved_tensors, dout, djout))
        if ctx.recompute:
            t = ctx.saved_tensors
            joint = tuple(t[3:6]) if ctx.has_joint else None
            if ctx.rcfg is None:  # no Ulysses split of the layer (recompute.plan)
                g = torch_backward.gradients(t[0], t[1], t[2], joint, dout,
                                             djout if ctx.has_joint else None, ctx.mesh)
                return _results(ctx, g)
            prog, pg, seconds, saved = recompute.run_kept(t[0], t[1], t[2], joint, ctx.mesh,
                                                          ctx.rcfg, ctx.kv_groups)
        else:
            prog, pg, seconds = ctx.prog, ctx.pg, ctx.seconds
            saved = dict(zip(ctx.kept, ctx.saved_tensors))
        g = recompute.transposed(prog, pg, seconds, saved, dout, djout, ctx.kv_groups)
        return _results(ctx, g)


def _joint_out(q, jout):
    """The joint output, [B, 0, H, D] without joint inputs (the Function returns two tensors)."""
    return q.new_empty(q.shape[0], 0, q.shape[2], q.shape[3]) if jout is None else jout


def _results(ctx, g):
    """backward's return: the gradients asked for, in the inputs' dtypes."""
    result = []
    for name, dtype, needed in zip(_NAMES_OUT, ctx.dtypes, ctx.needs_input_grad):
        result.append(g[name].to(dtype) if needed and name in g else None)
    return (*result, None, None)


def attention(q, k, v, joint_q, joint_k, joint_v, mesh: Mesh, cfg: Config):
    """The differentiable multi-rank attention (has_backward(cfg, q) must hold)."""
    return _Attention.apply(q, k, v, joint_q, joint_k, joint_v, mesh, cfg)
