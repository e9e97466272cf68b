"""ditscale: balanced DiT training (AdaptiveLoad) and topology-aware sequence-parallel
inference (SwiftFusion).

The CPU core is the compiled module ``ditscale._core``; the PyTorch ops (fused AdaLN, ...)
live in ``ditscale._C`` and are loaded on first use of ``ditscale.ops``.
"""

__version__ = "0.1.0"
