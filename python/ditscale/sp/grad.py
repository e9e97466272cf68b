"""Gradients of the multi-rank ditscale.sp.attention: which calls have a backward
(:data:`GRAD_STRATEGIES` on CPU tensors over gloo), the refusal of the others, and the
torch.autograd.Function the op's Autograd kernel applies (custom_op.py).

A program that merges nothing and writes every region once (the Ulysses schedules) is
transposed: the forward saves only the buffers its attention ops read (this rank's head group of
q, k, v over the whole sequence, its output and log-sum-exp) and the backward runs the program
transposed (cpu_backward.py): dOut all-to-all (sequence -> heads), the attention backward, dQ,
dK, dV all-to-all back. Any other schedule (ring, usp, swiftfusion-tas, torus) saves only this
rank's input shards; its backward recomputes the layer as Ulysses over the same group (the same
function: attention does not depend on the schedule) and transposes that program. Joint text
inputs: each rank's gradient is that of the heads it computed (zero elsewhere); summed over the
ranks it is the dense gradient of the sum of every rank's loss. docs/sp.md ("Gradients").
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from . import cpu_backward, cpu_runtime
from .config import Config
from .dispatch import check_distributed
from .meshes import Mesh

# Differentiable on more than one rank (CPU tensors, gloo): every strategy.
GRAD_STRATEGIES = ("ulysses", "ulysses-overlap", "ring", "usp", "swiftfusion-tas", "torus",
                   "auto")
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
    raise NotImplementedError(
        f"{where}: {', '.join(needs)} require grad on a mesh of {ranks} ranks: "
        f"sequence-parallel training is not supported yet for strategy {cfg.strategy!r} on "
        f"{tensors[0].device.type} tensors{_compiled()} (gradients: every strategy on CPU "
        f"tensors over gloo, eagerly); run it under torch.no_grad() or "
        f"torch.inference_mode(), or detach the inputs (one rank: autograd works)")


def _compiled() -> str:
    return " under torch.compile" if torch.compiler.is_compiling() else ""


_WHERE = "ditscale.sp.attention"


def _transposable(prog) -> bool:
    try:
        cpu_backward.check_transposable(prog, _WHERE)
    except ValueError:
        return False
    return True


def _recompute_config(cfg: Config) -> Config:
    """The configuration a non-transposable schedule's backward recomputes the layer with."""
    return Config(strategy="ulysses", transport="nccl", comm_sms=0, topology=cfg.topology)


def _kv_groups(q, k, mesh: Mesh) -> int:
    """How many times the recomputation repeats each kv head: 1, or the GQA group size when
    there are fewer kv heads than ranks (Ulysses gives every rank at least one kv head)."""
    return 1 if k.shape[2] >= mesh.size else q.shape[2] // k.shape[2]


def _expand(k: torch.Tensor, g: int) -> torch.Tensor:
    """k [B, T, Hk, D] -> [B, T, Hk * g, D], kv head h as heads h*g .. h*g+g-1."""
    return k if g == 1 else k.repeat_interleave(g, dim=2)


