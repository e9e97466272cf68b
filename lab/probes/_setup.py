"""The one-GPU probes' shared setup: the device and a one-rank NCCL group (lab/probes/README.md).

No torch import at module level: torch and torch.distributed are passed in by the probes. Flux's
attention-call inputs, which bench.sp.calibrate uses too, stay in bench.common."""

from __future__ import annotations

import datetime
import sys
import tempfile
from pathlib import Path


def probe_device(torch, who: str):
    """cuda:0, made current, with torch seeded 0: the one-GPU probes' device; None (after saying
    so on stderr) without a CUDA device."""
    if not torch.cuda.is_available():
        print(f"{who}: no CUDA device", file=sys.stderr)
        return None
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    return dev


def self_process_group(dist, dev, prefix: str):
    """A one-rank NCCL process group on `dev` (file store; NCCL's stream at high priority, as the
    executor's comm streams), for a probe's send/recv to this rank itself. Returns the function
    that destroys it."""
    init = tempfile.NamedTemporaryFile(prefix=prefix, delete=False)
    init.close()
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    dist.init_process_group("nccl", init_method=f"file://{init.name}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=dev,
                            pg_options=opts)

    def close():
        dist.destroy_process_group()
        Path(init.name).unlink(missing_ok=True)  # the FileStore may have removed it

    return close
