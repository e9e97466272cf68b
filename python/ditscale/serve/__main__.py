"""``python -m ditscale.serve``: see :mod:`ditscale.serve.cli`."""

import sys

from .cli import main

sys.exit(main())
