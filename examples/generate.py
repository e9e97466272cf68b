#!/usr/bin/env python3
"""Text-to-image / text-to-video with a diffusers pipeline, sequence- and CFG-parallel.

    torchrun --nproc-per-node 4 examples/generate.py --pipeline wan --size full --steps 20
    torchrun --nproc-per-node 2 examples/generate.py --pipeline flux --weights /ckpt/FLUX.1-dev \\
        --prompt "a red fox in the snow" --guidance 1.0
    python examples/generate.py --device cpu --pipeline sd3 --steps 2        (one rank, CPU)
    torchrun --nproc-per-node 2 examples/generate.py --device cpu --pipeline wan   (gloo)

The pipeline is ``ditscale.diffusers.tiny.make_pipeline(--pipeline, --size)`` (random weights
from --seed, no download; prompt embeddings made locally by ``make_prompt_embeds``: the output
is noise-like, the run shows speed and scaling), or with --weights a local diffusers checkpoint
folder (``load_pipeline``: its configs are checked against their ranges and the memory they
imply first; with text encoders --prompt / --negative-prompt are encoded, a checkpoint saved
without them gets stand-in embeddings seeded by the prompt texts, as the server does).
``ditscale.diffusers.parallelize_pipeline`` makes it parallel over every rank: with guidance
(--guidance > 1: the CFG scale, ``true_cfg_scale`` for Flux and HunyuanVideo, whose embedded
guidance keeps its default) on an even rank count, the conditional and unconditional passes
run on the two halves of the ranks (--no-cfg-parallel: both over all ranks); the image/video
tokens are sharded over the ranks of each half by --strategy (default auto). The VAE decode is
banded over every rank (``parallelize_vae``, docs/diffusers/vae.md) with --vae-parallel on (the
default; one rank decodes alone either way); off: every rank runs the stock decode of the whole
image/video (the baseline of the parallel decode's share of the call).

Printed by rank 0: the parallel layout, each step (``step k/n: ms``, after a device
synchronize; step 1 from the first transformer forward), the latency per step (mean) and in
total (the whole pipeline call), and at the end a table of seconds per stage
(``generation.StageTimer``: text encoding, denoising and its mean step, VAE decode, the rest of
the call, output encoding). Every rank checks that its output is bit-identical to rank 0's;
rank 0 saves it: a PNG for images, an MP4 for videos (imageio + imageio-ffmpeg; a GIF, with a
message, when they are missing, or when --out ends in .gif). --out's folder is created if
missing and checked writable before anything is built.

Ranges (checked, named in errors): --height, --width [8, 16384] (the pipeline adds its own
divisibility rule and limits: SD3's position embedding, Wan's rotary table); --frames
[1, 1025] (videos; 1 for images; Wan: within its rotary table); --steps [1, 1000]; --guidance
[0, 100]; --seed [0, 2^63 - 1]; --fps [1, 240]; --text-tokens [1, 4096]; --cache
first-block:THRESHOLD [0, 1] (``cache_option``; step caching that decides alike on every rank:
``sp_cache``, docs/diffusers/cache.md); --vae-parallel on | off. Defaults: the tiny or full
shape of the pipeline (``tiny.DEFAULT_SHAPES``; --size: tiny, with --weights full), 2 steps
tiny / 30 full, each pipeline's usual guidance.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import os
import sys

import torch
import torch.distributed as dist

from ditscale._checks import check_choice, check_int, check_real
from ditscale.diffusers import generation, parallelize_pipeline
from ditscale.diffusers import tiny
from ditscale.diffusers.cache_option import KINDS, parse_cache
from ditscale.diffusers.generation import DEFAULT_GUIDANCE
from ditscale.diffusers._sp_pipeline import state_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pipeline", choices=tiny.PIPELINES, default="flux")
    p.add_argument("--weights", default=None, help="a local diffusers checkpoint folder")
    p.add_argument("--size", choices=tiny.SIZES, default=None,
                   help="random-weight pipeline: tiny (1-2 blocks, the default) or full (real "
                        "dimensions); with --weights: whose default shape and steps to use "
                        "(default full)")
    p.add_argument("--prompt", default="a red fox running through fresh snow, golden hour",
                   help="with --weights")
    p.add_argument("--negative-prompt", default="", help="with --weights and guidance")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-tokens", type=int, default=None,
                   help="length of the made prompt embeddings (no --weights)")
    p.add_argument("--strategy", default="auto", help="a ditscale.sp strategy or auto")
    p.add_argument("--no-cfg-parallel", action="store_true")
    p.add_argument("--vae-parallel", default="on",
                   help="on: the VAE decode banded over every rank (parallelize_vae); off: the "
                        "stock decode on every rank")
    p.add_argument("--cache", default="none",
                   help="step caching: none, or " + "; ".join(
                       f"{k}:{v.field.upper()} in [{v.lo:g}, {v.hi:g}]: {v.meaning}"
                       for k, v in KINDS.items()))
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when available")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--fps", type=int, default=16)
    p.add_argument("--out", default=None, help="default: generate-<pipeline>.png / .mp4")
    args = p.parse_args(argv)
    return fill_defaults(args)


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The defaults that depend on the pipeline and size, and the range checks."""
    video = args.pipeline in tiny.VIDEO_PIPELINES
    if args.size is None:
        args.size = "full" if args.weights else "tiny"
    height, width, frames = tiny.DEFAULT_SHAPES[args.pipeline][args.size]
    args.height = check_int("--height", height if args.height is None else args.height, 8, 16384)
    args.width = check_int("--width", width if args.width is None else args.width, 8, 16384)
    args.frames = check_int("--frames", frames if args.frames is None else args.frames, 1,
                            1025 if video else 1)
    args.steps = check_int("--steps", (2 if args.size == "tiny" else 30) if args.steps is None
                           else args.steps, 1, 1000)
    args.guidance = check_real("--guidance", DEFAULT_GUIDANCE[args.pipeline]
                               if args.guidance is None else args.guidance, 0.0, 100.0)
    args.seed = check_int("--seed", args.seed, 0, 2**63 - 1)
    args.fps = check_int("--fps", args.fps, 1, 240)
    args.cache_config = parse_cache("--cache", args.cache)
    args.vae_parallel = check_choice("--vae-parallel", args.vae_parallel, ("on", "off"))
    if args.text_tokens is None:
        args.text_tokens = tiny.default_text_tokens(args.pipeline, args.size)
    args.text_tokens = check_int("--text-tokens", args.text_tokens, 1, 4096)
    for option, text in (("--prompt", args.prompt), ("--negative-prompt", args.negative_prompt)):
        try:
            text.encode()
        except UnicodeEncodeError as e:
            raise ValueError(f"{option}: {text!r:.60} is not valid text ({e.reason} at "
                             f"character {e.start})") from e
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.out is None:
        args.out = f"generate-{args.pipeline}.{'mp4' if video else 'png'}"
    ext = os.path.splitext(args.out)[1].lower()
    allowed = (".mp4", ".gif") if video else (".png",)
    if ext not in allowed:
        kind = "a video" if video else "an image"
        raise ValueError(f"--out: {args.out!r}: {kind} pipeline writes {' or '.join(allowed)}")
    if os.path.isdir(args.out):
        raise ValueError(f"--out: {args.out!r} is a folder (give a file name in it)")
    generation.check_output_dir("--out", os.path.dirname(os.path.abspath(args.out)))
    return args


