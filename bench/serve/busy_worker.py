#!/usr/bin/env python3
"""An experiment's variant of ``python -m ditscale.serve``: the worker never sleeps long
between requests.

    python -m bench.serve.bench_serve --server-module bench.serve.busy_worker ...

The stock worker blocks on the job store's condition until the next request arrives (at one
closed-loop client: the encoding, the answer and the client's next request, ~35 ms for Flux
small). This variant polls instead, every POLL_S seconds (the thread releases the GIL and the
core stays in a shallow idle state), for at most SPIN_S seconds before it falls back to the
stock blocking wait. If the server's pipeline call at 1 client is slower because its thread
slept (a cold core, a lowered clock), this server's is not; everything else is the stock
server's.
"""

from __future__ import annotations

import sys
import time

from ditscale.serve import cli
from ditscale.serve.jobs import JobStore

POLL_S = 100e-6
SPIN_S = 1.0

_stock_next_batch = JobStore.next_batch


def _polling_next_batch(self: JobStore, timeout: float):
    end = time.monotonic() + min(SPIN_S, timeout)
    while time.monotonic() < end:
        batch = _stock_next_batch(self, 0.0)
        if batch or self.closed is not None:
            return batch
        time.sleep(POLL_S)
    return _stock_next_batch(self, max(0.0, timeout - SPIN_S))


JobStore.next_batch = _polling_next_batch

if __name__ == "__main__":
    sys.exit(cli.main())
