"""GPU tests of the fused AdaLN ops (CUDA kernels through torch.ops.ditscale.*).

Every dtype x modulation layout x variant against an fp64 reference (PyTorch, on the GPU) on
fresh random inputs, forward and backward; relative error ||out - ref|| / ||ref|| within
fp32 < 1e-5, fp16 < 2e-3, bf16 < 1e-2. Shapes include N not a multiple of any tile, D = 1000 (not
a multiple of the vector width) and the model sizes 1536/3072/5120; modulation as strided chunks
of [B, 6, D] / [B, N, 6D] and as stride-0 expanded views. Also: gradcheck (the CUDA kernels have
no fp64 path, so fp32 with tolerances for fp32 finite differences, plus an exact comparison with
the fp64 CPU op whose gradients are gradchecked in tests/python), bitwise determinism of the
backward, and forward peak memory (output + 8 bytes per row, nothing else).

Run: pytest -q tests/gpu/test_adaln_cuda.py   (skips without CUDA)
"""

import random

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from ditscale import nn as dnn  # noqa: E402
from ditscale import ops  # noqa: E402

SEED = random.randrange(1 << 30)
DEV = "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NORMS = ["layernorm", "rmsnorm"]
# (B, N, D): N prime / odd (no tile divides it), D = 1000 (general path), model widths.
SHAPES = [(2, 1031, 1000), (1, 4099, 3072), (3, 77, 1536), (1, 129, 5120), (2, 33, 8)]


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def gen(offset):
    return torch.Generator(device=DEV).manual_seed(SEED + offset)


def randn(*shape, dtype, g, scale=1.0, offset=0.0):
    t = torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32) * scale + offset
    return t.to(dtype)


KINDS = ["per_sample", "per_sample_fp32", "chunk_b6d", "per_token", "chunk_bn6d_fp32", "expanded"]
MOD_NAMES = ("shift", "scale", "gate")


def make_mods(kind, B, N, D, count, dtype, g):
    """Modulation in layout `kind`: (leaf tensors, a function leaves -> [shift, scale, gate])."""
    names = MOD_NAMES[:count]
    if kind in ("per_sample", "per_sample_fp32", "per_token", "expanded"):
        dt = torch.float32 if kind.endswith("fp32") else dtype
        shape = {"per_token": (B, N, D), "expanded": (B, 1, D)}.get(kind, (B, D))
        leaves = {n: randn(*shape, dtype=dt, g=g, scale=0.5) for n in names}
        if kind == "expanded":  # [B, N, D] views with stride 0 along N
            return leaves, lambda lv: [lv[n].expand(B, N, D) for n in names]
        return leaves, lambda lv: [lv[n] for n in names]
    if kind == "chunk_b6d":  # Wan 2.1: strided [B, D] views of [B, 6, D]
        leaves = {"mod": randn(B, 6, D, dtype=dtype, g=g, scale=0.5)}
        return leaves, lambda lv: [lv["mod"][:, i] for i in range(count)]
    if kind == "chunk_bn6d_fp32":  # Wan 2.2: per-token fp32 chunks of [B, N, 6D]
        leaves = {"mod": randn(B, N, 6 * D, dtype=torch.float32, g=g, scale=0.5)}
        return leaves, lambda lv: list(lv["mod"].chunk(6, 2))[:count]
    raise ValueError(kind)


def _make_case(variant, kind, dtype, shape, affine, g):
    """Leaf tensors of one case, a builder of the op's arguments, and output gradients."""
    B, N, D = shape
    gated = variant == "gated"
    leaves, mods = make_mods(kind, B, N, D, 3 if gated else 2, dtype, g)
    leaves["x"] = randn(B, N, D, dtype=dtype, g=g, scale=2.0, offset=0.5)
    if gated:
        leaves["branch"] = randn(B, N, D, dtype=dtype, g=g)
    if affine:
        leaves["weight"] = randn(D, dtype=torch.float32, g=g, scale=0.2, offset=1.0)
        leaves["bias"] = randn(D, dtype=torch.float32, g=g, scale=0.2)
    grads = [randn(B, N, D, dtype=dtype, g=g) for _ in range(2)]
    return leaves, mods, grads


def _run(variant, leaves, mods, norm, grads):
    """Runs the op (or the fp64 reference when the leaves are fp64); outputs and leaf grads."""
    reference = leaves["x"].dtype == torch.float64
    m = mods(leaves)
    kw = dict(weight=leaves.get("weight"), bias=leaves.get("bias"), norm=norm)
    if variant == "plain":
        f = ops.adaln_reference if reference else ops.adaln
        outs = (f(leaves["x"], m[1], m[0], **kw),)
    else:
        f = ops.adaln_gated_reference if reference else ops.adaln_gated
        outs = f(leaves["x"], m[2], leaves["branch"], m[1], m[0], **kw)
    torch.autograd.backward(outs, grads[: len(outs)])
    return [o.detach() for o in outs], {k: v.grad for k, v in leaves.items()}


