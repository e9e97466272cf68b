"""``python -m ditscale.prepare``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
