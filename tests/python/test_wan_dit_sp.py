"""ditscale.models.WanDiT.sequence_parallel on 2 gloo processes (one spawn): the tiny config
(2 heads, a random output head), latents of 45 tokens (an odd count), loss =
output.square().mean() on every rank. For strategies ulysses and ring: the output equals the single-process one, and every parameter's gradient and
the latents' gradient, summed over the ranks, equal the single-process ones (fp32). One rank:
sequence_parallel changes nothing. See docs/models.md.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

from ditscale.models.wan_dit import WanDiT, make_config  # noqa: E402

TOLERANCE = 1e-4  # relative to the largest reference value of each tensor, fp32
ZERO_GRADIENT = ("self_attn.k.bias", "cross_attn.k.bias")  # softmax-invariant: ~0 in exact math


def _model():
    torch.manual_seed(0)
    return WanDiT(make_config("tiny", head_init_std=0.02))


def _inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 16, 3, 6, 10, generator=g), torch.tensor([400.0]),
            torch.randn(1, 8, 32, generator=g))


def _grads(model):
    latents, t, text = _inputs()
    latents.requires_grad_(True)
    out = model(latents, t, text)
    out.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads["(latents)"] = latents.grad
    return out.detach(), grads


def _relative(got, ref, scale=0.0) -> float:
    return float((got - ref).abs().max() / max(float(ref.abs().max()), scale, 1e-12))


def _check_ranks(rank, world):
    import torch.distributed as dist

    errors = {}
    for strategy in ("ulysses", "ring"):
        model = _model()
        ref_out, ref = _grads(copy.deepcopy(model))
        out, got = _grads(model.sequence_parallel(strategy=strategy))
        errors[(strategy, "output")] = _relative(out, ref_out)
        largest = max(float(g.abs().max()) for g in ref.values())
        for name, grad in got.items():
            total = grad.clone()
            dist.all_reduce(total)
            scale = largest if name.endswith(ZERO_GRADIENT) else 0.0
            errors[(strategy, name)] = _relative(total, ref[name], scale)
    return errors


def test_sequence_parallel_gradients_equal_the_single_process_ones_on_2_ranks():
    gloo_util = pytest.importorskip("gloo_util")
    for errors in gloo_util.run_gloo(_check_ranks, 2, timeout_s=300):
        bad = {k: e for k, e in errors.items() if not e <= TOLERANCE}
        assert not bad, bad
        assert len(errors) > 2 * 20


def test_one_rank_is_the_same_function():
    from ditscale import sp
    ref_out, ref = _grads(_model())
    out, got = _grads(_model().sequence_parallel(sp.Mesh(1, 1)))
    assert torch.equal(out, ref_out)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
