"""``python -m ditscale.train --config train.toml [--field value ...]`` (docs/train.md)."""

import sys

from .cli import main

sys.exit(main())
