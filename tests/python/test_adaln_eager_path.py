"""The eager path of ditscale.ops.adaln / adaln_gated (CPU): with grad a torch.autograd.Function
per op around the op called below autograd, without grad the op below autograd, instead of the
dispatcher's torch.library autograd kernel. Checked against the registered ops called directly
(the path torch.compile traces): bit-identical outputs and gradients for every op (separate and
packed modulation, affine, rmsnorm, per-token modulation, gated with one or both outputs used),
the same saved tensors, no graph without grad, the rows API (ops.adaln_rows / adaln_gated_rows)
against the views, and the bench script's pieces on tiny inputs.
"""

import pytest

torch = pytest.importorskip("torch")

from ditscale import ops  # noqa: E402

if not ops.is_available():
    pytest.skip(f"ditscale ops unavailable: {ops.load_error()}", allow_module_level=True)

B, N, D = 2, 5, 16


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


def via_registered(kind, t, norm):
    """The registered ops with their torch.library autograd, packed as ops.adaln packs."""
    shift, scale, gate = chunks(t["emb"])[:3]
    w, b = t.get("weight"), t.get("bias")
    packed = t["emb"].dim() == 2
    if kind == "adaln":
        if packed:
            mod = t["emb"].view(B, 6, D)
            return (torch.ops.ditscale.adaln_mod_fwd(t["x"], mod, 1, 0, w, b, norm, 1e-5)[0],)
        return (torch.ops.ditscale.adaln_fwd(t["x"], scale, shift, w, b, norm, 1e-5)[0],)
    if packed:
        mod = t["emb"].view(B, 6, D)
        return torch.ops.ditscale.adaln_gated_mod_fwd(t["x"], t["branch"], mod, 2, 1, 0, w, b,
                                                      norm, 1e-5)[:2]
    return torch.ops.ditscale.adaln_gated_fwd(t["x"], gate, t["branch"], scale, shift, w, b, norm,
                                              1e-5)[:2]


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


@pytest.mark.parametrize("kind,norm,per_token,affine,used", CASES)
def test_eager_path_bit_identical_to_registered_ops(kind, norm, per_token, affine, used):
    t = leaves(0, per_token, affine)
    out_e, grad_e = run(via_ops, kind, t, norm, used)
    out_r, grad_r = run(via_registered, kind, t, norm, used)
    for a, b in zip(out_e, out_r):
        assert torch.equal(a, b)
    for name, a, b in zip(t, grad_e, grad_r):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name


def test_eager_path_is_the_function_and_saves_what_the_registered_op_saves():
    t = leaves(1, per_token=False, affine=True)
    saved = {}
    for who, fn in (("eager", via_ops), ("registered", via_registered)):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda x: shapes.append((tuple(x.shape), x.dtype)) or x, lambda x: x):
            y = fn("gated", t, "layernorm")[1]
        saved[who] = shapes
        if who == "eager":
            assert type(y.grad_fn).__name__ == "Eager_adaln_gated_mod_fwdBackward"
    assert saved["eager"] == saved["registered"] and saved["eager"]


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
    # ours keeps only mean and rstd beyond its inputs (8 bytes per row), gated also h
    assert by[("adaln", "ours")] == 16 * 8
    assert by[("gated", "ours")] == 16 * 8 + 16 * 8 * 2
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
