"""CPU tests of the rotary embedding op (torch.ops.ditscale.rotary, ditscale.ops.rotary): the
forward gives diffusers' formula's bits (ops.rotary_reference, the arithmetic of Wan's
processor) in every dtype and layout, the backward is the formula's gradient (gradcheck in
fp64), torch.compile traces it, and every bad argument is refused by name. Fresh random inputs
on every run."""

import random

import pytest

torch = pytest.importorskip("torch")

from ditscale import ops  # noqa: E402

SEED = random.randrange(1 << 30)
pytestmark = pytest.mark.skipif(not ops.is_available(), reason="ditscale._C not built")


def gen(k=0):
    return torch.Generator().manual_seed(SEED + k)


def freqs(B, S, Dh, k=0):
    """Wan-like tables [B, S, 1, Dh] (each angle's value repeated for both members of a pair)
    plus noise, so that cos[2j] != cos[2j + 1]: the op must read the right member."""
    g = gen(k)
    angle = torch.rand(B, S, 1, Dh // 2, generator=g) * 6.3
    cos = angle.cos().repeat_interleave(2, -1) + 0.01 * torch.randn(B, S, 1, Dh, generator=g)
    sin = angle.sin().repeat_interleave(2, -1) + 0.01 * torch.randn(B, S, 1, Dh, generator=g)
    return cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("freq_batch", [1, 3])
def test_forward_is_the_formula_bit_for_bit(dtype, freq_batch):
    x = (torch.randn(3, 11, 4, 16, generator=gen(1)) * 3).to(dtype)
    cos, sin = freqs(freq_batch, 11, 16)
    y = ops.rotary(x, cos, sin)
    assert y.dtype == dtype and y.is_contiguous() and y.shape == x.shape
    assert torch.equal(y, ops.rotary_reference(x, cos, sin)), f"seed {SEED}"
    assert torch.equal(ops.rotary(x, cos.squeeze(2), sin.squeeze(2)), y)  # [Bf, S, Dh] tables


def test_strided_inputs_read_in_place_or_copied():
    cos, sin = freqs(1, 9, 8)
    base = torch.randn(2, 5, 9, 8, generator=gen(2), dtype=torch.bfloat16)
    x = base.transpose(1, 2)  # [B, S, H, Dh] over a [B, H, S, Dh] buffer: SDPA's gradient layout
    assert torch.equal(ops.rotary(x, cos, sin), ops.rotary_reference(x, cos, sin))
    odd = torch.randn(2, 9, 5, 9, generator=gen(3))[..., 1:]  # odd offset: a copy is made
    assert torch.equal(ops.rotary(odd, cos, sin), ops.rotary_reference(odd, cos, sin))
    wide = (cos.expand(2, 9, 1, 8), sin.expand(2, 9, 1, 8))  # stride-0 batch: made contiguous
    assert torch.equal(ops.rotary(x, *wide), ops.rotary_reference(x, cos, sin))
    with pytest.raises(RuntimeError, match=r"cos and sin must have the same batch size, got 2 "
                                           r"and 1"):
        ops.rotary(x, wide[0], sin)


def test_backward_is_the_formulas_gradient():
    cos, sin = freqs(2, 6, 8, k=4)
    x = torch.randn(2, 6, 3, 8, generator=gen(5), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ops.rotary(t, cos, sin), (x,))
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        a = torch.randn(2, 6, 3, 8, generator=gen(6)).to(dtype).requires_grad_()
        b = a.detach().clone().requires_grad_()
        dy = torch.randn(2, 6, 3, 8, generator=gen(7)).to(dtype)
        ops.rotary(a, cos, sin).backward(dy)
        ops.rotary_reference(b, cos, sin).backward(dy)
        err = ((a.grad.double() - b.grad.double()).norm() / b.grad.double().norm()).item()
        assert err <= tol, (dtype, err, SEED)
    y = ops.rotary(x, cos, sin)
    assert type(y.grad_fn).__name__ == "CppFunction" and "Rotary" in y.grad_fn.name()


def test_no_grad_and_inference_mode_record_nothing():
    cos, sin = freqs(1, 4, 4)
    x = torch.randn(1, 4, 2, 4, requires_grad=True)
    with torch.no_grad():
        assert ops.rotary(x, cos, sin).grad_fn is None
    with torch.inference_mode():
        assert torch.equal(ops.rotary(x.detach(), cos, sin), ops.rotary_reference(x, cos, sin))


def test_compiled_fullgraph_forward_and_backward():
    cos, sin = freqs(1, 5, 8, k=8)
    f = torch.compile(lambda t: ops.rotary(t * 2, cos, sin).sum(-1), fullgraph=True)
    x = torch.randn(2, 5, 3, 8, generator=gen(9), requires_grad=True)
    r = x.detach().clone().requires_grad_()
    out = f(x)
    ref = ops.rotary_reference(r * 2, cos, sin).sum(-1)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    out.sum().backward()
    ref.sum().backward()
    assert torch.allclose(x.grad, r.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args,message", [
    (((2, 7, 3, 7), (1, 7, 1, 7), (1, 7, 1, 7)), r"x's head dim \(its last\) must be even"),
    (((2, 7, 24), (1, 7, 1, 8), (1, 7, 1, 8)), r"x must be \[B, S, H, Dh\], got shape \[2, 7, 24\]"),
    (((2, 7, 3, 8), (1, 6, 1, 8), (1, 7, 1, 8)), r"cos must be \[1 or B, S, 1, Dh\].*got \[1, 6, 1, 8\]"),
    (((2, 7, 3, 8), (1, 7, 1, 8), (3, 7, 1, 8)), r"sin must be \[1 or B, S, 1, Dh\].*got \[3, 7, 1, 8\]"),
    (((2, 7, 3, 8), (1, 7, 2, 8), (1, 7, 1, 8)), r"cos must be"),
])
def test_bad_shapes_are_refused_by_name(args, message):
    x, c, s = (torch.randn(*shape) for shape in args)
    with pytest.raises(RuntimeError, match=message):
        ops.rotary(x, c, s)


def test_bad_dtypes_and_trainable_frequencies_are_refused():
    cos, sin = freqs(1, 4, 4)
    with pytest.raises(RuntimeError, match=r"x must be bfloat16, float16 or float32"):
        ops.rotary(torch.ones(1, 4, 2, 4, dtype=torch.int32), cos, sin)
    with pytest.raises(RuntimeError, match=r"cos must be float32, got Double"):
        ops.rotary(torch.ones(1, 4, 2, 4), cos.double(), sin)
    with pytest.raises(RuntimeError, match=r"cos and sin get no gradient"):
        ops.rotary(torch.ones(1, 4, 2, 4), cos.clone().requires_grad_(), sin)
    assert ops.rotary(torch.ones(0, 4, 2, 4), cos, sin).shape == (0, 4, 2, 4)
