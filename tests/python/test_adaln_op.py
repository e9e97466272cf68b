"""CPU tests of the fused AdaLN torch ops (torch.ops.ditscale.adaln_*, ditscale.ops, ditscale.nn).

The CPU implementation is the fp64-accumulating reference of ditscale/kernels, so these tests
check the op layer: registration, argument handling (strided modulation views, per-sample and
per-token layouts, the gated variant), autograd (gradcheck in fp64), fake kernels and
torch.compile tracing, and the module against the diffusers pattern. Inputs are fresh random
tensors on every run (the seed is printed on failure through the test id).
"""

import random
import re

import pytest

torch = pytest.importorskip("torch")

from ditscale import nn as dnn  # noqa: E402
from ditscale import ops  # noqa: E402


SEED = random.randrange(1 << 30)
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def gen(seed_offset=0):
    return torch.Generator().manual_seed(SEED + seed_offset)


def randn(*shape, dtype=torch.float64, g=None, scale=1.0, offset=0.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype)


def make_mod(kind, B, N, D, count, dtype, g):
    """`count` modulation tensors in the layout `kind`, as the models produce them."""
    if kind == "per_sample":  # separate [B, D] tensors
        return [randn(B, D, dtype=dtype, g=g, scale=0.5) for _ in range(count)]
    if kind == "per_sample_b1d":  # diffusers' scale[:, None] -> [B, 1, D]
        return [randn(B, 1, D, dtype=dtype, g=g, scale=0.5) for _ in range(count)]
    if kind == "chunk_b6d":  # Wan 2.1: [B, 6, D] chunks (strided [B, D] views)
        return [m.squeeze(1) for m in randn(B, 6, D, dtype=dtype, g=g, scale=0.5).chunk(6, 1)][
            :count
        ]
    if kind == "chunk_b6xd":  # Flux / SD3: [B, 6D] chunks
        return list(randn(B, 6 * D, dtype=dtype, g=g, scale=0.5).chunk(6, 1))[:count]
    if kind == "per_token":
        return [randn(B, N, D, dtype=dtype, g=g, scale=0.5) for _ in range(count)]
    if kind == "chunk_bn6d":  # Wan 2.2 per token: chunks of [B, N, 6D]
        return list(randn(B, N, 6 * D, dtype=dtype, g=g, scale=0.5).chunk(6, 2))[:count]
    raise ValueError(kind)


MOD_KINDS = ["per_sample", "per_sample_b1d", "chunk_b6d", "chunk_b6xd", "per_token", "chunk_bn6d"]
NORMS = ["layernorm", "rmsnorm"]


# ------------------------------------------------------------------------------------------
# Registration


def test_ops_registered():
    assert ops.is_available(), ops.load_error()
    names = ("adaln_fwd", "adaln_bwd", "adaln_mod_fwd", "adaln_mod_bwd", "adaln_gated_fwd",
             "adaln_gated_bwd", "adaln_gated_mod_fwd", "adaln_gated_mod_bwd")
    for name in names:
        op = getattr(torch.ops.ditscale, name)
        assert op.default._schema.name == f"ditscale::{name}"
    schema = str(torch.ops.ditscale.adaln_fwd.default._schema)
    assert "Tensor? weight" in schema and "str norm" in schema and "float eps" in schema
    # functional: no input is mutated or aliased
    for name in names:
        s = getattr(torch.ops.ditscale, name).default._schema
        assert all(a.alias_info is None for a in s.arguments), name
        assert all(r.alias_info is None for r in s.returns), name


def test_import_ditscale_lazy_attributes():
    import ditscale

    assert ditscale.ops is ops and ditscale.nn is dnn
    with pytest.raises(AttributeError):
        ditscale.not_a_module  # noqa: B018


# ------------------------------------------------------------------------------------------
# Forward against the PyTorch reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", MOD_KINDS)
@pytest.mark.parametrize("norm", NORMS)
def test_forward_matches_reference(dtype, kind, norm):
    g = gen(1)
    B, N, D = 2, 37, 1000
    x = randn(B, N, D, dtype=dtype, g=g, scale=2.0, offset=0.3)
    scale, shift = make_mod(kind, B, N, D, 2, dtype, g)
    y = ops.adaln(x, scale, shift, norm=norm)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    ref = ops.adaln_reference(x.double(), scale.double(), shift.double(), norm=norm)
    assert rel_err(y, ref) < TOL[dtype], f"seed {SEED}"


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("affine_dtype", [torch.float32, None])
def test_forward_affine_fp32_modulation(norm, affine_dtype):
    """bf16 activations with fp32 modulation (Wan) and fp32 or bf16 weight/bias."""
    g = gen(2)
    B, N, D = 3, 19, 136
    x = randn(B, N, D, dtype=torch.bfloat16, g=g)
    scale, shift = make_mod("chunk_bn6d", B, N, D, 2, torch.float32, g)
    adt = affine_dtype or torch.bfloat16
    w = randn(D, dtype=adt, g=g, scale=0.3, offset=1.0)
    b = randn(D, dtype=adt, g=g, scale=0.3)
    y = ops.adaln(x, scale, shift, weight=w, bias=b, norm=norm, eps=1e-5)
    assert y.dtype == torch.bfloat16
    ref = ops.adaln_reference(
        x.double(), scale.double(), shift.double(), weight=w.double(), bias=b.double(),
        norm=norm, eps=1e-5,
    )
    assert rel_err(y, ref) < TOL[torch.bfloat16]


