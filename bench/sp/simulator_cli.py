"""The simulator CLI as calibrate.py, fit_runs.py and report.py call it: `ditscale sp simulate
--json` for the Flux attention layer, and the check that a topology file is accepted."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Optional


def flux_height_width(image_tokens: int) -> tuple[int, int]:
    """Pixels (H, W) of a Flux image of `image_tokens` = (H/16) * (W/16), as square as possible."""
    if image_tokens <= 0:
        raise ValueError(f"image tokens must be > 0, got {image_tokens}")
    h = max(d for d in range(1, math.isqrt(image_tokens) + 1) if image_tokens % d == 0)
    return 16 * h, 16 * (image_tokens // h)


def simulate(cli: str, cluster: str, machines: int, gpus_per_machine: int, strategy: str,
             image_tokens: int, chunks: int = 1, one_sided: bool = False,
             batch: int = 1, transport: str = "", comm_sms: int = 0) -> dict:
    """`ditscale sp simulate ... --json` for the Flux attention layer with `image_tokens`
    (512 text tokens, 24 x 128 heads). `transport` (nccl | nvshmem | nvshmem-intra), when given,
    overrides `one_sided`; `comm_sms` > 0: SMs kept for communication (an SM partition). Raises
    RuntimeError with the CLI's message on failure."""
    h, w = flux_height_width(image_tokens)
    cmd = [cli, "sp", "simulate", "--cluster", str(cluster), "--machines", str(machines),
           "--gpus-per-machine", str(gpus_per_machine), "--model", "flux", "--height", str(h),
           "--width", str(w), "--batch", str(batch), "--strategy", strategy, "--json"]
    if strategy == "torus":
        cmd += ["--chunks", str(chunks)]
    if transport:
        cmd += ["--transport", transport]
    elif one_sided:
        cmd.append("--one-sided")
    if comm_sms:
        cmd += ["--comm-sms", str(comm_sms)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return json.loads(r.stdout)


def check_with_cli(cli: Optional[str], path: Path, machines: int, gpm: int) -> str:
    """'' when `ditscale sp simulate --cluster path` accepts the file, else the error."""
    if cli is None:
        return "ditscale CLI not found (not checked)"
    try:
        simulate(cli, str(path), machines, gpm, "ulysses", 4096)
        return ""
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        return str(e)
