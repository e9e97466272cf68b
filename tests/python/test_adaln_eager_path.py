"""The eager path of ditscale.ops.adaln / adaln_gated (CPU): the forward ops' autograd is C++
(ditscale/torch/adaln_autograd.cc, the Autograd dispatch key). Checked against

- the registered ops called directly, packed as ops.adaln packs (the wrappers' own logic);
- the previous Python autograd, kept here as the reference (``PyAutograd``: a
  torch.autograd.Function per forward op calling the op below autograd, saving the same tensors
  and calling the same backward op): bit-identical outputs and gradients for every op (separate
  and packed modulation, affine, rmsnorm, per-token modulation, gated with one or both outputs
  used), the same saved tensors;

and: no graph without grad, saved tensors released after backward and version-checked, the rows
API (ops.adaln_rows / adaln_gated_rows) against the views, and the bench script's pieces.
"""

import pytest

torch = pytest.importorskip("torch")

from ditscale import ops  # noqa: E402

if not ops.is_available():
    pytest.skip(f"ditscale ops unavailable: {ops.load_error()}", allow_module_level=True)

B, N, D = 2, 5, 16


# ---- the previous Python autograd of the forward ops (the reference of the C++ one) ----------

def _affine(weight, bias, dweight, dbias):
    return (dweight if weight is not None else None, dbias if bias is not None else None)


def _keep(ctx, norm, eps, mean, rstd):
    ctx.norm, ctx.eps = norm, eps
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _fwd(ctx, x, scale, shift, weight, bias, norm, eps):
    out = _below("adaln_fwd", x, scale, shift, weight, bias, norm, eps)
    ctx.save_for_backward(x, scale, shift, weight, bias, *out[1:])
    _keep(ctx, norm, eps, *out[1:])
    return out


def _fwd_bwd(ctx, dy, _m, _r):
    x, scale, shift, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:
        return (None,) * 7
    dx, ds, dt, dw, db = torch.ops.ditscale.adaln_bwd(dy, x, scale, shift, weight, bias, mean,
                                                       rstd, ctx.norm, ctx.eps)
    return dx, ds, dt, *_affine(weight, bias, dw, db), None, None


def _mod(ctx, x, mod, si, ti, weight, bias, norm, eps):
    out = _below("adaln_mod_fwd", x, mod, si, ti, weight, bias, norm, eps)
    ctx.save_for_backward(x, mod, weight, bias, *out[1:])
    ctx.rows = (si, ti)
    _keep(ctx, norm, eps, *out[1:])
    return out


def _mod_bwd(ctx, dy, _m, _r):
    x, mod, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:
        return (None,) * 8
    dx, dmod, dw, db = torch.ops.ditscale.adaln_mod_bwd(dy, x, mod, *ctx.rows, weight, bias,
                                                         mean, rstd, ctx.norm, ctx.eps)
    return dx, dmod, None, None, *_affine(weight, bias, dw, db), None, None


def _gated(ctx, residual, gate, branch, scale, shift, weight, bias, norm, eps):
    out = _below("adaln_gated_fwd", residual, gate, branch, scale, shift, weight, bias, norm, eps)
    ctx.save_for_backward(residual, gate, branch, scale, shift, weight, bias, *out[2:])
    _keep(ctx, norm, eps, *out[2:])
    return out


def _gated_bwd(ctx, dh, dy, _m, _r):
    res, gate, branch, scale, shift, weight, bias, mean, rstd = ctx.saved_tensors
    dy = torch.zeros_like(res) if dy is None else dy
    dr, dg, dbr, ds, dt, dw, db = torch.ops.ditscale.adaln_gated_bwd(
        dh, dy, res, gate, branch, scale, shift, weight, bias, mean, rstd, ctx.norm, ctx.eps)
    return dr, dg, dbr, ds, dt, *_affine(weight, bias, dw, db), None, None


def _gated_mod(ctx, residual, branch, mod, gi, si, ti, weight, bias, norm, eps):
    out = _below("adaln_gated_mod_fwd", residual, branch, mod, gi, si, ti, weight, bias, norm,
                 eps)
    ctx.save_for_backward(residual, branch, mod, weight, bias, *out[2:])
    ctx.rows = (gi, si, ti)
    _keep(ctx, norm, eps, *out[2:])
    return out


