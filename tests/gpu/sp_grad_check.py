"""GPU correctness of the gradients of ditscale.sp.attention against dense autograd.

    torchrun --nproc-per-node 2 tests/gpu/sp_grad_check.py [--tol 3e-2]

On a 1 x N mesh (N GPUs of one host, NCCL): strategies ulysses, ring, usp and ulysses-overlap,
eagerly and (ulysses, ring) under torch.compile, with joint text tokens, grouped kv heads, an
uneven token split, bf16 and fp32. Eagerly, ulysses, ring, usp and ulysses-overlap (as ulysses)
run torch_usp.py (forward over PyTorch's point-to-point transfers, the LSE saved, its own
backward); the compiled steps run the GPU executor's forward and the backward by recomputation
(torch_backward.py). Every rank holds its shard of q, k, v (and the full joint text), its
own upstream gradients (the loss of rank r is <out_r, g_r> + <joint_out_r, t_r>); the dense
reference is fp32 autograd of the sum of every rank's loss over the full sequence, computed on
each rank. Compared: this rank's q, k, v gradients, and the joint inputs' gradients summed over
the ranks (each rank holds those of its heads). Tolerance: max |err| / max |ref| <= --tol (bf16),
1e-4 (fp32). Prints one line per case, a summary table last; exits 1 on any failure.
"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

# (batch, image tokens, text tokens, heads, kv heads, head_dim, dtype)
SHAPES = [(1, 4099, 77, 8, 8, 64, torch.bfloat16), (2, 1023, 13, 12, 4, 64, torch.bfloat16),
          (1, 517, 9, 6, 6, 32, torch.float32)]
STRATEGIES = [("ulysses", False), ("ring", False), ("usp", False), ("ulysses-overlap", False),
              ("ulysses", True), ("ring", True)]


def dense(full, ups, text: int, world: int, sp):
    """Dense fp32 gradients of q, k, v [B, T + S, H or Hk, D] of the sum of every rank's loss."""
    q, k, v = (x.float().detach().requires_grad_() for x in full)
    g = q.shape[2] // k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2),
        v.repeat_interleave(g, 2).transpose(1, 2)).transpose(1, 2)
    S = q.shape[1] - text
    loss = out[:, :text].mul(sum(t for _, t in ups)).sum() if text else 0.0
    for r, (g_img, _) in enumerate(ups):
        b, c = sp.shard_range(S, world, r)
        loss = loss + out[:, text + b:text + b + c].mul(g_img).sum()
    return torch.autograd.grad(loss, (q, k, v))


def case(rank, world, shape, strategy, compiled, seed, sp):
    B, S, T, H, HK, D, dtype = shape
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(seed)
    full = [torch.randn(B, T + S, h, D, device=dev, generator=gen).to(dtype) for h in (H, HK, HK)]
    ups = [(torch.randn(B, sp.shard_range(S, world, r)[1], H, D, device=dev, generator=gen),
            torch.randn(B, T, H, D, device=dev, generator=gen)) for r in range(world)]
    ref = dense(full, ups, T, world, sp)
    b, c = sp.shard_range(S, world, rank)
    mine = [x[:, T + b:T + b + c].clone().requires_grad_() for x in full]
    joint = [x[:, :T].clone().requires_grad_() for x in full]
    mesh = sp.Mesh(1, world)

    def loss_of(q, k, v, tq, tk, tv):
        out, tout = sp.attention(q, k, v, mesh=mesh, strategy=strategy, joint_q=tq,
                                 joint_k=tk, joint_v=tv)
        return (out.float().mul(ups[rank][0]).sum() + tout.float().mul(ups[rank][1]).sum())

    fn = torch.compile(loss_of, fullgraph=True) if compiled else loss_of
    fn(*mine, *joint).backward()
    errs = []
    for x, want in zip(mine, ref):
        errs.append(float((x.grad.float() - want[:, T + b:T + b + c]).abs().max()))
    for x, want in zip(joint, ref):
        total = x.grad.float()
        dist.all_reduce(total)
        errs.append(float((total - want[:, :T]).abs().max()))
    return max(errs) / max(float(w.abs().max()) for w in ref)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tol", type=float, default=3e-2, help="bf16 tolerance (fp32: 1e-4)")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local),
                            timeout=datetime.timedelta(seconds=120))
    import ditscale.sp as sp
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, failed = [], 0
    for i, shape in enumerate(SHAPES):
        for strategy, compiled in STRATEGIES:
            label = f"{strategy}{' compiled' if compiled else ''} {tuple(shape[:6])} {shape[6]}"
            try:
                err = case(rank, world, shape, strategy, compiled, 100 + i, sp)
                tol = args.tol if shape[6] != torch.float32 else 1e-4
                ok = err <= tol
                rows.append((label, f"{err:.2e}", "ok" if ok else "FAIL"))
            except Exception as e:  # noqa: BLE001  (reported per case, then the exit status)
                ok = False
                rows.append((label, "-", f"ERROR {type(e).__name__}: {e}"[:120]))
            failed += not ok
            if rank == 0:
                print(" | ".join(rows[-1]), flush=True)
    if rank == 0:
        print(f"\n| case | max err / max ref | result |\n|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} |")
        print(f"\n{len(rows) - failed} of {len(rows)} cases passed on {world} GPUs")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