def build(args, device: torch.device):
    dtype = DTYPES[args.dtype]
    if args.weights:
        return tiny.load_pipeline(args.pipeline, args.weights, device=device, dtype=dtype)
    return tiny.make_pipeline(args.pipeline, size=args.size, device=device, dtype=dtype,
                              seed=args.seed)


def prompt_inputs(args, pipe, rank: int):
    """(text, embeds) of the call: the prompt texts when the pipeline has text encoders (a
    checkpoint with them), else embeddings made locally (``make_prompt_embeds``): seeded by
    --seed for a random-weight pipeline, by the prompt texts (``generation.stand_in_seed``, as
    the server does) for a checkpoint saved without text encoders."""
    guided = args.guidance > 1
    if args.weights:
        if generation.has_text_encoders(pipe, f"--weights {args.weights}"):
            return {"prompt": [args.prompt], "negative_prompt": [args.negative_prompt]}, None
        seed = generation.stand_in_seed(args.prompt, args.negative_prompt)
        if rank == 0:
            print(f"--weights {args.weights} has no text encoders: --prompt gets stand-in "
                  f"embeddings of {args.text_tokens} tokens (random, seeded by the prompt "
                  f"texts; not an encoding of them)", flush=True)
    else:
        seed = args.seed
    return None, tiny.make_prompt_embeds(pipe, args.text_tokens, negative=guided, seed=seed)