def _gated_mod_bwd(ctx, dh, dy, _m, _r):
    res, branch, mod, weight, bias, mean, rstd = ctx.saved_tensors
    if dh is None and dy is None:
        return (None,) * 10
    dy = torch.zeros_like(res) if dy is None else dy
    dr, dbr, dmod, dw, db = torch.ops.ditscale.adaln_gated_mod_bwd(
        dh, dy, res, branch, mod, *ctx.rows, weight, bias, mean, rstd, ctx.norm, ctx.eps)
    return dr, dbr, dmod, None, None, None, *_affine(weight, bias, dw, db), None, None


def _below(name, *args):
    with torch._C._AutoDispatchBelowAutograd():
        return getattr(torch.ops.ditscale, name)(*args)


PyAutograd = {
    name: type(f"Py_{name}", (torch.autograd.Function,),
               {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})
    for name, fwd, bwd in (("adaln_fwd", _fwd, _fwd_bwd), ("adaln_mod_fwd", _mod, _mod_bwd),
                           ("adaln_gated_fwd", _gated, _gated_bwd),
                           ("adaln_gated_mod_fwd", _gated_mod, _gated_mod_bwd))
}


def leaves(seed: int, per_token: bool, affine: bool):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    emb = (rnd(B, N, 6 * D) if per_token else rnd(B, 6 * D)) * 0.3
    t = {"x": rnd(B, N, D), "branch": rnd(B, N, D), "emb": emb}
    if affine:
        t["weight"], t["bias"] = rnd(D) * 0.2 + 1, rnd(D) * 0.1
    return {k: v.requires_grad_() for k, v in t.items()}


def chunks(emb):
    return emb.chunk(6, dim=-1)  # shift, scale, gate, ...: views of emb


def via_ops(kind, t, norm):
    """ditscale.ops (the eager path under test)."""
    shift, scale, gate = chunks(t["emb"])[:3]
    kw = dict(weight=t.get("weight"), bias=t.get("bias"), norm=norm, eps=1e-5)
    if kind == "adaln":
        return (ops.adaln(t["x"], scale, shift, **kw),)
    return ops.adaln_gated(t["x"], gate, t["branch"], scale, shift, **kw)


def via_registered(kind, t, norm, call=None):
    """The registered ops (their C++ autograd), packed as ops.adaln packs; ``call(name, *args)``
    replaces the op call (e.g. by the Python reference autograd)."""
    call = call or (lambda name, *a: getattr(torch.ops.ditscale, name)(*a))
    shift, scale, gate = chunks(t["emb"])[:3]
    w, b = t.get("weight"), t.get("bias")
    packed = t["emb"].dim() == 2
    if kind == "adaln":
        if packed:
            mod = t["emb"].view(B, 6, D)
            return (call("adaln_mod_fwd", t["x"], mod, 1, 0, w, b, norm, 1e-5)[0],)
        return (call("adaln_fwd", t["x"], scale, shift, w, b, norm, 1e-5)[0],)
    if packed:
        mod = t["emb"].view(B, 6, D)
        return call("adaln_gated_mod_fwd", t["x"], t["branch"], mod, 2, 1, 0, w, b, norm,
                    1e-5)[:2]
    return call("adaln_gated_fwd", t["x"], gate, t["branch"], scale, shift, w, b, norm, 1e-5)[:2]


def via_python_autograd(kind, t, norm):
    """The same calls through the previous Python autograd (PyAutograd)."""
    return via_registered(kind, t, norm, lambda name, *a: PyAutograd[name].apply(*a))


def run(fn, kind, t, norm, used):
    outs = fn(kind, t, norm)
    g = torch.Generator().manual_seed(9)
    loss = sum((outs[i] * torch.randn(outs[i].shape, generator=g)).sum() for i in used)
    grads = torch.autograd.grad(loss, list(t.values()), allow_unused=True)
    return [o.detach() for o in outs], grads


CASES = [(kind, norm, per_token, affine, used)
         for kind, useds in (("adaln", ((0,),)), ("gated", ((0, 1), (0,), (1,))))
         for norm in ("layernorm", "rmsnorm")
         for per_token in (False, True)
         for affine in (False, True)
         for used in useds]


def assert_same(got, want, names):
    (out_g, grad_g), (out_w, grad_w) = got, want
    for a, b in zip(out_g, out_w):
        assert torch.equal(a, b)
    for name, a, b in zip(names, grad_g, grad_w):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("kind,norm,per_token,affine,used", CASES)
