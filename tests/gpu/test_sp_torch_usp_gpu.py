"""The CUDA path of the multi-rank attention's gradients (ditscale/sp/torch_usp.py: CUDA tensors
that require grad, eagerly) with several ranks on ONE GPU: 2 and 4 processes share cuda:0 over a
gloo group (whose transfers of CUDA tensors go through the host, ring_backward.post), so that the
CUDA block kernels (cuDNN or flash for bfloat16, memory-efficient for float32) run inside the
real schedule: ulysses, ring, usp and swiftfusion-tas (2 x 2), ulysses-overlap (as ulysses),
GQA, joint text, odd token counts, through ``ditscale.sp.attention`` (the op's autograd path)
and ``torch_usp.attention`` directly.
Against dense float64 autograd on the CPU (test_sp_grad._reference): max |err| / max |ref|
within 3e-2 (bfloat16) and 2e-3 (float32, TF32 allowed), with the default kernels (cuDNN)
and under torch.use_deterministic_algorithms(True), where two runs give the same bits. NCCL
itself needs a GPU per rank: tests/gpu/sp_grad_check.py under torchrun. Skips without CUDA.

    pytest tests/gpu/test_sp_torch_usp_gpu.py
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from gloo_util import run_gloo  # noqa: E402
from test_sp_grad import BF16, F32, _reference  # noqa: E402

# (strategy, mesh, shape = (batch, seq, text, heads, kv_heads, head_dim, dtype), direct)
CASES_2 = [
    ("ring", (1, 2), (1, 1023, 77, 8, 4, 64, BF16), False),
    ("ulysses", (1, 2), (2, 517, 9, 6, 2, 128, BF16), False),
    ("ring", (1, 2), (1, 301, 5, 4, 4, 64, F32), True),
    ("ulysses-overlap", (1, 2), (1, 515, 7, 8, 8, 64, BF16), False),  # as ulysses
]
CASES_4 = [
    ("usp", (2, 2), (1, 1031, 13, 8, 4, 64, BF16), False),
    ("swiftfusion-tas", (2, 2), (1, 517, 0, 8, 8, 128, BF16), False),
    ("ring", (1, 4), (1, 259, 3, 4, 2, 64, F32), True),
]
TOL = {BF16: 3e-2, F32: 2e-3}


def _need_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _grads(rank, world, strategy, mesh, shape, direct, seed):
    """This rank's gradients (image shards of q, k, v; joint q, k, v summed over the ranks) of
    one CUDA step, as float64 on the CPU."""
    import torch.distributed as dist

    import ditscale.sp as sp
    from ditscale.sp import torch_usp
    S, T, dt = shape[1], shape[2], getattr(torch, shape[-1])
    full, ups, _, _ = _reference(shape, seed, world)
    begin, count = sp.shard_range(S, world, rank)
    dev = torch.device("cuda", 0)
    mine = [x[:, T + begin:T + begin + count].to(dev, dt).requires_grad_() for x in full]
    joint = [x[:, :T].to(dev, dt).requires_grad_() for x in full] if T else []
    m = sp.Mesh(*mesh)
    if direct:
        out, jout = torch_usp.attention(*mine, *(joint or [None] * 3), mesh=m,
                                        cfg=sp.make_config("t", strategy=strategy))
    else:
        kw = dict(zip(("joint_q", "joint_k", "joint_v"), joint))
        got = sp.attention(*mine, mesh=m, strategy=strategy, **kw)
        out, jout = got if T else (got, None)
        assert type(out.grad_fn).__name__ == "_TorchUspBackward", type(out.grad_fn).__name__
    loss = out.double().mul(ups[rank][0].to(dev)).sum()
    if T:
        loss = loss + jout.double().mul(ups[rank][1].to(dev)).sum()
    loss.backward()
    grads = [x.grad.double().cpu() for x in mine]
    for x in joint:
        total = x.grad.double()
        dist.all_reduce(total)
        grads.append(total.cpu())
    return grads


def _case(rank, world, strategy, mesh, shape, direct, seed):
    """(max relative error against dense: default kernels, deterministic ones; the same bits
    twice under torch.use_deterministic_algorithms(True))."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before cuBLAS starts
    torch.cuda.set_device(0)
    S, T = shape[1:3]
    import ditscale.sp as sp
    _, _, dense, _ = _reference(shape, seed, world)
    fast = _grads(rank, world, strategy, mesh, shape, direct, seed)
    torch.use_deterministic_algorithms(True)
    try:
        grads = _grads(rank, world, strategy, mesh, shape, direct, seed)
        again = _grads(rank, world, strategy, mesh, shape, direct, seed)
    finally:
        torch.use_deterministic_algorithms(False)
    begin, count = sp.shard_range(S, world, rank)
    refs = [w[:, T + begin:T + begin + count] for w in dense]
    refs += [w[:, :T] for w in dense] if T else []
    scale = max(w.abs().max().item() for w in dense)
    errs = [max((g - w).abs().max().item() for g, w in zip(run, refs)) / scale
            for run in (fast, grads)]
    return max(errs), all(torch.equal(a, b) for a, b in zip(grads, again))


def _all(rank, world, cases):
    return [_case(rank, world, *case, 10 * n) for n, case in enumerate(cases)]


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)])
def test_cuda_gradients_of_several_ranks_on_one_gpu(world, cases):
    _need_gpu()
    results = run_gloo(_all, world, cases, timeout_s=600, pg_timeout_s=120)
    for per_rank in results:
        for (strategy, mesh, shape, direct), (err, same) in zip(cases, per_rank):
            assert err <= TOL[shape[-1]], (strategy, shape, direct, err)
            assert same, (strategy, shape, direct)
