"""The VAE and the text encoder of a store: built, checked against the preset, and applied.

``load_vae`` gives diffusers' AutoencoderKLWan from a local folder (the VAE's own folder or a
pipeline folder with ``vae/``) or with random weights of the preset's config (seeded: every rank
and run gets the same bits). ``encode_video`` gives Wan's normalized latent of one clip,
``(mean - latents_mean) / latents_std`` of the posterior mean (deterministic).
``load_text_encoder`` gives UMT5EncoderModel + its tokenizer (``AutoTokenizer`` of the folder, or
``text_encoder/`` + ``tokenizer/`` of a pipeline folder), or a random UMT5 with the offline
byte-level tokenizer. ``encode_texts`` follows Wan's pipeline: tokens padded to
max_text_tokens with the attention mask, the last hidden state trimmed to each text's real
tokens. See [docs/prepare.md](../../../docs/prepare.md#encoders).
"""

from __future__ import annotations

import os
from typing import List, Tuple

import torch

from .presets import Preset
from .tokenizer import byte_tokenizer

TEXT_BATCH = 16     # captions per text-encoder call


def _component_dir(path: str, sub: str, what: str) -> str:
    """``path`` if it holds a config.json, else ``path/sub`` if that does; else ValueError."""
    for d in (path, os.path.join(path, sub)):
        if os.path.isfile(os.path.join(d, "config.json")):
            return d
    raise ValueError(f"{what}: {path}: no config.json in it or in {sub}/ (expected a local "
                     "diffusers / transformers folder)")


def _to(model, device, dtype: torch.dtype):
    """On device, in eval mode, cast to dtype only when it differs (diffusers warns on a cast)."""
    model = model.to(device=device)
    if dtype != next(model.parameters()).dtype:
        model = model.to(dtype=dtype)
    return model.eval().requires_grad_(False)


def load_vae(preset: Preset, folder, device: str, dtype: torch.dtype, seed: int):
    """(vae, source): ``source`` is the folder or "random:<preset>"."""
    from diffusers import AutoencoderKLWan

    if folder:
        d = _component_dir(folder, "vae", "--vae")
        vae = AutoencoderKLWan.from_pretrained(d, local_files_only=True)
        source = os.path.abspath(folder)
    else:
        torch.manual_seed(seed)
        with torch.device(device):   # drawn where it runs: a full-size model in seconds
            vae = AutoencoderKLWan(**preset.vae_config())
        source = f"random:{preset.name}"
    cfg = vae.config
    if getattr(cfg, "patch_size", None) not in (None, 1) or getattr(cfg, "is_residual", False):
        raise ValueError(f"--vae: {source}: a Wan 2.2 VAE (patch_size / residual blocks); "
                         "the presets need Wan 2.1's")
    if (cfg.scale_factor_temporal, cfg.scale_factor_spatial) != (4, 8):
        raise ValueError(f"--vae: {source}: compresses time by {cfg.scale_factor_temporal} and "
                         f"space by {cfg.scale_factor_spatial}; the shape rule needs 4 and 8")
    return _to(vae, device, dtype), source


def vae_stats(vae, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(latents_mean, latents_std) as [1, C, 1, 1, 1] float32 on device."""
    c = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=device)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=device)
    return mean.view(1, c, 1, 1, 1), std.view(1, c, 1, 1, 1)


@torch.no_grad()
def encode_video(vae, stats, video: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1] -> the normalized latent [C, (F-1)/4+1, H/8, W/8] (float32)."""
    x = video.unsqueeze(0).to(device=stats[0].device, dtype=vae.dtype)
    mean = vae.encode(x).latent_dist.mean.float()
    return ((mean - stats[0]) / stats[1])[0]


def load_text_encoder(preset: Preset, folder, device: str, dtype: torch.dtype, seed: int):
    """(encoder, tokenizer, source)."""
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    if folder:
        d = _component_dir(folder, "text_encoder", "--text-encoder")
        tok_dir = folder if d == folder else os.path.join(folder, "tokenizer")
        enc = UMT5EncoderModel.from_pretrained(d, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        source = os.path.abspath(folder)
    else:
        torch.manual_seed(seed)
        config = UMT5Config(**preset.umt5, pad_token_id=0, eos_token_id=1)
        with torch.device(device):
            enc = UMT5EncoderModel._from_config(config, dtype=dtype)
        tokenizer = byte_tokenizer()
        source = f"random:{preset.name}"
    if enc.config.d_model != preset.text_dim():
        raise ValueError(f"--text-encoder: {source}: width {enc.config.d_model}, the "
                         f"{preset.name} transformer's text_dim is {preset.text_dim()}")
    return _to(enc, device, dtype), tokenizer, source


@torch.no_grad()
def encode_texts(encoder, tokenizer, captions: List[str], max_tokens: int) -> List[torch.Tensor]:
    """Each caption's [L_i, text_dim] last hidden state (float32), L_i its real tokens."""
    out = []
    device = next(encoder.parameters()).device
    for start in range(0, len(captions), TEXT_BATCH):
        batch = captions[start:start + TEXT_BATCH]
        t = tokenizer(batch, padding="max_length", max_length=max_tokens, truncation=True,
                      add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        mask = t.attention_mask.to(device)
        hidden = encoder(t.input_ids.to(device), mask).last_hidden_state.float()
        for k, n in enumerate(mask.sum(dim=1).tolist()):
            out.append(hidden[k, :max(int(n), 1)].cpu())
    return out


def vae_channels(preset: Preset, folder) -> int:
    """The VAE's latent channels (z_dim) from its config alone (no weights loaded)."""
    import inspect
    import json

    from diffusers import AutoencoderKLWan

    default = inspect.signature(AutoencoderKLWan.__init__).parameters["z_dim"].default
    if not folder:
        return int(preset.vae_config().get("z_dim", default))
    with open(os.path.join(_component_dir(folder, "vae", "--vae"), "config.json")) as f:
        return int(json.load(f).get("z_dim", default))
