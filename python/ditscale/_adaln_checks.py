"""Argument checks of the AdaLN fake (meta) kernels (ditscale._fake_kernels): check_call, one
function for every op.

They repeat the op bodies' checks (ditscale/torch/adaln_impl.h, adaln_prepare.cc) with the same
messages, so that meta tensors, fake tensors and tensors of mixed devices fail as the CPU / CUDA
implementations do instead of returning uninitialised outputs. Shapes are compared with
torch._check, which also holds under symbolic shapes."""

from __future__ import annotations

import torch

NORMS = ("layernorm", "rmsnorm")
# The documented range of eps (ditscale/torch/adaln_prepare.h: kMinEps, kMaxEps): finite, > 0,
# and a normal float32 once the kernels round it.
EPS_RANGE = (1e-30, 1e30)


ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_devices(op: str, named) -> None:
    """All defined tensors of ``named`` ((name, tensor or None) pairs) on the first one's
    device, else RuntimeError naming both arguments and devices (adaln_prepare.cc:
    check_same_device)."""
    first = None
    for name, t in named:
        if t is None:
            continue
        if first is None:
            first = (name, t)
        elif t.device != first[1].device:
            raise RuntimeError(
                f"{op}: expected all tensors to be on the same device, but got {name} on "
                f"{t.device}, different from {first[0]} on {first[1].device}"
            )


def dt(dtype) -> str:
    """A dtype as ATen prints a ScalarType in the op's messages ("Float", "BFloat16", ...)."""
    names = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
             torch.float64: "Double", torch.int32: "Int", torch.int64: "Long",
             torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def fmt_sizes(shape) -> str:
    return "[" + ", ".join(str(v) for v in shape) + "]"


def check_config(op: str, xname: str, x, norm, eps) -> None:
    if x.dim() != 3:
        raise RuntimeError(f"{op}: {xname} must be [B, N, D], got shape {fmt_sizes(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise RuntimeError(
            f"{op}: {xname} must be bfloat16, float16, float32 or float64, got {dt(x.dtype)}"
        )
    if norm not in NORMS:
        raise RuntimeError(f'{op}: norm must be "layernorm" or "rmsnorm", got "{norm}"')
    lo, hi = EPS_RANGE
    if not (lo <= eps <= hi):  # also NaN
        raise RuntimeError(
            f"{op}: eps: {eps:.6g} is out of range [{lo:.6g}, {hi:.6g}] (eps must be finite "
            f"and > 0)"
        )


def check_rows(op: str, name: str, t, x) -> None:
    torch._check(
        t.dim() == 3 and all(a == b for a, b in zip(t.shape, x.shape)),
        lambda: f"{op}: {name} must have x's shape [B, N, D] = {fmt_sizes(x.shape)}, got "
        f"{fmt_sizes(t.shape)}",
    )
    if t.dtype != x.dtype:
        raise RuntimeError(f"{op}: {name} must have x's dtype {dt(x.dtype)}, got {dt(t.dtype)}")


def check_modulation(op: str, name: str, t, x) -> None:
    B, N, D = x.shape
    torch._check(
        (t.dim() == 2 and t.shape[0] == B and t.shape[1] == D)
        or (t.dim() == 3 and t.shape[0] == B and t.shape[1] == N and t.shape[2] == D),
        lambda: f"{op}: {name} must be per sample [B, D] = [{B}, {D}] or per token [B, N, D] = "
        f"[{B}, {N}, {D}], got {fmt_sizes(t.shape)} (a [B, 1, D] tensor: pass t.squeeze(1), as "
        f"ditscale.ops.adaln does)",
    )
    if t.dtype not in (x.dtype, torch.float32):
        raise RuntimeError(
            f"{op}: {name} must have x's dtype ({dt(x.dtype)}) or float32, got {dt(t.dtype)}"
        )


def check_affine(op: str, x, weight, bias) -> None:
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        torch._check(
            t.dim() == 1 and t.shape[0] == x.shape[2],
            lambda: f"{op}: {name} must be [D] = [{x.shape[2]}], got {fmt_sizes(t.shape)}",
        )
        if t.dtype not in (x.dtype, torch.float32):
            raise RuntimeError(
                f"{op}: {name} must have x's dtype ({dt(x.dtype)}) or float32, got {dt(t.dtype)}"
            )
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise RuntimeError(
            f"{op}: weight and bias must have the same dtype, got {dt(weight.dtype)} and "
            f"{dt(bias.dtype)}"
        )


def check_stats(op: str, x, mean, rstd) -> None:
    B, N = x.shape[0], x.shape[1]
    for name, t in (("mean", mean), ("rstd", rstd)):
        torch._check(
            t.dim() == 2 and t.shape[0] == B and t.shape[1] == N,
            lambda: f"{op}: {name} must be [B, N] = [{B}, {N}] (from the forward), got "
            f"{fmt_sizes(t.shape)}",
        )
        if t.dtype != torch.float32:
            raise RuntimeError(f"{op}: {name} must be float32, got {dt(t.dtype)}")


def check_mod_rows(op: str, mod, x, rows) -> None:
    """mod [B, K, D] and distinct row indices ((name, index) pairs) below K."""
    torch._check(
        mod.dim() == 3 and mod.shape[0] == x.shape[0] and mod.shape[2] == x.shape[2],
        lambda: f"{op}: mod must be [B, K, D] with B = {x.shape[0]} and D = {x.shape[2]}, got "
        f"{fmt_sizes(mod.shape)}",
    )
    K = mod.shape[1]
    for k, (name, index) in enumerate(rows):
        torch._check(
            0 <= index < K, lambda: f"{op}: {name} = {index} is outside mod's K = {K} rows"
        )
        for other, prev in rows[:k]:
            if prev == index:
                raise RuntimeError(
                    f"{op}: {other} and {name} are both {index} (each modulation must be a "
                    f"different row of mod)"
                )


def check_call(op: str, x_name: str, x, norm, eps, *, devices, rows=(), mods=(), weight=None,
               bias=None, stats=None, mod=None, mod_rows=()) -> None:
    """Every check of one AdaLN op's arguments, in the op body's order: the devices of
    ``devices`` ((name, tensor or None) pairs), x (named ``x_name``), norm and eps, ``mod``'s
    rows ``mod_rows`` ((name, index) pairs), the [B, N, D] tensors ``rows`` (None skipped), the
    modulation tensors ``mods`` (a row index instead of a tensor: that row of ``mod``, taken once
    the rows are checked), the affine weight and bias, the forward's ``stats`` (mean, rstd). The one check behind every fake kernel (ditscale._fake_kernels)."""
    check_devices(op, devices)
    check_config(op, x_name, x, norm, eps)
    if mod is not None:
        check_mod_rows(op, mod, x, mod_rows)
    for name, t in rows:
        if t is not None:
            check_rows(op, name, t, x)
    for name, t in mods:
        check_modulation(op, name, t if isinstance(t, torch.Tensor) else mod[:, t], x)
    check_affine(op, x, weight, bias)
    if stats is not None:
        check_stats(op, x, *stats)
