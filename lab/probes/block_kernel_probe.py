"""Which CUDA kernel should run the sequence-parallel block attention with its LSE and the
backward from a saved LSE (ditscale/sp/block_kernels.py): PyTorch's flash attention (FA2) or
cuDNN's, through the aten ops. For each shape (one rank's share of Wan's attention), bf16:

- time of SDPA forward + backward under autograd (the recomputation's work), of each kernel's
  forward with LSE and of its backward from a given (out, LSE);
- cuDNN's LSE against flash's (the base: natural log or log2), their outputs and gradients
  against each other;
- whether each backward gives the same bits twice, with torch.use_deterministic_algorithms off
  and on;
- whether cuDNN's backward takes the [B, T, H, D] strided views (no copies) as well as
  contiguous heads-first tensors.

    python -m lab.probes.block_kernel_probe [--shapes 1:32760:20:128,1:32760:2:128] [--reps 10]
"""

import argparse
import math

import torch

A = torch.ops.aten


def _time(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def flash_fwd(q, k, v, scale):
    r = A._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return r[0], r[1]


def flash_bwd(do, q, k, v, o, lse, scale):
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    off = torch.empty((), dtype=torch.uint64, device=q.device)
    return A._scaled_dot_product_flash_attention_backward(
        do, q, k, v, o, lse, None, None, q.shape[2], k.shape[2], 0.0, False, seed, off,
        scale=scale)


def cudnn_fwd(q, k, v, scale):
    r = A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                              scale=scale)
    return r[0], r[1]


def cudnn_bwd(do, q, k, v, o, lse, scale):
    """cum_seq_q / k and attn_bias undefined (None: a dense batch without bias), as the forward
    returns them; the philox tensors are never read (no dropout)."""
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    off = torch.empty((), dtype=torch.int64, device=q.device)
    return A._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse, seed, off, None, None, None, q.shape[2], k.shape[2], 0.0, False,
        scale=scale)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _same_twice(bwd, args):
    g1 = bwd(*args)
    g2 = bwd(*args)
    return all(torch.equal(a, b) for a, b in zip(g1, g2))


def probe(B, S, H, D, reps):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bshd = [torch.randn(B, S, H, D, device=dev, generator=g).bfloat16() for _ in range(4)]
    q, k, v, do = (x.transpose(1, 2) for x in bshd)  # [B, H, S, D] strided views
    qc, kc, vc, doc = (x.contiguous() for x in (q, k, v, do))
    scale = 1.0 / math.sqrt(D)
    print(f"== B={B} S={S} H={H} D={D} bf16")
    qa, ka, va = (x.detach().clone().requires_grad_() for x in (qc, kc, vc))

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(qa, ka, va)
        out.backward(doc)
    print(f"SDPA fwd+bwd (autograd)     {_time(sdpa, reps):8.3f} ms")
    of, lf = flash_fwd(qc, kc, vc, scale)
    oc, lc = cudnn_fwd(qc, kc, vc, scale)
    for name, fwd in (("flash", flash_fwd), ("cudnn", cudnn_fwd)):
        ms = _time(lambda: fwd(qc, kc, vc, scale), reps)
        print(f"{name} fwd                   {ms:8.3f} ms")
    print(f"lse shapes flash {tuple(lf.shape)} {lf.dtype}, cudnn {tuple(lc.shape)} {lc.dtype}")
    r = A._scaled_dot_product_cudnn_attention(qc, kc, vc, None, True, 0.0, False, False,
                                              scale=scale)
    print("cudnn fwd returns cum_seq_q", None if r[2] is None else tuple(r[2].shape),
          "philox", [None if t is None else (tuple(t.shape), t.dtype) for t in r[6:8]])
    lc3 = lc.reshape(lf.shape).float()
    ratio = (lc3 / lf).median().item()
    print(f"cudnn lse / flash lse (median) {ratio:.6f}; out rel diff {_rel(oc, of):.2e}")
    fl_args = (doc, qc, kc, vc, of, lf, scale)
    cu_args = (doc, qc, kc, vc, of, (lf / ratio).reshape(lc.shape).to(lc.dtype), scale)
    print(f"flash bwd                   {_time(lambda: flash_bwd(*fl_args), reps):8.3f} ms")
    print(f"cudnn bwd (contiguous)      {_time(lambda: cudnn_bwd(*cu_args), reps):8.3f} ms")
    gf = flash_bwd(*fl_args)
    gc = cudnn_bwd(*cu_args)
    print("grad rel diff cudnn vs flash: " +
          ", ".join(f"{_rel(a, b):.2e}" for a, b in zip(gc, gf)))
    try:
        strided = (do, q, k, v, of, cu_args[5], scale)
        gs = cudnn_bwd(*strided)
        print("cudnn bwd on [B,T,H,D] views: grad rel diff vs contiguous " +
              ", ".join(f"{_rel(a, b):.2e}" for a, b in zip(gs, gc)) +
              f"; {_time(lambda: cudnn_bwd(*strided), reps):.3f} ms")
    except RuntimeError as e:
        print(f"cudnn bwd on [B,T,H,D] views: refused: {str(e)[:200]}")
    for det in (False, True):
        torch.use_deterministic_algorithms(det)
        print(f"deterministic={det}: flash same bits twice {_same_twice(flash_bwd, fl_args)}, "
              f"cudnn {_same_twice(cudnn_bwd, cu_args)}")
        if det:
            for name, bwd, args_ in (("flash", flash_bwd, fl_args), ("cudnn", cudnn_bwd, cu_args)):
                ms = _time(lambda: bwd(*args_), reps)
                print(f"  {name} bwd (deterministic)  {ms:8.3f} ms")
    torch.use_deterministic_algorithms(False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1:32760:20:128,1:32760:2:128,1:4095:40:128")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    for item in args.shapes.split(","):
        probe(*(int(x) for x in item.split(":")), args.reps)


if __name__ == "__main__":
    main()
