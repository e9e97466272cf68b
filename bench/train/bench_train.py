"""Training from real media on one GPU: corpus -> ``ditscale.prepare`` -> ``ditscale.train``.

    python -m bench.train.bench_train --model wan2.1-1.3b --work /tmp/bt --out-dir bench/results

1. writes a corpus (``corpus.py``: 480p and 720p clips and images, captions) under WORK/media;
2. runs ``ditscale.prepare`` into WORK/store: clips/s over the encode time (VAE-bound);
3. trains three runs of ``--steps`` steps at the same seed: ``balanced`` from the store,
   ``balanced`` from in-memory latents of the same shapes and ids (``synthetic.py``, through the
   same loop: ``ditscale.train.loop.run(cfg, dataset=...)``), ``equal-token`` from the store;
   steady-state tokens/s after ``--warmup-steps``, peak memory, the store / synthetic ratio;
4. writes ``train-real_<hw>_<YYYY-MM>.md`` and the loss plot ``train-real-loss_<hw>_<YYYY-MM>.png``
   to ``--out-dir`` (``report.py``). One process, one device; ``--model tiny --scale small``
   is the CPU dry run (tests/python/test_bench_train.py). See bench/README.md and docs/train.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import re
import shlex
import shutil
import sys

import torch

from bench import reporter
from bench.train import corpus, report, runs
from bench.train.synthetic import SyntheticDataset
from ditscale._checks import check_int


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.train.bench_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="wan2.1-1.3b", choices=("tiny", "wan2.1-1.3b", "wan2.1-14b"),
      help="the prepare preset and the transformer preset")
    a("--work", default="/tmp/ditscale-bench-train", help="media/, store/, runs/ (store/ and "
      "runs/ are redone; media/ is kept when it was made with the same corpus settings)")
    a("--out-dir", default="bench/results", help="where the report and the plot go")
    a("--hw", default=None, help="hardware tag of the file names (default: from the device)")
    a("--videos-480p", type=int, default=160)
    a("--videos-720p", type=int, default=60)
    a("--images", type=int, default=80)
    a("--frames", type=int, default=49, help="frames per clip, [2, 1025]")
    a("--scale", default="full", choices=tuple(corpus.SCALES), help="media sizes (small: CPU)")
    a("--jobs", type=int, default=max(1, os.cpu_count() or 1), help="corpus writer processes")
    a("--vae", default=None, help="prepare's --vae (default: random weights)")
    a("--text-encoder", default=None, help="prepare's --text-encoder (default: random)")
    a("--device", default="auto", choices=("auto", "cuda", "cpu"))
    a("--steps", type=int, default=60, help="steps of each train run, [2, 100000]")
    a("--warmup-steps", type=int, default=10, help="first steps not measured, [0, steps - 1]")
    a("--seed", type=int, default=0, help="the seed of every run, [0, 2^31-1]")
    a("--train-args", default="", help="more ditscale.train flags for every run, one string "
      "(e.g. '--activation-checkpointing full --num-workers 4')")
    args = p.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("one process on one device: run it without torchrun")
    try:
        check_int("--steps", args.steps, 2, 100_000)
        check_int("--warmup-steps", args.warmup_steps, 0, args.steps - 1)
        check_int("--seed", args.seed, 0, 2**31 - 1)
        args.spec = corpus.CorpusSpec(args.videos_480p, args.videos_720p, args.images,
                                      args.frames, args.scale)
        check_int("--jobs", args.jobs, 1, 1024)
    except ValueError as e:
        p.error(str(e))
    return args


def hardware(explicit) -> str:
    """``h100`` / ``h200`` ... from the GPU's name (``cpu`` without one)."""
    if explicit:
        return explicit
    if not torch.cuda.is_available():
        return "cpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", torch.cuda.get_device_name(0))
    return m.group(1).lower() if m else "gpu"


def make_media(args) -> str:
    """WORK/media, written unless it holds the same corpus already."""
    media, stamp = os.path.join(args.work, "media"), repr(args.spec)
    marker = os.path.join(media, "corpus.spec")
    if os.path.isfile(marker) and open(marker).read() == stamp:
        return media
    shutil.rmtree(media, ignore_errors=True)
    counts = corpus.write_corpus(media, args.spec, args.jobs)
    with open(marker, "w") as f:
        f.write(stamp)
    print(f"bench.train: corpus {counts} -> {media}", file=sys.stderr)
    return media


