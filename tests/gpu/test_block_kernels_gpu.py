"""The CUDA block kernels of ditscale/sp/block_kernels.py (flash attention for bfloat16 / float16,
memory-efficient attention for float32; the LSE and the backward from a given LSE) against
cpu_kernels' CPU functions on the same inputs in float32 (fresh random inputs): GQA (query heads
folded), odd token counts, a head_dim the kernels need padded, an empty kv block, the backward
from a merged (out, LSE) of two blocks (as the ring's backward uses it). One GPU; skips without
CUDA.

    pytest tests/gpu/test_block_kernels_gpu.py
"""

import pytest
import torch

# (batch, query tokens, kv tokens, query heads, kv heads, head_dim)
SHAPES = [(2, 77, 131, 8, 2, 64), (1, 33, 250, 6, 6, 128), (1, 1, 7, 4, 1, 64),
          (1, 19, 40, 4, 2, 60)]  # head_dim 60: padded to 64 for the kernels
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-3}  # fp32 may use TF32


def _need_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _inputs(shape, dtype, seed):
    B, Tq, Tk, H, Hk, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Tq, H, d, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(B, Tk, Hk, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).abs().max() /
            b.double().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backward_match_the_cpu_kernels(shape, dtype):
    _need_gpu()
    from ditscale.sp import block_kernels, cpu_kernels
    q, k, v = _inputs(shape, dtype, 7)
    out, lse = block_kernels.attention_lse(q, k, v)
    assert out.dtype == lse.dtype == torch.float32
    assert lse.shape == (*q.shape[:3], 1)
    qc, kc, vc = (t.float().cpu() for t in (q, k, v))
    ref_out, ref_lse = cpu_kernels.attention_lse(qc, kc, vc)
    assert _rel(out, ref_out) < TOL[dtype]
    assert (lse.cpu() - ref_lse).abs().max().item() < 2e-3
    dout = torch.randn_like(out)
    got = block_kernels.attention_lse_backward(dout, q, k, v, out, lse)
    want = cpu_kernels.attention_lse_backward(dout.cpu(), qc, kc, vc, ref_out, ref_lse)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert _rel(a, b) < 5 * TOL[dtype], (name, _rel(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_from_a_merged_lse(dtype):
    """Two kv blocks merged (cpu_kernels.merge_lse_), each block's backward from the merged out
    and LSE, summed: the gradients of attention over both blocks at once."""
    _need_gpu()
    from ditscale.sp import block_kernels, cpu_kernels
    q, k, v = _inputs((1, 45, 96, 8, 4, 64), dtype, 11)
    halves = [(k[:, :40], v[:, :40]), (k[:, 40:], v[:, 40:])]
    out, lse = block_kernels.attention_lse(q, *halves[0])
    cpu_kernels.merge_lse_(out, lse, *block_kernels.attention_lse(q, *halves[1]))
    dout = torch.randn_like(out)
    parts = [block_kernels.attention_lse_backward(dout, q, *h, out, lse) for h in halves]
    dq = parts[0][0] + parts[1][0]
    dk = torch.cat([parts[0][1], parts[1][1]], 1)
    qc, kc, vc = (t.float().cpu() for t in (q, k, v))
    ref_out, ref_lse = cpu_kernels.attention_lse(qc, kc, vc)
    assert _rel(out, ref_out) < TOL[dtype]
    want = cpu_kernels.attention_lse_backward(dout.cpu(), qc, kc, vc, ref_out, ref_lse)
    assert _rel(dq, want[0]) < 5 * TOL[dtype]
    assert _rel(dk, want[1]) < 5 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_empty_block(dtype):
    _need_gpu()
    from ditscale.sp import block_kernels
    q, k, v = _inputs((1, 5, 0, 4, 2, 64), dtype, 3)
    out, lse = block_kernels.attention_lse(q, k, v)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    grads = block_kernels.attention_lse_backward(torch.ones_like(out), q, k, v, out, lse)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    assert all(not g.abs().sum().item() for g in grads)


def test_cudnn_runs_the_half_precision_blocks_and_determinism_gives_the_same_bits():
    """bfloat16 blocks run cuDNN attention here (its LSE checked once: no switch to flash); under
    torch.use_deterministic_algorithms(True) the backward (flash's deterministic algorithm) gives
    the same bits twice, and matches the default backward within bf16 tolerance."""
    _need_gpu()
    import os
    import warnings

    from ditscale.sp import block_kernels, cuda_attention
    q, k, v = _inputs((1, 300, 515, 8, 2, 128), torch.bfloat16, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a switch to flash warns
        out, lse = block_kernels.attention_lse(q, k, v)
        dout = torch.randn_like(out)
        fast = block_kernels.attention_lse_backward(dout, q, k, v, out, lse)
    assert cuda_attention._CUDNN["usable"] is True
    old = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    try:
        once = block_kernels.attention_lse_backward(dout, q, k, v, out, lse)
        twice = block_kernels.attention_lse_backward(dout, q, k, v, out, lse)
    finally:
        torch.use_deterministic_algorithms(False)
        if old is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG")
    assert all(torch.equal(a, b) for a, b in zip(once, twice))
    assert all(_rel(a, b) < 5 * TOL[torch.bfloat16] for a, b in zip(once, fast))
