#!/usr/bin/env python3
"""One rank's share of a sequence-parallel (Ulysses) training step of a DiT block, run alone on
one device: the compute efficiency eff(d, S) that the planner's SP cost term divides by.

    python -m bench.sp.block_share [--models wan2.1-1.3b,wan2.1-14b]
        [--tokens 1560,8190,32760,75600] [--degrees 2,4,8] [--reps 3] [--device cuda|cpu]
        [--out-dir DIR]

A diffusers ``WanTransformerBlock`` at the model's dimensions, forward + backward, batch 1, bf16
(fp32 on the CPU), 512 text tokens, no rotary (its cost is the same at every degree):
- degree 1: the block on S tokens, ``T1``;
- degree d: the block on S / d tokens whose self-attention runs as one Ulysses rank does: its
  tokens' q, k, v for H / d heads over all S tokens (the local rows repeated d times stand for
  the rows an all-to-all brings; the copies stand for its packing), the output's S / d rows for
  all H heads back. No communication: that is the simulator's term. ``Td``.
eff(d, S) = T1 / (d * Td): 1 when the share is a perfect 1 / d of the work. Writes
DIR/sp-block-share.md, and ``--json`` the efficiencies (docs/balance.md, "Sequence parallelism
per micro-batch").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

from bench import reporter
from bench.common import int_list, name_list
from bench.timing import time_fn

# name: (dim, ffn_dim, heads)
MODELS: Dict[str, tuple] = {"wan2.1-1.3b": (1536, 8960, 12), "wan2.1-14b": (5120, 13824, 40),
                            "tiny": (64, 128, 8)}
TEXT_TOKENS = 512
MAX_TOKENS = 1 << 20


class UlyssesShare:
    """A WanAttention processor computing one Ulysses rank's self-attention of ``d`` ranks
    from its own S / d tokens: q, k, v of H / d heads over S rows, the output rows back."""

    def __init__(self, d: int):
        self.d = d

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        import torch.nn.functional as F
        d, h = self.d, attn.heads
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (h, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (h, -1))
        v = attn.to_v(hidden_states).unflatten(2, (h, -1))
        g = h // d  # this rank's head group
        q, k, v = (t[:, :, :g].repeat(1, d, 1, 1).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)  # [B, S, g, hd]
        o = o[:, :hidden_states.shape[1]].repeat(1, 1, d, 1).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](o))


def _block(model: str, dev, dtype):
    import torch
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    dim, ffn, heads = MODELS[model]
    torch.manual_seed(0)
    with torch.device(dev):
        block = WanTransformerBlock(dim, ffn, heads, "rms_norm_across_heads", True, 1e-6)
    return block.to(dtype)


def _step_fn(block, dim: int, tokens: int, dev, dtype):
    """forward + backward of the block (width ``dim``) on ``tokens`` rows (inputs made once)."""
    import torch
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, tokens, dim, device=dev, generator=g).to(dtype).requires_grad_()
    text = torch.randn(1, TEXT_TOKENS, dim, device=dev, generator=g).to(dtype)
    temb = torch.randn(1, 6, dim, device=dev, generator=g).to(dtype)
    grad = torch.randn_like(x)

    def step():
        block(x, text, temb, None).backward(grad)
    return step


def _measure(block, dim, tokens, d, args, dev, dtype):
    """(Timing, peak MiB or None) of the degree-d share of S = ``tokens``."""
    import torch
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    block.attn1.set_processor(UlyssesShare(d) if d > 1 else WanAttnProcessor())
    step = _step_fn(block, dim, -(-tokens // d), dev, dtype)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time_fn(step, warmup=1, reps=args.reps, min_reps=1)
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None
    block.zero_grad(set_to_none=True)
    return t, peak


def model_rows(model, args, dev, dtype, eff):
    rows = []
    block = _block(model, dev, dtype)
    dim, _, heads = MODELS[model]
    for S in args.tokens:
        t1, p1 = _measure(block, dim, S, 1, args, dev, dtype)
        rows.append([model, S, 1, *reporter.timing_cells(t1), "1.000", _mib(p1)])
        for d in args.degrees:
            if heads % d:
                continue
            td, pd = _measure(block, dim, S, d, args, dev, dtype)
            e = t1.median_ms / (d * td.median_ms)
            eff.setdefault(model, {}).setdefault(str(d), {})[str(S)] = round(e, 4)
            rows.append([model, S, d, *reporter.timing_cells(td), f"{e:.3f}", _mib(pd)])
    return rows


def _mib(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


COLUMNS = ["model", "S", "d", *reporter.TIMING_COLUMNS, "eff(d, S)", "peak MiB"]


def run(args):
    import torch
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows, eff = [], {}
    for model in args.models:
        rows += model_rows(model, args, dev, dtype, eff)
        print(reporter.table(COLUMNS, rows), flush=True)
    notes = ("One WanTransformerBlock, forward + backward, batch 1, 512 text tokens, "
             f"{'bf16' if dev.type == 'cuda' else 'fp32'}; degree d: one Ulysses rank's share "
             "(S / d tokens, self-attention of H / d heads over S), no communication. "
             "eff(d, S) = T(1) / (d T(d)).")
    text = reporter.report("One rank's share of a sequence-parallel DiT block step", COLUMNS,
                           rows, notes=notes, argv=sys.argv)
    return text, eff


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=lambda t: name_list(t, "--models", MODELS),
                    default=["wan2.1-1.3b", "wan2.1-14b"])
    ap.add_argument("--tokens", type=lambda t: int_list(t, "--tokens", 8, MAX_TOKENS),
                    default=[1560, 8190, 32760, 75600])
    ap.add_argument("--degrees", type=lambda t: int_list(t, "--degrees", 2, 64),
                    default=[2, 4, 8])
    ap.add_argument("--reps", type=lambda t: int_list(t, "--reps", 1, 100)[0], default=3)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--json", default=None, help="also write the efficiencies here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    text, eff = run(args)
    reporter.write(os.path.join(args.out_dir, "sp-block-share.md"), text)
    if args.json:
        reporter.write(args.json, json.dumps(eff, indent=1, sort_keys=True) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
