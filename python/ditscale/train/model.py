"""The trained model: diffusers ``WanTransformer3DModel`` from a preset or a local folder,
checked against the latent store, with the fused AdaLN, activation checkpointing and FSDP2.

- ``--model PRESET`` (tiny, wan2.1-1.3b, wan2.1-14b: the transformers of
  ``ditscale.diffusers.tiny``'s Wan configs, for which ``ditscale.prepare``'s presets of the same
  names make stores): random weights from ``seed``; ``--model DIR``: a local diffusers model
  folder (its config.json and weights; ``ditscale.models.diffusers_wan``).
- The store must have been made for it: latent channels == in_channels, patch, text width
  (``LatentStore.check_model``); the padded text length is the store's ``max_text_tokens``.
- Activation checkpointing wraps a block's forward in ``torch.utils.checkpoint`` (non-reentrant):
  ``full`` every block, ``every`` the blocks 0, k, 2k, ...
- Sequence parallelism (``sp_degree`` > 1, ``parallel``): the diffusers model is parallelized
  over this rank's SP group after the fused AdaLN, before the checkpointing and FSDP2.
- FSDP2 (``fully_shard``): one unit per block, then the root; the float32 modules of Wan as in
  ``ditscale.models.training.build_model`` (params fp32, compute in the training dtype).
See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Dict

import torch
import torch.utils.checkpoint

from ..diffusers import tiny
from ..models import diffusers_wan
from ..models.wan_dit import WanConfig, make_config

# Presets: the transformers the stores of ``ditscale.prepare``'s presets are made for (the
# configs of ``ditscale.diffusers.tiny``: size, 14B).
PRESETS = {"tiny": ("tiny", False), "wan2.1-1.3b": ("full", False),
           "wan2.1-14b": ("full", True)}


def preset_config(name: str, num_layers: int, max_text_tokens: int) -> WanConfig:
    """The WanConfig of the preset ``name`` (``num_layers`` 0: the preset's block count)."""
    size, big = PRESETS[name]
    c = tiny._wan_model(size, big)
    heads, head_dim = c["num_attention_heads"], c["attention_head_dim"]
    cfg = make_config("wan2.1-1.3b", num_layers or c["num_layers"], dim=heads * head_dim,
                      num_heads=heads, ffn_dim=c["ffn_dim"], in_channels=c["in_channels"],
                      out_channels=c["out_channels"], patch=tuple(c["patch_size"]),
                      text_dim=c["text_dim"], freq_dim=c["freq_dim"], eps=c["eps"],
                      text_len=max_text_tokens)
    return dataclasses.replace(cfg, name=name)


def model_config(name: str, num_layers: int, max_text_tokens: int) -> WanConfig:
    """The WanConfig of ``--model`` (a preset or a folder; ``num_layers`` 0: the preset's)."""
    if name in PRESETS:
        return preset_config(name, num_layers, max_text_tokens)
    if not os.path.isdir(name):
        raise ValueError(f"model: {name!r} is neither a preset ({', '.join(PRESETS)}) "
                         f"nor a folder")
    base = make_config("wan2.1-1.3b", text_len=max_text_tokens)
    return diffusers_wan.checkpoint_config(name, base, num_layers or None)


def describe(cfg: WanConfig) -> Dict:
    """What identifies the model's parameters (the checkpoint's model check compares it)."""
    return {"dim": cfg.dim, "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
            "ffn_dim": cfg.ffn_dim, "in_channels": cfg.in_channels,
            "out_channels": cfg.out_channels, "patch": list(cfg.patch), "text_dim": cfg.text_dim,
            "freq_dim": cfg.freq_dim}


def check_store(store, cfg: WanConfig) -> None:
    """The store was made for this model (else ValueError naming both)."""
    store.check_model(latent_channels=cfg.in_channels, patch=tuple(cfg.patch),
                      text_dim=cfg.text_dim)


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def apply_activation_checkpointing(model, mode: str, every: int) -> int:
    """Wraps the chosen blocks' forward (see the module); returns how many."""
    if mode == "off":
        return 0
    step = 1 if mode == "full" else every
    chosen = [b for i, b in enumerate(model.blocks) if i % step == 0]
    for block in chosen:
        block.forward = _checkpointed(block.forward)
    return len(chosen)


def build(cfg: WanConfig, tcfg, device: torch.device, dtype: torch.dtype, layout=None):
    """The FSDP2-sharded model (fp32 parameters; see the module), sequence-parallel over this
    rank's SP group of ``layout`` (``parallel.Layout``; None: none)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from . import parallel

    folder = None if tcfg.model in PRESETS else tcfg.model
    model = diffusers_wan.build(cfg, device, seed=tcfg.seed, weights=folder,
                                fused_adaln=tcfg.fused_adaln)
    if layout is not None:
        parallel.parallelize(model, layout, tcfg.sp_strategy)
    apply_activation_checkpointing(model, tcfg.activation_checkpointing, tcfg.ac_every)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    mp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    units32, replicated = diffusers_wan.fp32_split(model)
    ignored = set(replicated)
    for unit in units32:
        fully_shard(unit, mp_policy=mp32, reshard_after_forward=False, ignored_params=ignored)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)
    return model
