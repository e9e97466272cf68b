"""The ``--cache`` option of the example and the server: ``KIND:VALUE`` -> a diffusers
``enable_cache`` config, range-checked (docs/diffusers/cache.md).

    parse_cache("--cache", "first-block:0.1")  # FirstBlockCacheConfig(threshold=0.1)
    parse_cache("--cache", "none")              # None: no cache

Each kind is one row of :data:`KINDS` (its config class, the field VALUE sets, its type and
range); a cache offered here works on every family's blocks and is one ``sp_cache`` keeps
under sequence and CFG parallelism. (TaylorSeer's default module patterns miss Wan's and
CogVideoX's attention modules, so it is not offered without patterns of its own.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .._checks import check_real


@dataclass(frozen=True)
class Kind:
    """One ``--cache`` kind: ``config`` (the class in ``diffusers.hooks``) with ``field`` =
    VALUE, a number in [lo, hi]."""

    config: str
    field: str
    lo: float
    hi: float
    meaning: str


KINDS = {
    "first-block": Kind("FirstBlockCacheConfig", "threshold", 0.0, 1.0,
                        "skip the other blocks while the first block's residual changes by "
                        "less than this (relative mean absolute change)"),
}


def parse_cache(name: str, text: Optional[str]):
    """The config of ``text`` ("none", None or ``KIND:VALUE``), or ValueError naming ``name``
    with the kinds and the value's range."""
    if text is None or text == "none":
        return None
    kind, sep, value = str(text).partition(":")
    if not sep or kind not in KINDS:
        choices = ", ".join(f"{k}:{v.field.upper()}" for k, v in KINDS.items())
        raise ValueError(f"{name}: {text!r} is not none or one of {choices}")
    row = KINDS[kind]
    where = f"{name} {kind}:{row.field}"
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{where}: {value!r} is not a number in [{row.lo:g}, {row.hi:g}]"
                         ) from None
    number = check_real(where, number, row.lo, row.hi)
    import diffusers.hooks

    return getattr(diffusers.hooks, row.config)(**{row.field: number})
