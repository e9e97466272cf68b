"""``python -m ditscale.serve``: a generation server over a sequence-parallel pipeline group.

    torchrun --nproc-per-node 4 -m ditscale.serve --pipeline flux --full-size --port 8000
    torchrun --nproc-per-node 2 -m ditscale.serve --device cpu --pipeline wan   (gloo)
    python -m ditscale.serve --pipeline sd3 --weights /ckpt/sd3.5-medium

Every rank builds the same pipeline (random weights of a tiny / small / full config, or
``--weights``), made sequence- (and CFG-) parallel by ``parallelize_pipeline``; rank 0 binds
``--host``:``--port`` before building (port 0: a free one), serves HTTP once built and logs
``ditscale.serve: listening on http://HOST:PORT``. Exit codes: 0 after a graceful shutdown
(SIGTERM / SIGINT to rank 0; a second SIGINT exits at once), 1 when the rank group failed, 2
for bad options (the message names the option, its value and its range). docs/serve.md.
"""

from __future__ import annotations

import copy

import os
import signal
import socket
import sys
import threading
import time
from typing import Optional

import torch

from ..diffusers import generation, parallelize_pipeline, tiny
from ..diffusers.cache_option import parse_cache
from .app import make_app
from .group import ControlGroup, GroupBroken
from .options import SIZE_LIMITS, ServeOptions, parse
from .schema import Limits
from .server import Server, log
from .transport import Transport, bind

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REPEAT_S = 1.0  # a SIGINT this long after the first one exits at once
DRAIN_S = 10.0  # how long a shutdown waits for the answers being written


def build_pipeline(opts: ServeOptions, device: torch.device):
    dtype = DTYPES[opts.dtype]
    if opts.weights:
        pipe = tiny.load_pipeline(opts.pipeline, opts.weights, device=device, dtype=dtype)
    else:
        pipe = tiny.make_pipeline(opts.pipeline, size=opts.size, device=device, dtype=dtype,
                                  seed=opts.seed)
    pipe = parallelize_pipeline(pipe, cfg_parallel=opts.cfg_parallel, strategy=opts.strategy)
    config = parse_cache("--cache", opts.cache)
    if config is not None:  # parallelize made every transformer's caches decide alike
        for t in (pipe.transformer, getattr(pipe, "transformer_2", None)):
            if t is not None:
                t.enable_cache(copy.deepcopy(config))
    return pipe


def limits_of(pipe, opts: ServeOptions) -> Limits:
    """What requests to ``pipe`` may ask for, from the pipeline and the options."""
    rule = generation.shape_rule(opts.pipeline, pipe)
    width, pooled = tiny._text_dims(pipe)
    size = "full" if opts.weights else opts.size
    max_size = opts.max_size
    if max_size is None:  # the size's cap, within the model's
        max_size = SIZE_LIMITS[size][0]
        if rule.max_side:
            max_size = min(max_size, rule.max_side)
        max_size -= max_size % rule.pixel_multiple
    elif rule.max_side and max_size > rule.max_side:
        raise ValueError(f"--max-size: {max_size} is above {rule.max_side}, the largest side "
                         f"the {opts.pipeline} model's position embedding covers")
    if max_size < rule.pixel_multiple:
        raise ValueError(f"--max-size: {max_size} is below the pipeline's pixel multiple "
                         f"{rule.pixel_multiple}")
    video = opts.pipeline in tiny.VIDEO_PIPELINES
    max_frames = _max_frames(opts, size, rule)
    default = _fit_default(opts, size, rule, max_size, max_frames)
    return Limits(
        pipeline=opts.pipeline, video=video, pixel_multiple=rule.pixel_multiple,
        frame_step=rule.frame_step, text_width=width, pooled_width=pooled,
        has_mask=opts.pipeline == "hunyuan-video",
        has_encoders=generation.has_text_encoders(pipe, f"--weights {opts.weights}"),
        default_size=default, default_steps=opts.steps,
        default_guidance=generation.DEFAULT_GUIDANCE[opts.pipeline], max_size=max_size,
        max_frames=max_frames if video else 1, max_steps=opts.max_steps,
        max_batch=opts.max_batch, max_n=opts.max_n, max_timeout_s=opts.request_timeout_s,
        stand_in_tokens=opts.text_tokens)


def _max_frames(opts: ServeOptions, size: str, rule) -> int:
    """--max-frames within the model's frame limit (Wan's rotary table): the size's default is
    lowered to it (logged), a larger value the user gave is refused."""
    if not rule.max_frames or opts.max_frames <= rule.max_frames:
        return opts.max_frames
    if opts.max_frames != SIZE_LIMITS[size][1]:
        raise ValueError(f"--max-frames: {opts.max_frames} is above {rule.max_frames}, the most "
                         f"frames the model covers ({rule.limit})")
    log(f"max frames: {rule.max_frames} (the default {opts.max_frames} is above the most the "
        f"model covers: {rule.limit})")
    return rule.max_frames