def _leaves(leaves, dtype=None):
    return {k: v.detach().to(dtype or v.dtype).requires_grad_() for k, v in leaves.items()}


def _check_case(variant, kind, dtype, shape, norm, affine, seed_offset):
    g = gen(seed_offset)
    leaves, mods, grads = _make_case(variant, kind, dtype, shape, affine, g)
    outs, dgrads = _run(variant, _leaves(leaves), mods, norm, grads)
    routs, rgrads = _run(
        variant, _leaves(leaves, torch.float64), mods, norm, [x.double() for x in grads]
    )
    tol = TOL[dtype]
    where = f"seed={SEED} {variant} {kind} {dtype} {shape} {norm} affine={affine}"
    for o, r, name in zip(outs, routs, ("h", "y") if variant == "gated" else ("y",)):
        assert o.dtype == dtype and o.shape == r.shape
        assert rel_err(o, r) < tol, f"{name}: {rel_err(o, r):.3g} ({where})"
    for k, rg in rgrads.items():
        got = dgrads[k]
        assert got is not None, f"no gradient for {k} ({where})"
        assert got.dtype == leaves[k].dtype and got.shape == leaves[k].shape, (k, where)
        # an fp32 gradient of bf16/fp16 inputs carries the inputs' rounding: use x's bound
        assert rel_err(got, rg) < max(tol, 2e-5), f"d{k}: {rel_err(got, rg):.3g} ({where})"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["plain", "gated"])
@pytest.mark.parametrize("norm", NORMS)
def test_forward_backward_per_sample(shape, dtype, variant, norm):
    _check_case(variant, "per_sample", dtype, shape, norm, False, 1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["plain", "gated"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("affine", [False, True])
def test_layouts(kind, dtype, variant, norm, affine):
    _check_case(variant, kind, dtype, (2, 1031, 1000), norm, affine, 2)


def test_large_d_vector_path_affine():
    for dtype in DTYPES:
        _check_case("gated", "chunk_b6d", dtype, (2, 2053, 3072), "layernorm", True, 3)


def test_matches_cpu_fp64_op():
    """CUDA fp32 gradients vs the CPU op in fp64 (itself gradchecked by the CPU suite)."""
    g = gen(4)
    B, N, D = 2, 17, 40
    x = randn(B, N, D, dtype=torch.float32, g=g)
    mod = randn(B, 6, D, dtype=torch.float32, g=g, scale=0.5)
    br = randn(B, N, D, dtype=torch.float32, g=g)
    w = randn(D, dtype=torch.float32, g=g, offset=1.0)
    dh, dy = randn(B, N, D, dtype=torch.float32, g=g), randn(B, N, D, dtype=torch.float32, g=g)
    res = []
    for dev, dt in ((DEV, torch.float32), ("cpu", torch.float64)):
        leaves = [v.detach().to(dev, dt).requires_grad_() for v in (x, mod, br, w)]
        h, y = ops.adaln_gated(leaves[0], leaves[1][:, 2], leaves[2], leaves[1][:, 1],
                               leaves[1][:, 0], weight=leaves[3], norm="rmsnorm")
        torch.autograd.backward((h, y), (dh.to(dev, dt), dy.to(dev, dt)))
        res.append([h, y] + [v.grad for v in leaves])
    for a, b in zip(*res):
        assert rel_err(a.cpu(), b) < 1e-5


@pytest.mark.parametrize("variant", ["plain", "gated"])
def test_gradcheck_fp32_small(variant):
    """gradcheck on CUDA: fp32 (the kernels have no fp64 path), finite differences eps=1e-3."""
    g = gen(5)
    B, N, D = 2, 3, 6
    x = randn(B, N, D, dtype=torch.float32, g=g).requires_grad_()
    mod = randn(B, 6, D, dtype=torch.float32, g=g, scale=0.5).requires_grad_()
    br = randn(B, N, D, dtype=torch.float32, g=g).requires_grad_()

    def plain(x, mod):
        return ops.adaln(x, mod[:, 1], mod[:, 0])

    def gated(x, mod, br):
        return ops.adaln_gated(x, mod[:, 2], br, mod[:, 1], mod[:, 0], norm="rmsnorm")

    fn, inputs = (plain, (x, mod)) if variant == "plain" else (gated, (x, mod, br))
    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-3, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["per_sample", "chunk_bn6d_fp32"])
def test_backward_deterministic(kind):
    g = gen(6)
    B, N, D = 2, 8191, 3072
    leaves, mods, grads = _make_case("gated", kind, torch.bfloat16, (B, N, D), True, g)
    runs = [_run("gated", _leaves(leaves), mods, "layernorm", grads)[1] for _ in range(2)]
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), f"d{k} differs between two runs"


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("variant", ["plain", "gated"])
def test_forward_peak_memory(requires_grad, variant):
    """Peak memory above the inputs: the outputs plus 8 bytes per row (mean, rstd)."""
    B, N, D = 2, 4096, 3072
    g = gen(7)
    x = randn(B, N, D, dtype=torch.bfloat16, g=g).requires_grad_(requires_grad)
    br = randn(B, N, D, dtype=torch.bfloat16, g=g)
    mod = randn(B, 6, D, dtype=torch.bfloat16, g=g).requires_grad_(requires_grad)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if variant == "plain":
        out = ops.adaln(x, mod[:, 1], mod[:, 0])
        n_out = 1
    else:
        out = ops.adaln_gated(x, mod[:, 2], br, mod[:, 1], mod[:, 0])
        n_out = 2
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - base
    expected = n_out * x.numel() * x.element_size() + 8 * B * N
    assert expected <= above <= expected + 4 * 512, (above, expected)
    del out


