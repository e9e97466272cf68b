"""Validation: the model generates from fixed prompt embeddings and seeds through diffusers'
``WanPipeline``, written as MP4 (PNG for one frame) under OUT/validation/step-N/ and logged.

Prompts: the text embeddings of store samples 0 .. n-1 (their captions through the store's text
encoder), zero-padded as in training; sample i is generated with a ``torch.Generator`` seeded
``validation_seed + i``; the scheduler is ``FlowMatchEulerDiscreteScheduler`` with the
training shift; the VAE is the store's (``store.json`` "vae": a diffusers ``AutoencoderKLWan``
folder, or "random:<preset>": that preset's VAE config with the random weights of the store's
``seed``, loaded by ``ditscale.prepare.encoders``: the VAE that made the latents). Every rank
runs the pipeline (the FSDP model's forward gathers its shards); rank 0 writes the files. The
model is the training weights, not the EMA. See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

import os
from typing import List

import torch

from ..diffusers.generation import encode_png, encode_video, output_array, to_uint8


def load_vae(spec: str, model: str, latent_channels: int, device: torch.device, seed: int = 0):
    """The store's VAE in float32 on ``device``, as ``ditscale.prepare`` loads it (``spec``: a
    folder, or "random:<preset>": the weights of ``seed``, the store's; the global RNG is left
    as it was); ValueError when it is missing or its latent channels differ from the store's."""
    from ..prepare.encoders import load_vae as prepare_vae
    from ..prepare.presets import get_preset

    if spec.startswith("random:"):
        preset, folder = get_preset(spec.split(":", 1)[1]), None
    elif os.path.isdir(spec):
        preset, folder = get_preset(model), spec
    else:
        raise ValueError(f"validation: the store's VAE {spec!r} is not a folder (or "
                         f"random:<preset>); it is needed to decode the validation samples")
    with torch.random.fork_rng(devices=[]):
        vae, _ = prepare_vae(preset, folder, str(device), torch.float32, seed)
    if vae.config.z_dim != latent_channels:
        raise ValueError(f"validation: the VAE {spec!r} has {vae.config.z_dim} latent channels, "
                         f"the store {latent_channels}")
    return vae


class Validator:
    def __init__(self, cfg, store, dataset, device: torch.device, dtype: torch.dtype,
                 out: str):
        self.cfg, self.device, self.dtype, self.out = cfg, device, dtype, out
        n = min(cfg.validation_samples, len(store))
        self.prompts = [dataset[i]["text"].float() for i in range(n)]
        self.vae = load_vae(store.meta.vae, store.meta.model, store.meta.latent_channels,
                            device, store.meta.seed)

    def _pipeline(self, model):
        from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=self.cfg.shift)
        pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=model, vae=self.vae,
                           scheduler=sched)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @torch.no_grad()
    def run(self, model, step: int, rank: int, log) -> List[str]:
        """Generates every prompt; rank 0 writes and logs them; returns the paths (rank 0)."""
        c = self.cfg
        pipe = self._pipeline(model)
        video = c.validation_frames > 1
        folder = os.path.join(self.out, "validation", f"step-{step:09d}")
        paths = []
        for i, emb in enumerate(self.prompts):
            emb = emb[None].to(self.device)
            kw = dict(prompt_embeds=emb, height=c.validation_height, width=c.validation_width,
                      num_frames=c.validation_frames, num_inference_steps=c.validation_steps,
                      guidance_scale=c.validation_guidance, output_type="np",
                      generator=torch.Generator(self.device).manual_seed(c.validation_seed + i))
            if c.validation_guidance > 1:
                kw["negative_prompt_embeds"] = torch.zeros_like(emb)
            with torch.autocast(self.device.type, dtype=self.dtype,
                                enabled=self.dtype != torch.float32):
                arr = to_uint8(output_array(pipe(**kw), video=True))[0]  # [F, H, W, 3]
            if rank != 0:
                continue
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"sample-{i}.{'mp4' if video else 'png'}")
            data = encode_video(arr, c.validation_fps, "mp4") if video else encode_png(arr[0])
            with open(path, "wb") as f:
                f.write(data)
            log.image(f"validation/sample-{i}", arr[0], step)
            paths.append(os.path.relpath(path, self.out))
        return paths
