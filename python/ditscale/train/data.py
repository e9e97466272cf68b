"""The latent store as a map-style dataset, batched by the sampler's plan, loaded by workers.

``StoreDataset[i]`` is store sample ``i``: its clean latent [C, F', H', W'] and its text
embedding zero-padded to ``max_text_tokens`` [L, D] (as Wan's pipeline pads). ``collate`` turns a
micro-batch (one training shape: the planner never mixes shapes) into the noised flow-matching
tensors of ``objective.Objective`` inside the worker, so the training process only copies them to
the device (pinned memory, ``non_blocking``). ``make_loader`` yields this rank's micro-batches of
a ``segment.Segment`` from a given step on, in order. See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

import functools
from typing import Dict, Iterator, List, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from .objective import Objective


class StoreDataset(Dataset):
    """Map-style dataset over a ``LatentStore`` (the store opens its shards lazily per process,
    so each worker reads through its own handles)."""

    def __init__(self, store, max_text_tokens: int):
        self.store = store
        self.max_text_tokens = int(max_text_tokens)

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, sample_id: int) -> Dict:
        item = self.store[int(sample_id)]
        text = item["text"]
        if text.shape[0] > self.max_text_tokens:
            raise ValueError(f"store sample {sample_id}: {text.shape[0]} text tokens > "
                             f"max_text_tokens {self.max_text_tokens}")
        padded = text.new_zeros((self.max_text_tokens, text.shape[1]))
        padded[: text.shape[0]] = text
        return {"id": int(sample_id), "latent": item["latent"], "text": padded}


def collate(items: List[Dict], objective: Objective, epoch: int, patch: Sequence[int]) -> Dict:
    """A micro-batch: x_t, t, text, target (CPU tensors) and the ids and token count."""
    shapes = {tuple(it["latent"].shape) for it in items}
    if len(shapes) != 1:
        raise ValueError(f"micro-batch {[it['id'] for it in items]} mixes latent shapes "
                         f"{sorted(shapes)}: the store's manifest does not give the shapes its "
                         f"latents were made at")
    latents = torch.stack([it["latent"] for it in items])
    text = torch.stack([it["text"] for it in items])
    mb = objective.micro_batch(latents, text, [it["id"] for it in items], epoch, patch)
    return {"x_t": mb.x_t, "t": mb.t, "text": mb.text, "target": mb.target,
            "ids": mb.sample_ids, "tokens": mb.tokens}


class _MicroBatches:
    """The batch sampler handed to the DataLoader: this rank's micro-batches (store ids) of
    ``segment`` from step ``start`` on."""

    def __init__(self, segment, start: int):
        self.segment, self.start = segment, start

    def __iter__(self) -> Iterator[List[int]]:
        for k in range(self.start, self.segment.num_steps):
            yield from self.segment.my_cell(k)

    def __len__(self) -> int:
        return sum(self.segment.counts[self.start:])


def make_loader(dataset: StoreDataset, segment, start: int, objective: Objective,
                patch: Sequence[int], cfg, device: torch.device) -> DataLoader:
    """A DataLoader over this rank's micro-batches of ``segment`` from step ``start``."""
    workers = cfg.num_workers
    return DataLoader(
        dataset, batch_sampler=_MicroBatches(segment, start),
        collate_fn=functools.partial(collate, objective=objective, epoch=segment.epoch,
                                     patch=tuple(patch)),
        num_workers=workers, pin_memory=cfg.pin_memory and device.type == "cuda",
        prefetch_factor=cfg.prefetch_factor if workers else None,
        persistent_workers=False, multiprocessing_context="fork" if workers else None)
