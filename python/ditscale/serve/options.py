"""Options of ``python -m ditscale.serve``, each range-checked at parse time.

:func:`parse` turns ``argv`` into a frozen :class:`ServeOptions`; a bad value is a ValueError
naming the option, its value and its range (the command exits 2). :data:`SIZE_LIMITS` gives
the default ``--max-size`` / ``--max-frames`` per size of random-weight pipeline; the model's
own limits are applied by ``cli.limits_of``. The table of options: docs/serve.md.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional

from .._checks import check_int, check_real
from ..diffusers import tiny
from ..diffusers.cache_option import parse_cache
from ..sp.config import STRATEGIES

# name -> (max height/width, max frames) per size of random-weight pipeline: what answers in
# bounded memory (tiny: a CPU in seconds; small/full: one H200). The default of --max-size and
# --max-frames; the model may allow less (SD3's position embedding: see cli.limits_of).
SIZE_LIMITS = {"tiny": (256, 33), "small": (2048, 129), "full": (4096, 129)}

# torchrun SIGKILLs its ranks 30 s after it forwards a signal to them: the default grace stays
# below that, so that the running request can end and the ranks exit by themselves.
DEFAULT_SHUTDOWN_GRACE_S = 20.0


@dataclass(frozen=True)
class ServeOptions:
    pipeline: str
    weights: Optional[str]
    size: str
    device: str
    dtype: str
    host: str
    port: int
    strategy: str
    cfg_parallel: bool
    max_queue: int
    max_batch: int
    max_n: int
    max_size: Optional[int]  # None: the size's SIZE_LIMITS cap, within the model's (cli)
    max_frames: int
    max_steps: int
    steps: int
    request_timeout_s: float
    max_body_mib: int
    max_connections: int
    read_timeout_s: float
    heartbeat_s: float
    group_timeout_s: float
    shutdown_grace_s: float
    output_dir: Optional[str]
    keep_files: int
    keep_jobs: int
    png_level: int
    text_tokens: int
    warmup: int
    seed: int
    cache: str = "none"  # --cache: KIND:VALUE (diffusers.cache_option), checked at parse time


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ditscale.serve",
                                description="A generation server over a sequence-parallel "
                                            "diffusers pipeline group (run under torchrun).")
    a = p.add_argument
    a("--pipeline", choices=tiny.PIPELINES, required=True)
    a("--weights", default=None, help="a local diffusers checkpoint folder")
    a("--size", choices=tiny.SIZES, default=None,
      help="random-weight pipeline: tiny (default), small (real widths, few blocks), full")
    a("--full-size", action="store_true", help="the same as --size full")
    a("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    a("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
      help="default: bfloat16 on cuda, float32 on cpu")
    a("--host", default="127.0.0.1", help="the address to listen on (default: loopback)")
    a("--port", type=int, default=8000, help="[0, 65535]; 0: any free port (printed)")
    a("--strategy", default="auto", choices=STRATEGIES + ("auto",),
      help="the sequence-parallel strategy (default: auto, the planner's choice)")
    a("--no-cfg-parallel", action="store_true")
    a("--max-queue", type=int, default=16, help="queued requests before 429, [1, 100000]")
    a("--max-batch", type=int, default=1,
      help="samples per pipeline call, [1, 64] (1: every request alone, bit-reproducible)")
    a("--max-n", type=int, default=8,
      help="samples of one request, [1, 64] (run in calls of at most --max-batch)")
    a("--max-size", type=int, default=None,
      help="largest height/width, [8, 16384] (default: tiny 256, small 2048, full 4096, "
           "within what the model allows)")
    a("--max-frames", type=int, default=None,
      help="largest frame count, [1, 1025] (default: tiny 33, small and full 129)")
    a("--max-steps", type=int, default=100, help="[1, 1000]")
    a("--steps", type=int, default=None, help="default steps of a request, [1, --max-steps]")
    a("--request-timeout", type=float, default=600.0, help="seconds, (0, 86400]")
    a("--max-body-mib", type=int, default=64, help="largest request body, [1, 4096] MiB")
    a("--max-connections", type=int, default=1024,
      help="open connections, [1, 100000] (beyond: 503)")
    a("--read-timeout", type=float, default=30.0,
      help="seconds for a request's headers and body to arrive, [0.1, 3600]")
    a("--heartbeat", type=float, default=2.0, help="idle heartbeat seconds, [0.05, 60]")
    a("--group-timeout", type=float, default=120.0,
      help="seconds a collective may wait, [5, 3600]; > 5x --heartbeat")
    a("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
      help="seconds a running request may take after SIGTERM, [0, 3600] (default 20: "
           "torchrun kills its ranks 30 s after forwarding a signal)")
    a("--output-dir", default=None, help="where response_format=url files go (default: a "
                                         "new folder under the temp dir, removed at exit)")
    a("--keep-files", type=int, default=1000, help="files kept in --output-dir, [1, 10^6]")
    a("--keep-jobs", type=int, default=1000, help="finished jobs kept for GET, [1, 10^6]")
    a("--png-level", type=int, default=1, help="PNG compression, [0, 9]")
    a("--text-tokens", type=int, default=None,
      help="T of stand-in prompt embeddings (no text encoder), [1, 4096]")
    a("--warmup", type=int, default=0, help="pipeline calls before serving, [0, 100]")
    a("--seed", type=int, default=0, help="random weights' seed, [0, 2^63 - 1]")
    a("--cache", default="none",
      help="step caching, none or first-block:THRESHOLD ([0, 1]; every rank decides alike)")
    return p


def parse(argv=None, torch_cuda: bool = False) -> ServeOptions:
    """The options of ``argv``; a bad value is a ValueError naming the option."""
    ns = parser().parse_args(argv)
    if ns.weights and (ns.full_size or ns.size is not None):
        raise ValueError("--weights: give a checkpoint folder or --size / --full-size, not both")
    if ns.full_size and ns.size not in (None, "full"):
        raise ValueError(f"--full-size: given with --size {ns.size}")
    size = "full" if ns.full_size else (ns.size or "tiny")
    device = ns.device or ("cuda" if torch_cuda else "cpu")
    dtype = ns.dtype or ("bfloat16" if device == "cuda" else "float32")
    frames_cap = SIZE_LIMITS["full" if ns.weights else size][1]
    max_steps = check_int("--max-steps", ns.max_steps, 1, 1000)
    default_steps = 2 if size == "tiny" and not ns.weights else 30
    heartbeat = check_real("--heartbeat", ns.heartbeat, 0.05, 60.0)
    group_timeout = check_real("--group-timeout", ns.group_timeout, 5.0, 3600.0)
    if group_timeout < 5 * heartbeat:
        raise ValueError(f"--group-timeout: {group_timeout:g} s must be at least 5x --heartbeat "
                         f"({heartbeat:g} s)")
    timeout = check_real("--request-timeout", ns.request_timeout, 0.0, 86400.0)
    if timeout == 0 or not math.isfinite(timeout):
        raise ValueError(f"--request-timeout: {timeout:g} is out of range (0, 86400]")
    tokens = ns.text_tokens if ns.text_tokens is not None else tiny.default_text_tokens(
        ns.pipeline, "full" if ns.weights else size)
    parse_cache("--cache", ns.cache)  # a bad kind or value: before anything is built
    return ServeOptions(
        cache=ns.cache, pipeline=ns.pipeline, weights=ns.weights, size=size, device=device, dtype=dtype,
        host=ns.host, port=check_int("--port", ns.port, 0, 65535), strategy=ns.strategy,
        cfg_parallel=not ns.no_cfg_parallel,
        max_queue=check_int("--max-queue", ns.max_queue, 1, 100000),
        max_batch=check_int("--max-batch", ns.max_batch, 1, 64),
        max_n=check_int("--max-n", ns.max_n, 1, 64),
        max_size=None if ns.max_size is None else check_int("--max-size", ns.max_size, 8,
                                                            16384),
        max_frames=check_int("--max-frames", frames_cap if ns.max_frames is None
                             else ns.max_frames, 1, 1025),
        max_steps=max_steps,
        steps=check_int("--steps", min(default_steps, max_steps) if ns.steps is None
                        else ns.steps, 1, max_steps),
        request_timeout_s=timeout,
        max_body_mib=check_int("--max-body-mib", ns.max_body_mib, 1, 4096),
        max_connections=check_int("--max-connections", ns.max_connections, 1, 100000),
        read_timeout_s=check_real("--read-timeout", ns.read_timeout, 0.1, 3600.0),
        heartbeat_s=heartbeat, group_timeout_s=group_timeout,
        shutdown_grace_s=check_real("--shutdown-grace", ns.shutdown_grace, 0.0, 3600.0),
        output_dir=ns.output_dir,
        keep_files=check_int("--keep-files", ns.keep_files, 1, 10**6),
        keep_jobs=check_int("--keep-jobs", ns.keep_jobs, 1, 10**6),
        png_level=check_int("--png-level", ns.png_level, 0, 9),
        text_tokens=check_int("--text-tokens", tokens, 1, 4096),
        warmup=check_int("--warmup", ns.warmup, 0, 100),
        seed=check_int("--seed", ns.seed, 0, 2**63 - 1))
