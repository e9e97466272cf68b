"""GPU path of the diffusers integration on one GPU:

- every family's ``parallelize`` at world size 1 on CUDA (bf16, real head sizes, one block of
  each kind) gives the stock module's output;
- ``ditscale._experimental.sp_local.run_local`` (every rank of a strategy in this process, the
  real GPU executor) through the attention shapes the integration produces for each model (heads, head_dim, joint text tokens,
  uneven token shards) against dense attention.

Skips without a GPU, diffusers or the compiled runtime."""

import os

# run_local's ranks wait on CUDA hardware queues: more than two ranks need more queues than the
# default 8 connections give, set before CUDA starts (run this file in its own pytest process).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("diffusers")

# (model, heads, head_dim, text tokens): the attention calls of each supported family.
ATTENTION_SHAPES = [
    ("flux", 24, 128, 512), ("wan2.1-1.3b", 12, 128, 0), ("wan2.1-14b", 40, 128, 0),
    ("hunyuan-video", 24, 128, 256), ("cogvideox-5b", 48, 64, 226), ("sd3.5-medium", 24, 64, 333)]
STRATEGIES = [("ulysses", (1, 2), 1), ("ring", (1, 2), 1), ("ring", (1, 4), 1), ("torus", (2, 2), 2),
              ("usp", (2, 2), 1), ("swiftfusion-tas", (2, 2), 1)]


def _need_gpu(what):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import ditscale.ops as ops
    if not ops.is_available():
        pytest.skip(f"ditscale._C missing: {ops.load_error()}")
    if what == "runtime" and not hasattr(torch.ops.ditscale, "sp_run_local"):
        pytest.skip("ditscale._C without the CUDA sequence-parallel runtime")


def _dense(q, k, v, jq, jk, jv):
    if jq is not None:
        q, k, v = (torch.cat([a, b], 1) for a, b in ((jq, q), (jk, k), (jv, v)))
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("model,heads,head_dim,text", ATTENTION_SHAPES)
@pytest.mark.parametrize("strategy,mesh,chunks", STRATEGIES)
def test_run_local_through_model_attention_shapes(model, heads, head_dim, text, strategy, mesh,
                                                   chunks):
    _need_gpu("runtime")
    from ditscale._experimental import sp_local
    if strategy == "ulysses" and heads % 2:
        pytest.skip("odd head count")
    g = torch.Generator(device="cuda").manual_seed(heads * 131 + text)
    S = 4099  # not divisible by the ranks: uneven shards

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    q, k, v = (rnd(1, S, heads, head_dim) for _ in range(3))
    joint = [rnd(1, text, heads, head_dim) for _ in range(3)] if text else [None] * 3
    inputs = [t.clone() for t in (q, k, v)]
    first, _, text_out, _ = sp_local.run_local(
        q, k, v, strategy=strategy, machines=mesh[0], gpus_per_machine=mesh[1],
        chunks=chunks if strategy == "torus" else None, joint_q=joint[0], joint_k=joint[1],
        joint_v=joint[2])
    torch.cuda.synchronize()
    for name, before, after in zip("qkv", inputs, (q, k, v)):
        assert torch.equal(before, after), f"{model} {strategy}: the layer wrote its input {name}"
    ref = _dense(q, k, v, *joint).float()
    err = (first.float() - ref[:, text:]).abs().max().item()
    assert err < 3e-2, f"{model} {strategy}: max err {err}"
    if text:
        terr = (text_out.float() - ref[:, :text].unsqueeze(0)).abs().max().item()
        assert terr < 3e-2, f"{model} {strategy} text: max err {terr}"


MODELS = ["flux", "wan2.1-1.3b", "hunyuan-video", "cogvideox-5b", "sd3.5-medium"]


@pytest.mark.parametrize("model", MODELS)
def test_parallelize_world_size_1_matches_stock(model):
    _need_gpu("ops")
    import ditscale.diffusers as dd
    from bench.diffusers import models as M

    dev = torch.device("cuda", 0)
    outs = []
    for parallel in (False, True):
        m, _ = M.make(model, 1, torch.bfloat16, dev)
        m.eval()
        if parallel:
            dd.parallelize(m)
        kw = M.inputs(model, m, 1024, 1, torch.bfloat16, dev, seed=3)
        with torch.no_grad():
            outs.append(m(**kw)[0].float())
        del m
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert err < 1e-2, f"{model}: relative L2 {err}"


@pytest.mark.parametrize("model", ["wan2.1-1.3b", "flux"])
def test_fused_adaln_matches_stock_on_gpu(model):
    _need_gpu("ops")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda", 0)
    outs, grads = [], []
    # Flash attention for both: torch 2.11's cuDNN backward of Flux's joint attention reads out of
    # bounds (compute-sanitizer, stock model), which made the stock gradients garbage here.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        _fused_and_stock(model, dev, outs, grads)
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    gerr = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
    assert err < 1e-2 and gerr < 5e-2, f"{model}: out {err}, grads {gerr}"


def _fused_and_stock(model, dev, outs, grads):
    import ditscale.diffusers as dd
    from bench.diffusers import models as M

    for fused in (False, True):
        m, _ = M.make(model, 1, torch.bfloat16, dev)
        if fused:
            dd.apply_fused_adaln(m)
        kw = M.inputs(model, m, 1024, 1, torch.bfloat16, dev, seed=3)
        out = m(**kw)[0]
        out.float().square().mean().backward()
        outs.append(out.detach().float())
        grads.append(torch.cat([p.grad.float().flatten() for p in m.parameters()
                                if p.grad is not None]))
        del m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotary_op_on_gpu_is_the_cpu_op_and_the_formula(dtype):
    """The CUDA kernel of ops.rotary at Wan 1.3B's head layout (12 x 128, 4,099 tokens, the
    model's [1, S, 1, 128] tables): forward and inverse bit-identical to the CPU op, the forward
    bit-identical to diffusers' formula on the GPU, x read in place through SDPA's gradient
    layout, and the backward's gradient the formula's."""
    _need_gpu("ops")
    from ditscale import ops
    g = torch.Generator().manual_seed(11)
    S, H, Dh = 4099, 12, 128
    angle = torch.rand(1, S, 1, Dh // 2, generator=g) * 6.3
    cos = angle.cos().repeat_interleave(2, -1) + 0.01 * torch.randn(1, S, 1, Dh, generator=g)
    sin = angle.sin().repeat_interleave(2, -1) + 0.01 * torch.randn(1, S, 1, Dh, generator=g)
    x = (torch.randn(2, H, S, Dh, generator=g) * 3).to(dtype).transpose(1, 2)  # strided
    dc, ds, dx = cos.cuda(), sin.cuda(), x.cuda()
    y = ops.rotary(dx, dc, ds)
    assert torch.equal(y.cpu(), ops.rotary(x, cos, sin))
    assert torch.equal(y, ops.rotary_reference(dx, dc, ds))
    inv = torch.ops.ditscale.rotary(dx, dc, ds, True)
    assert torch.equal(inv.cpu(), torch.ops.ditscale.rotary(x, cos, sin, True))
    a = dx.detach().clone().requires_grad_()
    b = dx.detach().clone().requires_grad_()
    dy = torch.randn(2, S, H, Dh, device="cuda").to(dtype)
    ops.rotary(a, dc, ds).backward(dy)
    ops.rotary_reference(b, dc, ds).backward(dy)
    err = ((a.grad.double() - b.grad.double()).norm() / b.grad.double().norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err
