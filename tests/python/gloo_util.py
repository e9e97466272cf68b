"""Run a function on N processes of a gloo process group (CPU multi-rank tests).

    from gloo_util import run_gloo
    results = run_gloo(fn, 2, arg1, arg2, timeout_s=60)   # [fn(0, 2, arg1, arg2), fn(1, 2, ...)]

``fn(rank, world_size, *args)`` runs in each of ``world_size`` processes (forked from a
forkserver that imported torch once) after
``torch.distributed.init_process_group("gloo")`` on 127.0.0.1 (a free port; process-group
timeout ``pg_timeout_s``; ``torch.set_num_threads(threads)``). ``fn`` and ``args`` must be
picklable (a module-level function of a test module). Returns every rank's return value (pickled
by value). A rank that raises makes run_gloo raise :class:`ChildError` with that rank's traceback
(the other ranks are killed); ranks still running after ``timeout_s`` are killed and
:class:`TimeoutError` names them; a rank that dies without a result (a crash) is a ChildError with
its exit code. Children never outlive the call.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, List


class ChildError(RuntimeError):
    """A rank of run_gloo failed: ``rank``, ``exc_type`` (the exception's class name, or
    "crash") and ``child_traceback`` (its formatted traceback)."""

    def __init__(self, rank: int, exc_type: str, child_traceback: str):
        super().__init__(f"rank {rank} failed ({exc_type}):\n{child_traceback}")
        self.rank = rank
        self.exc_type = exc_type
        self.child_traceback = child_traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, pg_timeout_s, threads, args, results) -> None:
    try:
        import datetime

        import torch
        import torch.distributed as dist
        torch.set_num_threads(threads)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as e:  # reported to the parent, which raises ChildError
        results.put((rank, type(e).__name__, traceback.format_exc()))


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


_PRELOAD = ["torch", "torch.distributed"]


def _context():
    """A forkserver context whose server has imported torch once per test session: each rank
    is a fork of it (no import of torch per rank, none of fork's hazards: the server runs no
    torch op and starts no thread)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_gloo(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 60.0,
             pg_timeout_s: float = 60.0, threads: int = 1) -> List[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each rank in its own
    process of one gloo group (see the module)."""
    if not isinstance(world_size, int) or not 1 <= world_size <= 64:
        raise ValueError(f"run_gloo: world_size {world_size!r} is not in [1, 64]")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(fn, r, world_size, port, pg_timeout_s, threads, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    late = [r for r in range(world_size) if r not in got]
                    raise TimeoutError(f"run_gloo: ranks {late} did not finish within "
                                       f"{timeout_s:g} s (killed)") from None
                for r, p in enumerate(procs):
                    if r not in got and p.exitcode is not None and results.empty():
                        time.sleep(0.5)  # a result put just before exiting may still be in flight
                        if results.empty():
                            raise ChildError(r, "crash", f"exited with code {p.exitcode} "
                                                         f"without a result")
                continue
            if status != "ok":
                raise ChildError(rank, status, payload)
            got[rank] = pickle.loads(payload)
    finally:
        _stop(procs)
    return [got[r] for r in range(world_size)]