def test_compile_on_cuda():
    torch._dynamo.reset()
    g = gen(8)
    B, N, D = 2, 301, 256
    norm = dnn.AdaLayerNorm(D).to(DEV)
    x = randn(B, N, D, dtype=torch.bfloat16, g=g)
    e = randn(B, 6, D, dtype=torch.float32, g=g, scale=0.3)

    def block(x, e):
        shift, scale, gate = dnn.chunk_modulation(e, 6)[:3]
        h, y = norm.forward_gated(x, gate, torch.tanh(x), shift, scale)
        return h + y

    for backend in ("aot_eager", "inductor"):
        f = torch.compile(block, fullgraph=True, backend=backend)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        outs = [f(xs[0], e), block(xs[1], e)]
        for o in outs:
            o.float().square().sum().backward()
        torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=2e-2, atol=5e-2)


def test_device_mismatch_is_an_error():
    x = torch.randn(2, 3, 8, device=DEV)
    with pytest.raises(RuntimeError, match=r"got scale on cpu, different from x on cuda:0"):
        torch.ops.ditscale.adaln_fwd(x, torch.randn(2, 8), x[:, 0], None, None, "layernorm", 1e-6)
    # x on the CPU, the rest on the GPU: the CUDA kernel runs and names x's device
    with pytest.raises(RuntimeError, match=r"got scale on cuda:0, different from x on cpu"):
        torch.ops.ditscale.adaln_fwd(x.cpu(), x[:, 0], x[:, 0], None, None, "layernorm", 1e-6)
    with pytest.raises(RuntimeError, match=r"float64, which only the CPU implementation"):
        xd = x.double()
        torch.ops.ditscale.adaln_fwd(xd, xd[:, 0], xd[:, 0], None, None, "layernorm", 1e-6)


def test_every_op_checks_the_devices_of_all_its_tensors():
    """One device check of all tensor arguments in the CUDA op bodies (adaln_impl.h): each
    tensor argument of each op moved to the CPU in turn."""
    B, N, D, K = 2, 5, 8, 6
    x, r, t = (torch.randn(B, N, D, device=DEV) for _ in range(3))
    s, mod = torch.randn(B, D, device=DEV), torch.randn(B, K, D, device=DEV)
    w = torch.ones(D, device=DEV)
    mean, rstd = torch.zeros(B, N, device=DEV), torch.ones(B, N, device=DEV)
    calls = {
        "adaln_fwd": dict(x=x, scale=s, shift=t, weight=w, bias=w, norm="layernorm", eps=1e-6),
        "adaln_bwd": dict(dy=r, x=x, scale=s, shift=t, weight=w, bias=w, mean=mean, rstd=rstd,
                          norm="layernorm", eps=1e-6),
        "adaln_mod_fwd": dict(x=x, mod=mod, si=1, hi=0, weight=w, bias=None, norm="rmsnorm",
                              eps=1e-6),
        "adaln_mod_bwd": dict(dy=r, x=x, mod=mod, si=1, hi=0, weight=w, bias=None, mean=mean,
                              rstd=rstd, norm="rmsnorm", eps=1e-6),
        "adaln_gated_fwd": dict(residual=x, gate=s, branch=r, scale=t, shift=s, weight=w,
                                bias=None, norm="layernorm", eps=1e-6),
        "adaln_gated_bwd": dict(dh=r, dy=r, residual=x, gate=s, branch=r, scale=t, shift=s,
                                weight=None, bias=w, mean=mean, rstd=rstd, norm="layernorm",
                                eps=1e-6),
        "adaln_gated_mod_fwd": dict(residual=x, branch=r, mod=mod, gi=2, si=1, hi=0, weight=None,
                                    bias=None, norm="layernorm", eps=1e-6),
        "adaln_gated_mod_bwd": dict(dh=r, dy=r, residual=x, branch=r, mod=mod, gi=2, si=1, hi=0,
                                    weight=w, bias=w, mean=mean, rstd=rstd, norm="layernorm",
                                    eps=1e-6),
    }
    for name, args in calls.items():
        op = getattr(torch.ops.ditscale, name)
        op(*args.values())  # valid on the GPU
        tensors = [k for k, v in args.items() if isinstance(v, torch.Tensor)]
        for arg in tensors[1:]:
            bad = dict(args)
            bad[arg] = bad[arg].cpu()
            with pytest.raises(RuntimeError) as e:
                op(*bad.values())
            want = f"ditscale::{name}: expected all tensors to be on the same device, but got " \
                   f"{arg} on cpu, different from {tensors[0]} on cuda:0"
            assert want in str(e.value), str(e.value)