def test_eager_path_bit_identical_to_registered_ops(kind, norm, per_token, affine, used):
    t = leaves(0, per_token, affine)
    assert_same(run(via_ops, kind, t, norm, used), run(via_registered, kind, t, norm, used), t)


@pytest.mark.parametrize("kind,norm,per_token,affine,used", CASES)
def test_cpp_autograd_bit_identical_to_python_autograd(kind, norm, per_token, affine, used):
    t = leaves(6, per_token, affine)
    assert_same(run(via_registered, kind, t, norm, used),
                run(via_python_autograd, kind, t, norm, used), t)


@pytest.mark.parametrize("kind", ("adaln", "gated"))
@pytest.mark.parametrize("per_token", (False, True))
def test_cpp_autograd_saves_what_the_python_autograd_saved(kind, per_token):
    t = leaves(1, per_token=per_token, affine=True)
    saved = {}
    for who, fn in (("cpp", via_ops), ("python", via_python_autograd)):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda x: shapes.append((tuple(x.shape), x.dtype)) or x, lambda x: x):
            y = fn(kind, t, "layernorm")[-1]
        saved[who] = shapes
        if who == "cpp":
            name = "Gated" if kind == "gated" else ""
            mod = "" if per_token else "Mod"
            assert y.grad_fn.name() == f"DitscaleAdaLN{name}{mod}Backward"
            edges = {"adaln": 5, "gated": 7}[kind] - (0 if per_token else 1 + (kind == "gated"))
            assert len(y.grad_fn.next_functions) == edges  # the tensor inputs
    assert saved["cpp"] == saved["python"] and saved["cpp"]


def test_cpp_autograd_releases_and_version_checks_saved_tensors():
    t = leaves(7, per_token=False, affine=False)
    h, y = via_ops("gated", t, "layernorm")
    (y.sum() + h.sum()).backward(retain_graph=True)
    first = t["emb"].grad.clone()
    (y.sum() + h.sum()).backward()  # retained: the same gradient again
    assert torch.equal(t["emb"].grad, 2 * first)
    with pytest.raises(RuntimeError, match=r"backward through the graph a second time"):
        y.sum().backward()
    (y,) = via_ops("adaln", t, "rmsnorm")
    with torch.no_grad():
        t["x"].mul_(2.0)  # a saved input modified in place
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        y.sum().backward()


def test_functorch_grad_and_vmap():
    """torch.func.grad goes through the C++ node as through autograd; vmap (no grad) runs the op
    per sample through PyTorch's batching fallback."""
    t = {k: v.detach() for k, v in leaves(8, per_token=False, affine=False).items()}
    mod = t["emb"].view(B, 6, D)

    def loss(x, m):
        h, y = ops.adaln_gated_rows(x, t["branch"], m, 2, 1, 0)
        return (h * y).sum()

    got = torch.func.grad(loss, argnums=(0, 1))(t["x"], mod)
    x, m = t["x"].clone().requires_grad_(), mod.clone().requires_grad_()
    want = torch.autograd.grad(loss(x, m), (x, m))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    shift, scale = chunks(t["emb"])[:2]
    got = torch.func.vmap(lambda x, s, b: ops.adaln(x[None], s[None], b[None])[0])(
        t["x"], scale, shift)
    assert torch.equal(got, ops.adaln(t["x"], scale, shift))


def test_no_grad_and_inference_record_nothing():
    t = leaves(2, per_token=False, affine=False)
    with torch.no_grad():
        for out in via_ops("gated", t, "layernorm"):
            assert out.grad_fn is None and not out.requires_grad
    with torch.inference_mode():
        (y,) = via_ops("adaln", t, "layernorm")
    assert y.grad_fn is None
    plain = {k: v.detach() for k, v in t.items()}  # grad on, nothing requires grad
    (y,) = via_ops("adaln", plain, "rmsnorm")
    assert y.grad_fn is None
    with torch.no_grad():
        (ref,) = via_registered("adaln", plain, "rmsnorm")
    assert torch.equal(y, ref)


def test_bad_arguments_still_raise_the_ops_errors():
    t = leaves(3, per_token=False, affine=False)
    shift, scale = chunks(t["emb"])[:2]
    with pytest.raises(ValueError, match=r"eps: 0 is out of range"):
        ops.adaln(t["x"], scale, shift, eps=0.0)
    with pytest.raises(ValueError, match=r"eps: nan is out of range"):
        ops.adaln(t["x"], scale, shift, eps=float("nan"))
    with pytest.raises(TypeError, match=r"eps: expected a number"):
        ops.adaln(t["x"], scale, shift, eps="1e-6")
    assert ops.adaln(t["x"], scale, shift, eps=1).shape == t["x"].shape  # an int in range
    with pytest.raises(RuntimeError, match=r"Optional\[Tensor\]' for argument 'weight'"):
        ops.adaln(t["x"], scale, shift, weight=[1.0] * D)
    with pytest.raises(RuntimeError, match=r"weight must be \[D\]"):
        ops.adaln(t["x"], scale, shift, weight=torch.ones(D + 1))


