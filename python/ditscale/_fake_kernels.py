"""Fake (meta) kernels of the ops of ``ditscale._C``, so that ``torch.compile(fullgraph=True)``
traces them: each checks its arguments through one shared check (``_adaln_checks.check_call``,
the op bodies' checks with the same messages) and returns empty outputs of the right shapes,
dtypes and devices. Registered by ditscale._extension once the extension is loaded, or on import
when the ops are already there (the ops' set_python_module names this module). docs/adaln.md.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._adaln_checks import check_call

_NS = "ditscale::"


def _stats(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Empty fp32 mean and rstd, [B, N]."""
    return tuple(x.new_empty((x.shape[0], x.shape[1]), dtype=torch.float32) for _ in range(2))


def _rows_like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _grad_like(ref: torch.Tensor, t: Optional[torch.Tensor]) -> torch.Tensor:
    """The gradient of an optional weight or bias: [0] fp32 when absent."""
    if t is None:
        return ref.new_empty((0,), dtype=torch.float32)
    return t.new_empty(t.shape)


def adaln_fwd(x, scale, shift, weight, bias, norm, eps):
    check_call(_NS + "adaln_fwd", "x", x, norm, eps, weight=weight, bias=bias,
               devices=(("x", x), ("scale", scale), ("shift", shift), ("weight", weight),
                        ("bias", bias)),
               mods=(("scale", scale), ("shift", shift)))
    return (_rows_like(x), *_stats(x))


def adaln_bwd(dy, x, scale, shift, weight, bias, mean, rstd, norm, eps):
    check_call(_NS + "adaln_bwd", "x", x, norm, eps, weight=weight, bias=bias,
               devices=(("dy", dy), ("x", x), ("scale", scale), ("shift", shift),
                        ("weight", weight), ("bias", bias), ("mean", mean), ("rstd", rstd)),
               rows=(("dy", dy),), mods=(("scale", scale), ("shift", shift)),
               stats=(mean, rstd))
    return (_rows_like(x), scale.new_empty(scale.shape), shift.new_empty(shift.shape),
            _grad_like(x, weight), _grad_like(x, bias))


def adaln_mod_fwd(x, mod, scale_index, shift_index, weight, bias, norm, eps):
    rows = (("scale_index", scale_index), ("shift_index", shift_index))
    check_call(_NS + "adaln_mod_fwd", "x", x, norm, eps, weight=weight, bias=bias,
               devices=(("x", x), ("mod", mod), ("weight", weight), ("bias", bias)),
               mod=mod, mod_rows=rows,
               mods=(("scale", scale_index), ("shift", shift_index)))
    return (_rows_like(x), *_stats(x))


def adaln_mod_bwd(dy, x, mod, scale_index, shift_index, weight, bias, mean, rstd, norm, eps):
    rows = (("scale_index", scale_index), ("shift_index", shift_index))
    check_call(_NS + "adaln_mod_bwd", "x", x, norm, eps, weight=weight, bias=bias,
               devices=(("dy", dy), ("x", x), ("mod", mod), ("weight", weight), ("bias", bias),
                        ("mean", mean), ("rstd", rstd)),
               mod=mod, mod_rows=rows, rows=(("dy", dy),), mods=(("scale", scale_index),),
               stats=(mean, rstd))
    return _rows_like(x), mod.new_empty(mod.shape), _grad_like(x, weight), _grad_like(x, bias)


def adaln_gated_fwd(residual, gate, branch, scale, shift, weight, bias, norm, eps):
    check_call(_NS + "adaln_gated_fwd", "residual", residual, norm, eps, weight=weight,
               bias=bias,
               devices=(("residual", residual), ("gate", gate), ("branch", branch),
                        ("scale", scale), ("shift", shift), ("weight", weight), ("bias", bias)),
               rows=(("branch", branch),),
               mods=(("gate", gate), ("scale", scale), ("shift", shift)))
    return (_rows_like(residual), _rows_like(residual), *_stats(residual))


