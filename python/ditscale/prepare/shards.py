"""Encoding this rank's shards: decode each sample, encode it with the VAE and its caption with
the text encoder, check the latent's shape, and write the shard (latent_store.write_shard: a
tmp file renamed, then its done marker). A thread decodes up to PREFETCH clips ahead of the
VAE, so that decoding overlaps encoding (the results do not depend on it). A shard already
finished by an earlier run (its done marker and sha256 match) is kept; the encoders are loaded
only when there is a shard to encode.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import time
from typing import Callable, Dict, Iterable, Iterator, List, Sequence, Tuple

import torch

from .. import latent_store as ls
from . import encoders
from .frames import load_clip
from .plan import Sample
from .presets import Preset

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PREFETCH = 2    # clips decoded ahead of the VAE


def prefetched(fn: Callable, args: Iterable, depth: int = PREFETCH) -> Iterator:
    """fn(a) for each a of args, in order, computed by one thread at most ``depth`` ahead."""
    it = iter(args)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pending = collections.deque(pool.submit(fn, a) for a in itertools.islice(it, depth))
        while pending:
            done = pending.popleft()
            pending.extend(pool.submit(fn, a) for a in itertools.islice(it, 1))
            yield done.result()


class Encoders:
    """The VAE (with its latents_mean / std) and the text encoder with its tokenizer."""

    def __init__(self, preset: Preset, opts, device: torch.device):
        self.vae, _ = encoders.load_vae(preset, opts.vae, device, _DTYPES[opts.vae_dtype],
                                        opts.seed)
        self.stats = encoders.vae_stats(self.vae, device)
        self.text, self.tokenizer, _ = encoders.load_text_encoder(
            preset, opts.text_encoder, device, _DTYPES[opts.dtype], opts.seed)
        self.preset = preset

    def encode(self, samples: Sequence[Sample], on_sample) -> List[Tuple[torch.Tensor, ...]]:
        """(latent, text) of each sample, in order; ``on_sample()`` after each."""
        texts = encoders.encode_texts(self.text, self.tokenizer,
                                      [s.item.caption for s in samples],
                                      self.preset.max_text_tokens)
        out = []
        channels = self.vae.config.z_dim
        clips = prefetched(lambda s: load_clip(s.item, s.probe, s.shape, self.preset.fps),
                           samples)
        for s, text, clip in zip(samples, texts, clips):
            latent = encoders.encode_video(self.vae, self.stats, clip).cpu()
            t, hw = self.vae.config.scale_factor_temporal, self.vae.config.scale_factor_spatial
            want = (channels, (s.shape["frames"] - 1) // t + 1, s.shape["height"] // hw,
                    s.shape["width"] // hw)
            if tuple(latent.shape) != want:
                raise ValueError(f"{s.item.path}: latent {list(latent.shape)}, expected "
                                 f"{list(want)} for the training shape {s.shape}")
            out.append((latent, text))
            on_sample()
        return out


def encode_shards(store: str, samples: Sequence[Sample], mine: Sequence[Tuple[int, int, int]],
                  make_encoders, bar) -> Tuple[Dict[int, ls.ShardInfo], int, int, float]:
    """({index: ShardInfo} of this rank's shards, shards kept from before, samples encoded,
    seconds encoding them (after the encoders are loaded)). ``make_encoders()`` builds the
    Encoders (called at most once)."""
    infos: Dict[int, ls.ShardInfo] = {}
    todo = []
    for k, first, count in mine:
        done = ls.finished_shard(store, k, first, count)
        if done is None:
            todo.append((k, first, count))
        else:
            infos[k] = done
    bar.reset(total=sum(c for _, _, c in todo))
    enc = make_encoders() if todo else None
    encoded, start = 0, time.monotonic()
    for k, first, count in todo:
        pairs = enc.encode(samples[first:first + count], lambda: bar.update(1))
        infos[k] = ls.write_shard(store, k, first, pairs)
        encoded += count
    return infos, len(mine) - len(todo), encoded, time.monotonic() - start
