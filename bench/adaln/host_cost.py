#!/usr/bin/env python3
"""Host cost per call of the fused AdaLN ops against the eager chain they replace, on CPU with
tiny tensors (so that Python, dispatch and autograd bookkeeping dominate, as they do on a GPU
at ~1,024 tokens), and what each saves for backward at a model's size.

    python -m bench.adaln.host_cost [--out bench/results/adaln-host-cost_cpu_2026-12.md] [--quick]
        [--number N] [--repeat R] [--no-block-compile] [--saved-tokens 1024] [--saved-dim 1536]

Rows (adaln, gated, a tiny Wan block; eager and compiled) and modes (fwd no_grad, fwd grad,
fwd+bwd), cells in microseconds of this thread's CPU time per call; the saved-for-backward bytes
and peak memory of one Wan 2.1 1.3B block. The workload and method: docs/diffusers/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from bench import reporter
from bench.timing import time_interleaved
from ditscale import ops

B, N, D = 2, 8, 64
EPS = 1e-6
MODES = ("fwd no_grad", "fwd grad", "fwd+bwd")


# ---- the functions under test ---------------------------------------------------------------

def ours_adaln(x, emb):
    shift, scale = emb.chunk(6, dim=1)[:2]
    return ops.adaln(x, scale, shift, eps=EPS)


def eager_adaln(x, emb):
    shift, scale = emb.chunk(6, dim=1)[:2]
    return F.layer_norm(x, (x.shape[-1],), eps=EPS) * (1 + scale[:, None]) + shift[:, None]


def ours_gated(x, branch, emb):
    shift, scale, gate = emb.chunk(6, dim=1)[:3]
    h, y = ops.adaln_gated(x, gate, branch, scale, shift, eps=EPS)
    return y


def eager_gated(x, branch, emb):
    shift, scale, gate = emb.chunk(6, dim=1)[:3]
    h = x + gate[:, None] * branch
    return F.layer_norm(h, (h.shape[-1],), eps=EPS) * (1 + scale[:, None]) + shift[:, None]


KINDS: Dict[str, Tuple[Callable, Callable, int]] = {
    # kind: (ours, eager, number of [B, N, D] activation inputs)
    "adaln": (ours_adaln, eager_adaln, 1),
    "gated": (ours_gated, eager_gated, 2),
}


# ---- timing ---------------------------------------------------------------------------------

def make_inputs(acts: int, grad: bool):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(B, N, D, generator=g).requires_grad_(grad) for _ in range(acts)]
    emb = (torch.randn(B, 6 * D, generator=g) * 0.1).requires_grad_(grad)
    dy = torch.randn(B, N, D, generator=g)
    return xs, emb, dy


def step_of(fn: Callable, mode: str, acts: int) -> Callable[[], None]:
    xs, emb, dy = make_inputs(acts, grad=mode != "fwd no_grad")
    if mode == "fwd no_grad":
        def step():
            with torch.no_grad():
                fn(*xs, emb)
    elif mode == "fwd grad":
        def step():
            fn(*xs, emb)
    else:
        def step():
            fn(*xs, emb).backward(dy)
    return step


def per_call_us(step: Callable[[], None], number: int) -> float:
    """One step's CPU time (us): the smallest of 7 repeats of ``number`` calls."""
    return per_call_us_interleaved([step], number)[0]


