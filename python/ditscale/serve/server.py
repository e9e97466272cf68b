"""The server's core: rank 0's worker loop, the other ranks' loop, and a batch's life.

Rank 0 (``Server.serve``) takes the next batch from the :class:`JobStore` (idle: a heartbeat),
sends its :class:`RunSpec` to every rank in calls of at most ``--max-batch`` samples, runs it
like every rank, gathers the statuses and settles the jobs: same output bytes on every rank ->
encoded (PNG / MP4 / GIF, base64 or a file written under a temporary name and renamed) on the
encoder thread while the group runs on; a rank's failure, or a batch the worker cannot prepare
-> that batch's jobs fail (500) and the group serves on; a stop at a step -> 409 / 504 / 503.
Other ranks (``Server.follow``): receive, run, report, until ``stop``. A failed collective
(:class:`GroupBroken`) fails every unfinished job with 503 and exits 1; ``request_shutdown``
lets the running batch finish within ``--shutdown-grace``. docs/serve.md.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Deque, List, Optional

import numpy as np
import torch

from ..diffusers import generation
from ..diffusers.stage_timer import StageTimer
from .errors import RequestError
from .group import ControlGroup, GroupBroken
from .jobs import Job, JobStore, timeout_error
from .metrics import Metrics
from .options import ServeOptions
from .runner import (STOP_CANCEL, STOP_NONE, STOP_SHUTDOWN, STOP_TIMEOUT, RunFailure, RunSpec,
                     Stopped, build_spec, digest, execute, split_spec, stage_seconds)
from .schema import Limits

HEARTBEAT, STOP = {"op": "heartbeat"}, {"op": "stop"}


def log(msg: str) -> None:
    print(f"ditscale.serve: {msg}", file=sys.stderr, flush=True)


class StepControl:
    """``callback_on_step_end`` of a batch (see ``runner``); rank 0 also records progress."""

    def __init__(self, server: "Server", batch: Optional[List[Job]]):
        self.server, self.batch = server, batch

    def decide(self) -> int:
        s, now = self.server, time.monotonic()
        if s.shutdown_deadline is not None and now > s.shutdown_deadline:
            return STOP_SHUTDOWN
        live = [j for j in self.batch if not j.cancel_requested and j.deadline > now]
        if live:
            return STOP_NONE
        return STOP_CANCEL if any(j.cancel_requested for j in self.batch) else STOP_TIMEOUT

    def __call__(self, pipe, step: int, timestep, callback_kwargs):
        if self.batch is not None:  # rank 0
            for job in self.batch:
                self.server.store.progress(job, step + 1)
            flag = self.server.group.step(self.decide())
        else:
            flag = self.server.group.step(STOP_NONE)
        if flag != STOP_NONE:
            raise Stopped(flag)
        return callback_kwargs


class Server:
    def __init__(self, pipe, opts: ServeOptions, limits: Limits, group: ControlGroup):
        self.pipe, self.opts, self.limits, self.group = pipe, opts, limits, group
        self.device = pipe.transformer.device
        self.store = JobStore(opts.max_queue, opts.max_batch, opts.keep_jobs)
        self.metrics = Metrics()
        self.store.on_finish = self._finished
        self.shutdown_deadline: Optional[float] = None
        self.stopping = threading.Event()
        self.broken: Optional[str] = None
        self.ranks: List[dict] = []
        self.encoder = concurrent.futures.ThreadPoolExecutor(1, "ditscale-encode")
        # rank 0 writes the response_format=url files; a folder made here is removed by close()
        self.own_output_dir = opts.output_dir is None and group.rank == 0
        self.output_dir = opts.output_dir or ""
        if self.own_output_dir:
            self.output_dir = tempfile.mkdtemp(prefix="ditscale-serve-")
        elif group.rank == 0:
            self.output_dir = generation.check_output_dir("--output-dir", self.output_dir)
        self.files: Deque[str] = collections.deque()
        self.base_url = ""

    # -- every rank -------------------------------------------------------------------------

    def introduce(self) -> None:
        """Every rank's pid and device, on every rank (``/health`` shows them)."""
        me = {"rank": self.group.rank, "pid": os.getpid(), "device": str(self.device),
              "host": os.uname().nodename}
        self.ranks = self.group.gather(me)

    def run_once(self, spec: RunSpec, control: StepControl):
        """(status, samples or None) of this rank for ``spec``."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        begin = time.perf_counter()
        samples, status = None, {"ok": True}
        timer = StageTimer(self.device)
        try:
            samples = execute(self.pipe, self.opts.pipeline, spec, control, timer)
            if self.group.world > 1:
                status["digest"] = digest(samples)
        except Stopped as e:
            status = {"ok": False, "stopped": e.reason}
        except RunFailure as e:
            status = {"ok": False, "status": e.status, "code": e.code, "message": str(e)}
        status["run_s"] = time.perf_counter() - begin
        status["stages"] = stage_seconds(timer)
        status["rank"] = self.group.rank
        status["memory"] = self._memory()
        return status, samples

    def _memory(self) -> dict:
        if self.device.type != "cuda":
            return {}
        return {"allocated": torch.cuda.memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device),
                "peak": torch.cuda.max_memory_allocated(self.device)}

    def follow(self) -> int:
        """The loop of ranks > 0; returns the exit code."""
        try:
            while True:
                msg = self.group.recv()
                if msg["op"] == "stop":
                    return 0
                if msg["op"] == "run":
                    status, _ = self.run_once(msg["spec"], StepControl(self, None))
                    self.group.gather(status)
        except GroupBroken as e:
            log(f"rank {self.group.rank}: {e}; exiting")
            return 1

    # -- rank 0 -----------------------------------------------------------------------------

    def warmup(self, calls: int) -> None:
        """``calls`` pipeline calls of the default shape before serving (kernels, autotuning)."""
        from .schema import Request

        h, w, f = self.limits.default_size
        for i in range(calls):
            req = Request(self.limits.video and "video" or "image", h, w, f, self.opts.steps,
                          self.limits.default_guidance, 1, i, 16, "b64_json",
                          "mp4" if self.limits.video else "png", self.opts.request_timeout_s,
                          False, "pipeline" if self.limits.has_encoders else "stand-in",
                          prompt="warm-up")
            spec = build_spec([req], self.opts.text_tokens)
            self.group.send({"op": "run", "spec": spec})
            status, _ = self.run_once(spec, StepControl(self, None))
            statuses = self.group.gather(status)
            failed = [s for s in statuses if not s["ok"]]
            if failed:
                raise RuntimeError(f"warm-up call {i + 1} failed on rank {failed[0]['rank']}: "
                                   f"{failed[0].get('message', failed[0])}")
            log(f"warm-up {i + 1}/{calls}: {statuses[0]['run_s']:.3f} s")

    def serve(self) -> int:
        """Rank 0's worker loop until shutdown; returns the exit code. Under torchrun, the
        launcher's exit (SIGKILL: it forwards no signal then) shuts the server down too: its
        ranks run in sessions of their own and would serve on."""
        launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        try:
            while True:
                if launcher is not None and os.getppid() != launcher:
                    self.request_shutdown(f"the launcher (pid {launcher}) exited")
                    launcher = None
                batch = self.store.next_batch(timeout=self.opts.heartbeat_s)
                self.metrics.queue_depth.set(self.store.depth())
                if batch:
                    self._run_batch(batch)
                elif self.stopping.is_set():
                    break
                else:
                    self.group.send(HEARTBEAT)
            self.encoder.shutdown(wait=True)
            self.group.send(STOP)
            log("stopped: every rank told to exit")
            return 0
        except GroupBroken as e:
            self._broken(str(e))
            return 1

    def _broken(self, why: str, batch: Optional[List[Job]] = None) -> None:
        """Every unfinished job (``batch``: the one that ran) fails with 503; serving stops."""
        if self.broken is not None:
            return
        self.broken = why
        log(f"the rank group failed: {why}; failing every unfinished request with 503 and "
            f"shutting down")
        err = RequestError(503, f"the server's rank group failed ({why})", code="group_failed")
        for job in self.store.close(err.message) + list(batch or self.store.running):
            self.store.fail(job, err)
        self.encoder.shutdown(wait=True)
        self.stopping.set()

    def request_shutdown(self, why: str) -> None:
        """Graceful shutdown (see the module); safe from a signal handler's thread."""
        if self.stopping.is_set():
            return
        log(f"shutting down ({why}): no new requests; the running one has "
            f"{self.opts.shutdown_grace_s:g} s to finish")
        self.shutdown_deadline = time.monotonic() + self.opts.shutdown_grace_s
        err = RequestError(503, "the server is shutting down", code="shutting_down")
        for job in self.store.close(err.message):
            self.store.fail(job, err)
        self.stopping.set()

    def _run_batch(self, batch: List[Job]) -> None:
        """``batch`` on the group, in calls of at most --max-batch samples; a failure of the
        batch (its spec, a rank's run) fails its jobs only."""
        self.metrics.running_jobs.set(len(batch))
        try:
            spec = build_spec([j.request for j in batch], self.opts.text_tokens)
            outs = []
            for part in split_spec(spec, self.opts.max_batch):
                self.group.send({"op": "run", "spec": part})
                status, samples = self.run_once(part, StepControl(self, batch))
                outs.append((self.group.gather(status), samples))
                if not self._settled(batch, outs[-1][0]):
                    return
            self._succeeded(batch, spec, outs)
        except GroupBroken as e:  # this batch's jobs fail first (the store forgets them
            self._broken(str(e), batch)  # as running when the batch ends)
            raise
        except Exception as e:  # a bug of ours: this batch fails, the server serves on
            log(f"batch of {len(batch)} failed: {traceback.format_exc()}")
            self._fail_all(batch, RequestError(500, f"internal error: {type(e).__name__}: {e}",
                                               code="internal_error"))
        finally:
            self.store.batch_done()
            self.metrics.running_jobs.set(0)

    def _settled(self, batch: List[Job], statuses: List[dict]) -> bool:
        """True when every rank ran this call with the same output; else the batch's jobs
        fail (a stop: 409 / 504 / 503; a rank's failure; ranks that disagree)."""
        for s in statuses:
            for kind, value in s["memory"].items():
                self.metrics.gpu_memory_bytes.labels(rank=str(s["rank"]), kind=kind).set(value)
        stopped = [s["stopped"] for s in statuses if "stopped" in s]
        failed = [s for s in statuses if not s["ok"] and "stopped" not in s]
        if stopped:
            self._fail_stopped(batch, stopped[0])
        elif failed:
            f = failed[0]
            where = f" (rank {f['rank']})" if self.group.world > 1 else ""
            self._fail_all(batch, RequestError(f["status"], f["message"] + where, code=f["code"]))
        elif len({s.get("digest") for s in statuses}) > 1:
            self._fail_all(batch, RequestError(500, "the ranks produced different outputs",
                                               code="ranks_disagree"))
        else:
            return True
        return False

    def _succeeded(self, batch: List[Job], spec: RunSpec, outs) -> None:
        run_s = sum(max(s["run_s"] for s in statuses) for statuses, _ in outs)
        stages = [statuses[0]["stages"] for statuses, _ in outs]  # rank 0's
        self.metrics.run_seconds.observe(run_s)
        for st in stages:
            self.metrics.stage_seconds.labels(stage="text_encoding").observe(
                st["text_encoding_s"])
            self.metrics.stage_seconds.labels(stage="vae_decode").observe(st["vae_decode_s"])
            for step_s in st["denoising_steps_s"]:
                self.metrics.stage_seconds.labels(stage="denoising_step").observe(step_s)
        steps = spec.steps * len(outs)
        self.metrics.steps.inc(steps)
        self.metrics.steps_per_second.set(steps / run_s if run_s > 0 else 0.0)
        samples = np.concatenate([s for _, s in outs]) if len(outs) > 1 else outs[0][1]
        timings = {"run_s": round(run_s, 6),
                   "text_encoding_s": round(sum(st["text_encoding_s"] for st in stages), 6),
                   "denoising_s": round(sum(st["denoising_s"] for st in stages), 6),
                   "denoising_steps_s": [x for st in stages for x in st["denoising_steps_s"]],
                   "vae_decode_s": round(sum(st["vae_decode_s"] for st in stages), 6)}
        self._hand_out(batch, samples, timings, {"requests": spec.requests,
                                                 "samples": len(spec.seeds),
                                                 "calls": len(outs)})

    def _hand_out(self, batch: List[Job], samples: np.ndarray, timings: dict,
                  shared: dict) -> None:
        """Each live job's samples to the encoder thread (``shared``: the batch's size, reported
        in every result); jobs cancelled or timed out while the batch ran fail now."""
        start, now = 0, time.monotonic()
        for job in batch:
            part = samples[start:start + job.request.n]
            start += job.request.n
            if job.cancel_requested:
                self._fail(job, RequestError(409, "cancelled by a client", code="cancelled"))
            elif job.deadline <= now:
                self._fail(job, timeout_error(job))
            else:
                self.encoder.submit(self._encode, job, part, timings, shared)

    def _fail_stopped(self, batch: List[Job], reason: int) -> None:
        for job in batch:
            if reason == STOP_SHUTDOWN:
                err = RequestError(503, "the server shut down before the request finished",
                                   code="shutting_down")
            elif job.cancel_requested:
                err = RequestError(409, "cancelled by a client", code="cancelled")
            else:
                err = timeout_error(job)
            self._fail(job, err)

    def _fail_all(self, batch: List[Job], err: RequestError) -> None:
        log(f"batch of {len(batch)} failed: {err.message}")
        for job in batch:
            self._fail(job, err)

    def _fail(self, job: Job, err: RequestError) -> None:
        self.store.fail(job, err)

    def _finished(self, job: Job) -> None:
        self.metrics.jobs.labels(status=job.status).inc()
        if job.status == "succeeded":
            self.metrics.samples.inc(job.request.n)
            self.metrics.job_latency_seconds.observe(time.monotonic() - job.submitted_mono)

    # -- results ----------------------------------------------------------------------------

    def _encode(self, job: Job, samples: np.ndarray, timings: dict, batch: dict) -> None:
        if job.cancel_requested:
            self._fail(job, RequestError(409, "cancelled by a client", code="cancelled"))
            return
        try:
            begin = time.perf_counter()
            items = [self._item(job, i, s) for i, s in enumerate(samples)]
            encode_s = time.perf_counter() - begin
            self.metrics.stage_seconds.labels(stage="output_encoding").observe(encode_s)
            req = job.request
            result = {"created": int(job.created), "id": job.id, "model": self.opts.pipeline,
                      "object": f"{req.kind}.generation", "data": items, "seed": req.seed,
                      "size": f"{req.width}x{req.height}", "steps": req.steps,
                      "guidance": req.guidance, "text_encoder": req.text_source,
                      "batch": batch,
                      "timings": {"queued_s": round(job.started - job.created, 6), **timings,
                                  "encode_s": round(encode_s, 6),
                                  "output_encoding_s": round(encode_s, 6)}}
            if req.kind == "video":
                result.update(frames=req.frames, fps=req.fps)
            self.store.complete(job, result)
        except Exception as e:  # an encoder failure fails this job alone
            self._fail(job, RequestError(500, f"encoding the output failed: "
                                              f"{type(e).__name__}: {e}", code="encode_failed"))

    def _item(self, job: Job, index: int, sample: np.ndarray) -> dict:
        req = job.request
        if req.kind == "image":
            data, ext = generation.encode_png(sample, self.opts.png_level), "png"
        else:
            data, ext = generation.encode_video(sample, req.fps, req.output_format), \
                req.output_format
        if req.response_format == "b64_json":
            return {"b64_json": base64.b64encode(data).decode("ascii")}
        name = f"{job.id}-{index}.{ext}"
        self._write_file(name, data)
        return {"url": f"{self.base_url}/v1/files/{name}"}

    def close(self) -> None:
        """After serving: the default output folder (a temporary one) is removed; a given
        --output-dir keeps its files."""
        if self.own_output_dir:
            shutil.rmtree(self.output_dir, ignore_errors=True)

    def file_path(self, name: str) -> Optional[str]:
        """The path of the output file ``name`` (already matched against the route's
        pattern: no separators), or None when it is not (or no longer) there."""
        path = os.path.join(self.output_dir, name)
        return path if os.path.isfile(path) else None

    def log_request(self, line: str) -> None:
        log(line)

    def _write_file(self, name: str, data: bytes) -> None:
        path = os.path.join(self.output_dir, name)
        tmp = path + ".part"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        self.files.append(path)
        while len(self.files) > self.opts.keep_files:
            old = self.files.popleft()
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass
