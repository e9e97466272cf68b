"""ditscale: balanced DiT training (AdaptiveLoad) and topology-aware sequence-parallel
inference (SwiftFusion).

The CPU core is the compiled module ``ditscale._core``; the PyTorch ops (fused AdaLN, ...)
live in ``ditscale._C`` and are loaded on first use of ``ditscale.ops``.
"""

__version__ = "0.1.0"


# PyTorch layer (fused AdaLN ops and modules): imported on first access, so that
# `import ditscale` works without torch or without the compiled extension ditscale._C.
def __getattr__(name):
    if name in ("ops", "nn"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# CPU core: manifests, training shapes and the distributed sampler (AdaptiveLoad).
try:
    from . import _core  # noqa: F401,E402
except ImportError as _e:  # a Parquet build moved away from the pyarrow it linked: load pyarrow's
    if "libarrow" not in str(_e) and "libparquet" not in str(_e):  # libraries first, then retry
        raise
    import pyarrow  # noqa: F401,E402
from ._core import Error, Manifest, model_presets, read_manifest, seq_len, train_shape  # noqa: E402
from .sampler import BalancedBatchSampler  # noqa: E402