def per_call_us_interleaved(steps: List[Callable[[], None]], number: int,
                            repeat: int = 7) -> List[float]:
    """Each step's CPU time per call (us), the repeats of the steps interleaved (so that a burst
    of load on a shared machine hits them alike), the smallest repeat of each."""
    # warm-up (compile, allocator, caches), then `repeat` rounds of `number` calls of each step
    res = time_interleaved(steps, warmup=max(3, number // 10), rounds=repeat, calls=number,
                           clock="thread")
    return [t.min_ms * 1e3 for t in res.timings]


def host_rows(number: int, repeat: int) -> List[Tuple[str, str, float, float]]:
    rows = []
    for compiled in (False, True):
        for kind, (ours, eager, acts) in KINDS.items():
            for mode in MODES:
                steps = []
                for fn in (ours, eager):
                    if compiled:
                        fn = torch.compile(fn, fullgraph=True, dynamic=False)
                    steps.append(step_of(fn, mode, acts))
                cells = per_call_us_interleaved(steps, number, repeat)
                label = f"{kind}{' compiled' if compiled else ''}"
                rows.append((label, mode, cells[0], cells[1]))
                print(f"{label:16s} {mode:12s} ours {cells[0]:8.1f} us  eager {cells[1]:8.1f} us",
                      file=sys.stderr)
                torch._dynamo.reset()
    return rows


# ---- saved for backward ---------------------------------------------------------------------

def saved_bytes(fn: Callable, args) -> Tuple[int, int, List[str]]:
    """(bytes of the tensors autograd saves that are not among ``args``, bytes of saved args,
    one description per saved storage), each storage counted once."""
    seen: Dict[int, Tuple[int, bool, str]] = {}
    arg_ptrs = {a.untyped_storage().data_ptr() for a in args if torch.is_tensor(a)}

    def pack(t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in seen:
            what = f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"
            seen[ptr] = (s.nbytes(), ptr in arg_ptrs, what + (" (input)" if ptr in arg_ptrs
                                                               else ""))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    extra = sum(n for n, is_arg, _ in seen.values() if not is_arg)
    inputs = sum(n for n, is_arg, _ in seen.values() if is_arg)
    return extra, inputs, [w for _, _, w in seen.values()]


def saved_rows(tokens: int, dim: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, dim, generator=g).bfloat16().requires_grad_()
    br = torch.randn(1, tokens, dim, generator=g).bfloat16().requires_grad_()
    emb = (torch.randn(1, 6 * dim, generator=g) * 0.1).requires_grad_()  # fp32, as Wan's
    rows = []
    for kind, (ours, eager, acts) in KINDS.items():
        args = (x, emb) if acts == 1 else (x, br, emb)
        for who, fn in (("ours", ours), ("eager", eager)):
            extra, inputs, what = saved_bytes(fn, args)
            rows.append((kind, who, extra, inputs, "; ".join(what)))
    return rows


def wan_block_pair(tokens: int, heads: int = 12, head_dim: int = 128, ffn: int = 8960,
                   context: int = 512):
    """(stock block, fused block, inputs) of one WanTransformerBlock (default: Wan 2.1 1.3B's
    dimensions), random weights, bf16 with diffusers' fp32 modules; the video tokens are the
    nearest 4 x side x side latent's (4 (side / 2)^2)."""
    import copy

    from diffusers import WanTransformer3DModel

    import ditscale.diffusers as dd

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
        in_channels=16, out_channels=16, text_dim=64, freq_dim=256, ffn_dim=ffn, num_layers=1)
    fp32 = {n for n, t in model.state_dict().items()
            if any(k in n.split(".") for k in model._keep_in_fp32_modules)}
    model = model.to(torch.bfloat16)
    for name, t in model.state_dict(keep_vars=True).items():
        if name in fp32:
            t.data = t.data.float()
    fused = dd.apply_fused_adaln(copy.deepcopy(model))
    g = torch.Generator().manual_seed(0)
    side = int(round((tokens / 4) ** 0.5)) * 2  # latent 4 x side x side: 4 (side / 2)^2 tokens
    rotary = model.rope(torch.zeros(1, 16, 4, side, side))
    S, D = rotary[0].shape[1], heads * head_dim
    args = (torch.randn(1, S, D, generator=g).bfloat16(),
            torch.randn(1, context, D, generator=g).bfloat16(),
            torch.randn(1, 6, D, generator=g).bfloat16(), rotary)
    return model.blocks[0], fused.blocks[0], args


def block_step(block, args, mode: str) -> Callable[[], None]:
    x, c, t, rot = args
    grad = mode != "fwd no_grad"
    x, t = x.clone().requires_grad_(grad), t.clone().requires_grad_(grad)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype)
    if mode == "fwd no_grad":
        def step():
            with torch.no_grad():
                block(x, c, t, rot)
    elif mode == "fwd grad":
        def step():
            block(x, c, t, rot)
    else:
        def step():
            block(x, c, t, rot).backward(dy)
    return step


def block_host_rows(number: int, repeat: int, compiled_too: bool):
    """Host cost of a tiny WanTransformerBlock (D 64, 2 heads, ffn 128, 16 video and 8 context
    tokens, bf16): stock vs apply_fused_adaln, eager and (``compiled_too``) under
    torch.compile(block, fullgraph=True) as diffusers' regional compile does. Compiled, the
    fused block is measured with the fused ops (_adaln_common.COMPILED_STOCK_MAX_ROWS = 0; by
    default a block this small runs diffusers' own forward when compiled)."""
    from ditscale.diffusers import _adaln_common

    stock, fused, args = wan_block_pair(16, heads=2, head_dim=32, ffn=128, context=8)
    limit = getattr(_adaln_common, "COMPILED_STOCK_MAX_ROWS", None)
    _adaln_common.COMPILED_STOCK_MAX_ROWS = 0
    try:
        return _block_host_rows(stock, fused, args, number, repeat, compiled_too)
    finally:
        _adaln_common.COMPILED_STOCK_MAX_ROWS = limit


