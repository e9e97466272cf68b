"""In-memory latents of a store's shapes and ids: the training benchmark's baseline data source.

``SyntheticDataset(store, max_text_tokens, seed)`` answers ``StoreDataset``'s items (``id``,
``latent`` [C, F', H', W'] bf16, ``text`` [max_text_tokens, D] bf16, zero-padded past the
sample's tokens) for the same ids and shapes, from random tensors made once per distinct shape
at construction: no file is read while training. It goes through the same DataLoader workers,
collate and loop as the store (``ditscale.train.loop.run(cfg, dataset=...)``), so a run on it
differs from a run on the store only in where the items come from.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch.utils.data import Dataset


class SyntheticDataset(Dataset):
    def __init__(self, store, max_text_tokens: int, seed: int = 0):
        """Reads every sample of ``store`` once (its shapes and text lengths), then keeps one
        random latent per shape and one padded text per length."""
        g = torch.Generator().manual_seed(seed)
        self.max_text_tokens = int(max_text_tokens)
        self.shapes, self.lengths = [], []
        self.latents: Dict[Tuple[int, ...], torch.Tensor] = {}
        self.texts: Dict[int, torch.Tensor] = {}
        dim = store.meta.text_dim
        for i in range(len(store)):
            item = store[i]
            shape, n = tuple(item["latent"].shape), int(item["text"].shape[0])
            if shape not in self.latents:
                self.latents[shape] = torch.randn(shape, generator=g).to(torch.bfloat16)
            if n not in self.texts:
                text = torch.zeros(self.max_text_tokens, dim, dtype=torch.bfloat16)
                text[:n] = torch.randn(n, dim, generator=g).to(torch.bfloat16)
                self.texts[n] = text
            self.shapes.append(shape)
            self.lengths.append(n)

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, sample_id: int) -> Dict:
        i = int(sample_id)
        return {"id": i, "latent": self.latents[self.shapes[i]],
                "text": self.texts[self.lengths[i]]}
