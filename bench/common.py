"""What several bench scripts share: the repository root, the ditscale CLI, Flux's
attention-call inputs (bench.sp.calibrate and lab/probes), and the parsers of list options.

No torch import at module level: torch (and torch.distributed) are passed in by the callers that
run on a GPU, so the CPU-side scripts (calibrate fit, fit_runs, report) import this without it."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional

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


def flux_call_inputs(torch, dev):
    """Random q, k, v [1, 24, 66048, 128] bf16 on `dev`: the probes' and p2p_under_compute's
    attention call (aten's cuDNN attention takes [B, H, S, D])."""
    q = torch.randn(1, FLUX_CALL_HEADS, FLUX_CALL_TOKENS, FLUX_CALL_HEAD_DIM, device=dev,
                    dtype=torch.bfloat16)
    return q, torch.randn_like(q), torch.randn_like(q)


def int_list(text: str, name: str, lo: int, hi: int) -> List[int]:
    """An argparse type: "a,b,..." -> ints, each in [lo, hi]; errors name the option."""
    import argparse

    from ditscale._checks import check_int
    out = []
    for item in text.split(","):
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {item!r} is not an integer") from None
        try:
            out.append(check_int(name, value, lo, hi))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return out


def name_list(text: str, name: str, table: Dict) -> List[str]:
    """An argparse type: "a,b,..." -> names, each a key of ``table``; errors name the option."""
    import argparse
    names = text.split(",")
    for n in names:
        if n not in table:
            raise argparse.ArgumentTypeError(f"{name}: {n!r} is not one of {', '.join(table)}")
    return names