def _fit_default(opts: ServeOptions, size: str, rule, max_size: int, max_frames: int):
    """The default (height, width, frames) of a request: the size's own, fitted within
    ``max_size`` (the aspect kept, sides down to the pixel multiple) and ``--max-frames`` (1 +
    k * the frame step), logged when fitted: a default nobody gave is never a reason to
    refuse a checkpoint or an option."""
    h, w, frames = tiny.DEFAULT_SHAPES[opts.pipeline][size]
    m = rule.pixel_multiple
    if max(h, w) > max_size:
        scale = max_size / max(h, w)
        fitted = (max(m, int(h * scale) // m * m), max(m, int(w * scale) // m * m))
        log(f"default size: {fitted[1]}x{fitted[0]} ({w}x{h} of {opts.pipeline} ({size}) is "
            f"above the largest side {max_size})")
        h, w = fitted
    if opts.pipeline not in tiny.VIDEO_PIPELINES:
        return h, w, frames
    cap = min(frames, max_frames)
    fitted = cap - (cap - 1) % rule.frame_step  # the largest 1 + k * step within the cap
    if fitted != frames:
        log(f"default frames: {fitted} ({frames} of {opts.pipeline} ({size}) is above "
            f"--max-frames {max_frames} or breaks the frame rule 1 + k * "
            f"{rule.frame_step})")
    return h, w, fitted


def _signals(server: Server, rank: int) -> None:
    """Rank 0: SIGTERM / SIGINT shut down gracefully; a SIGINT at least REPEAT_S seconds after
    the first exits at once (a user's second Ctrl-C; one a launcher relays right after the
    terminal's own is not taken for it). Other ranks ignore both and wait for rank 0's stop
    (torchrun signals every rank)."""
    if rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return
    first = []

    def on_signal(signum, frame):
        now = time.monotonic()
        if signum == signal.SIGINT and first and now - first[0] >= REPEAT_S:
            log("second SIGINT: exiting now")
            os._exit(130)
        if not first:
            first.append(now)
        threading.Thread(target=server.request_shutdown, args=(signal.Signals(signum).name,),
                         daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _bind(opts: ServeOptions, rank: int) -> Optional[socket.socket]:
    """Rank 0's listening socket, bound before the pipeline is built (a taken port fails
    fast); connections wait in the backlog until serving starts."""
    if rank != 0:
        return None
    try:
        return bind(opts.host, opts.port)
    except OSError as e:
        raise ValueError(f"--host {opts.host} --port {opts.port}: cannot listen there: "
                         f"{e.strerror or e}") from None


def _serve_http(server: Server, sock: socket.socket, opts: ServeOptions) -> int:
    http = Transport(make_app(server), sock, opts.read_timeout_s, opts.max_connections,
                     DRAIN_S)
    host, port = http.address
    server.base_url = f"http://{host}:{port}"
    http.start()
    log(f"listening on {server.base_url} ({opts.pipeline}, {server.group.world} rank(s), "
        f"strategy {opts.strategy}, {opts.device} {opts.dtype}, files in {server.output_dir})")
    try:
        return server.serve()
    finally:
        if not http.stop():  # no new requests; the answers being written go out first
            log(f"answers still being written after {DRAIN_S:g} s")
        server.close()


class SetupError(ValueError):
    """What the options ask for cannot be served (a port taken, the pipeline's shape rule, a
    weights folder): exit status 2. A ValueError while serving is not one."""


def _setup(opts: ServeOptions, device, group: ControlGroup):
    """(socket or None, Server) of this rank; a refusal is a SetupError."""
    sock = None
    try:
        sock = _bind(opts, group.rank)
        pipe = build_pipeline(opts, device)
        return sock, Server(pipe, opts, limits_of(pipe, opts), group)
    except ValueError as e:
        if sock is not None:
            sock.close()
        raise SetupError(str(e)) from None


def run(opts: ServeOptions) -> int:
    device = generation.init_distributed(opts.device, opts.group_timeout_s)
    group = ControlGroup(opts.group_timeout_s)
    sock, server = _setup(opts, device, group)
    try:
        _signals(server, group.rank)
        server.introduce()
        if group.rank != 0:
            return server.follow()
        server.warmup(opts.warmup)
        code = _serve_http(server, sock, opts)
        sock = None
        return code
    except GroupBroken as e:
        log(f"rank {group.rank}: {e}")
        return 1
    finally:
        if sock is not None:
            sock.close()


def main(argv=None) -> int:
    try:
        opts = parse(argv, torch.cuda.is_available())
    except ValueError as e:
        print(f"python -m ditscale.serve: error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    try:
        code = run(opts)
    except SetupError as e:  # options the pipeline refuses (its shape rule, a weights folder)
        print(f"python -m ditscale.serve: error: {e}", file=sys.stderr)
        code = 2
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()  # a broken group is left alone: its peers are gone
    return code