def _fold(dk: torch.Tensor, g: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: [B, T, Hk * g, D] -> [B, T, Hk, D] (sum of a group)."""
    B, T, H, D = dk.shape
    return dk if g == 1 else dk.reshape(B, T, H // g, g, D).sum(3)


def _check_recomputable(q, k, joint, mesh: Mesh, cfg: Config) -> None:
    """NotImplementedError (before the forward's communication, alike on every rank: the shape
    is the group's) when the Ulysses schedule of the backward cannot be built for this layer."""
    g = _kv_groups(q, k, mesh)
    if joint is not None:
        joint = (joint[0], _expand(joint[1], g), joint[2])
    try:
        cpu_runtime.program_for(q, _expand(k, g), joint, mesh, _recompute_config(cfg), _WHERE)
    except ValueError as e:
        raise NotImplementedError(
            f"{_WHERE}: the backward of strategy {cfg.strategy!r} on {mesh.size} ranks runs as "
            f"Ulysses over the same group, which cannot split this layer ({e}); train with "
            f"fewer ranks in the group or more heads") from None


class _Attention(torch.autograd.Function):
    """(out, joint_out [B, T or 0, H, D]) of q, k, v, joint_q/k/v (or None), with a backward."""

    @staticmethod
    def forward(ctx, q, k, v, joint_q, joint_k, joint_v, mesh: Mesh, cfg: Config):
        check_distributed(q, mesh, _WHERE)
        joint = None if joint_q is None else (joint_q, joint_k, joint_v)
        inputs = (q, k, v, joint_q, joint_k, joint_v)
        prog = cpu_runtime.program_for(q, k, joint, mesh, cfg, _WHERE)
        ctx.recompute = not _transposable(prog)
        if ctx.recompute:
            _check_recomputable(q, k, joint, mesh, cfg)
        out, jout, (prog, pg, seconds, bufs) = cpu_runtime.attention_kept(
            q, k, v, joint, mesh, cfg, _WHERE)
        if ctx.recompute:  # only this rank's inputs: the backward recomputes the rest
            ctx.save_for_backward(*(t for t in inputs if t is not None))
            ctx.mesh, ctx.cfg, ctx.has_joint = mesh, cfg, joint is not None
        else:
            kept = cpu_backward.saved_buffers(prog)
            ctx.save_for_backward(*(bufs[i] for i in kept))
            ctx.kept, ctx.prog, ctx.pg, ctx.seconds = kept, prog, pg, seconds
        ctx.dtypes = tuple(None if t is None else t.dtype for t in inputs)
        if jout is None:
            jout = q.new_empty(q.shape[0], 0, q.shape[2], q.shape[3])
        return out, jout

    @staticmethod
    def backward(ctx, dout, djout):
        if torch.is_grad_enabled():  # create_graph=True: the backward is not differentiable
            raise NotImplementedError("ditscale.sp.attention: no double backward on more than "
                                      "one rank (create_graph=True)")
        prog, pg, seconds, saved, kv_groups = _saved(ctx)
        grads_out = {"out": dout}
        if prog.io["text_out"] >= 0:
            grads_out["text_out"] = djout
        g = cpu_backward.backward(prog, pg, saved, grads_out, dout.shape[0], seconds)
        for name in ("k", "v", "text_k", "text_v"):
            if name in g:
                g[name] = _fold(g[name], kv_groups)
        names = ("q", "k", "v", "text_q", "text_k", "text_v")
        result = []
        for name, dtype, needed in zip(names, ctx.dtypes, ctx.needs_input_grad):
            result.append(g[name].to(dtype) if needed and name in g else None)
        return (*result, None, None)


def _saved(ctx):
    """(program, process group, timeout in s, saved buffers by index, kv head repeats) of the
    transposed program: the forward's, or the Ulysses recomputation of the layer (see the
    module; GQA with fewer kv heads than ranks: kv heads repeated, :func:`_kv_groups`)."""
    if not ctx.recompute:
        return ctx.prog, ctx.pg, ctx.seconds, dict(zip(ctx.kept, ctx.saved_tensors)), 1
    tensors = ctx.saved_tensors
    g = _kv_groups(tensors[0], tensors[1], ctx.mesh)
    q, k, v = tensors[0], _expand(tensors[1], g), _expand(tensors[2], g)
    joint = None
    if ctx.has_joint:
        joint = (tensors[3], _expand(tensors[4], g), _expand(tensors[5], g))
    with torch.no_grad():
        _, _, (prog, pg, seconds, bufs) = cpu_runtime.attention_kept(
            q, k, v, joint, ctx.mesh, _recompute_config(ctx.cfg), _WHERE)
    return prog, pg, seconds, {i: bufs[i] for i in cpu_backward.saved_buffers(prog)}, g


def attention(q, k, v, joint_q, joint_k, joint_v, mesh: Mesh, cfg: Config):
    """The differentiable multi-rank attention (has_backward(cfg, q) must hold)."""
    return _Attention.apply(q, k, v, joint_q, joint_k, joint_v, mesh, cfg)
