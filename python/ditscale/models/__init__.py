"""Reference models for training benchmarks (random weights): a Wan-2.1-style video DiT.

    from ditscale.models import WanDiT, make_config
    model = WanDiT(make_config("wan2.1-1.3b", num_layers=4), fused_adaln=True)

``ditscale.models.training`` holds the FSDP2 step, the synthetic data and the process-group
helpers shared by ``python -m ditscale.shape_bench`` and ``bench/train/policies.py``.
"""

from .wan_dit import (  # noqa: F401
    CONFIGS,
    WanConfig,
    WanDiT,
    apply_rope,
    latent_shape,
    make_config,
    patchify,
    rope_freqs,
    seq_len_of,
    timestep_embedding,
    unpatchify,
)
from .mmdit import FluxMMDiT, MMDiTConfig, build_mmdit, make_mmdit_config  # noqa: F401
