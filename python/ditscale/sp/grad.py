"""Gradients of the multi-rank ditscale.sp.attention: which calls have a backward
(:data:`GRAD_STRATEGIES` on CPU tensors over gloo), the refusal of the others, and the
torch.autograd.Function the op's Autograd kernel applies (custom_op.py).

The forward runs the strategy's schedule (cpu_runtime.attention_kept) and saves only the buffers
its attention ops read: this rank's head group of q, k, v over the whole sequence, its output and
log-sum-exp. The backward is that program transposed (cpu_backward.py): dOut all-to-all (sequence
-> heads), the attention backward, dQ, dK, dV all-to-all back. Joint text inputs: each rank's
gradient is that of the heads it computed (zero elsewhere); summed over the ranks it is the dense
gradient of the sum of every rank's loss. docs/sp.md ("Gradients").
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from . import cpu_backward, cpu_runtime
from .config import Config
from .dispatch import check_distributed
from .meshes import Mesh

GRAD_STRATEGIES = ("ulysses",)  # differentiable on more than one rank (CPU tensors, gloo)
_NAMES = ("q", "k", "v", "joint_q", "joint_k", "joint_v")


def has_backward(cfg: Config, q: torch.Tensor) -> bool:
    """Whether the multi-rank op differentiates cfg on q's device (eagerly: torch.compile does
    not trace the backward yet)."""
    return (cfg.strategy in GRAD_STRATEGIES and q.device.type == "cpu"
            and not torch.compiler.is_compiling() and not is_fake(q))


def refuse_grad(where: str, ranks: int, tensors, cfg: Config) -> None:
    """Refuses inputs (q, k, v, joint_q, joint_k, joint_v; None skipped) that autograd would
    record when the call has no backward (never a partial graph)."""
    if not torch.is_grad_enabled():
        return
    needs = [n for n, t in zip(_NAMES, tensors) if t is not None and t.requires_grad]
    if not needs or has_backward(cfg, tensors[0]):
        return
    supported = ", ".join(repr(s) for s in GRAD_STRATEGIES)
    raise NotImplementedError(
        f"{where}: {', '.join(needs)} require grad on a mesh of {ranks} ranks: "
        f"sequence-parallel training is not supported yet for strategy {cfg.strategy!r} on "
        f"{tensors[0].device.type} tensors{_compiled()} (gradients: strategy {supported} on "
        f"CPU tensors over gloo, eagerly); run it under torch.no_grad() or "
        f"torch.inference_mode(), or detach the inputs (one rank: autograd works)")


def _compiled() -> str:
    return " under torch.compile" if torch.compiler.is_compiling() else ""


class _Attention(torch.autograd.Function):
    """(out, joint_out [B, T or 0, H, D]) of q, k, v, joint_q/k/v (or None), with a backward."""

    @staticmethod
    def forward(ctx, q, k, v, joint_q, joint_k, joint_v, mesh: Mesh, cfg: Config):
        where = "ditscale.sp.attention"
        check_distributed(q, mesh, where)
        joint = None if joint_q is None else (joint_q, joint_k, joint_v)
        out, jout, (prog, pg, seconds, bufs) = cpu_runtime.attention_kept(
            q, k, v, joint, mesh, cfg, where)
        cpu_backward.check_transposable(prog, where)
        kept = cpu_backward.saved_buffers(prog)
        ctx.save_for_backward(*(bufs[i] for i in kept))
        ctx.kept, ctx.prog, ctx.pg, ctx.seconds = kept, prog, pg, seconds
        inputs = (q, k, v, joint_q, joint_k, joint_v)
        ctx.dtypes = tuple(None if t is None else t.dtype for t in inputs)
        if jout is None:
            jout = q.new_empty(q.shape[0], 0, q.shape[2], q.shape[3])
        return out, jout

    @staticmethod
    def backward(ctx, dout, djout):
        if torch.is_grad_enabled():  # create_graph=True: the backward is not differentiable
            raise NotImplementedError("ditscale.sp.attention: no double backward on more than "
                                      "one rank (create_graph=True)")
        saved = dict(zip(ctx.kept, ctx.saved_tensors))
        grads_out = {"out": dout}
        if ctx.prog.io["text_out"] >= 0:
            grads_out["text_out"] = djout
        g = cpu_backward.backward(ctx.prog, ctx.pg, saved, grads_out, dout.shape[0], ctx.seconds)
        names = ("q", "k", "v", "text_q", "text_k", "text_v")
        result = []
        for name, dtype, needed in zip(names, ctx.dtypes, ctx.needs_input_grad):
            result.append(g[name].to(dtype) if needed and name in g else None)
        return (*result, None, None)


def attention(q, k, v, joint_q, joint_k, joint_v, mesh: Mesh, cfg: Config):
    """The differentiable multi-rank attention (has_backward(cfg, q) must hold)."""
    return _Attention.apply(q, k, v, joint_q, joint_k, joint_v, mesh, cfg)
