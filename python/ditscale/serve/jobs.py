"""Jobs and the bounded queue of the server (rank 0 only; thread-safe).

A :class:`Job` is one request: ``queued`` -> ``running`` -> ``succeeded`` | ``failed`` |
``cancelled`` (a queued job can be cancelled, or time out, before it runs). Every change bumps
``job.version`` and wakes the threads waiting on the store's condition (the server-sent events
of ``/v1/jobs/{id}/events`` watch every change; a blocking POST only the end: woken once, not at
each denoising step, which would take the GIL from the pipeline's loop).

:class:`JobStore`: ``submit`` adds a queued job or raises 429 when ``max_queue`` jobs already
wait (the running batch does not count); ``next_batch`` hands the worker the oldest queued job
and the queued jobs with the same :meth:`Request.batch_key` after it, up to ``max_batch``
samples in all; finished jobs are kept for ``GET /v1/jobs/{id}`` until ``keep`` of them exist,
then the oldest finished is forgotten.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from .errors import RequestError
from .schema import Request

FINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Job:
    id: str
    request: Request
    created: float  # time.time()
    deadline: float  # time.monotonic() after which the job times out
    status: str = "queued"
    step: int = 0  # denoising steps done
    started: Optional[float] = None
    finished: Optional[float] = None
    error: Optional[RequestError] = None
    result: Optional[dict] = None  # the response body of a succeeded job
    cancel_requested: bool = False
    version: int = 0
    submitted_mono: float = field(default_factory=time.monotonic)
    finished_event: threading.Event = field(default_factory=threading.Event, repr=False)
    watchers: List[Tuple[Callable[[], None], bool]] = field(default_factory=list, repr=False)

    @property
    def done(self) -> bool:
        return self.status in FINAL

    def view(self) -> dict:
        """The job as ``GET /v1/jobs/{id}`` shows it."""
        out: Dict[str, Any] = {
            "id": self.id, "object": "job", "kind": self.request.kind, "status": self.status,
            "created": int(self.created),
            "progress": {"step": self.step, "steps": self.request.steps},
            "text_encoder": self.request.text_source, "seed": self.request.seed,
        }
        if self.started is not None:
            out["started"] = self.started
        if self.finished is not None:
            out["finished"] = self.finished
        if self.error is not None:
            out["error"] = self.error.body()["error"]
        if self.result is not None:
            out["result"] = self.result
        return out


class JobStore:
    """The jobs of the server (see the module)."""

    def __init__(self, max_queue: int, max_batch: int, keep: int = 1000):
        self.max_queue, self.max_batch, self.keep = max_queue, max_batch, keep
        self.cond = threading.Condition()
        self.jobs: Dict[str, Job] = {}
        self.queue: Deque[Job] = collections.deque()
        self.finished: Deque[str] = collections.deque()
        self.closed: Optional[str] = None  # why new jobs are refused (shutdown), else None
        self.running: List[Job] = []
        self.on_finish: Optional[Callable[[Job], None]] = None  # called under the lock

    # -- clients' side --------------------------------------------------------------------

    def submit(self, request: Request) -> Job:
        with self.cond:
            if self.closed is not None:
                raise RequestError(503, self.closed, code="shutting_down")
            if len(self.queue) >= self.max_queue:
                raise RequestError(429, f"the queue is full ({self.max_queue} requests wait); "
                                        f"retry later", code="queue_full")
            job = Job(f"gen-{os.urandom(8).hex()}", request, time.time(),
                      time.monotonic() + request.timeout_s)
            self.jobs[job.id] = job
            self.queue.append(job)
            self._changed(job)
            return job

    def get(self, job_id: str) -> Job:
        with self.cond:
            self._expire_queued()
            job = self.jobs.get(job_id)
        if job is None:
            raise RequestError(404, f"no job {job_id!r} (unknown, or finished long ago)",
                               param="id", code="not_found")
        return job

    def cancel(self, job_id: str) -> Job:
        """Cancels a queued job now, a running one at its next step (the worker's check)."""
        job = self.get(job_id)
        with self.cond:
            if job.status == "queued":
                self.queue.remove(job)
                self._finish(job, "cancelled", RequestError(409, "cancelled by a client",
                                                            code="cancelled"))
            elif job.status == "running":
                job.cancel_requested = True
        return job

    def watch(self, job: Job, wake: Callable[[], None], every_change: bool) -> Callable[[], None]:
        """Calls ``wake()`` (under the store's lock: it must only signal) when ``job`` changes
        (``every_change``) or finishes; returns the function that stops it."""
        entry = (wake, every_change)
        with self.cond:
            job.watchers.append(entry)
            if job.done:
                wake()

        def unwatch():
            with self.cond:
                if entry in job.watchers:
                    job.watchers.remove(entry)
        return unwatch

    def snapshot(self, job: Job) -> Tuple[int, dict]:
        """(version, view without the result) of ``job``, read at one instant."""
        with self.cond:
            view = job.view()
            view.pop("result", None)
            return job.version, view

    def expire(self) -> None:
        """Queued jobs past their deadline fail with 504 now."""
        with self.cond:
            self._expire_queued()

    def wait_done(self, job: Job, timeout: float) -> bool:
        """Blocks until ``job`` is finished (woken once, not at each step) or ``timeout``
        seconds pass (a queued job past its deadline fails with 504 by then); True when
        finished."""
        if not job.finished_event.wait(_until_deadline(job, timeout)):
            with self.cond:
                self._expire_queued()
        return job.done

    def wait(self, job: Job, version: int, timeout: float) -> int:
        """Blocks until ``job.version`` differs from ``version`` or ``timeout`` seconds pass
        (a queued job past its deadline fails with 504 by then); returns the version now."""
        with self.cond:
            if not self.cond.wait_for(lambda: job.version != version,
                                      timeout=_until_deadline(job, timeout)):
                self._expire_queued()
            return job.version

    # -- the worker's side ----------------------------------------------------------------

    def next_batch(self, timeout: float) -> List[Job]:
        """The next batch (running from now on), or [] after ``timeout`` seconds without one.
        Queued jobs past their deadline fail with 504 first."""
        with self.cond:
            self.cond.wait_for(lambda: self.queue or self.closed is not None, timeout=timeout)
            self._expire_queued()
            if not self.queue:
                return []
            first = self.queue.popleft()
            batch, samples = [first], first.request.n
            key = first.request.batch_key()
            for job in list(self.queue):
                if samples == self.max_batch:
                    break
                if (job.request.batch_key() == key
                        and samples + job.request.n <= self.max_batch):
                    self.queue.remove(job)
                    batch.append(job)
                    samples += job.request.n
            now = time.time()
            for job in batch:
                job.status, job.started = "running", now
                self._changed(job)
            self.running = batch
            return batch

    def _expire_queued(self) -> None:
        now = time.monotonic()
        for job in [j for j in self.queue if j.deadline <= now]:
            self.queue.remove(job)
            self._finish(job, "failed", timeout_error(job))

    def progress(self, job: Job, step: int) -> None:
        with self.cond:
            job.step = step
            self._changed(job)

    def complete(self, job: Job, result: dict) -> None:
        with self.cond:
            if job.done:  # failed meanwhile (the group broke)
                return
            job.step = job.request.steps
            job.result = result
            self._finish(job, "succeeded", None)

    def fail(self, job: Job, error: RequestError) -> None:
        with self.cond:
            if not job.done:
                status = "cancelled" if error.code == "cancelled" else "failed"
                if job.status == "queued":
                    self.queue.remove(job)
                self._finish(job, status, error)

    def batch_done(self) -> None:
        with self.cond:
            self.running = []

    def close(self, why: str) -> List[Job]:
        """Refuses new jobs from now on (503 ``why``); returns the queued ones, which the caller
        fails."""
        with self.cond:
            self.closed = why
            queued = list(self.queue)
            self.cond.notify_all()
            return queued

    def depth(self) -> int:
        with self.cond:
            return len(self.queue)

    def _finish(self, job: Job, status: str, error: Optional[RequestError]) -> None:
        job.status, job.error, job.finished = status, error, time.time()
        self._changed(job)
        job.finished_event.set()
        if self.on_finish is not None:
            self.on_finish(job)
        self.finished.append(job.id)
        while len(self.finished) > self.keep:
            self.jobs.pop(self.finished.popleft(), None)

    def _changed(self, job: Job) -> None:
        job.version += 1
        self.cond.notify_all()
        for wake, every_change in job.watchers:
            if every_change or job.done:
                wake()


def _until_deadline(job: Job, timeout: float) -> float:
    """``timeout``, cut to the deadline of a job still queued (whose waiter then fails it)."""
    if job.status == "queued":
        return max(0.0, min(timeout, job.deadline - time.monotonic()))
    return timeout


def timeout_error(job: Job) -> RequestError:
    return RequestError(504, f"the request did not finish within its timeout of "
                             f"{job.request.timeout_s:g} s", param="timeout", code="timeout")
