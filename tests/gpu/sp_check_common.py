"""What the sequence-parallel GPU checks share (sp_attention_check.py under torchrun,
sp_local_check.py in one process): the full-sequence inputs, the dense fp32 reference and which
configurations the runtime refuses by design."""

import torch


def dense_case(dev, B, S, T, H, HK, D, dtype, seed):
    """Full inputs, joint text tokens first (q [B, T + S, H, D], k and v [B, T + S, HK, D] in
    `dtype`, standard normal from `seed`) and the fp32 attention over all of them (non-causal,
    scale 1/sqrt(D), grouped kv heads expanded): (q, k, v, reference)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, T + S, H, D, device=dev, generator=g, dtype=torch.float32).to(dtype)
    k = torch.randn(B, T + S, HK, D, device=dev, generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(B, T + S, HK, D, device=dev, generator=g, dtype=torch.float32).to(dtype)
    rk, rv = k.float(), v.float()
    if HK != H:
        rk, rv = rk.repeat_interleave(H // HK, 2), rv.repeat_interleave(H // HK, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), rk.transpose(1, 2), rv.transpose(1, 2)).transpose(1, 2)
    return q, k, v, ref


def refused(strategy, chunks, machines, gpus_per_machine, kv_heads):
    """True when the runtime refuses the configuration by design: a Ulysses degree above the kv
    heads (each Ulysses rank needs a kv head), or more Ulysses head chunks than kv heads per rank.
    The Ulysses degree: every rank for ulysses / ulysses-overlap, the GPUs of a machine for usp,
    none for ring, the machines for swiftfusion-tas and torus."""
    n = machines * gpus_per_machine
    u = {"ulysses": n, "ulysses-overlap": n, "ring": 1, "usp": gpus_per_machine}.get(strategy,
                                                                                   machines)
    return u > kv_heads or (strategy == "ulysses" and chunks > kv_heads // u)
