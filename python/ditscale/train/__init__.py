"""``ditscale.train``: train a diffusers Wan transformer on a latent store with the balanced
sampler, FSDP2, exact resume and validation (``python -m ditscale.train``).

Modules, one idea each: ``config`` (fields, TOML, flags), ``data`` (dataset, DataLoader),
``segment`` (an epoch's plan and its re-plan on another world size), ``model``, ``objective``
(flow matching), ``optim`` (AdamW, schedule, clipping, EMA), ``step`` (one optimizer step),
``checkpoint``, ``logs``, ``validation``, ``loop``, ``cli``. Manual:
[docs/train.md](../../../docs/train.md).
"""

from .cli import main
from .config import FIELDS, TrainConfig, load_config

__all__ = ["main", "FIELDS", "TrainConfig", "load_config"]