def run_prepare(args, media: str, store: str) -> dict:
    from ditscale.prepare import PrepareOptions, prepare

    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    shutil.rmtree(store, ignore_errors=True)
    return prepare(PrepareOptions(
        input=media, out=store, model=args.model, vae=args.vae, text_encoder=args.text_encoder,
        device=device, dtype="bfloat16" if device == "cuda" else "float32", seed=args.seed,
        progress=False))


def train_all(args, store: str):
    """The runs, in this order: store balanced (the process's first: it pays the one-time
    costs of each new shape, lazily loaded kernels and library heuristics), synthetic
    balanced, store balanced again (the one compared), store equal-token."""
    from ditscale.latent_store import LatentStore

    base = ["--store", store, "--model", args.model, "--steps", str(args.steps), "--device",
            args.device, "--seed", str(args.seed), "--checkpoint-every", "0", "--resume",
            "never", "--no-tensorboard", "--no-progress", *shlex.split(args.train_args)]
    out = os.path.join(args.work, "runs")
    shutil.rmtree(out, ignore_errors=True)
    st = LatentStore(store)
    synthetic = SyntheticDataset(st, st.meta.max_text_tokens, args.seed)
    first = runs.train_run("store-first", [*base, "--policy", "balanced"], f"{out}/store-first")
    synth = runs.train_run("synthetic", [*base, "--policy", "balanced"], f"{out}/synthetic",
                           dataset=synthetic)
    real = runs.train_run("store", [*base, "--policy", "balanced"], f"{out}/store")
    equal = runs.train_run("store-equal-token", [*base, "--policy", "equal-token"],
                           f"{out}/equal-token")
    return first, real, synth, equal


def notes(args, prep: dict) -> str:
    s = args.spec
    return (f"Corpus: {s.videos_480p} clips 480p + {s.videos_720p} clips 720p ({s.frames} "
            f"frames at 16/24/30 fps, scale `{s.scale}`) + {s.images} images; model "
            f"`{args.model}` (VAE {args.vae or 'random weights'}, text encoder "
            f"{args.text_encoder or 'random weights'}); store: {prep['good']} samples in "
            f"{prep['shards']} shards. Train: {args.steps} steps per run, seed {args.seed}, "
            f"rates over the steps after the first {args.warmup_steps}; extra flags: "
            f"`{args.train_args or '-'}`. The synthetic run reads in-memory latents of the "
            "store's shapes and ids through the same DataLoader, collate and loop. Order: "
            "store (first), synthetic, store, equal-token: the process's first run pays the "
            "one-time costs of every new shape (lazily loaded kernels, library heuristics), so "
            "the store run compared is the second; the store's shards are in the page cache "
            "(prepare has just written them).")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    media, store = make_media(args), os.path.join(args.work, "store")
    prep = run_prepare(args, media, store)
    gc.collect()                    # the encoders' GPU memory, before the train runs
    first, real, synth, equal = train_all(args, store)
    t = {r.name: runs.throughput(r, args.warmup_steps) for r in (first, real, synth, equal)}
    rows = [report.throughput_row("store-first", "store", "balanced", t["store-first"],
                                  first.peak_gib),
            report.throughput_row("store", "store", "balanced", t["store"], real.peak_gib),
            report.throughput_row("synthetic", "in memory", "balanced", t["synthetic"],
                                  synth.peak_gib),
            report.throughput_row("store-equal-token", "store", "equal-token",
                                  t["store-equal-token"], equal.peak_gib)]
    tag = f"{hardware(args.hw)}_{datetime.datetime.now(datetime.timezone.utc):%Y-%m}"
    plot_name = f"train-real-loss_{tag}.png"
    os.makedirs(args.out_dir, exist_ok=True)
    plotted = report.plot(os.path.join(args.out_dir, plot_name), real, equal)
    text = report.markdown(
        "Training from real media: prepare, tokens/s from the store, balanced vs equal-token",
        notes(args, prep), prep, rows, report.ratio_line(t["store"], t["synthetic"]),
        real.ids() == synth.ids(), real, equal, plot_name if plotted else "(no matplotlib)")
    reporter.write(os.path.join(args.out_dir, f"train-real_{tag}.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
