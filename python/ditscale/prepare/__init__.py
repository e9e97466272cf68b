"""``python -m ditscale.prepare``: media and captions to a latent store for ``ditscale.train``.

    python -m ditscale.prepare --input media/ --out store/ --model tiny
    torchrun --nproc-per-node 8 -m ditscale.prepare --input media/ --out store/ \\
        --model wan2.1-1.3b --vae Wan2.1-T2V-1.3B-Diffusers --text-encoder Wan2.1-T2V-1.3B-Diffusers

From Python: ``prepare(PrepareOptions(input=..., out=..., model="tiny"))`` (joins a process
group the caller made). One idea per module: discover (inputs, captions), probe, plan (shapes,
ids, shards), frames (decode, resample, resize), tokenizer, encoders, shards (encoding),
report, group (ranks), run, options, cli. The manual: [docs/prepare.md](../../../docs/prepare.md).
"""

from .options import PrepareOptions
from .run import prepare

__all__ = ["PrepareOptions", "prepare"]
