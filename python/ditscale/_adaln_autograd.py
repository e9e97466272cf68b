"""The autograd of the AdaLN ops: one setup and one backward formula per forward op, registered
twice by :func:`register_autograds` (called by ``ditscale.ops`` once the extension is loaded):

- ``torch.library.register_autograd``: what torch.compile (AOTAutograd) traces and what direct
  ``torch.ops.ditscale.*`` calls use (the dispatcher's Python autograd kernel);
- ``EAGER[op]``: a ``torch.autograd.Function`` whose forward calls the op below autograd and runs
  the same setup, for ``ditscale.ops``' eager calls (it skips that kernel's per-call Python: the
  argument re-binding against the schema, fill_defaults, was most of a small call's host time).

Both save the same tensors and call the same backward ops, so they give the same bits. The
backward ops themselves have no autograd (no double backward).
"""

from __future__ import annotations

import torch

# Op name -> the torch.autograd.Function of the eager path.
EAGER = {}


def register_autograds() -> None:
    """Registers every forward op's autograd both ways (see the module docstring)."""
    register("adaln_fwd", _fwd_backward, _fwd_setup)
    register("adaln_mod_fwd", _mod_backward, _mod_setup)
    register("adaln_gated_fwd", _gated_backward, _gated_setup)
    register("adaln_gated_mod_fwd", _gated_mod_backward, _gated_mod_setup)


def register(name: str, backward, setup) -> None:
    """The autograd of op ``name`` twice, from one formula: torch.library.register_autograd (what
    torch.compile traces and direct torch.ops.ditscale calls use) and the eager path's
    torch.autograd.Function ``EAGER[name]``, whose forward calls the op below autograd and runs
    the same ``setup``; both return all of the op's outputs."""
    op = getattr(torch.ops.ditscale, name).default
    torch.library.register_autograd("ditscale::" + name, backward, setup_context=setup)

    def forward(ctx, *inputs):
        with torch._C._AutoDispatchBelowAutograd():
            output = op(*inputs)
        setup(ctx, inputs, output)
        return output

    EAGER[name] = type(f"Eager_{name}", (torch.autograd.Function,),
                       {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _keep_norm(ctx, norm, eps, mean, rstd):
    """The non-tensor state of every AdaLN op's autograd; mean / rstd get no gradient."""
    ctx.norm, ctx.eps = norm, eps
    ctx.mark_non_differentiable(mean, rstd)
    # Without this autograd fills two [B, N] fp32 zero tensors for mean / rstd on every
    # backward (two kernels, ~1.7 us on the H200 at B*N = 16384).
    ctx.set_materialize_grads(False)


def _affine_grads(weight, bias, dweight, dbias):
    """The ops return [0] placeholders for an absent weight / bias; autograd wants None."""
    return (dweight if weight is not None else None, dbias if bias is not None else None)


# ---- adaln_fwd autograd ----


def _fwd_setup(ctx, inputs, output):
    x, scale, shift, weight, bias, norm, eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, scale, shift, weight, bias, mean, rstd)
    _keep_norm(ctx, norm, eps, mean, rstd)


def _fwd_backward(ctx, dy, dmean, drstd):
    x, scale, shift, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:  # y is not used downstream: every gradient is zero
        return None, None, None, None, None, None, None
    dx, dscale, dshift, dweight, dbias = torch.ops.ditscale.adaln_bwd(
        dy, x, scale, shift, weight, bias, mean, rstd, ctx.norm, ctx.eps
    )
    return (
        dx,
        dscale,
        dshift,
        *_affine_grads(weight, bias, dweight, dbias),
        None,
        None,
    )


# ---- adaln_mod_fwd autograd ----


def _mod_setup(ctx, inputs, output):
    x, mod, scale_index, shift_index, weight, bias, norm, eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, mod, weight, bias, mean, rstd)
    ctx.scale_index, ctx.shift_index = scale_index, shift_index
    _keep_norm(ctx, norm, eps, mean, rstd)


def _mod_backward(ctx, dy, dmean, drstd):
    x, mod, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:  # y is not used downstream: every gradient is zero
        return None, None, None, None, None, None, None, None
    dx, dmod, dweight, dbias = torch.ops.ditscale.adaln_mod_bwd(
        dy, x, mod, ctx.scale_index, ctx.shift_index, weight, bias, mean, rstd, ctx.norm,
        ctx.eps,
    )
    return (
        dx,
        dmod,
        None,
        None,
        *_affine_grads(weight, bias, dweight, dbias),
        None,
        None,
    )


# ---- adaln_gated_fwd autograd ----


def _gated_setup(ctx, inputs, output):
    residual, gate, branch, scale, shift, weight, bias, norm, eps = inputs
    h, _, mean, rstd = output
    ctx.save_for_backward(h, gate, branch, scale, shift, weight, bias, mean, rstd)
    _keep_norm(ctx, norm, eps, mean, rstd)


def _gated_backward(ctx, dh, dy, dmean, drstd):
    h, gate, branch, scale, shift, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:  # only h is used downstream: y's gradient is zero
        dy = torch.zeros_like(h)
    dres, dgate, dbranch, dscale, dshift, dweight, dbias = torch.ops.ditscale.adaln_gated_bwd(
        dh, dy, h, gate, branch, scale, shift, weight, bias, mean, rstd, ctx.norm, ctx.eps
    )
    return (
        dres,
        dgate,
        dbranch,
        dscale,
        dshift,
        *_affine_grads(weight, bias, dweight, dbias),
        None,
        None,
    )


# ---- adaln_gated_mod_fwd autograd ----


def _gated_mod_setup(ctx, inputs, output):
    (residual, branch, mod, gate_index, scale_index, shift_index, weight, bias, norm,
     eps) = inputs
    h, _, mean, rstd = output
    ctx.save_for_backward(h, branch, mod, weight, bias, mean, rstd)
    ctx.rows = (gate_index, scale_index, shift_index)
    _keep_norm(ctx, norm, eps, mean, rstd)


def _gated_mod_backward(ctx, dh, dy, dmean, drstd):
    h, branch, mod, weight, bias, mean, rstd = ctx.saved_tensors
    if dh is None and dy is None:
        return (None,) * 10
    if dy is None:  # only h is used downstream: y's gradient is zero
        dy = torch.zeros_like(h)
    dres, dbranch, dmod, dweight, dbias = torch.ops.ditscale.adaln_gated_mod_bwd(
        dh, dy, h, branch, mod, *ctx.rows, weight, bias, mean, rstd, ctx.norm, ctx.eps
    )
    return (
        dres,
        dbranch,
        dmod,
        None,
        None,
        None,
        *_affine_grads(weight, bias, dweight, dbias),
        None,
        None,
    )
