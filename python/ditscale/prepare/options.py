"""Options of ``python -m ditscale.prepare``, each range-checked (name, value and range in the
error) when a PrepareOptions is made, from the CLI or from Python. The table of options:
[docs/prepare.md](../../../docs/prepare.md#options)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from .._checks import INT64_MAX, check_int, check_real
from .presets import PRESETS

MAX_SHARD_SIZE = 65536
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
    input: str
    out: str
    model: str
    vae: Optional[str] = None
    text_encoder: Optional[str] = None
    shard_size: int = 64
    device: str = "cpu"
    dtype: str = "float32"          # the text encoder's
    vae_dtype: str = "float32"
    seed: int = 0
    timeout_s: float = 1800.0
    progress: bool = True

    def __post_init__(self):
        for name, value in (("--input", self.input), ("--out", self.out)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}: expected a path, got {value!r}")
        for name, value, choices in (("--model", self.model, tuple(PRESETS)),
                                     ("--device", self.device, DEVICES),
                                     ("--dtype", self.dtype, DTYPES),
                                     ("--vae-dtype", self.vae_dtype, DTYPES)):
            if value not in choices:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
        check_int("--shard-size", self.shard_size, 1, MAX_SHARD_SIZE)
        check_int("--seed", self.seed, 0, INT64_MAX)
        check_real("--timeout-s", self.timeout_s, 1, 86400)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ditscale.prepare",
        description="Media + captions to a latent store (VAE latents, text embeddings, "
                    "manifest) for ditscale.train; under torchrun, each rank encodes its shards.")
    a = p.add_argument
    a("--input", required=True, help="a folder (media + sidecar .txt captions, WebDataset .tar "
                                     "shards), a .tar shard, or a .csv/.jsonl/.parquet table of "
                                     "path, caption")
    a("--out", required=True, help="the store folder (created; a run into it resumes)")
    a("--model", required=True, choices=tuple(PRESETS), help="the preset")
    a("--vae", default=None, help="a local AutoencoderKLWan folder (or a pipeline folder with "
                                  "vae/); default: random weights of the preset's config")
    a("--text-encoder", default=None,
      help="a local UMT5 folder with its tokenizer (or a pipeline folder with text_encoder/ and "
           "tokenizer/); default: a random UMT5 of the preset's config, byte-level tokenizer")
    a("--shard-size", type=int, default=64, help=f"samples per shard, [1, {MAX_SHARD_SIZE}]")
    a("--device", choices=DEVICES, default=None, help="default: cuda when available")
    a("--dtype", choices=DTYPES, default=None,
      help="the text encoder's compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    a("--vae-dtype", choices=DTYPES, default="float32",
      help="the VAE's compute dtype (default float32, as Wan's pipelines run it)")
    a("--seed", type=int, default=0, help=f"seed of random weights, [0, {INT64_MAX}]")
    a("--timeout-s", type=float, default=1800.0,
      help="the ranks' group timeout in seconds, [1, 86400]")
    a("--no-progress", action="store_true", help="no progress bar")
    return p


def from_args(argv=None) -> PrepareOptions:
    """PrepareOptions of the command line; a bad option exits 2 with its name, value, range."""
    p = parser()
    args = p.parse_args(argv)
    device = args.device
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return PrepareOptions(input=args.input, out=args.out, model=args.model, vae=args.vae,
                              text_encoder=args.text_encoder, shard_size=args.shard_size,
                              device=device, dtype=args.dtype or (
                                  "bfloat16" if device == "cuda" else "float32"),
                              vae_dtype=args.vae_dtype, seed=args.seed,
                              timeout_s=args.timeout_s, progress=not args.no_progress)
    except (ValueError, TypeError) as e:
        p.error(str(e))