@pytest.mark.parametrize("D", [1536, 5120])
def test_packed_modulation_matches_separate_tensors_bitwise(D):
    """scale / shift as rows of one [B, 6, D] tensor that requires grad take adaln_mod_fwd (its
    gradient written by the backward's reduction into the rows): same kernels, same bits as the
    op on separate [B, D] tensors; the other rows of the gradient are zero."""
    g = gen(9)
    B, N = 2, 4099
    x = randn(B, N, D, dtype=torch.bfloat16, g=g, scale=2.0, offset=0.5)
    mod = randn(B, 6, D, dtype=torch.bfloat16, g=g, scale=0.5)
    dy = randn(B, N, D, dtype=torch.bfloat16, g=g)
    xp, mp = x.clone().requires_grad_(), mod.clone().requires_grad_()
    yp = ops.adaln(xp, mp[:, 1], mp[:, 0])
    dxp, dmod = torch.autograd.grad(yp, (xp, mp), dy)
    xs = x.clone().requires_grad_()
    scale, shift = mod[:, 1].clone().requires_grad_(), mod[:, 0].clone().requires_grad_()
    ys = ops.adaln(xs, scale, shift)
    dxs, dscale, dshift = torch.autograd.grad(ys, (xs, scale, shift), dy)
    assert torch.equal(yp, ys) and torch.equal(dxp, dxs)
    assert torch.equal(dmod[:, 1], dscale) and torch.equal(dmod[:, 0], dshift)
    assert not dmod[:, 2:].any()
    dmod2 = torch.autograd.grad(ops.adaln(xp, mp[:, 1], mp[:, 0]), mp, dy)[0]
    assert torch.equal(dmod, dmod2), "packed backward is not bitwise deterministic"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_packed_modulation_matches_separate_tensors_bitwise(dtype):
    """gate / scale / shift as rows of one [B, 6D] tensor (Flux layout) that requires grad take
    adaln_gated_mod_fwd: same kernels and bits as the gated op on separate tensors; dmod holds
    dgate / dscale / dshift in those rows and zeros elsewhere."""
    g = gen(10)
    B, N, D = 2, 1031, 3072
    res = randn(B, N, D, dtype=dtype, g=g, scale=2.0, offset=0.5)
    branch = randn(B, N, D, dtype=dtype, g=g)
    mod = randn(B, 6 * D, dtype=dtype, g=g, scale=0.5)
    dh, dy = randn(B, N, D, dtype=dtype, g=g), randn(B, N, D, dtype=dtype, g=g)

    def run(views):
        r, b = res.clone().requires_grad_(), branch.clone().requires_grad_()
        m = mod.clone().requires_grad_()
        leaves = views(m)
        shift, scale, gate = leaves
        h, y = ops.adaln_gated(r, gate, b, scale, shift)
        grads = torch.autograd.grad((h, y), (r, b, m, *leaves), (dh, dy), allow_unused=True)
        return h, y, grads

    hp, yp, (drp, dbp, dmod, *_) = run(lambda m: list(m.chunk(6, dim=1)[3:6]))
    hs, ys, (drs, dbs, dm_unused, dshift, dscale, dgate) = run(
        lambda m: [c.detach().clone().requires_grad_() for c in m.chunk(6, dim=1)[3:6]]
    )
    assert dm_unused is None
    assert torch.equal(hp, hs) and torch.equal(yp, ys)
    assert torch.equal(drp, drs) and torch.equal(dbp, dbs)
    rows = dmod.view(B, 6, D)
    assert torch.equal(rows[:, 3], dshift) and torch.equal(rows[:, 4], dscale)
    assert torch.equal(rows[:, 5], dgate) and not rows[:, :3].any()
