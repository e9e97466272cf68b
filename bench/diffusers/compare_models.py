"""The models, inputs and denoising loop of bench/diffusers/compare_peers.py.

``model_config(family, size, blocks)`` -> the diffusers constructor arguments of Flux
(``FluxTransformer2DModel``, Flux.1 dimensions: 3072 = 24 x 128 heads, text 4096 -> 512 tokens)
or Wan 2.1 1.3B (``WanTransformer3DModel``: 1536 = 12 x 128 heads, ffn 8960), or tiny ones (4
heads of 8); ``build(cls, cfg, dtype, device, seed)`` -> the module with seeded weights;
``make_inputs`` -> the noise latents and text embeddings (N(0, 1), seeded, on the CPU then moved);
``denoise(model, family, inputs, steps, device)`` -> (final latents, seconds per step).

A step is what the diffusers pipeline does per step, over the transformer alone: Flux one
forward (guidance embedded, 3.5; timestep t / 1000) and a FlowMatchEulerDiscreteScheduler step
(FluxPipeline's dynamic shift mu = 0.5 + 0.65 (S - 256) / 3840 for S image tokens, sigmas
linspace(1, 1/steps)); Wan two forwards (classifier-free guidance, x_u + 5.0 (x_c - x_u)) and a
UniPCMultistepScheduler step (flow prediction, flow_shift 3.0). Each step ends with a device
synchronize, so its wall time is the step's latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from bench.timing import time_fn

TINY_GRID = {"flux": (1, 4, 6), "wan": (2, 3, 4)}  # 24 image tokens
TEXT_TOKENS = {"full": 512, "tiny": 8}
FLUX_GUIDANCE, WAN_CFG_SCALE = 3.5, 5.0


# ---- models and inputs --------------------------------------------------------------------------

def model_config(family: str, size: str, blocks: int) -> dict:
    """The diffusers constructor arguments: the published dimensions (as bench/diffusers/models.py
    lists them) or the tiny ones; ``blocks`` > 0 overrides the block counts."""
    if family == "flux":
        if size == "full":
            cfg = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                       pooled_projection_dim=768, guidance_embeds=True,
                       axes_dims_rope=(16, 56, 56))
        else:
            cfg = dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                       attention_head_dim=8, num_attention_heads=4, joint_attention_dim=16,
                       pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
        if blocks:
            cfg.update(num_layers=blocks, num_single_layers=blocks)
        return cfg
    if size == "full":
        cfg = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                   in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                   num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                   eps=1e-6, rope_max_seq_len=1024)
    else:
        cfg = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8,
                   in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32,
                   num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                   eps=1e-6, rope_max_seq_len=64)
    if blocks:
        cfg["num_layers"] = blocks
    return cfg


def build(cls, cfg: dict, dtype, device, seed: int):
    """``cls(**cfg)`` with its weights drawn from ``seed`` on ``device``, cast to ``dtype`` except
    its ``_keep_in_fp32_modules`` (as from_pretrained loads it), in eval mode."""
    import torch

    from bench.diffusers.models import _cast

    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(**cfg)
    return _cast(model, dtype).eval()


def stock_class(family: str):
    import diffusers

    return diffusers.FluxTransformer2DModel if family == "flux" else diffusers.WanTransformer3DModel


@dataclass
class Inputs:
    noise: object  # initial latents: Flux [1, S, C] packed, model dtype; Wan [1, C, F, H, W] fp32
    cond: dict  # the forward's keyword arguments other than hidden_states and timestep
    uncond: Optional[dict]  # Wan: the negative prompt's (classifier-free guidance)
    tokens: int
    text: int
    dtype: object  # the transformer's input dtype


def make_inputs(family, grid, text, cfg, dtype, device, seed) -> Inputs:
    import torch

    g = torch.Generator().manual_seed(seed + 1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    f, h, w = grid
    if family == "flux":
        ids = torch.zeros(h, w, 3)
        ids[..., 1] = torch.arange(h)[:, None]
        ids[..., 2] = torch.arange(w)[None, :]
        cond = dict(encoder_hidden_states=rnd(1, text, cfg["joint_attention_dim"]),
                    pooled_projections=rnd(1, cfg["pooled_projection_dim"]),
                    img_ids=ids.reshape(-1, 3).to(device),
                    txt_ids=torch.zeros(text, 3, device=device),
                    guidance=torch.full((1,), FLUX_GUIDANCE, device=device))
        return Inputs(rnd(1, h * w, cfg["in_channels"]), cond, None, h * w, text, dtype)
    # WanPipeline keeps its latents in fp32 and casts the transformer's input
    noise = rnd(1, cfg["in_channels"], f, 2 * h, 2 * w).float()
    cond = dict(encoder_hidden_states=rnd(1, text, cfg["text_dim"]))
    uncond = dict(encoder_hidden_states=rnd(1, text, cfg["text_dim"]))
    return Inputs(noise, cond, uncond, f * h * w, text, dtype)


def make_scheduler(family: str, tokens: int, steps: int, device):
    """The pipeline's scheduler with ``steps`` timesteps set."""
    import diffusers
    import numpy as np

    if family == "flux":
        s = diffusers.FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096)
        # FluxPipeline's shift: linear in the image token count between (256, 0.5), (4096, 1.15)
        mu = 0.5 + (1.15 - 0.5) * (tokens - 256) / (4096 - 256)
        s.set_timesteps(steps, device=device, sigmas=np.linspace(1.0, 1.0 / steps, steps), mu=mu)
        return s
    s = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                          num_train_timesteps=1000, flow_shift=3.0)
    s.set_timesteps(steps, device=device)
    return s


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def denoise(model, family, inp: Inputs, steps: int, device):
    """Runs ``steps`` denoising steps; returns (final latents fp32 on the CPU, [s per step])."""
    import torch

    sched = make_scheduler(family, inp.tokens, steps, device)
    x = inp.noise.clone()

    def one_step(t):
        nonlocal x
        with torch.no_grad():
            if family == "flux":
                tt = (t / 1000).expand(1).to(x.dtype)
                pred = model(hidden_states=x, timestep=tt, return_dict=False, **inp.cond)[0]
            else:
                tt, xin = t.expand(1), x.to(inp.dtype)
                pred = model(hidden_states=xin, timestep=tt, return_dict=False, **inp.cond)[0]
                neg = model(hidden_states=xin, timestep=tt, return_dict=False, **inp.uncond)[0]
                pred = neg + WAN_CFG_SCALE * (pred - neg)
            x = sched.step(pred, t, x, return_dict=False)[0]

    times = []
    for t in sched.timesteps:  # each step once, wall clock with the device synchronized around
        step = time_fn(lambda: one_step(t), warmup=0, reps=1, clock="wall",
                       sync=lambda: sync(device))
        times.append(step.median_ms / 1e3)
    return x.float().cpu(), times
