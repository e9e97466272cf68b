"""Model presets of ``ditscale.prepare``: which VAE, text encoder and shape rule a store is for.

A preset names the diffusers Wan configs it takes from ``ditscale.diffusers.tiny`` (the VAE and
the transformer's text width, so that the store fits the transformer ``ditscale.train`` builds),
the UMT5 text encoder's config when it is made with random weights, the text length, and the
shape rule of ``ditscale._core.train_shape``: a C++ preset name, or (``tiny``, which has no C++
preset) a JSON model file based on ``wan2.1-1.3b`` with small buckets that the store carries as
``model.json``. See [docs/prepare.md](../../../docs/prepare.md#presets).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..diffusers import tiny

# UMT5-XXL, Wan 2.1's text encoder (google/umt5-xxl).
_UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                 num_heads=64, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, feed_forward_proj="gated-gelu")
# A UMT5 for CPU tests; the vocabulary covers the byte-level tokenizer (tokenizer.py).
_UMT5_TINY = dict(vocab_size=259, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                  relative_attention_num_buckets=8, relative_attention_max_distance=32,
                  feed_forward_proj="gated-gelu")

# The tiny shape rule: wan2.1-1.3b's strides and patch, 8 fps, at most 9 frames, small buckets.
TINY_MODEL_FILE = {"base": "wan2.1-1.3b", "name": "tiny", "hidden": 24, "layers": 1, "heads": 3,
                   "ffn_hidden": 32, "text_tokens": 32, "params_b": 0.0001, "target_fps": 8,
                   "max_frames": 9,
                   "buckets": [[16, 16], [32, 32], [32, 48], [48, 32], [16, 32], [32, 16],
                               [48, 48]]}


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    size: str                       # ditscale.diffusers.tiny size of the Wan configs
    big: bool                       # the 14B transformer (text width is the same)
    umt5: dict                      # UMT5Config fields except d_model's check (text_dim)
    max_text_tokens: int            # the tokenizer's max_length (Wan: 512)
    fps: float                      # the shape rule's target fps
    shape_model: str                # C++ preset name, or "model.json" (model_file below)
    model_file: Optional[dict] = None

    def vae_config(self) -> dict:
        return tiny._wan_vae(self.size)

    def text_dim(self) -> int:
        return tiny._wan_model(self.size, self.big)["text_dim"]

    def patch(self):
        return tuple(tiny._wan_model(self.size, self.big)["patch_size"])


PRESETS = {
    "tiny": Preset("tiny", "tiny", False, _UMT5_TINY, 32, 8.0, "model.json", TINY_MODEL_FILE),
    "wan2.1-1.3b": Preset("wan2.1-1.3b", "full", False, _UMT5_XXL, 512, 16.0, "wan2.1-1.3b"),
    "wan2.1-14b": Preset("wan2.1-14b", "full", True, _UMT5_XXL, 512, 16.0, "wan2.1-14b"),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"--model: {name!r} is not one of {', '.join(PRESETS)}")
    return PRESETS[name]