def test_statistics_outputs():
    g = gen(3)
    x = randn(2, 9, 33, g=g, scale=3.0, offset=1.5)
    s, t = make_mod("per_sample", 2, 9, 33, 2, torch.float64, g)
    for norm in NORMS:
        _, mean, rstd = torch.ops.ditscale.adaln_fwd(x, s, t, None, None, norm, 1e-6)
        assert mean.shape == (2, 9) and mean.dtype == torch.float32
        if norm == "layernorm":
            torch.testing.assert_close(mean, x.mean(-1).float())
            var = x.var(-1, unbiased=False)
        else:
            assert torch.count_nonzero(mean) == 0
            var = x.pow(2).mean(-1)
        torch.testing.assert_close(rstd, (var + 1e-6).rsqrt().float())


@pytest.mark.parametrize("kind", ["per_sample", "chunk_b6d", "per_token", "chunk_bn6d"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gated_forward_matches_reference(kind, norm, dtype):
    g = gen(4)
    B, N, D = 2, 21, 1000
    res = randn(B, N, D, dtype=dtype, g=g)
    branch = randn(B, N, D, dtype=dtype, g=g)
    gate, scale, shift = make_mod(kind, B, N, D, 3, dtype, g)
    h, y = ops.adaln_gated(res, gate, branch, scale, shift, norm=norm)
    h_ref, y_ref = ops.adaln_gated_reference(
        res.double(), gate.double(), branch.double(), scale.double(), shift.double(), norm=norm
    )
    assert rel_err(h, h_ref) < TOL[dtype] and rel_err(y, y_ref) < TOL[dtype]


def test_noncontiguous_x_and_expanded_modulation():
    g = gen(5)
    B, N, D = 2, 11, 24
    base = randn(B, D, N, g=g)
    x = base.transpose(1, 2)  # last-dim stride != 1: copied by the op
    x_rows = randn(B, 2 * N, D, g=g)[:, ::2]  # strided rows, contiguous last dim: read in place
    s = randn(B, D, g=g).unsqueeze(1).expand(B, N, D)  # stride 0 along N
    t = randn(1, N, D, g=g).expand(B, N, D)  # stride 0 along B
    for xx in (x, x_rows):
        y = ops.adaln(xx, s, t)
        ref = ops.adaln_reference(xx, s, t)
        assert rel_err(y, ref) < 1e-12


def test_empty_and_tiny_shapes():
    x = torch.randn(2, 0, 8, dtype=torch.float64)
    s = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    xx = x.clone().requires_grad_()
    y = ops.adaln(xx, s, s.detach().clone())
    assert y.shape == (2, 0, 8)
    y.sum().backward()
    assert torch.count_nonzero(s.grad) == 0
    x1 = torch.randn(3, 4, 1, dtype=torch.float64)  # D = 1: layernorm output is shift
    s1, t1 = torch.randn(3, 1, dtype=torch.float64), torch.randn(3, 1, dtype=torch.float64)
    torch.testing.assert_close(ops.adaln(x1, s1, t1), ops.adaln_reference(x1, s1, t1))


# ------------------------------------------------------------------------------------------
# Errors


def test_errors_name_the_argument():
    x = torch.randn(2, 5, 8)
    s = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"scale must be per sample \[B, D\]"):
        torch.ops.ditscale.adaln_fwd(x, torch.randn(2, 7), s, None, None, "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match=r"shift must have x's dtype"):
        torch.ops.ditscale.adaln_fwd(x, s, s.half(), None, None, "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match=r"norm must be \"layernorm\" or \"rmsnorm\""):
        torch.ops.ditscale.adaln_fwd(x, s, s, None, None, "batchnorm", 1e-6)
    with pytest.raises(ValueError, match="norm must be one of"):
        ops.adaln(x, s, s, norm="batchnorm")
    with pytest.raises(RuntimeError, match=r"eps must be finite and > 0"):
        torch.ops.ditscale.adaln_fwd(x, s, s, None, None, "layernorm", 0.0)
    with pytest.raises(RuntimeError, match=r"x must be bfloat16, float16, float32 or float64"):
        torch.ops.ditscale.adaln_fwd(x.int(), s, s, None, None, "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match=r"x must be \[B, N, D\]"):
        torch.ops.ditscale.adaln_fwd(x[0], s, s, None, None, "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match=r"weight must be \[D\] = \[8\]"):
        torch.ops.ditscale.adaln_fwd(x, s, s, torch.ones(9), None, "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match=r"weight and bias must have the same dtype"):
        torch.ops.ditscale.adaln_fwd(
            x.double(), s, s, torch.ones(8), torch.zeros(8, dtype=torch.float64),
            "layernorm", 1e-6,
        )
    with pytest.raises(RuntimeError, match=r"branch must have x's shape"):
        torch.ops.ditscale.adaln_gated_fwd(
            x, s, torch.randn(2, 4, 8), s, s, None, None, "layernorm", 1e-6
        )
    y, mean, rstd = torch.ops.ditscale.adaln_fwd(x, s, s, None, None, "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match=r"rstd must be float32"):
        torch.ops.ditscale.adaln_bwd(y, x, s, s, None, None, mean, rstd.double(), "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match=r"mean must be \[B, N\] = \[2, 5\]"):
        torch.ops.ditscale.adaln_bwd(y, x, s, s, None, None, mean[:, :3], rstd, "layernorm", 1e-6)


def _op_args(name, B=2, N=5, D=8, K=6):
    """Valid arguments of torch.ops.ditscale.<name> on the CPU, as an ordered dict (schema
    order; tensors and None for the optional ones)."""
    x, r = torch.randn(B, N, D), torch.randn(B, N, D)
    s, t = torch.randn(B, D), torch.randn(B, N, D)
    mod, w = torch.randn(B, K, D), torch.randn(D)
    mean, rstd = torch.zeros(B, N), torch.ones(B, N)
    table = {
        "adaln_fwd": dict(x=x, scale=s, shift=t, weight=w, bias=w, norm="layernorm", eps=1e-6),
        "adaln_bwd": dict(dy=r, x=x, scale=s, shift=t, weight=w, bias=w, mean=mean, rstd=rstd,
                          norm="layernorm", eps=1e-6),
        "adaln_mod_fwd": dict(x=x, mod=mod, scale_index=1, shift_index=0, weight=w, bias=None,
                              norm="rmsnorm", eps=1e-6),
        "adaln_mod_bwd": dict(dy=r, x=x, mod=mod, scale_index=1, shift_index=0, weight=w,
                              bias=None, mean=mean, rstd=rstd, norm="rmsnorm", eps=1e-6),
        "adaln_gated_fwd": dict(residual=x, gate=s, branch=r, scale=t, shift=s, weight=w,
                                bias=None, norm="layernorm", eps=1e-6),
        "adaln_gated_bwd": dict(dh=r, dy=r, residual=x, gate=s, branch=r, scale=t, shift=s,
                                weight=None, bias=w, mean=mean, rstd=rstd, norm="layernorm",
                                eps=1e-6),
        "adaln_gated_mod_fwd": dict(residual=x, branch=r, mod=mod, gate_index=2, scale_index=1,
                                    shift_index=0, weight=None, bias=None, norm="layernorm",
                                    eps=1e-6),
        "adaln_gated_mod_bwd": dict(dh=r, dy=r, residual=x, branch=r, mod=mod, gate_index=2,
                                    scale_index=1, shift_index=0, weight=w, bias=w, mean=mean,
                                    rstd=rstd, norm="layernorm", eps=1e-6),
    }
    return table[name]


OP_NAMES = ["adaln_fwd", "adaln_bwd", "adaln_mod_fwd", "adaln_mod_bwd", "adaln_gated_fwd",
            "adaln_gated_bwd", "adaln_gated_mod_fwd", "adaln_gated_mod_bwd"]


def _call(name, args):
    return getattr(torch.ops.ditscale, name)(*args.values())


@pytest.mark.parametrize("name", OP_NAMES)
def test_mixed_devices_raise_naming_the_argument_and_both_devices(name):
    """One tensor on meta among CPU tensors (the meta kernel runs): a RuntimeError as PyTorch's
    own ops raise, for every tensor argument of every op, instead of uninitialised outputs."""
    base = _op_args(name)
    tensors = [k for k, v in base.items() if isinstance(v, torch.Tensor)]
    first = tensors[0]
    _call(name, base)  # valid on the CPU
    for arg in tensors:
        args = dict(base)
        args[arg] = args[arg].to("meta")
        if arg == first:  # the reference device is the first tensor's: the second one differs
            other, want = tensors[1], f"got {tensors[1]} on cpu, different from {first} on meta"
        else:
            other, want = arg, f"got {arg} on meta, different from {first} on cpu"
        with pytest.raises(RuntimeError) as e:
            _call(name, args)
        msg = str(e.value)
        assert f"ditscale::{name}: expected all tensors to be on the same device" in msg, msg
        assert want in msg, (other, msg)


@pytest.mark.parametrize("name", OP_NAMES)
def test_meta_tensors_give_the_outputs_of_the_cpu_op(name):
    base = _op_args(name)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in base.items()}
    got, want = _call(name, meta), _call(name, base)
    for g, w in zip(got, want):
        assert g.device.type == "meta" and g.shape == w.shape and g.dtype == w.dtype


def test_wrappers_raise_on_mixed_devices():
    x, s = torch.randn(2, 5, 8), torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="got shift on meta, different from x on cpu"):
        ops.adaln(x, s, s.to("meta"))
    with pytest.raises(RuntimeError, match="got gate on meta, different from residual on cpu"):
        ops.adaln_gated(x, s.to("meta"), x, s, s)
    w = torch.ones(8, device="meta")
    with pytest.raises(RuntimeError, match="got weight on meta, different from x on cpu"):
        ops.adaln(x, s, s, weight=w)


# (op, argument, bad value, text of the error): each raised alike by the CPU op and by the meta
# (fake) kernel, whose checks mirror the op's.
_BAD_ARGS = [
    ("adaln_fwd", "x", lambda a: a["x"].int(), "x must be bfloat16, float16, float32 or float64"),
    ("adaln_fwd", "x", lambda a: a["x"][0], "x must be [B, N, D], got shape [5, 8]"),
    ("adaln_fwd", "scale", lambda a: torch.randn(2, 7),
     "scale must be per sample [B, D] = [2, 8] or per token [B, N, D] = [2, 5, 8], got [2, 7]"),
    ("adaln_fwd", "shift", lambda a: a["shift"].half(),
     "shift must have x's dtype (Float) or float32, got Half"),
    ("adaln_fwd", "weight", lambda a: torch.ones(9), "weight must be [D] = [8], got [9]"),
    ("adaln_fwd", "bias", lambda a: torch.ones(8, dtype=torch.float64),
     "bias must have x's dtype (Float) or float32, got Double"),
    ("adaln_fwd", "norm", lambda a: "batchnorm",
     'norm must be "layernorm" or "rmsnorm", got "batchnorm"'),
    ("adaln_bwd", "dy", lambda a: torch.randn(2, 4, 8),
     "dy must have x's shape [B, N, D] = [2, 5, 8], got [2, 4, 8]"),
    ("adaln_bwd", "dy", lambda a: a["dy"].double(), "dy must have x's dtype Float, got Double"),
    ("adaln_bwd", "mean", lambda a: a["mean"][:, :3],
     "mean must be [B, N] = [2, 5] (from the forward), got [2, 3]"),
    ("adaln_bwd", "rstd", lambda a: a["rstd"].double(), "rstd must be float32, got Double"),
    ("adaln_mod_fwd", "scale_index", lambda a: 6, "scale_index = 6 is outside mod's K = 6 rows"),
    ("adaln_mod_fwd", "shift_index", lambda a: 1,
     "scale_index and shift_index are both 1 (each modulation must be a different row of mod)"),
    ("adaln_mod_bwd", "mod", lambda a: a["mod"][:, :, :4],
     "mod must be [B, K, D] with B = 2 and D = 8, got [2, 6, 4]"),
    ("adaln_gated_fwd", "branch", lambda a: torch.randn(2, 4, 8),
     "branch must have x's shape [B, N, D] = [2, 5, 8], got [2, 4, 8]"),
    ("adaln_gated_fwd", "gate", lambda a: torch.randn(2, 1, 8),
     "gate must be per sample [B, D] = [2, 8] or per token [B, N, D] = [2, 5, 8], got [2, 1, 8]"),
    ("adaln_gated_bwd", "dh", lambda a: torch.randn(2, 5, 9),
     "dh must have x's shape [B, N, D] = [2, 5, 8], got [2, 5, 9]"),
    ("adaln_gated_mod_fwd", "gate_index", lambda a: -1,
     "gate_index = -1 is outside mod's K = 6 rows"),
    ("adaln_gated_mod_bwd", "gate_index", lambda a: 0,
     "shift_index and gate_index are both 0"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name,arg,bad,text", _BAD_ARGS, ids=[f"{c[0]}-{c[1]}" for c in _BAD_ARGS])
def test_bad_arguments_raise_naming_them_on_cpu_and_meta(device, name, arg, bad, text):
    args = _op_args(name)
    args[arg] = bad(args)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(RuntimeError) as e:
        _call(name, args)
    assert f"ditscale::{name}: {text}" in str(e.value), str(e.value)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan"), float("inf"), 1e-40, 1e31])
@pytest.mark.parametrize("name", OP_NAMES)
def test_eps_out_of_range_raises_naming_it(device, eps, name):
    args = _op_args(name)
    args["eps"] = eps
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(RuntimeError) as e:
        _call(name, args)
    want = f"ditscale::{name}: eps: {eps:.6g} is out of range [1e-30, 1e+30]"
    assert want in str(e.value), str(e.value)


def test_wrappers_and_module_check_eps_and_dim():
    x, s = torch.randn(2, 5, 8), torch.randn(2, 8)
    for eps in (0.0, float("nan"), 1e31):
        want = re.escape(f"eps: {eps:.6g} is out of range [1e-30, 1e+30]")
        with pytest.raises(ValueError, match=want):
            ops.adaln(x, s, s, eps=eps)
        with pytest.raises(ValueError, match=r"eps: .* is out of range"):
            ops.adaln_gated(x, s, x, s, s, eps=eps)
        with pytest.raises(ValueError, match=r"AdaLayerNorm: eps: .* is out of range"):
            dnn.AdaLayerNorm(8, eps=eps)
    with pytest.raises(ValueError, match=r"AdaLayerNorm: dim: 0 is out of range \[1, "):
        dnn.AdaLayerNorm(0)
    with pytest.raises(TypeError, match="AdaLayerNorm: dim: expected an integer"):
        dnn.AdaLayerNorm(8.5)
    assert ops.adaln(x, s, s, eps=1e-30).shape == x.shape  # the range's ends are accepted
    assert ops.adaln(x, s, s, eps=1e30).shape == x.shape


# ------------------------------------------------------------------------------------------
# Autograd


def _gradcheck(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=False)


@pytest.mark.parametrize("kind", ["per_sample", "chunk_b6d", "per_token", "chunk_bn6d"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("affine", [False, True])
def test_gradcheck_adaln(kind, norm, affine):
    g = gen(6)
    B, N, D = 2, 3, 5
    x = randn(B, N, D, g=g, scale=1.5).requires_grad_()
    if kind.startswith("chunk"):
        packed = (randn(B, 6, D, g=g) if kind == "chunk_b6d" else randn(B, N, 6 * D, g=g))
        packed.requires_grad_()
        mods = (packed,)

        def split(p):
            parts = make_mod_from(kind, p)
            return parts[1], parts[0]  # scale, shift
    else:
        s, t = make_mod(kind, B, N, D, 2, torch.float64, g)
        mods = (s.requires_grad_(), t.requires_grad_())

        def split(s, t):
            return s, t

    extra = ()
    if affine:
        extra = (randn(D, g=g, offset=1.0).requires_grad_(), randn(D, g=g).requires_grad_())

    def fn(x, *rest):
        m, aff = rest[: len(mods)], rest[len(mods):]
        scale, shift = split(*m)
        w, b = aff if aff else (None, None)
        return ops.adaln(x, scale, shift, weight=w, bias=b, norm=norm)

    _gradcheck(fn, (x, *mods, *extra))


def make_mod_from(kind, packed):
    if kind == "chunk_b6d":
        return [packed[:, i] for i in range(6)]
    return list(packed.chunk(6, dim=2))


@pytest.mark.parametrize("kind", ["per_sample", "per_token", "chunk_b6d"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("outputs", ["both", "h", "y"])
def test_gradcheck_adaln_gated(kind, norm, outputs):
    g = gen(7)
    B, N, D = 2, 3, 4
    res = randn(B, N, D, g=g).requires_grad_()
    branch = randn(B, N, D, g=g).requires_grad_()
    if kind == "chunk_b6d":
        packed = randn(B, 6, D, g=g).requires_grad_()
        mods = (packed,)

        def split(p):
            return p[:, 2], p[:, 1], p[:, 0]  # gate, scale, shift (strided views)
    else:
        mods = tuple(m.requires_grad_() for m in make_mod(kind, B, N, D, 3, torch.float64, g))

        def split(gt, s, t):
            return gt, s, t

    w = randn(D, g=g, offset=1.0).requires_grad_()

    def fn(res, branch, w, *m):
        gate, scale, shift = split(*m)
        h, y = ops.adaln_gated(res, gate, branch, scale, shift, weight=w, norm=norm)
        return {"both": (h, y), "h": (h,), "y": (y,)}[outputs]

    _gradcheck(fn, (res, branch, w, *mods))


def test_backward_matches_reference_autograd_fp32():
    """Gradients of the op vs autograd through the PyTorch reference (fp32, D=1000)."""
    g = gen(8)
    B, N, D = 2, 13, 1000
    x = randn(B, N, D, dtype=torch.float32, g=g)
    packed = randn(B, N, 6 * D, dtype=torch.float32, g=g, scale=0.5)
    w = randn(D, dtype=torch.float32, g=g, offset=1.0)
    b = randn(D, dtype=torch.float32, g=g)
    dy = randn(B, N, D, dtype=torch.float32, g=g)
    grads = []
    for fn, prec in ((ops.adaln, torch.float32), (ops.adaln_reference, torch.float64)):
        leaves = [t.detach().to(prec).requires_grad_() for t in (x, packed, w, b)]
        shift, scale = leaves[1].chunk(6, 2)[:2]
        y = fn(leaves[0], scale, shift, weight=leaves[2], bias=leaves[3])
        y.backward(dy.to(prec))
        grads.append([t.grad for t in leaves])
    for got, ref in zip(*grads):
        assert rel_err(got, ref) < 1e-5


# ------------------------------------------------------------------------------------------
# Fake kernels, opcheck, torch.compile


def _opcheck_args():
    g = gen(9)
    B, N, D = 2, 4, 8
    x = randn(B, N, D, g=g, dtype=torch.float32)
    s = randn(B, D, g=g, dtype=torch.float32)
    t = randn(B, N, D, g=g, dtype=torch.float32)
    w = randn(D, g=g, dtype=torch.float32)
    return x, s, t, w


def test_opcheck_forward_ops():
    x, s, t, w = _opcheck_args()
    for args in (
        (x, s, t, None, None, "layernorm", 1e-6),
        (x.requires_grad_(), s.requires_grad_(), t.requires_grad_(), w, w, "rmsnorm", 1e-5),
    ):
        torch.library.opcheck(torch.ops.ditscale.adaln_fwd.default, args)
    gate = torch.randn(2, 8, requires_grad=True)
    torch.library.opcheck(
        torch.ops.ditscale.adaln_gated_fwd.default,
        (x, gate, torch.randn_like(x), s, t, w, None, "layernorm", 1e-6),
    )


def test_opcheck_packed_modulation_ops():
    x, _, _, w = _opcheck_args()
    mod = torch.randn(2, 6, 8, requires_grad=True)
    for args in (
        (x, mod, 1, 0, None, None, "layernorm", 1e-6),
        (x.requires_grad_(), mod, 4, 3, w, w, "rmsnorm", 1e-5),
    ):
        torch.library.opcheck(torch.ops.ditscale.adaln_mod_fwd.default, args)
    x, mod = x.detach(), mod.detach()  # the backward op itself has no autograd formula
    y, mean, rstd = torch.ops.ditscale.adaln_mod_fwd(x, mod, 1, 0, w, None, "layernorm", 1e-6)
    torch.library.opcheck(
        torch.ops.ditscale.adaln_mod_bwd.default,
        (torch.randn_like(y), x, mod, 1, 0, w, None, mean, rstd, "layernorm", 1e-6),
    )


def test_opcheck_gated_packed_modulation_ops():
    x, _, _, w = _opcheck_args()
    branch = torch.randn_like(x)
    mod = torch.randn(2, 6, 8, requires_grad=True)
    torch.library.opcheck(
        torch.ops.ditscale.adaln_gated_mod_fwd.default,
        (x.requires_grad_(), branch, mod, 2, 1, 0, w, None, "layernorm", 1e-6),
    )
    x, mod = x.detach(), mod.detach()  # the backward op itself has no autograd formula
    h, y, mean, rstd = torch.ops.ditscale.adaln_gated_mod_fwd(
        x, branch, mod, 5, 4, 3, None, None, "rmsnorm", 1e-6
    )
    for dh in (None, torch.randn_like(h)):
        torch.library.opcheck(
            torch.ops.ditscale.adaln_gated_mod_bwd.default,
            (dh, torch.randn_like(y), x, branch, mod, 5, 4, 3, None, None, mean, rstd, "rmsnorm",
             1e-6),
        )


def test_opcheck_backward_ops():
    x, s, t, w = _opcheck_args()
    y, mean, rstd = torch.ops.ditscale.adaln_fwd(x, s, t, w, None, "layernorm", 1e-6)
    dy = torch.randn_like(y)
    torch.library.opcheck(
        torch.ops.ditscale.adaln_bwd.default,
        (dy, x, s, t, w, None, mean, rstd, "layernorm", 1e-6),
    )
    gate = torch.randn(2, 8)
    torch.library.opcheck(
        torch.ops.ditscale.adaln_gated_bwd.default,
        (None, dy, x, gate, torch.randn_like(x), s, t, None, None, mean, rstd, "rmsnorm", 1e-6),
    )


def test_fake_tensor_propagation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 1024, 96, dtype=torch.bfloat16)
        mod = torch.empty(3, 1024, 6 * 96, dtype=torch.float32)
        shift, scale = mod.chunk(6, 2)[:2]
        y, mean, rstd = torch.ops.ditscale.adaln_fwd(x, scale, shift, None, None, "rmsnorm", 1e-6)
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        assert mean.shape == (3, 1024) and rstd.dtype == torch.float32
        dx, ds, dt, dw, db = torch.ops.ditscale.adaln_bwd(
            y, x, scale, shift, None, None, mean, rstd, "rmsnorm", 1e-6
        )
        assert dx.shape == x.shape and ds.shape == scale.shape and ds.dtype == torch.float32
        assert dw.shape == (0,)
    # meta tensors take the same path
    xm = torch.empty(2, 5, 7, device="meta")
    sm = torch.empty(2, 7, device="meta")
    h, y, mean, rstd = torch.ops.ditscale.adaln_gated_fwd(
        xm, sm, xm, sm, sm, None, None, "layernorm", 1e-6
    )
    assert h.device.type == "meta" and y.shape == (2, 5, 7) and mean.shape == (2, 5)


class _Block(torch.nn.Module):
    """A DiT block reduced to its AdaLN-Zero skeleton (Wan 2.1 style [B, 6, D] modulation)."""

    def __init__(self, D):
        super().__init__()
        self.norm1 = dnn.AdaLayerNorm(D)
        self.norm2 = dnn.AdaLayerNorm(D, norm="rmsnorm", elementwise_affine=True)
        self.attn = torch.nn.Linear(D, D, dtype=torch.float64)
        self.mlp = torch.nn.Linear(D, D, dtype=torch.float64)
        self.norm2.weight.data = self.norm2.weight.data.double()

    def forward(self, x, e):
        shift1, scale1, gate1, shift2, scale2, gate2 = dnn.chunk_modulation(e, 6)
        a = self.attn(self.norm1(x, shift1, scale1))
        x, hn = self.norm2.forward_gated(x, gate1, a, shift2, scale2)
        return x + gate2.unsqueeze(1) * self.mlp(hn)


def _block_reference(block, x, e):
    shift1, scale1, gate1, shift2, scale2, gate2 = [t.unsqueeze(1) for t in e.unbind(1)]
    ln = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-6)
    a = block.attn(ln * (1 + scale1) + shift1)
    x = x + gate1 * a
    rms = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight=block.norm2.weight, eps=1e-6)
    return x + gate2 * block.mlp(rms * (1 + scale2) + shift2)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    g = gen(10)
    B, N, D = 2, 7, 16
    block = _Block(D)
    x = randn(B, N, D, g=g)
    e = randn(B, 6, D, g=g, scale=0.3)

    def run(f):
        xx, ee = x.clone().requires_grad_(), e.clone().requires_grad_()
        out = f(xx, ee)
        out.square().sum().backward()
        return out.detach(), xx.grad, ee.grad

    compiled = torch.compile(block, fullgraph=True, backend=backend)
    got = run(compiled)
    want = run(lambda a, b: _block_reference(block, a, b))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------
# Module


@pytest.mark.parametrize("affine", [False, True])
def test_adalayernorm_matches_diffusers_pattern(affine):
    g = gen(11)
    B, N, D = 2, 10, 64
    x = randn(B, N, D, dtype=torch.float32, g=g)
    emb = randn(B, 6 * D, dtype=torch.float32, g=g, scale=0.2)  # Flux / SD3 layout
    shift, scale, gate, *_ = dnn.chunk_modulation(emb, 6)
    ln = torch.nn.LayerNorm(D, elementwise_affine=affine, eps=1e-6)
    ours = dnn.AdaLayerNorm(D, eps=1e-6, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            ln.weight.copy_(torch.randn(D, generator=g))
            ln.bias.copy_(torch.randn(D, generator=g))
            ours.load_state_dict(ln.state_dict())
    want = ln(x) * (1 + scale[:, None]) + shift[:, None]
    torch.testing.assert_close(ours(x, shift, scale), want, rtol=1e-5, atol=1e-5)
    # [B, 1, D] modulation is accepted as well
    torch.testing.assert_close(ours(x, shift[:, None], scale[:, None]), want, rtol=1e-5, atol=1e-5)
    h, y = ours.forward_gated(x, gate, x.flip(1), shift, scale)
    h_want = x + gate[:, None] * x.flip(1)
    torch.testing.assert_close(h, h_want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        y, ln(h_want) * (1 + scale[:, None]) + shift[:, None], rtol=1e-5, atol=1e-5
    )
    assert "elementwise_affine" in repr(ours)


def test_chunk_modulation_layouts():
    B, N, D = 2, 5, 8
    m = torch.randn(B, 6, D)
    parts = dnn.chunk_modulation(m)
    assert len(parts) == 6 and parts[3].shape == (B, D)
    assert parts[3].data_ptr() == m[:, 3].data_ptr()  # views, no copy
    assert [p.shape for p in dnn.chunk_modulation(torch.randn(B, 6 * D))] == [(B, D)] * 6
    assert [p.shape for p in dnn.chunk_modulation(torch.randn(B, N, 6 * D))] == [(B, N, D)] * 6
    assert [p.shape for p in dnn.chunk_modulation(torch.randn(B, N, 6, D))] == [(B, N, D)] * 6
    with pytest.raises(ValueError):
        dnn.chunk_modulation(torch.randn(B, 7 * D + 1))
    with pytest.raises(ValueError):
        dnn.AdaLayerNorm(8, norm="groupnorm")
    with pytest.raises(ValueError, match=r"x must be \[B, N, 8\]"):
        dnn.AdaLayerNorm(8)(torch.randn(2, 3, 9), torch.randn(2, 9), torch.randn(2, 9))


# ------------------------------------------------------------------------------------------
# Packed modulation: scale and shift as rows of one tensor that requires grad


def _mod_edges(y):
    """Types of the autograd nodes y's node feeds (AccumulateGrad / SelectBackward0 / ...)."""
    return [type(f).__name__ if f is not None else None for f, _ in y.grad_fn.next_functions]


@pytest.mark.parametrize(
    "layout", ["b6d_select", "b6d_chunk_keepdim", "b6xd_chunk", "b1_b6d", "fp32_mod"]
)
def test_packed_modulation_routes_the_gradient_to_the_packed_tensor(layout):
    g = gen(12)
    B, N, D = (1 if layout == "b1_b6d" else 3), 5, 16
    x_dtype = torch.bfloat16 if layout == "fp32_mod" else torch.float32
    x = randn(B, N, D, g=g, dtype=x_dtype).requires_grad_()
    shape = (B, 6 * D) if layout == "b6xd_chunk" else (B, 6, D)
    mod = randn(*shape, g=g, dtype=torch.float32, scale=0.3).requires_grad_()

    def views(m):
        if layout == "b6xd_chunk":
            parts = m.chunk(6, dim=1)  # [B, D] views, Flux / SD3
        elif layout == "b6d_chunk_keepdim":
            parts = m.chunk(6, dim=1)  # [B, 1, D] views, Wan 2.1
        else:
            parts = [m[:, i] for i in range(6)]
        return parts[4], parts[3]  # scale, shift: rows 4 and 3

    y = ops.adaln(x, *views(mod), norm="layernorm")
    edges = _mod_edges(y)
    assert "AccumulateGrad" in edges and not any("Select" in str(e) for e in edges), edges
    dy = randn(B, N, D, g=g, dtype=x_dtype)
    dx, dmod = torch.autograd.grad(y, (x, mod), dy)
    # the same call through separate copies (the plain op and select_backward)
    x2 = x.detach().clone().requires_grad_()
    mod2 = mod.detach().clone().requires_grad_()
    scale2, shift2 = (t.clone() for t in views(mod2))
    y2 = ops.adaln(x2, scale2, shift2, norm="layernorm")
    assert not any("AccumulateGrad" == e for e in _mod_edges(y2)[1:]), _mod_edges(y2)
    dx2, dmod2 = torch.autograd.grad(y2, (x2, mod2), dy)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx2, rtol=0, atol=0)
    torch.testing.assert_close(dmod, dmod2, rtol=1e-12, atol=0)
    rows = dmod.view(B, 6, D)
    assert rows[:, [0, 1, 2, 5]].abs().max() == 0 and rows[:, 3].abs().max() > 0


def test_packed_modulation_falls_back_where_it_does_not_apply():
    g = gen(13)
    B, N, D = 2, 4, 8
    x = randn(B, N, D, g=g, dtype=torch.float32).requires_grad_()
    mod = randn(B, 6, D, g=g, dtype=torch.float32, scale=0.3)
    cases = {
        "base without grad": (mod[:, 1], mod[:, 0]),
        "same row": (mod.requires_grad_()[:, 1], mod[:, 1]),
        "per token": tuple(randn(B, N, 6 * D, g=g).float().requires_grad_().chunk(6, 2)[:2]),
        "different bases": (mod[:, 1], mod.detach().clone().requires_grad_()[:, 0]),
        "non-contiguous base": tuple(
            randn(B, D, 6, g=g).float().requires_grad_().transpose(1, 2)[:, i] for i in (1, 0)
        ),
    }
    for name, (scale, shift) in cases.items():
        y = ops.adaln(x, scale, shift)
        ref = ops.adaln_reference(x, scale, shift)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5, msg=name)
        if y.requires_grad:
            (y * y).sum().backward()  # the plain op's autograd runs
    with torch.no_grad():  # inference: the plain op, nothing to route
        y = ops.adaln(x, mod[:, 1], mod[:, 0])
        assert y.grad_fn is None


def test_packed_modulation_op_errors_name_the_argument():
    x = torch.randn(2, 3, 8)
    mod = torch.randn(2, 6, 8)
    with pytest.raises(RuntimeError, match="scale_index = 6 is outside mod's K = 6 rows"):
        torch.ops.ditscale.adaln_mod_fwd(x, mod, 6, 0, None, None, "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match="scale_index and shift_index are both 2"):
        torch.ops.ditscale.adaln_mod_fwd(x, mod, 2, 2, None, None, "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match=r"mod must be \[B, K, D\]"):
        torch.ops.ditscale.adaln_mod_fwd(x, mod[:, :, :4], 1, 0, None, None, "layernorm", 1e-6)


@pytest.mark.parametrize("outputs", ["both", "h", "y"])
def test_gated_packed_modulation_routes_the_gradient_to_the_packed_tensor(outputs):
    g = gen(14)
    B, N, D = 2, 5, 16
    res = randn(B, N, D, g=g, dtype=torch.float32).requires_grad_()
    branch = randn(B, N, D, g=g, dtype=torch.float32).requires_grad_()
    mod = randn(B, 6 * D, g=g, dtype=torch.float32, scale=0.3).requires_grad_()  # Flux layout
    w = randn(D, g=g, dtype=torch.float32, offset=1.0).requires_grad_()
    dh, dy = randn(B, N, D, g=g, dtype=torch.float32), randn(B, N, D, g=g, dtype=torch.float32)

    def run(res, branch, mod, views):
        shift, scale, gate = views(mod)
        h, y = ops.adaln_gated(res, gate, branch, scale, shift, weight=w, norm="rmsnorm")
        outs, grads = {"both": ((h, y), (dh, dy)), "h": ((h,), (dh,)), "y": ((y,), (dy,))}[
            outputs
        ]
        return h, y, torch.autograd.grad(outs, (res, branch, mod, w), grads)

    h, y, got = run(res, branch, mod, lambda m: m.chunk(6, dim=1)[3:6])
    assert "AccumulateGrad" in _mod_edges(h) and not any("Split" in str(e) for e in _mod_edges(h))
    h2, y2, want = run(res, branch, mod, lambda m: [c.clone() for c in m.chunk(6, dim=1)[3:6]])
    torch.testing.assert_close(h, h2, rtol=0, atol=0)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    for a, b, name in zip(got, want, ("dres", "dbranch", "dmod", "dweight")):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0, msg=name)
    rows = got[2].view(B, 6, D)
    assert rows[:, :3].abs().max() == 0
    assert rows[:, 5].abs().max() > 0  # dgate (row 5) reaches mod whichever output is used


def test_gated_packed_modulation_op_errors_name_the_argument():
    x = torch.randn(2, 3, 8)
    mod = torch.randn(2, 6, 8)
    with pytest.raises(RuntimeError, match="shift_index and gate_index are both 1"):
        torch.ops.ditscale.adaln_gated_mod_fwd(x, x, mod, 1, 2, 1, None, None, "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match="gate_index = -1 is outside mod's K = 6 rows"):
        torch.ops.ditscale.adaln_gated_mod_fwd(x, x, mod, -1, 2, 1, None, None, "layernorm", 1e-6)
