#!/usr/bin/env python3
"""One sequence-parallel training step of Wan 2.1 on dp x sp meshes: median step time, per-rank
peak memory and the predicted step time at each degree; ``--longest``: the longest clip that fits.

    python -m torch.distributed.run --nproc-per-node N -m bench.train.sp_step \
        [--model wan2.1-1.3b] [--degrees N,N/2,..,1] [--frames 81 --height 720 --width 1280]
        [--reps 3] [--longest --frames-step 40 --longest-budget-s 120] [--eff-json EFF.json]
        [--device cuda|cpu] [--out-dir DIR]

The model, meshes and step are ditscale.train's own (docs/train.md): ``train.model.build``
(diffusers' WanTransformer3DModel at the preset's dimensions, random weights, fused AdaLN,
activation checkpointing, FSDP2 over all N ranks) on ``train.parallel.make_layout(d)`` (N / d
groups of d consecutive ranks), one sample per group (81 x 720 x 1280: 21 x 45 x 80 = 75,600
tokens), ``models.training.StepRunner`` (forward + backward, gradient sync, AdamW). Predicted:
bench/train/sp_predict.py (the planner's SP cost with Work(S) from the smallest measured
degree). ``--longest`` adds frames (``--frames-step``) at each degree until a step runs out of
memory (caught on every rank, memory freed; a rank out of memory inside a collective that the
others wait in ends them all at --timeout-s) or the budget ends. Without torchrun: one rank;
``--model tiny --device cpu`` is the CI dry run (``--oom-above-tokens``: a step of more tokens
per rank counts as out of memory, StepRunner's test hook). Writes DIR/sp-step-N.md on rank 0.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

from bench import reporter
from bench.common import int_list
from bench.timing import time_fn
from bench.train import sp_predict
from ditscale.train.config import BY_NAME

STRATEGIES = BY_NAME["sp_strategy"].choices
MODELS = ("tiny", "wan2.1-1.3b", "wan2.1-14b")
COLUMNS = ["degree", "dp x sp", "tokens", *reporter.TIMING_COLUMNS, "fwd+bwd ms",
           "peak GiB max", "peak GiB min", "predicted ms", "measured / predicted", "note"]
LONGEST_COLUMNS = ["degree", "longest frames", "latent", "tokens", "peak GiB max", "stopped by",
                   "tries"]


def _int(name: str, lo: int, hi: int):
    return lambda t: int_list(t, name, lo, hi)[0]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.train.sp_step",
                                description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--model", default="wan2.1-1.3b", choices=MODELS)
    a("--num-layers", type=_int("--num-layers", 0, 1000), default=0, help="0: the preset's")
    a("--degrees", type=lambda t: int_list(t, "--degrees", 1, 64), default=None,
      help="sp degrees, each dividing the world size (default: N and its power-of-two divisors)")
    a("--frames", type=_int("--frames", 1, 1025), default=81, help="4k + 1")
    a("--height", type=_int("--height", 16, 8192), default=720, help="a multiple of 16")
    a("--width", type=_int("--width", 16, 8192), default=1280, help="a multiple of 16")
    a("--text-tokens", type=_int("--text-tokens", 1, 4096), default=512)
    a("--reps", type=_int("--reps", 1, 100), default=3)
    a("--warmup", type=_int("--warmup", 0, 10), default=1)
    a("--activation-checkpointing", default="full", choices=("off", "full", "every"))
    a("--strategy", default="ulysses", choices=STRATEGIES, help="ditscale.train's sp_strategy")
    a("--longest", action="store_true", help="also the longest clip that fits at each degree")
    a("--frames-step", type=_int("--frames-step", 4, 1024), default=40, help="a multiple of 4")
    a("--max-frames", type=_int("--max-frames", 1, 1025), default=1025)
    a("--longest-budget-s", type=_int("--longest-budget-s", 1, 3600), default=120,
      help="per degree")
    a("--eff-json", default=None, help="bench.sp.block_share --json: eff(d) of the prediction")
    a("--topology", default=sp_predict.TOPOLOGY, help="the sp node preset of comm(d, S)")
    a("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    a("--timeout-s", type=_int("--timeout-s", 10, 3600), default=120,
      help="the process groups' timeout")
    a("--oom-above-tokens", type=_int("--oom-above-tokens", 0, 1 << 30), default=0,
      help="testing: a step of more tokens per rank (S / d) counts as out of memory (0: off)")
    a("--out-dir", default=".")
    args = p.parse_args(argv)
    for name in ("frames", "max_frames"):
        if (getattr(args, name) - 1) % 4:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not 4k + 1")
    if args.frames_step % 4:
        p.error(f"--frames-step: {args.frames_step} is not a multiple of 4")
    for name in ("height", "width"):
        if getattr(args, name) % 16:
            p.error(f"--{name}: {getattr(args, name)} is not a multiple of 16")
    return args


def default_degrees(world: int) -> List[int]:
    """N and its power-of-two divisors, largest first."""
    return sorted({world} | {1 << k for k in range(7) if world % (1 << k) == 0}, reverse=True)


def check_degrees(degrees: List[int], world: int) -> None:
    bad = [d for d in degrees if world % d]
    if bad:
        raise ValueError(f"--degrees: {bad[0]} does not divide the world size {world}")


class OutOfMemory(Exception):
    """Some rank ran out of memory in the step (every rank raises it)."""


@dataclass
class Run:
    """The model, optimizer and step runner of one degree."""
    degree: int
    layout: object
    wan: object
    model: object
    runner: object
    data: object
    dtype: object
    compute_s: List[float] = field(default_factory=list)


def build_run(env, args, degree: int) -> Run:
    """ditscale.train's layout, model (FSDP2, sp on the group) and AdamW at ``degree``."""
    from ditscale.models.training import StepRunner, SyntheticData
    from ditscale.train import config, model, optim, parallel
    import torch
    values = {f.name: f.default for f in config.FIELDS}
    values.update(store="-", out="-", model=args.model, num_layers=args.num_layers,
                  sp_degree=degree, sp_strategy=args.strategy, lr=1e-5,
                  activation_checkpointing=args.activation_checkpointing)
    tcfg = config.finish(values)
    dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    wan = model.model_config(tcfg.model, tcfg.num_layers, args.text_tokens)
    layout = parallel.make_layout(degree, args.strategy, args.timeout_s, env.device, wan)
    m = model.build(wan, tcfg, env.device, dtype, layout)
    runner = StepRunner(m, optim.adamw(m, tcfg), env.device, cfg=wan, dtype=dtype,
                        sync_tokens=degree)
    return Run(degree, layout, wan, m, runner, SyntheticData(wan, env.device, dtype), dtype)


