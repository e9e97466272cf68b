"""What several bench scripts share: the repository root, the ditscale CLI, and the setup of the
one-GPU probes (device, a one-rank NCCL group, Flux's attention-call inputs).

No torch import at module level: torch (and torch.distributed) are passed in by the callers that
run on a GPU, so the CPU-side scripts (calibrate fit, fit_runs, report) import this without it."""

from __future__ import annotations

import datetime
import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]

# Flux's attention call on one GPU: S + T = 65,536 + 512 tokens, 24 heads x 128.
FLUX_CALL_HEADS, FLUX_CALL_TOKENS, FLUX_CALL_HEAD_DIM = 24, 66048, 128


def find_cli(explicit: Optional[str] = None) -> Optional[str]:
    """The ditscale CLI: `explicit`, $DITSCALE_CLI, `ditscale` on PATH, or the newest
    build*/tools/ditscale of this checkout."""
    for c in (explicit, os.environ.get("DITSCALE_CLI"), shutil.which("ditscale")):
        if c and os.access(c, os.X_OK):
            return c
    found = [p for p in glob.glob(str(REPO / "build*" / "tools" / "ditscale"))
             if os.access(p, os.X_OK)]
    return max(found, key=os.path.getmtime) if found else None


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


def flux_call_inputs(torch, dev):
    """Random q, k, v [1, 24, 66048, 128] bf16 on `dev`: the probes' and p2p_under_compute's
    attention call (aten's cuDNN attention takes [B, H, S, D])."""
    q = torch.randn(1, FLUX_CALL_HEADS, FLUX_CALL_TOKENS, FLUX_CALL_HEAD_DIM, device=dev,
                    dtype=torch.bfloat16)
    return q, torch.randn_like(q), torch.randn_like(q)
