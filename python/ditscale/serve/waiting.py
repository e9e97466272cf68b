"""Waiting on a job from an async handler without blocking the event loop.

The job store's threads wake a handler (:meth:`~.jobs.JobStore.watch`) through
``call_soon_threadsafe`` (:class:`Wakeup`): a blocking POST only when its job ends
(:func:`wait_finished`, which cancels the job when the client disconnects first), an event
stream at every change (:func:`events`: ``progress``, then the final status). Queued jobs past
their deadline are expired by their waiters. The events' format: docs/serve.md.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.requests import Request

from .jobs import FINAL, Job, JobStore
from .reading import ClientGone

SSE_KEEPALIVE_S = 15.0


class Wakeup:
    """An asyncio.Event that the job store's threads set (see the module)."""

    def __init__(self, store: JobStore, job: Job, every_change: bool):
        self.loop, self.event = asyncio.get_running_loop(), asyncio.Event()
        self.unwatch = store.watch(job, self._wake, every_change)

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    async def wait(self, timeout: float, *others) -> None:
        waiter = asyncio.ensure_future(self.event.wait())
        try:
            await asyncio.wait({waiter, *others}, timeout=max(timeout, 0.0),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            self.event.clear()


async def _disconnected(request: Request) -> None:
    """Returns when the client of ``request`` (its body already read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _budget(job: Job, timeout: float) -> float:
    """``timeout``, cut to the deadline of a queued job (whose waiter then expires it)."""
    if job.status == "queued":
        return min(timeout, job.deadline - time.monotonic())
    return timeout


async def wait_finished(store: JobStore, job: Job, request: Request) -> None:
    """Until ``job`` ends; a client that disconnects meanwhile cancels it (ClientGone)."""
    wake = Wakeup(store, job, every_change=False)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while not job.done:
            await wake.wait(_budget(job, 1.0), gone)
            if gone.done() and not job.done:
                store.cancel(job.id)
                raise ClientGone()
            store.expire()
    finally:
        wake.unwatch()
        gone.cancel()


async def events(store: JobStore, job: Job):
    """The server-sent events of ``job``: ``progress`` at each change, then its final status
    (the name and the data from one snapshot: a finished job's last event is never
    ``progress``)."""
    wake = Wakeup(store, job, every_change=True)
    version, last = -1, time.monotonic()
    try:
        while True:
            current, view = store.snapshot(job)
            if current != version:
                version = current
                name = view["status"] if view["status"] in FINAL else "progress"
                yield f"event: {name}\ndata: {json.dumps(view)}\n\n"
                last = time.monotonic()
                if name != "progress":
                    return
            elif time.monotonic() - last > SSE_KEEPALIVE_S:
                yield ": keep-alive\n\n"
                last = time.monotonic()
            await wake.wait(_budget(job, 1.0))
            store.expire()
    finally:
        wake.unwatch()
