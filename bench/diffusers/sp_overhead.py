#!/usr/bin/env python3
"""What ``ditscale.diffusers.parallelize`` costs on one GPU: the parallelized transformer at world
size 1 against the stock module, bf16 inference (the forward of a denoising step), eager and
under ``torch.compile`` of the whole module, at the models' typical token counts.

    python -m bench.diffusers.sp_overhead [--models flux,wan2.1-1.3b] [--blocks 2]
        [--modes eager,compile] [--out-dir DIR]

Writes DIR/sp-overhead.md (+ .json); ``--device cpu`` measures the host time of the tiny configs
instead (DIR/sp-host-cpu.md). The set-up, rounds and columns: docs/diffusers/benchmarks.md.
"""

from __future__ import annotations

import gc
import datetime
import os
import sys
import tempfile

from bench.diffusers import cli
from bench.diffusers import models as M
from bench.diffusers.timing import measure_pair, rel_l2
from bench.timing import time_interleaved

DEFAULT_TOKENS = {"flux": (4096, 16384), "wan2.1-1.3b": (32760, 75600),
                  "wan2.1-14b": (32760,), "hunyuan-video": (32760,), "cogvideox-5b": (17550,),
                  "sd3.5-medium": (16384,)}


def build(name, args, parallel, compiled, dtype, dev):
    """(model, the callable to time) of ``name``: stock or parallelized, eager or compiled."""
    import torch

    import ditscale.diffusers as dd

    model, _ = M.make(name, args.blocks, dtype, dev)
    model.eval()
    if parallel:
        dd.parallelize(model, strategy=args.strategy)
    return model, (torch.compile(model) if compiled else model)


def run(args):
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = tempfile.NamedTemporaryFile(prefix="sp_overhead_", delete=False)
    store.close()
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))

    def compare(name, tokens, compiled):
        # Both built (the same seed: the same weights), then timed in alternating rounds.
        stock, run_stock = build(name, args, False, compiled, torch.bfloat16, dev)
        parallel, run_parallel = build(name, args, True, compiled, torch.bfloat16, dev)
        kw = M.inputs(name, stock, tokens, 1, torch.bfloat16, dev, seed=1)

        def step(fn):
            with torch.no_grad():
                return fn(**kw)[0]

        try:
            r = measure_pair(lambda: step(run_stock), lambda: step(run_parallel),
                             warmup=args.warmup, rounds=args.reps, reps=5, max_s=args.max_s)
            outs = [step(fn).float().cpu() for fn in (run_stock, run_parallel)]
        finally:
            del stock, parallel, run_stock, run_parallel, kw
            torch._dynamo.reset()
            gc.collect()  # a patched block's forward is bound to the block: a cycle
            torch.cuda.empty_cache()
        row = dict(stock_ms=r["a_ms"], parallel_ms=r["b_ms"], overhead=r["ratio"] - 1.0,
                   rel_l2=rel_l2(outs[1], outs[0]), rounds=r["rounds"])
        return row, (f"stock {r['a_ms']:8.2f} ms parallelized {r['b_ms']:8.2f} ms  overhead "
                     f"{100 * row['overhead']:+.2f}%  rel_l2 {row['rel_l2']:.1e}")

    try:
        return cli.sweep("sp_overhead", args, DEFAULT_TOKENS, compare)
    finally:
        dist.destroy_process_group()
        os.unlink(store.name)


# ---- --device cpu: host time of the tiny models --------------------------------------------------

# bench model name -> ditscale.diffusers.tiny pipeline name.
TINY = {"flux": "flux", "wan2.1-1.3b": "wan", "wan2.1-14b": "wan",
        "hunyuan-video": "hunyuan-video", "cogvideox-5b": "cogvideox", "sd3.5-medium": "sd3"}
TINY_TEXT = 8


def tiny_model(name):
    """The tiny transformer of bench model ``name`` (fp32, CPU, eval), seed 0."""
    from ditscale.diffusers import tiny

    return tiny.make_pipeline(TINY[name], "tiny").transformer


def tiny_inputs(name, model, tokens, batch=1):
    """Keyword arguments of the tiny ``model.forward`` with ``tokens`` image/video tokens (one
    frame or row of patches as the model's patching allows) and TINY_TEXT text tokens."""
    import torch

    g = torch.Generator().manual_seed(1)
    cfg = model.config
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    t = torch.full((batch,), 500.0)
    family = TINY[name]
    if family == "flux":
        ids = torch.stack([torch.zeros(tokens), torch.arange(tokens) // 4,
                           torch.arange(tokens) % 4], 1)
        return dict(hidden_states=rnd(batch, tokens, cfg.in_channels),
                    encoder_hidden_states=rnd(batch, TINY_TEXT, cfg.joint_attention_dim),
                    pooled_projections=rnd(batch, cfg.pooled_projection_dim), timestep=t / 1000,
                    img_ids=ids, txt_ids=torch.zeros(TINY_TEXT, 3),
                    guidance=torch.full((batch,), 3.5), return_dict=False)
    if family == "sd3":
        return dict(hidden_states=rnd(batch, cfg.in_channels, 2, 2 * tokens),
                    encoder_hidden_states=rnd(batch, TINY_TEXT, cfg.joint_attention_dim),
                    pooled_projections=rnd(batch, cfg.pooled_projection_dim), timestep=t,
                    return_dict=False)
    if family == "wan":
        return dict(hidden_states=rnd(batch, cfg.in_channels, 1, 2, 2 * tokens), timestep=t,
                    encoder_hidden_states=rnd(batch, TINY_TEXT, cfg.text_dim), return_dict=False)
    if family == "hunyuan-video":
        return dict(hidden_states=rnd(batch, cfg.in_channels, 1, 2, 2 * tokens), timestep=t,
                    encoder_hidden_states=rnd(batch, TINY_TEXT, cfg.text_embed_dim),
                    encoder_attention_mask=torch.ones(batch, TINY_TEXT, dtype=torch.int64),
                    pooled_projections=rnd(batch, cfg.pooled_projection_dim),
                    guidance=torch.full((batch,), 6000.0), return_dict=False)
    from diffusers.models.embeddings import get_3d_rotary_pos_embed  # cogvideox

    cos, sin = get_3d_rotary_pos_embed(embed_dim=cfg.attention_head_dim,
                                       crops_coords=((0, 0), (1, tokens)),
                                       grid_size=(1, tokens), temporal_size=1)
    return dict(hidden_states=rnd(batch, 1, cfg.in_channels, 2, 2 * tokens),
                encoder_hidden_states=rnd(batch, TINY_TEXT, cfg.text_embed_dim),
                timestep=t.long(), image_rotary_emb=(cos, sin), return_dict=False)


