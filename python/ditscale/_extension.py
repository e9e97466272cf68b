"""Loading of the PyTorch extension ``ditscale._C`` (its ops ``torch.ops.ditscale.*`` and the
sequence-parallel runtime class), once per process, on first import of this module.

The library is looked up in the package folder, or at ``$DITSCALE_EXT_PATH`` when set
(docs/configuration.md). Once loaded, torch.compile's caches are keyed to this build
(ditscale._compile_cache) and the ops' fake kernels are registered (ditscale._fake_kernels).
Without it, :func:`is_available` is False and :func:`load_error` says why; everything that needs
the ops calls :func:`require`. The public face of this module is ditscale.ops (is_available,
load_error).
"""

from __future__ import annotations

import glob
import os
from typing import Dict, Optional

import torch

from . import _fake_kernels
from ._compile_cache import tag_compile_caches

OP_NAMES = ("adaln_fwd", "adaln_bwd", "adaln_mod_fwd", "adaln_mod_bwd", "adaln_gated_fwd",
            "adaln_gated_bwd", "adaln_gated_mod_fwd", "adaln_gated_mod_bwd", "rotary")
# Op name -> its default overload (torch.ops.ditscale.<name>.default), once the extension is
# loaded: the wrappers call these (one Python frame less per call than the overload packet).
OPS: Dict[str, object] = {}
_load_error: Optional[str] = None


def library_path() -> Optional[str]:
    """$DITSCALE_EXT_PATH, else the _C library in the package folder, else None."""
    env = os.environ.get("DITSCALE_EXT_PATH")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for pattern in ("_C.so", "_C.*.so", "_C.pyd", "_C.dylib"):
        found = sorted(glob.glob(os.path.join(here, pattern)))
        if found:
            return found[0]
    return None


def _load_library(path: Optional[str]) -> Optional[str]:
    """Loads the extension at ``path``; None, or why it could not be loaded."""
    if path is None:
        return (
            "ditscale._C (the PyTorch extension) was not found next to "
            f"{os.path.abspath(__file__)}; build the package with torch installed "
            "(`pip install --no-build-isolation .`) or set DITSCALE_EXT_PATH"
        )
    try:
        torch.ops.load_library(path)
    except OSError as e:  # wrong torch version, missing CUDA runtime, ...
        return f"loading {path} failed: {e}"
    return None


def _load() -> None:
    """Loads ditscale._C once, keys torch.compile's caches to this build, registers the fake
    kernels and fills OPS."""
    global _load_error
    path = library_path()
    if not all(hasattr(torch.ops.ditscale, n) for n in OP_NAMES):  # not loaded by another path
        _load_error = _load_library(path)
    tag_compile_caches(path if _load_error is None else None)
    if _load_error is None:
        _fake_kernels.register()
        for name in OP_NAMES:
            OPS[name] = getattr(torch.ops.ditscale, name).default


def is_available() -> bool:
    """True when the compiled ops are registered (``torch.ops.ditscale.adaln_fwd`` exists)."""
    return _load_error is None


def load_error() -> Optional[str]:
    """Why the extension could not be loaded, or None."""
    return _load_error


def require(who: str = "ditscale.ops") -> None:
    """RuntimeError naming ``who`` and the reason when the extension is not loaded."""
    if _load_error is not None:
        raise RuntimeError(f"{who}: {_load_error}")


_load()
