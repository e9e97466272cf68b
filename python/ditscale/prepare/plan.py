"""From probed items to samples with their training shapes, sample ids and shards.

Sample ids are the order of the good items (input order); shard k holds ids
[k * shard_size, min((k + 1) * shard_size, n)). Each sample's training shape is
``ditscale._core.train_shape`` of its manifest row's values (the fps as the manifest writes
it), so the trainer's sampler maps the row to the same shape. ``fingerprint`` identifies what a
run makes (rows, captions, shards, encoders): a resumed run must have the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import List, Sequence, Tuple, Union

from .. import _core
from .discover import Bad, Item
from .probe import Probe


@dataclasses.dataclass(frozen=True)
class Sample:
    item: Item
    probe: Probe
    fps_text: str       # the manifest's fps field ("" for an image)
    shape: dict         # train_shape: frames, height, width, seq_len


def manifest_fps(probe: Probe) -> str:
    return "" if probe.num_frames == 1 else f"{probe.fps:.10g}"


def plan_samples(items: Sequence[Item], probes: Sequence[Union[Probe, str]],
                 shape_model: str) -> Tuple[List[Sample], List[Bad]]:
    """The good samples in input order, and the bad items with their reasons."""
    samples, bad = [], []
    for item, p in zip(items, probes):
        if isinstance(p, str):
            bad.append(Bad(item.path, p))
            continue
        fps_text = manifest_fps(p)
        try:
            shape = _core.train_shape(p.num_frames, p.height, p.width,
                                      float(fps_text or 0), shape_model)
        except (ValueError, RuntimeError, _core.Error) as e:
            bad.append(Bad(item.path, f"no training shape: {e}"))
            continue
        samples.append(Sample(item, p, fps_text, dict(shape)))
    return samples, bad


def plan_shards(num_samples: int, shard_size: int) -> List[Tuple[int, int, int]]:
    """(index, first_id, count) of every shard."""
    return [(k, first, min(shard_size, num_samples - first))
            for k, first in enumerate(range(0, num_samples, shard_size))]


def fingerprint(samples: Sequence[Sample], **settings) -> str:
    """sha256 of the manifest rows, captions, shapes and the settings (JSON-able values)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for s in samples:
        p = s.probe
        row = [s.item.path, s.item.caption, p.num_frames, p.height, p.width, s.fps_text,
               s.shape["frames"], s.shape["height"], s.shape["width"]]
        h.update(json.dumps(row).encode())
    return h.hexdigest()