def attention_calls(model) -> int:
    """The attention modules a forward of ``model`` runs (diffusers' AttentionModuleMixin), the
    text refiner's included."""
    return sum(1 for m in model.modules()
               if hasattr(m, "processor") and hasattr(m, "set_processor"))


def host_us(fns, reps, inner):
    """The least thread (CPU) time of one call of each of ``fns`` in us: ``reps`` samples of
    ``inner`` calls each, the functions taking turns sample by sample (a busy phase of a shared
    machine hits them alike; the least sample is the one it disturbed least), after ``inner``
    warm-up calls each (bench.timing's thread clock)."""
    res = time_interleaved(fns, warmup=inner, rounds=reps, calls=inner, clock="thread")
    return [t.min_ms * 1e3 for t in res.timings]


def host_pair(name, tokens, args):
    """(row fields, summary) of stock vs parallelized ``name`` at world size 1, host time."""
    import torch

    import ditscale.diffusers as dd

    stock = tiny_model(name)
    parallel = dd.parallelize(tiny_model(name), strategy=args.strategy)
    kw = tiny_inputs(name, stock, tokens)
    with torch.no_grad():
        outs = [m(**kw)[0] for m in (stock, parallel)]
        s_us, p_us = host_us([lambda: stock(**kw), lambda: parallel(**kw)], args.reps, args.inner)
    calls = attention_calls(stock)
    extra = p_us - s_us
    row = dict(stock_us=s_us, parallel_us=p_us, extra_us=extra, attention_calls=calls,
               extra_per_attention_us=extra / calls,
               identical=bool(torch.equal(outs[0], outs[1])))
    return row, (f"stock {s_us:8.1f} us parallelized {p_us:8.1f} us  extra {extra:+7.1f} us "
                 f"({extra / calls:+.1f} per attention, {calls} calls)  "
                 f"identical {row['identical']}")


def run_host_cpu(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = tempfile.NamedTemporaryFile(prefix="sp_host_", delete=False)
    store.close()
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    tokens = {name: (16,) for name in TINY}
    try:
        return cli.sweep("sp_host_cpu", args, tokens, lambda n, t, _c: host_pair(n, t, args))
    finally:
        dist.destroy_process_group()
        os.unlink(store.name)


def host_table(rows) -> str:
    columns = ("model (tiny)", "tokens", "stock us", "parallelized us", "extra us",
               "attention calls", "extra us / attention", "bit-identical")
    return cli.markdown(rows, columns, lambda r: (
        r["model"], str(r["tokens"]), f"{r['stock_us']:.1f}", f"{r['parallel_us']:.1f}",
        f"{r['extra_us']:+.1f}", str(r["attention_calls"]), f"{r['extra_per_attention_us']:+.1f}",
        str(r["identical"])))


def table(rows) -> str:
    columns = ("model", "tokens", "mode", "stock ms", "parallelized ms", "overhead", "rel. L2")
    return cli.markdown(rows, columns, lambda r: (
        r["model"], str(r["tokens"]), r["mode"], f"{r['stock_ms']:.2f}",
        f"{r['parallel_ms']:.2f}", f"{100 * r['overhead']:+.2f}%", f"{r['rel_l2']:.1e}"))


def parse(argv):
    ap = cli.parser(__doc__, "flux,wan2.1-1.3b,hunyuan-video,cogvideox-5b,sd3.5-medium", 2, 15.0)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: host time of the tiny models (see above)")
    ap.add_argument("--inner", type=int, default=20, help="--device cpu: calls per sample, "
                    "[1, 10000]")
    args = cli.parse(ap, argv)
    if not 1 <= args.inner <= 10000:
        ap.error(f"--inner: {args.inner} is out of range [1, 10000]")
    if args.device == "cpu":
        args.modes = ["eager"]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu":
        rows = run_host_cpu(args)
        return cli.write(args.out_dir, "sp-host-cpu", rows, host_table(rows),
                         "parallelize at world size 1 against stock: host time (CPU)")
    rows = run(args)
    return cli.write(args.out_dir, "sp-overhead", rows, table(rows),
                     "parallelize at world size 1 against stock")


if __name__ == "__main__":
    sys.exit(main())
