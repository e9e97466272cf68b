"""GPU correctness of ditscale.sp.attention against single-device attention on the full sequence.

    torchrun --nproc-per-node 2 tests/gpu/sp_attention_check.py [--emulate-machines 2] [--quick]

Every strategy (ulysses plain and in 2 head chunks, ulysses-overlap, ring, usp, swiftfusion-tas,
torus with 1-3 chunks), the transports
(NCCL; NVSHMEM when built with it: "nvshmem" on real machines or one host, "nvshmem-intra" -- puts
within machines, NCCL between them -- on meshes of several machines; emulated machines refuse
"nvshmem", whose puts would bypass the emulated link), meshes 1 x N (NVLink) and N x 1 (the machine
split, over NVLink, or over NCCL's socket transport with --emulate-machines), with joint text
tokens, uneven
heads (3 heads on 2 ranks), grouped kv heads, batch 2, an uneven sequence split and fp16. Each
rank gathers q, k, v and compares its output with fp32 attention over everything (bf16/fp16
tolerance: max |err| / max |ref| <= 2e-2) and checks that a second run gives identical bits.
Prints one line per case, a summary table last; exits 1 on any failure.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from sp_check_common import dense_case, refused


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--emulate-machines", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--tiny", action="store_true",
                    help="two small cases, NCCL only (for compute-sanitizer)")
    ap.add_argument("--tol", type=float, default=2e-2)
    args = ap.parse_args()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    import ditscale.sp as sp

    if args.emulate_machines:
        sp.emulate_machines(args.emulate_machines)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    detected = sp.Mesh.from_process_group()
    meshes = [detected]
    if detected.machines == 1 and world > 1:
        meshes.append(sp.Mesh(world, 1))  # the machine split on this host's NVLink
        if world >= 4 and world % 2 == 0:  # both degrees of the hybrids > 1
            meshes.append(sp.Mesh(2, world // 2))
    nvshmem_ok = not torch.ops.ditscale.sp_nvshmem_unavailable()
    emulated = sp.emulated_machines() > 1

    # (batch, seq, text, heads, kv_heads, head_dim, dtype)
    shapes = [(2, 1024, 77, 6, 6, 64, torch.bfloat16),
              (1, 1031, 0, 3, 3, 128, torch.bfloat16),
              (1, 512, 64, 4, 2, 128, torch.float16)]
    strategies = [("ulysses", 1), ("ulysses", 2), ("ulysses-overlap", 1), ("ring", 1), ("usp", 1),
                  ("swiftfusion-tas", 1), ("torus", 1), ("torus", 2), ("torus", 3)]
    if args.quick:
        shapes = shapes[:1]
        strategies = [("ulysses", 1), ("ulysses", 2), ("ulysses-overlap", 1), ("ring", 1),
                      ("torus", 2)]
    if args.tiny:
        shapes = [(1, 256, 16, 2, 2, 64, torch.bfloat16)]
        strategies = [("ring", 1), ("torus", 2)]
        nvshmem_ok = False
        meshes = meshes[:1]

    def cases(mesh):
        """(strategy, chunks, transport) to run on `mesh`."""
        several = mesh.machines > 1
        # "nvshmem-intra" differs from "nccl" only where a machine has several GPUs, except on
        # emulated machines, where it is the one-sided transport that is allowed.
        intra = nvshmem_ok and several and (emulated or mesh.gpus_per_machine > 1)
        ts = ["nccl"] + (["nvshmem"] if nvshmem_ok and not (emulated and several) else [])
        out = [(s, c, t) for s, c in strategies
               for t in ts + (["nvshmem-intra"] if intra and not args.quick else [])]
        if intra and args.quick:  # a small --quick: the two strategies TAS / torus only
            out += [(s, c, "nvshmem-intra") for s, c in (("swiftfusion-tas", 1), ("torus", 2))]
        return out

    transports = sorted({t for m in meshes for _, _, t in cases(m)})

    rows, failures = [], 0
    for mesh in meshes:
        for (B, S, T, H, HK, D, dt) in shapes:
            full_q, full_k, full_v, ref = dense_case(dev, B, S, T, H, HK, D, dt, 1000 + S + T)
            begin, count = sp.shard_range(S, world, rank)
            sl = slice(T + begin, T + begin + count)
            q, k, v = full_q[:, sl], full_k[:, sl], full_v[:, sl]
            jq, jk, jv = ((full_q[:, :T], full_k[:, :T], full_v[:, :T]) if T else
                          (None, None, None))
            ref_out, ref_text = ref[:, sl], ref[:, :T]
            scale_ref = ref.abs().max().item()
            for strategy, chunks, transport in cases(mesh):
                name = (f"{mesh.machines}x{mesh.gpus_per_machine} {strategy}"
                        f"{'/' + str(chunks) if strategy == 'torus' or chunks > 1 else ''} {transport} "
                        f"B{B} S{S} T{T} H{H}/{HK} D{D} {str(dt)[6:]}")
                t0 = time.time()
                # More Ulysses ranks than kv heads is refused by design, and so are more Ulysses
                # head chunks than kv heads per rank; the check expects those refusals.
                refusal = refused(strategy, chunks, mesh.machines, mesh.gpus_per_machine, HK)
                inputs = [x.clone() for x in (q, k, v) + ((jq, jk, jv) if T else ())]
                try:
                    def run():
                        r = sp.attention(q, k, v, mesh=mesh, strategy=strategy, chunks=chunks,
                                         transport=transport, joint_q=jq, joint_k=jk,
                                         joint_v=jv)
                        return r if T else (r, None)
                    out, tout = run()
                    sp.synchronize(mesh, dev, timeout_s=30)
                    err = (out.float() - ref_out).abs().max().item()
                    if T:
                        err = max(err, (tout.float() - ref_text).abs().max().item())
                    rel = err / scale_ref
                    out2, tout2 = run()
                    sp.synchronize(mesh, dev, timeout_s=30)
                    same = torch.equal(out, out2) and (not T or torch.equal(tout, tout2))
                    # Worst over ranks.
                    t = torch.tensor([rel, 0.0 if same else 1.0], device=dev)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    rel, differs = t[0].item(), t[1].item() > 0
                    # The caller's tensors are inputs only (a ring once reused them as buffers).
                    kept = all(torch.equal(a, b) for a, b in
                               zip(inputs, (q, k, v) + ((jq, jk, jv) if T else ())))
                    t = torch.tensor([0.0 if kept else 1.0], device=dev)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    clobbered = t.item() > 0
                    ok = rel <= args.tol and not differs and not clobbered and not refusal
                    status = ("ok" if ok else "INPUTS OVERWRITTEN" if clobbered else
                              "NOT REFUSED (Ulysses degree or head chunks > kv heads)" if refusal else
                              "NOT DETERMINISTIC" if differs else "WRONG")
                except Exception as e:  # noqa: BLE001 - reported, then the next case
                    if refusal and ("exceeds" in str(e) or "head chunks" in str(e)):
                        rel, ok, status = (float("nan"), True,
                                           "ok (refused: Ulysses degree or head chunks > kv heads)")
                    else:
                        rel, ok, status = float("nan"), False, f"ERROR {type(e).__name__}: {e}"
                for a, b in zip(inputs, (q, k, v) + ((jq, jk, jv) if T else ())):
                    b.copy_(a)  # the next case starts from the true inputs, whatever happened
                failures += 0 if ok else 1
                rows.append((name, rel, status))
                if rank == 0:
                    print(f"[{len(rows):3d}] {name:60s} rel err {rel:.2e} {status} "
                          f"({time.time() - t0:.1f} s)", flush=True)
    if rank == 0:
        print(f"\n| case | rel err | result |\n|---|---|---|")
        for name, rel, status in rows:
            print(f"| {name} | {rel:.2e} | {status.splitlines()[0][:120]} |")
        print(f"\n{len(rows) - failures}/{len(rows)} cases passed "
              f"(transports: {', '.join(transports)}; meshes: "
              f"{', '.join(f'{m.machines}x{m.gpus_per_machine}' for m in meshes)}"
              f"{'; emulated machines over sockets' if args.emulate_machines else ''}; one-sided "
              f"engine {os.environ.get('DITSCALE_SP_ONE_SIDED_ENGINE') or 'auto'})")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
