#!/usr/bin/env python3
"""ditscale.train with a sequence-parallel degree per micro-batch (``sp_degrees``) against fixed
degrees on a generated mixed corpus, measured and as ``ditscale plan --compare`` predicts it.

    python -m bench.train.sp_degrees corpus --work W [--model wan2.1-1.3b] [--videos-480p 16]
        [--videos-720p 8] [--images 16] [--frames 81] [--scale full|small] [--device cuda|cpu]
    torchrun --nproc-per-node N -m ditscale.train --store W/store --out W/runs/NAME \
        --policy balanced --sp-degrees D --m-mem-tokens M ...       (one run per NAME=D)
    python -m bench.train.sp_degrees report --work W --runs mixed=1,2,4,8 fixed-8=8
        --world-size N --m-mem M [--warmup-steps 2] [--ditscale CLI] --out-dir DIR

``corpus``: the media of bench/train/corpus.py (480p and 720p clips, images; a clip of 81 frames
at 720p is 75,600 tokens, beyond one GPU's M_mem at Wan 2.1 1.3B) through ``ditscale.prepare``
into W/store (bench_train's steps). ``report``: each run's W/runs/NAME/metrics.jsonl after the
warm-up steps: tokens/s, the step time's mean and coefficient of variation (std / mean over the
steps), the ranks' wait share; beside it ``ditscale plan`` on the store's manifest and shape
model, the same world size, M_mem, seed and the default cost (the trainer's): the run of the
same degrees ("balanced sp=D", --compare for the fixed ones), its tokens/s, step-time CV,
compute CV (across ranks) and unfit samples. Writes DIR/sp-degrees-train-N.md. A fixed degree
here is ``sp_degrees = "D"`` (every micro-batch on groups of D ranks), the planner's fixed rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Optional

from bench import reporter
from bench.common import find_cli, int_list

COLUMNS = ["run", "degrees", "steps", "tokens/s", "step ms mean", "step-time CV", "wait share",
           "pred. tokens/s", "measured / pred.", "pred. step-time CV", "pred. compute CV",
           "pred. unfit"]


def corpus(args) -> int:
    """W/media and W/store (bench.train.bench_train's corpus and prepare steps)."""
    from bench.train import bench_train
    from bench.train import corpus as corpus_mod
    args.spec = corpus_mod.CorpusSpec(args.videos_480p, args.videos_720p, args.images,
                                      args.frames, args.scale)
    args.vae = args.text_encoder = None
    args.seed = 0
    media = bench_train.make_media(args)
    prep = bench_train.run_prepare(args, media, os.path.join(args.work, "store"))
    print(f"sp_degrees corpus: {prep}", flush=True)
    return 0


def parse_runs(items: List[str], world: int) -> Dict[str, List[int]]:
    """["NAME=1,2,4", ...] -> {NAME: degrees}; each degree dividing ``world``."""
    runs = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--runs: {item!r} is not NAME=DEGREES (e.g. mixed=1,2,4,8)")
        degrees = int_list(text, "--runs", 1, 8)
        bad = [d for d in degrees if world % d]
        if bad:
            raise ValueError(f"--runs: {name}: {bad[0]} does not divide --world-size {world}")
        runs[name] = sorted(degrees)
    return runs


def measured(metrics: List[dict], warmup: int, name: str) -> dict:
    """tokens/s, mean step ms, step-time CV and wait share of the steps after ``warmup``."""
    steps = metrics[warmup:]
    if len(steps) < 2:
        raise ValueError(f"--warmup-steps: {warmup} leaves {len(steps)} of the {len(metrics)} "
                         f"steps of run {name!r} (at least 2 are needed)")
    times = [float(m["step_time_s"]) for m in steps]
    mean = statistics.fmean(times)
    waits = [statistics.fmean(m["wait_s"]) / float(m["step_time_s"]) for m in steps]
    return {"steps": len(steps), "tokens_per_s": sum(m["tokens"] for m in steps) / sum(times),
            "step_ms": 1e3 * mean, "cv": statistics.pstdev(times) / mean,
            "wait": statistics.fmean(waits)}


def plan(cli: str, store, world: int, m_mem: int, degrees: List[int], seed: int) -> dict:
    """``ditscale plan --compare --json`` of the store's manifest: {run name: policy JSON}."""
    cmd = [cli, "plan", "--manifest", store.manifest_path, "--model", store.shape_model,
           "--world-size", str(world), "--policy", "balanced", "--sp-degrees",
           ",".join(map(str, degrees)), "--compare", "--json", "--quiet", "--seed", str(seed)]
    if m_mem:
        cmd += ["--m-mem", str(m_mem)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()[-1000:]}")
    return json.loads(r.stdout)["policies"]


def predicted(cli: Optional[str], store, args, degrees: List[int], cache: dict) -> Optional[dict]:
    """The plan's run of ``degrees`` ("balanced sp=D"; "balanced" for [1]), or None without
    the CLI."""
    if cli is None:
        return None
    key = tuple(degrees)
    if key not in cache:
        cache[key] = plan(cli, store, args.world_size, args.m_mem, degrees, args.seed)
    name = "balanced" if degrees == [1] else "balanced sp=" + ",".join(map(str, degrees))
    return cache[key].get(name)


def row(name: str, degrees: List[int], m: dict, p: Optional[dict], world: int) -> list:
    cells = [name, ",".join(map(str, degrees)), m["steps"], m["tokens_per_s"], m["step_ms"],
             f"{m['cv']:.3f}", f"{m['wait']:.3f}"]
    if p is None:
        return cells + ["-"] * 5
    tps = p["tokens_per_s_per_gpu"] * world
    return cells + [tps, f"{m['tokens_per_s'] / tps:.2f}", f"{p['step_time_cv']:.3f}",
                    f"{p['compute_cv']:.3f}", p.get("samples_unfit", p["dropped_samples"])]


def report(args) -> int:
    from bench.train.runs import read_metrics
    from ditscale.latent_store import LatentStore
    runs = parse_runs(args.runs, args.world_size)
    store = LatentStore(os.path.join(args.work, "store"))
    cli = find_cli(args.ditscale)
    cache: dict = {}
    rows = []
    for name, degrees in runs.items():
        m = measured(read_metrics(os.path.join(args.work, "runs", name)), args.warmup_steps,
                     name)
        rows.append(row(name, degrees, m, predicted(cli, store, args, degrees, cache),
                        args.world_size))
    notes = (f"{args.world_size} ranks, store {store.path} ({store.meta.num_samples} samples, "
             f"shape model {store.meta.shape_model}); M_mem {args.m_mem or 'the trainer default'}"
             f" tokens; measured over the steps after the first {args.warmup_steps} (rank 0's "
             f"step_time_s; wait share: the ranks' mean idle at the step barrier / step time); "
             f"predicted: `ditscale plan --compare --json` "
             + (f"({cli}), the default analytical cost: compare ratios between runs, not "
                f"absolute rates" if cli else "(no ditscale CLI found: not predicted)") + ".")
    text = reporter.report(f"sp_degrees against fixed degrees on {args.world_size} ranks",
                           COLUMNS, rows, notes=notes)
    reporter.write(os.path.join(args.out_dir, f"sp-degrees-train-{args.world_size}.md"), text)
    print(text)
    return 0


def _int(name: str, lo: int, hi: int):
    return lambda t: int_list(t, name, lo, hi)[0]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.train.sp_degrees",
                                description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("corpus", help="the media and the store")
    c.add_argument("--work", required=True)
    c.add_argument("--model", default="wan2.1-1.3b", choices=("tiny", "wan2.1-1.3b"))
    c.add_argument("--videos-480p", type=_int("--videos-480p", 0, 10000), default=16)
    c.add_argument("--videos-720p", type=_int("--videos-720p", 0, 10000), default=8)
    c.add_argument("--images", type=_int("--images", 0, 100000), default=16)
    c.add_argument("--frames", type=_int("--frames", 2, 1025), default=81)
    c.add_argument("--scale", default="full", choices=("full", "small"))
    c.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    c.add_argument("--jobs", type=_int("--jobs", 1, 1024), default=max(1, os.cpu_count() or 1))
    r = sub.add_parser("report", help="the runs against the plan")
    r.add_argument("--work", required=True)
    r.add_argument("--runs", nargs="+", required=True, help="NAME=DEGREES of W/runs/NAME")
    r.add_argument("--world-size", type=_int("--world-size", 1, 4096), required=True)
    r.add_argument("--m-mem", type=_int("--m-mem", 0, 1 << 40), default=0,
                   help="the runs' --m-mem-tokens (0: the trainer's default)")
    r.add_argument("--warmup-steps", type=_int("--warmup-steps", 0, 100000), default=2)
    r.add_argument("--seed", type=_int("--seed", 0, 2**31 - 1), default=0)
    r.add_argument("--ditscale", default=None, help="the ditscale CLI (default: found)")
    r.add_argument("--out-dir", default=".")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return corpus(args) if args.command == "corpus" else report(args)
    except ValueError as e:
        print(f"sp_degrees: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