def call_kwargs(args, pipe, device: torch.device, rank: int = 0) -> dict:
    """The pipeline call (``generation.call_kwargs``): shape, steps, guidance by the
    pipeline's own switch, one generator seeded --seed (the same on every rank), the prompt
    (:func:`prompt_inputs`)."""
    text, embeds = prompt_inputs(args, pipe, rank)
    return generation.call_kwargs(args.pipeline, height=args.height, width=args.width,
                                  frames=args.frames, steps=args.steps, guidance=args.guidance,
                                  seeds=[args.seed], device=device, text=text, embeds=embeds)


def layout(pipe, guided: bool, world: int) -> str:
    halves = state_of(pipe).halves
    if guided and halves is not None:
        n = halves.mesh.size
        return (f"CFG parallel: the cond and uncond passes on 2 halves of {n} rank(s)"
                + (", each sequence parallel" if n > 1 else ""))
    return f"sequence parallel over {world} rank(s)" + ("" if guided else " (no guidance)")


def vae_layout(pipe, world: int) -> str:
    if state_of(pipe).vae is not None:
        return f"VAE decode banded over {world} ranks"
    return "VAE decode: stock" + (" on every rank" if world > 1 else "")


def step_printer(steps: int, timer, rank: int):
    """The step callback after the timer's: prints ``step k/n: ms`` on rank 0."""
    def callback(pipe, step: int, timestep, callback_kwargs):
        if rank == 0:
            print(f"step {step + 1}/{steps}: {1e3 * timer.steps[-1]:.1f} ms", flush=True)
        return callback_kwargs
    return callback


STAGE_ROWS = (("text encoding", "text_encoding"), ("denoising", "denoising"),
              ("vae decode", "vae_decode"), ("other (latents, post-processing)", "other"),
              ("output encoding", "output_encoding"))


def timings_table(timings: dict) -> str:
    """The per-stage seconds of ``StageTimer.as_dict()`` as a table with each stage's share of
    the total (the pipeline call plus output encoding)."""
    total = timings.get("pipeline", 0.0) + timings.get("output_encoding", 0.0)
    lines = [f"{'stage':<34}{'seconds':>10}{'share':>9}"]
    for label, key in STAGE_ROWS:
        if key in timings:
            share = 100.0 * timings[key] / total if total > 0 else 0.0
            lines.append(f"{label:<34}{timings[key]:>10.3f}{share:>8.1f}%")
        if key == "denoising" and timings.get("steps"):
            steps = timings["steps"]
            lines.append(f"{'  per step (mean of ' + str(len(steps)) + ')':<34}"
                         f"{sum(steps) / len(steps):>10.3f}")
    lines.append(f"{'total':<34}{total:>10.3f}{100.0 if total > 0 else 0.0:>8.1f}%")
    return "\n".join(lines)


