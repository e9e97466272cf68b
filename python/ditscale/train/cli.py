"""The command line of ``python -m ditscale.train``: the configuration, then the loop; a bad
input is one line ``ditscale.train: error: ...`` on stderr and exit status 2.
See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from .. import Error as DitscaleError
from .config import load_config


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = load_config(argv)
        from .loop import run

        return run(cfg)
    except (ValueError, TypeError, FileNotFoundError, DitscaleError) as e:
        print(f"ditscale.train: error: {e}", file=sys.stderr, flush=True)
        return 2