def _block_host_rows(stock, fused, args, number: int, repeat: int, compiled_too: bool):
    rows = []
    for compiled in (False, True) if compiled_too else (False,):
        for mode in MODES:
            blocks = [torch.compile(b, fullgraph=True, dynamic=False) if compiled else b
                      for b in (fused, stock)]
            cells = per_call_us_interleaved([block_step(b, args, mode) for b in blocks],
                                            max(1, number // 4), repeat)
            label = f"Wan block{' compiled' if compiled else ''}"
            rows.append((label, mode, cells[0], cells[1]))
            print(f"{label:16s} {mode:12s} fused {cells[0]:8.1f} us  stock {cells[1]:8.1f} us",
                  file=sys.stderr)
            torch._dynamo.reset()
    return rows


def block_peak_mib(block, args):
    """Peak CPU memory of block(*args) and its backward above the start (MiB), or None."""
    try:
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import MemoryProfileTimeline
    except ImportError:
        return None
    x, c, t, rot = args
    x, t = x.clone().requires_grad_(), t.clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        out = block(x, c, t, rot)
        out.backward(torch.ones_like(out))
        del out
    block.zero_grad(set_to_none=True)
    try:
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(
            torch.device("cpu"))
    except Exception:  # noqa: BLE001 - a private API: report n/a rather than fail the bench
        return None
    totals = [sum(s) for s in sizes]
    return (max(totals) - totals[0]) / (1024.0 * 1024.0) if totals else None


def block_rows(tokens: int):
    stock, fused, args = wan_block_pair(tokens)
    params = {p.untyped_storage().data_ptr() for b in (stock, fused) for p in b.parameters()}
    rows = []
    for who, block in (("stock", stock), ("fused", fused)):
        x, c, t, rot = args
        x, t = x.clone().requires_grad_(), t.clone().requires_grad_()
        seen: Dict[int, int] = {}

        def pack(tensor):
            s = tensor.untyped_storage()
            if s.data_ptr() not in params:
                seen.setdefault(s.data_ptr(), s.nbytes())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = block(x, c, t, rot)
        del out
        inputs = {a.untyped_storage().data_ptr() for a in (x, c, t, *rot)}
        saved = sum(n for p, n in seen.items() if p not in inputs)
        rows.append((who, args[0].shape[1], saved / (1024.0 * 1024.0),
                     block_peak_mib(block, args)))
    return rows


# ---- report ---------------------------------------------------------------------------------

def table(rows, saved, blocks, tokens: int, dim: int) -> str:
    head = [f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads; x [{B}, {N}, {D}] fp32; "
            "Wan block rows: ours = apply_fused_adaln, eager = the stock block",
            "", "| op | mode | ours (us) | eager (us) | eager / ours |", "|---|---|---|---|---|"]
    body = [f"| {k} | {m} | {o:.1f} | {e:.1f} | {e / o:.2f} |" for k, m, o, e in rows]
    mib = 1024.0 * 1024.0
    sv = ["", f"Saved for backward, x [1, {tokens}, {dim}] bf16, modulation fp32 (MiB; inputs "
          "the caller holds anyway apart):", "",
          "| op | who | saved beyond inputs (MiB) | saved inputs (MiB) | tensors |",
          "|---|---|---|---|---|"]
    sv += [f"| {k} | {w} | {e / mib:.2f} | {i / mib:.2f} | {what} |"
           for k, w, e, i, what in saved]
    bl = ["", "One WanTransformerBlock of Wan 2.1 1.3B, bf16, forward+backward on CPU (MiB):", "",
          "| block | tokens | saved for backward | peak above start |", "|---|---|---|---|"]
    bl += [f"| {w} | {n} | {s:.1f} | {'n/a' if p is None else f'{p:.1f}'} |"
           for w, n, s, p in blocks]
    return "\n".join(head + body + sv + bl) + "\n"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the markdown tables there too")
    p.add_argument("--quick", action="store_true", help="fewer calls per repeat (noisier)")
    p.add_argument("--number", type=int, default=0, help="calls per repeat (0: 100, quick 20)")
    p.add_argument("--repeat", type=int, default=15, help="repeats (the smallest is kept)")
    p.add_argument("--no-block-compile", action="store_true",
                   help="leave out the compiled Wan block rows (their compiles take minutes)")
    p.add_argument("--saved-tokens", type=int, default=1024)
    p.add_argument("--saved-dim", type=int, default=1536)
    args = p.parse_args(argv)
    for name in ("number", "repeat", "saved_tokens", "saved_dim"):
        lo = 0 if name == "number" else 1
        if not lo <= getattr(args, name) <= 1 << 20:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is out of range "
                    f"[{lo}, {1 << 20}]")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if not ops.is_available():
        print(f"host_cost: ditscale ops unavailable: {ops.load_error()}", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    number = args.number or (20 if args.quick else 100)
    rows = host_rows(number, args.repeat)
    rows += block_host_rows(number, args.repeat, compiled_too=not args.no_block_compile)
    saved = saved_rows(args.saved_tokens, args.saved_dim)
    blocks = block_rows(args.saved_tokens)
    text = "\n".join(reporter.header_lines(
        "Host cost of the fused AdaLN ops against the eager chain (CPU)")) + "\n" + table(
        rows, saved, blocks, args.saved_tokens, args.saved_dim)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
