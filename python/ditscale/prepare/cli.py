"""The command line of ``python -m ditscale.prepare``: options, then one run on this rank.
Errors are one line on stderr (no traceback) and exit status 1; bad options exit 2."""

from __future__ import annotations

import sys

from .options import from_args
from .run import prepare


def main(argv=None) -> int:
    opts = from_args(argv)
    try:
        prepare(opts)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        print(f"ditscale.prepare: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
