"""Band geometry of a parallel VAE: which rows of the image each rank of the group computes.

The latent height ``H`` is split as ``ditscale.sp.shard_range`` splits tokens (the first
``H % N`` ranks hold one row more); a layer that works at ``s`` times the latent resolution
(after the decoder's up-samplings, before the encoder's down-samplings) holds ``s`` times those
rows. Every rank knows every rank's band, so each decision below (refusing a band thinner than
a halo) is the same on every rank.
See docs/diffusers/vae.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ... import sp


@dataclass
class Bands:
    """The group (``mesh``) and, during one parallel decode or encode, the latent height it
    splits. ``counts[r]``: latent rows of rank r; ``begin``: this rank's first latent row."""

    mesh: sp.Mesh
    height: Optional[int] = None  # latent rows; None outside a parallel call
    counts: List[int] = field(default_factory=list)
    begin: int = 0

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def active(self) -> bool:
        return self.height is not None

    def start(self, height: int) -> None:
        """Splits ``height`` latent rows over the group (every rank at least one)."""
        if height < self.size:
            raise ValueError(f"parallelize_vae: a latent height of {height} rows cannot be split "
                             f"over {self.size} ranks (every rank needs at least 1 row: latent "
                             f"height >= {self.size})")
        self.counts = [sp.shard_range(height, self.size, r)[1] for r in range(self.size)]
        self.begin = sp.shard_range(height, self.size, self.rank)[0]
        self.height = height

    def stop(self) -> None:
        self.height, self.counts, self.begin = None, [], 0

    def scale(self, rows: int, where: str) -> int:
        """The resolution (rows per latent row) of a layer whose band has ``rows`` rows here."""
        mine = self.counts[self.rank]
        if rows % mine != 0:
            raise RuntimeError(f"parallelize_vae: {where} got a band of {rows} rows, not a "
                               f"multiple of this rank's {mine} latent rows")
        return rows // mine

    def level_counts(self, rows: int, where: str) -> List[int]:
        """Every rank's band rows at the resolution of a band of ``rows`` rows here."""
        s = self.scale(rows, where)
        return [c * s for c in self.counts]

    def latent_slice(self, z: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's latent rows of ``z`` (full height along ``dim``)."""
        return z.narrow(dim, self.begin, self.counts[self.rank])

    def local_range(self, rows: int, where: str) -> Tuple[int, int]:
        """(begin, count) of this rank's band, at the resolution of a band of ``rows`` here."""
        counts = self.level_counts(rows, where)
        return sum(counts[:self.rank]), counts[self.rank]
