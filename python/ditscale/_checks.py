"""Range checks of numeric arguments: the Python side of ditscale/core/range.h.

One rule for every numeric argument of the Python API, as for the CLI's options: a value outside
its documented range raises ``ValueError("<name>: <value> is out of range [lo, hi]")``; NaN and
infinities are never in range; integers must be integers (``True`` and ``2.0`` are refused).
"""

from __future__ import annotations

import math
import numbers

UINT64_MAX = 2**64 - 1
INT64_MAX = 2**63 - 1


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def check_int(name: str, value, lo: int, hi: int) -> int:
    """``value`` as an int in [lo, hi], or ValueError/TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < lo or v > hi:
        raise ValueError(f"{name}: {v} is out of range [{_fmt(lo)}, {_fmt(hi)}]")
    return v


def check_real(name: str, value, lo: float, hi: float) -> float:
    """``value`` as a finite float in [lo, hi], or ValueError/TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < lo or v > hi:
        raise ValueError(f"{name}: {_fmt(v)} is out of range [{_fmt(lo)}, {_fmt(hi)}]")
    return v


def check_choice(name: str, value, choices) -> str:
    """``value`` if it is one of the strings ``choices``, else ValueError naming ``name``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
    return value
