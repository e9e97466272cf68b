"""Caches that hold process groups (or objects holding them), emptied at interpreter exit
before finalization starts: a gloo group kept alive by a module-level cache past
``destroy_process_group`` would otherwise be freed during finalization, when its worker threads
can no longer release the tensors they hold, and the process aborts ("terminate called without
an active exception"). Usage: ``_CACHE: Dict[...] = clear_at_exit({})``.
"""

from __future__ import annotations

import atexit
from typing import List, MutableMapping, TypeVar

C = TypeVar("C", bound=MutableMapping)
_CACHES: List[MutableMapping] = []


def clear_at_exit(cache: C) -> C:
    """Registers ``cache`` to be emptied at exit; returns it."""
    _CACHES.append(cache)
    return cache


@atexit.register
def _clear() -> None:
    for cache in _CACHES:
        cache.clear()