def result_array(out, video: bool):
    """The first sample as uint8: [H, W, 3] (an image) or [F, H, W, 3] (a video)."""
    return generation.to_uint8(generation.output_array(out, video))[0]


def check_identical(array, rank: int, world: int) -> None:
    """Every rank's output has rank 0's bytes (else a RuntimeError on every rank)."""
    if world == 1:
        return
    digest = hashlib.sha256(array.tobytes()).hexdigest()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise RuntimeError(f"ranks {differ} produced another output than rank 0")
    if rank == 0:
        print(f"output identical on all {world} ranks (sha256 {digest[:16]})", flush=True)


def save(array, path: str, fps: int) -> str:
    """Writes the image (PNG) or video (MP4, else GIF); returns what was written."""
    import imageio

    if array.ndim == 3:
        from PIL import Image

        Image.fromarray(array).save(path)
        return path
    if path.lower().endswith(".mp4"):
        try:
            import imageio_ffmpeg  # noqa: F401  (the MP4 writer's backend)

            imageio.mimwrite(path, list(array), fps=fps, codec="libx264", macro_block_size=1)
            return path
        except ImportError:
            path = os.path.splitext(path)[0] + ".gif"
            print(f"imageio-ffmpeg is not installed: writing a GIF instead ({path})",
                  flush=True)
    imageio.mimwrite(path, list(array), duration=1000.0 / fps, loop=0)
    return path


def enable_cache(pipe, config) -> None:
    """--cache on every transformer of the parallelized ``pipe`` (each rank decides alike:
    ``sp_cache``), or nothing for none."""
    if config is None:
        return
    for t in (pipe.transformer, getattr(pipe, "transformer_2", None)):
        if t is not None:  # parallelize_pipeline made its caches decide alike (sp_cache)
            t.enable_cache(copy.deepcopy(config))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = generation.init_distributed(args.device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    video = args.pipeline in tiny.VIDEO_PIPELINES
    try:
        pipe = build(args, device)
        wrong = generation.shape_error(generation.shape_rule(args.pipeline, pipe), args.height,
                                       args.width, args.frames)
        if wrong:  # the pipelines would round it silently, or fail deep inside
            raise ValueError(f"--height/--width/--frames: {wrong}")
        pipe = parallelize_pipeline(pipe, cfg_parallel=not args.no_cfg_parallel,
                                    strategy=args.strategy,
                                    parallel_vae=args.vae_parallel == "on")
        enable_cache(pipe, args.cache_config)
        kwargs = call_kwargs(args, pipe, device, rank)
        if rank == 0:
            shape = f"{args.height}x{args.width}" + (f", {args.frames} frames" if video else "")
            print(f"{args.pipeline} ({'weights ' + args.weights if args.weights else args.size}"
                  f", {args.dtype}, {device.type}): {shape}, {args.steps} steps, guidance "
                  f"{args.guidance:g}; {layout(pipe, args.guidance > 1, world)}, strategy "
                  f"{args.strategy}; {vae_layout(pipe, world)}", flush=True)
        timer = generation.StageTimer(device)
        with timer.attach(pipe):
            out = pipe(**kwargs, callback_on_step_end=timer.step_callback(
                step_printer(args.steps, timer, rank)))
        array = result_array(out, video)
        check_identical(array, rank, world)
        if rank == 0:
            with timer.stage("output_encoding"):
                path = save(array, args.out, args.fps)
            timings = timer.as_dict()
            mean = sum(timer.steps) / len(timer.steps)
            print(f"latency: {1e3 * mean:.1f} ms per step (mean of {len(timer.steps)}), "
                  f"{timings['pipeline']:.3f} s in total", flush=True)
            print(f"saved {path} ({'x'.join(map(str, array.shape))})", flush=True)
            print(timings_table(timings), flush=True)
        if dist.is_initialized():  # no rank tears the group down while rank 0 still writes
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:  # bad options: the message names the option
        print(f"generate.py: error: {e}", file=sys.stderr)
        sys.exit(2)