def free(run: Run) -> None:
    """Gradients dropped, cached blocks given back (after an out-of-memory step)."""
    from ditscale.models.training import release_memory
    run.runner.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    release_memory(run.runner.device)


def step(run: Run, mb, args) -> None:
    """One training step of this rank's micro-batch; OutOfMemory on every rank when any ran out
    (StepRunner agrees on it in the forward/backward; the optimizer's OOM is agreed here)."""
    import torch
    import torch.distributed as dist
    oom = False
    try:
        st = run.runner.step([mb], run.layout.world / run.layout.dp,
                             fail_above_tokens=args.oom_above_tokens * run.degree or None)
        oom = st.oom
        run.compute_s.append(st.compute_s)
    except torch.cuda.OutOfMemoryError:
        oom = True
    flag = torch.tensor([1.0 if oom else 0.0], device=run.runner.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        free(run)
        raise OutOfMemory()


def peaks_gib(device) -> tuple:
    """(max, min) over the ranks of this rank's peak allocated memory, GiB (None on the CPU)."""
    import torch
    import torch.distributed as dist
    from ditscale.models.training import peak_memory_bytes
    if device.type != "cuda":
        return None, None
    t = torch.tensor([peak_memory_bytes(device) / 2**30, 0.0], device=device)
    t[1] = -t[0]
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(-t[1])


def _max_over_ranks(device):
    import torch
    import torch.distributed as dist

    def reduce(ms: float) -> float:
        t = torch.tensor([ms], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())
    return reduce


def latent(args, frames: int):
    from ditscale.models.wan_dit import latent_shape
    return latent_shape(frames, args.height, args.width)


def measure(run: Run, args):
    """(Timing of the step: the slowest rank's, fwd+bwd median s, peaks) or OutOfMemory."""
    import torch.distributed as dist
    from ditscale.models.training import reset_peak_memory, synchronize
    dev = run.runner.device
    mb = run.data.micro_batch([run.layout.dp_rank], latent(args, args.frames))
    reset_peak_memory(dev)
    t = time_fn(lambda: step(run, mb, args), warmup=args.warmup, reps=args.reps, clock="wall",
                min_reps=1, sync=lambda: synchronize(dev), before_each=dist.barrier,
                reduce=_max_over_ranks(dev))
    compute = sorted(run.compute_s[args.warmup:])[len(run.compute_s[args.warmup:]) // 2]
    return t, compute, peaks_gib(dev)


def _all_agree(flag: bool, device) -> bool:
    """True on every rank when ``flag`` is true on any."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() > 0


def longest(run: Run, args) -> list:
    """The longest clip that fits at this degree: frames from --frames up by --frames-step, one
    step each, until out of memory, --max-frames or the budget (a deadline, not a measurement:
    every rank agrees on it before each try)."""
    from ditscale.models.training import reset_peak_memory
    dev = run.runner.device
    deadline = time.monotonic() + args.longest_budget_s
    best, stopped, tries = None, f"--max-frames {args.max_frames}", 0
    for frames in range(args.frames, args.max_frames + 1, args.frames_step):
        if _all_agree(time.monotonic() > deadline, dev):
            stopped = f"budget {args.longest_budget_s} s"
            break
        mb = run.data.micro_batch([run.layout.dp_rank], latent(args, frames))
        reset_peak_memory(dev)
        tries += 1
        try:
            step(run, mb, args)
        except OutOfMemory:
            stopped = f"out of memory at {frames} frames ({mb.tokens} tokens)"
            break
        best = (frames, mb.tokens, peaks_gib(dev)[0])
        del mb
    if best is None:
        return [run.degree, "none", "-", "-", "-", stopped, tries]
    frames, tokens, peak = best
    shape = "x".join(map(str, latent(args, frames)))
    return [run.degree, frames, shape, tokens, peak if peak is not None else "-", stopped, tries]


def degree_rows(env, args, degree: int):
    """(measured row cells without the prediction, median step s or None, note, longest row)."""
    import torch.distributed as dist
    from ditscale.models.training import release_memory
    run = build_run(env, args, degree)
    mesh = f"{run.layout.dp} x {degree}"
    tokens = run.data.micro_batch([0], latent(args, args.frames)).tokens
    try:
        t, compute, (pmax, pmin) = measure(run, args)
        row = [degree, mesh, tokens, *reporter.timing_cells(t), 1e3 * compute,
               _gib(pmax), _gib(pmin)]
        median_s, note = t.median_ms / 1e3, "-"
    except OutOfMemory:
        row = [degree, mesh, tokens, "-", "-", "-", 0, "-", "-", "-"]
        median_s, note = None, "out of memory"
    far = None
    if args.longest and median_s is None:  # it did not fit at --frames: nothing longer will
        far = [degree, "none", "-", "-", "-", f"out of memory at {args.frames} frames", 0]
    elif args.longest:
        far = longest(run, args)
    group, dev = run.layout.group, run.runner.device
    del run
    gc.collect()
    release_memory(dev)  # the next degree builds its model on a clean device
    if group is not None:
        dist.destroy_process_group(group)
    return row, median_s, note, far


def _gib(x) -> object:
    return "-" if x is None else x


def with_predictions(rows, measured, notes, wan, tokens, args, eff) -> list:
    """Each row + predicted ms, measured / predicted, note (sp_predict)."""
    degrees = [r[0] for r in rows]
    heads, layers = wan.num_heads, wan.num_layers
    comm = {d: sp_predict.comm_s(d, tokens, heads, wan.dim // heads, layers, args.topology)
            for d in degrees}
    pred = sp_predict.predict({d: s for d, s in measured.items() if s is not None}, degrees,
                              comm, eff)
    out = []
    for r in rows:
        d, p, m = r[0], pred.get(r[0]), measured.get(r[0])
        ratio = f"{m / p:.2f}" if p and m else "-"
        out.append([*r, "-" if p is None else 1e3 * p, ratio, notes[d]])
    return out


def notes_text(args, env, wan, eff) -> str:
    return (f"{args.model} ({wan.num_layers} blocks, dim {wan.dim}, {wan.num_heads} heads), "
            f"{args.frames} x {args.height} x {args.width} clip, {args.text_tokens} text "
            f"tokens, one sample per sp group, {env.world_size} ranks on {env.device.type}, "
            f"strategy {args.strategy}, activation checkpointing {args.activation_checkpointing}"
            f"; median: the slowest rank's whole step (forward + backward, gradient sync, "
            f"AdamW); fwd+bwd: rank 0's forward + backward (median); peak: allocated, max and "
            f"min over the ranks; predicted (bench/train/sp_predict.py): Work from the smallest "
            f"measured degree, comm(d, S) = 3 L exposed(d, S) of the sp simulator (Ulysses, "
            f"NCCL, {args.topology}), eff(d) "
            + (f"{eff} ({args.eff_json})" if eff else "1 (no --eff-json)") + ".")


def report_text(env, args, wan, tokens, eff, rows, measured, notes, far) -> str:
    rows = with_predictions(rows, measured, notes, wan, tokens, args, eff)
    text = reporter.report(f"Sequence-parallel training step on {env.world_size} ranks",
                           COLUMNS, rows, notes=notes_text(args, env, wan, eff))
    if far:
        text += ("\n## The longest clip that fits\n\n" + reporter.table(LONGEST_COLUMNS, far)
                 + f"\n\nframes from {args.frames} by {args.frames_step} up to "
                 f"{args.max_frames}, one step each; no new try after {args.longest_budget_s} s "
                 f"per degree.\n")
    return text


def run_all(env, args) -> None:
    """Every degree; rank 0 rewrites DIR/sp-step-N.md after each (a run stopped by its
    timeout keeps the degrees it measured)."""
    from ditscale.train import model
    degrees = args.degrees or default_degrees(env.world_size)
    check_degrees(degrees, env.world_size)
    wan = model.model_config(args.model, args.num_layers, args.text_tokens)
    (pt, ph, pw), (lt, lh, lw) = wan.patch, latent(args, args.frames)
    tokens = (lt // pt) * (lh // ph) * (lw // pw)
    eff = sp_predict.read_eff(args.eff_json, args.model, tokens)
    path = os.path.join(args.out_dir, f"sp-step-{env.world_size}.md")
    rows, measured, notes, far, text = [], {}, {}, [], ""
    for d in degrees:
        row, measured[d], notes[d], lrow = degree_rows(env, args, d)
        rows.append(row)
        far += [lrow] if lrow is not None else []
        if env.rank == 0:
            text = report_text(env, args, wan, tokens, eff, rows, measured, notes, far)
            reporter.write(path, text)
    if env.rank == 0:
        print(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist
    from ditscale.models.training import init_distributed
    env = init_distributed(args.device or "auto", timeout_s=args.timeout_s)
    try:
        run_all(env, args)
        dist.barrier()  # no rank tears its group down while another still uses it
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:  # a bad option: the message names it
        print(f"sp_step: error: {e}", file=sys.stderr)
        sys.exit(2)