def test_bench_host_cost_pieces():
    from bench.adaln import host_cost as H

    for mode in H.MODES:
        for ours, eager, acts in H.KINDS.values():
            for fn in (ours, eager):
                assert H.per_call_us(H.step_of(fn, mode, acts), number=2) > 0
    saved = H.saved_rows(tokens=16, dim=8)
    by = {(k, w): e for k, w, e, _, _ in saved}
    # ours keeps only mean and rstd beyond its inputs (8 bytes per row); gated too (its backward
    # recomputes h from the residual, an input)
    assert by[("adaln", "ours")] == 16 * 8
    assert by[("gated", "ours")] == 16 * 8
    assert by[("adaln", "eager")] > by[("adaln", "ours")]
    text = H.table([("adaln", "fwd grad", 2.0, 3.0)], saved, [("stock", 16, 1.0, None)], 16, 8)
    assert "| adaln | fwd grad | 2.0 | 3.0 | 1.50 |" in text
    assert "| stock | 16 | 1.0 | n/a |" in text


@pytest.mark.parametrize("kind", ("adaln", "gated"))
@pytest.mark.parametrize("grad", (True, False))
def test_rows_api_equals_the_views(kind, grad):
    """ops.adaln_rows / adaln_gated_rows on a [B, 6, D] tensor give the bits of ops.adaln /
    adaln_gated on its row views, and the same gradient of that tensor."""
    t = leaves(4, per_token=False, affine=True)
    kw = dict(weight=t["weight"], bias=t["bias"], eps=1e-5)
    results = []
    for rows in (True, False):
        mod = t["emb"].view(B, 6, D) * 1.0  # a non-leaf [B, 6, D], as a block makes it
        with torch.set_grad_enabled(grad):
            if kind == "adaln":
                outs = ((ops.adaln_rows(t["x"], mod, 1, 0, **kw),) if rows else
                        (ops.adaln(t["x"], mod[:, 1], mod[:, 0], **kw),))
            else:
                outs = (ops.adaln_gated_rows(t["x"], t["branch"], mod, 2, 1, 0, **kw) if rows
                        else ops.adaln_gated(t["x"], mod[:, 2], t["branch"], mod[:, 1],
                                             mod[:, 0], **kw))
        grads = None
        if grad:
            grads = torch.autograd.grad(sum(o.sum() for o in outs), [t["emb"], t["x"]])
        results.append(([o.detach() for o in outs], grads))
    (out_r, g_r), (out_v, g_v) = results
    assert all(torch.equal(a, b) for a, b in zip(out_r, out_v))
    if grad:
        assert all(torch.equal(a, b) for a, b in zip(g_r, g_v))


def test_rows_api_errors_and_compile():
    t = leaves(5, per_token=False, affine=False)
    mod = t["emb"].view(B, 6, D)
    with pytest.raises(RuntimeError, match=r"scale_index and shift_index are both 1"):
        ops.adaln_rows(t["x"], mod, 1, 1)
    with pytest.raises(RuntimeError, match=r"scale_index = 6 is outside mod's K = 6 rows"):
        ops.adaln_rows(t["x"], mod, 6, 0)
    with pytest.raises(ValueError, match=r"norm must be one of"):
        ops.adaln_gated_rows(t["x"], t["branch"], mod, 2, 1, 0, norm="batchnorm")

    def f(x, branch, emb):
        m = emb.view(B, 6, D)
        h, y = ops.adaln_gated_rows(x, branch, m, 2, 1, 0)
        return ops.adaln_rows(h, m, 4, 3) + y

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    args = (t["x"], t["branch"], t["emb"])
    out_c, out_e = compiled(*args), f(*args)
    assert torch.equal(out_c, out_e)
    g_c = torch.autograd.grad(out_c.sum(), args)
    g_e = torch.autograd.grad(out_e.sum(), args)
    assert all(torch.equal(a, b) for a, b in zip(g_c, g_e))