def adaln_gated_bwd(dh, dy, residual, gate, branch, scale, shift, weight, bias, mean, rstd, norm,
                    eps):
    check_call(_NS + "adaln_gated_bwd", "residual", residual, norm, eps, weight=weight,
               bias=bias,
               devices=(("dh", dh), ("dy", dy), ("residual", residual), ("gate", gate),
                        ("branch", branch), ("scale", scale), ("shift", shift),
                        ("weight", weight), ("bias", bias), ("mean", mean), ("rstd", rstd)),
               rows=(("dy", dy), ("branch", branch), ("dh", dh)),
               mods=(("gate", gate), ("scale", scale), ("shift", shift)), stats=(mean, rstd))
    return (_rows_like(residual), gate.new_empty(gate.shape), _rows_like(residual),
            scale.new_empty(scale.shape), shift.new_empty(shift.shape),
            _grad_like(residual, weight), _grad_like(residual, bias))


def adaln_gated_mod_fwd(residual, branch, mod, gate_index, scale_index, shift_index, weight,
                        bias, norm, eps):
    check_call(_NS + "adaln_gated_mod_fwd", "residual", residual, norm, eps, weight=weight,
               bias=bias,
               devices=(("residual", residual), ("branch", branch), ("mod", mod),
                        ("weight", weight), ("bias", bias)),
               mod=mod, mod_rows=(("scale_index", scale_index), ("shift_index", shift_index),
                                  ("gate_index", gate_index)),
               rows=(("branch", branch),),
               mods=(("gate", gate_index), ("scale", scale_index), ("shift", shift_index)))
    return (_rows_like(residual), _rows_like(residual), *_stats(residual))


def adaln_gated_mod_bwd(dh, dy, residual, branch, mod, gate_index, scale_index, shift_index,
                        weight, bias, mean, rstd, norm, eps):
    check_call(_NS + "adaln_gated_mod_bwd", "residual", residual, norm, eps, weight=weight,
               bias=bias,
               devices=(("dh", dh), ("dy", dy), ("residual", residual), ("branch", branch),
                        ("mod", mod), ("weight", weight), ("bias", bias), ("mean", mean),
                        ("rstd", rstd)),
               mod=mod, mod_rows=(("scale_index", scale_index), ("shift_index", shift_index),
                                  ("gate_index", gate_index)),
               rows=(("dy", dy), ("branch", branch), ("dh", dh)),
               mods=(("scale", scale_index),), stats=(mean, rstd))
    return (_rows_like(residual), _rows_like(residual), mod.new_empty(mod.shape),
            _grad_like(residual, weight), _grad_like(residual, bias))


def rotary(x, cos, sin, inverse=False):
    torch._check(x.dim() == 4, lambda: f"ditscale.ops.rotary: x must be [B, S, H, Dh], "
                                       f"got shape {tuple(x.shape)}")
    torch._check(x.shape[3] >= 2 and x.shape[3] % 2 == 0,
                 lambda: f"ditscale.ops.rotary: x's head dim (its last) must be even and "
                         f">= 2, got {x.shape[3]}")
    for name, f in (("cos", cos), ("sin", sin)):
        torch._check(f.dtype == torch.float32,
                     lambda: f"ditscale.ops.rotary: {name} must be float32, got {f.dtype}")
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_FAKES = (adaln_fwd, adaln_bwd, adaln_mod_fwd, adaln_mod_bwd, adaln_gated_fwd, adaln_gated_bwd,
          adaln_gated_mod_fwd, adaln_gated_mod_bwd, rotary)


_registered = False


def register() -> None:
    """Registers every fake kernel (each under its function's name), once; the ops must be
    loaded."""
    global _registered
    if not _registered:
        for fake in _FAKES:
            torch.library.register_fake(_NS + fake.__name__)(fake)
        _registered = True


# The ops name this module as their fakes' home (set_python_module in adaln_ops.cc): torch imports
# it when it needs a fake kernel, also where _C was loaded without ditscale._extension.
if hasattr(torch.ops.ditscale, "adaln_fwd"):
    register()
