"""``python -m ditscale.serve``: a generation server over a sequence-parallel pipeline group.

    torchrun --nproc-per-node 4 -m ditscale.serve --pipeline flux --full-size --port 8000
    torchrun --nproc-per-node 2 -m ditscale.serve --device cpu --pipeline wan   (gloo)
    python -m ditscale.serve --pipeline sd3 --weights /ckpt/sd3.5-medium

Every rank builds the same pipeline (random weights of the tiny config by default, of the
real dimensions with ``--full-size``, ``--size small`` for real widths with a few blocks, or a
local checkpoint with ``--weights``) and ``parallelize_pipeline`` makes it sequence- (and CFG-)
parallel over all ranks with ``--strategy``; rank 0 serves HTTP on ``--host``:``--port``
(loopback by default; port 0 picks a free one) and hands each request, or batch of compatible
requests (``--max-batch``), to the whole group. The listening address is logged on stderr as
``ditscale.serve: listening on http://HOST:PORT``. The API: docs/serve.md.

Exit codes: 0 after a graceful shutdown (SIGTERM or SIGINT to rank 0; a second SIGINT exits
at once), 1 when the rank group failed (a rank died: the log names the failed collective), 2
for bad options (the message names the option, its value and its range).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch

from ..diffusers import generation, parallelize_pipeline, tiny
from .group import ControlGroup, GroupBroken
from .http import make_http_server
from .options import ServeOptions, parse
from .schema import Limits
from .server import Server, log

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_pipeline(opts: ServeOptions, device: torch.device):
    dtype = DTYPES[opts.dtype]
    if opts.weights:
        pipe = tiny.load_pipeline(opts.pipeline, opts.weights, device=device, dtype=dtype)
    else:
        pipe = tiny.make_pipeline(opts.pipeline, size=opts.size, device=device, dtype=dtype,
                                  seed=opts.seed)
    return parallelize_pipeline(pipe, cfg_parallel=opts.cfg_parallel, strategy=opts.strategy)


def limits_of(pipe, opts: ServeOptions) -> Limits:
    """What requests to ``pipe`` may ask for, from the pipeline and the options."""
    rule = generation.shape_rule(opts.pipeline, pipe)
    width, pooled = tiny._text_dims(pipe)
    size = "full" if opts.weights else opts.size
    if opts.max_size < rule.pixel_multiple:
        raise ValueError(f"--max-size: {opts.max_size} is below the pipeline's pixel multiple "
                         f"{rule.pixel_multiple}")
    video = opts.pipeline in tiny.VIDEO_PIPELINES
    return Limits(
        pipeline=opts.pipeline, video=video, pixel_multiple=rule.pixel_multiple,
        frame_step=rule.frame_step, text_width=width, pooled_width=pooled,
        has_mask=opts.pipeline == "hunyuan-video",
        has_encoders=getattr(pipe, "text_encoder", None) is not None,
        default_size=tiny.DEFAULT_SHAPES[opts.pipeline][size], default_steps=opts.steps,
        default_guidance=generation.DEFAULT_GUIDANCE[opts.pipeline], max_size=opts.max_size,
        max_frames=opts.max_frames if video else 1, max_steps=opts.max_steps,
        max_batch=opts.max_batch, max_timeout_s=opts.request_timeout_s,
        stand_in_tokens=opts.text_tokens)


def _signals(server: Server, rank: int) -> None:
    """Rank 0: SIGTERM / SIGINT shut down gracefully (a second SIGINT exits at once). Other
    ranks ignore both and wait for rank 0's stop (torchrun signals every rank)."""
    if rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return

    def on_signal(signum, frame):
        if signum == signal.SIGINT and server.stopping.is_set():
            log("second SIGINT: exiting now")
            os._exit(130)
        threading.Thread(target=server.request_shutdown, args=(signal.Signals(signum).name,),
                         daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _serve_http(server: Server, opts: ServeOptions) -> int:
    httpd = make_http_server(server, opts.host, opts.port)
    host, port = httpd.server_address[:2]
    server.base_url = f"http://{host}:{port}"
    thread = threading.Thread(target=httpd.serve_forever, name="ditscale-http", daemon=True)
    thread.start()
    log(f"listening on {server.base_url} ({opts.pipeline}, {server.group.world} rank(s), "
        f"strategy {opts.strategy}, {opts.device} {opts.dtype}, files in {server.output_dir})")
    try:
        return server.serve()
    finally:
        httpd.shutdown()
        httpd.server_close()


def run(opts: ServeOptions) -> int:
    device = generation.init_distributed(opts.device, opts.group_timeout_s)
    group = ControlGroup(opts.group_timeout_s)
    pipe = build_pipeline(opts, device)
    server = Server(pipe, opts, limits_of(pipe, opts), group)
    _signals(server, group.rank)
    try:
        server.introduce()
        if group.rank != 0:
            return server.follow()
        server.warmup(opts.warmup)
        return _serve_http(server, opts)
    except GroupBroken as e:
        log(f"rank {group.rank}: {e}")
        return 1


def main(argv=None) -> int:
    try:
        opts = parse(argv, torch.cuda.is_available())
    except ValueError as e:
        print(f"python -m ditscale.serve: error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    try:
        code = run(opts)
    except ValueError as e:  # options the pipeline refuses (its shape rule, a weights folder)
        print(f"python -m ditscale.serve: error: {e}", file=sys.stderr)
        code = 2
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()  # a broken group is left alone: its peers are gone
    return code
