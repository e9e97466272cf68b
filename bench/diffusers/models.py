"""The diffusers transformers of the benchmarks, at their real dimensions with a few blocks and
random weights, and their inputs at a given token count.

``make(name, blocks, dtype, device)`` -> (transformer, config dict); ``inputs(name, model,
tokens, batch, dtype, device, seed)`` -> the forward's keyword arguments with ``tokens`` image /
video tokens after patching. Names: :data:`MODELS`, typical token counts: :data:`TOKENS`; the
table of classes and dimensions: docs/diffusers/benchmarks.md.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

MODELS = ("wan2.1-1.3b", "wan2.1-14b", "flux", "hunyuan-video", "cogvideox-5b", "sd3.5-medium")

# Typical image/video token counts per model (after patching).
TOKENS: Dict[str, Tuple[int, ...]] = {
    "wan2.1-1.3b": (1024, 32760, 75600),
    "wan2.1-14b": (1024, 32760, 75600),
    "flux": (4096, 16384),
    "hunyuan-video": (4096, 32760),
    "cogvideox-5b": (4096, 17550),
    "sd3.5-medium": (4096, 16384),
}

TEXT_TOKENS = {"wan2.1-1.3b": 512, "wan2.1-14b": 512, "flux": 512, "hunyuan-video": 256,
               "cogvideox-5b": 226, "sd3.5-medium": 333}


def _grid(tokens: int, frames_first: bool) -> Tuple[int, int, int]:
    """(frames, h, w) of a patched grid with frames * h * w == tokens: the video grid of the
    published shapes when it matches (21 frames: 81 video frames), else one frame as square as
    the factors allow."""
    known = {32760: (21, 30, 52), 75600: (21, 45, 80), 17550: (13, 30, 45)}
    if frames_first and tokens in known:
        return known[tokens]
    h = int(math.isqrt(tokens))
    while tokens % h:
        h -= 1
    return 1, h, tokens // h


def make(name: str, blocks: int, dtype, device):
    """The transformer ``name`` (see the module table) with ``blocks`` blocks of each kind."""
    import diffusers
    import torch

    if name not in MODELS:
        raise ValueError(f"model {name!r} is not one of {', '.join(MODELS)}")
    if not 1 <= blocks <= 64:
        raise ValueError(f"blocks: {blocks} is out of range [1, 64]")
    torch.manual_seed(0)
    with torch.device(device):  # random init where the model runs (fast on a GPU)
        model, cfg = _build(diffusers, name, blocks)
    return _cast(model, dtype), cfg


def _build(diffusers, name: str, blocks: int):
    if name.startswith("wan2.1"):
        big = name.endswith("14b")
        cfg = dict(patch_size=(1, 2, 2), num_attention_heads=40 if big else 12,
                   attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                   freq_dim=256, ffn_dim=13824 if big else 8960, num_layers=blocks,
                   cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                   rope_max_seq_len=1024)
        model = diffusers.WanTransformer3DModel(**cfg)
    elif name == "flux":
        cfg = dict(patch_size=1, in_channels=64, num_layers=blocks, num_single_layers=blocks,
                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                   pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
        model = diffusers.FluxTransformer2DModel(**cfg)
    elif name == "hunyuan-video":
        cfg = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
                   num_layers=blocks, num_single_layers=blocks, num_refiner_layers=1,
                   patch_size=2, patch_size_t=1, guidance_embeds=True, text_embed_dim=4096,
                   pooled_projection_dim=768, rope_axes_dim=(16, 56, 56))
        model = diffusers.HunyuanVideoTransformer3DModel(**cfg)
    elif name == "cogvideox-5b":
        cfg = dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16,
                   time_embed_dim=512, text_embed_dim=4096, num_layers=blocks, sample_width=90,
                   sample_height=60, sample_frames=49, patch_size=2,
                   use_rotary_positional_embeddings=True)
        model = diffusers.CogVideoXTransformer3DModel(**cfg)
    else:  # sd3.5-medium
        cfg = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=blocks,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                   pos_embed_max_size=384, dual_attention_layers=tuple(range(min(blocks, 13))),
                   qk_norm="rms_norm")
        model = diffusers.SD3Transformer2DModel(**cfg)
    return model, cfg


def _cast(model, dtype):
    """``model`` in ``dtype`` except its ``_keep_in_fp32_modules`` (Wan's rope, time embedder,
    modulation table and norms), as ``from_pretrained(torch_dtype=...)`` loads it."""
    import torch

    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, module in model.named_modules():
        if keep and any(k in name.split(".") for k in keep):
            continue
        for pname, p in module.named_parameters(recurse=False):
            if pname not in keep:
                p.data = p.data.to(dtype)
        for bname, b in module.named_buffers(recurse=False):
            if b.is_floating_point():
                setattr(module, bname, b.to(dtype))
    return model


def inputs(name: str, model, tokens: int, batch: int, dtype, device, seed: int = 0) -> dict:
    """Keyword arguments of ``model.forward`` with ``tokens`` image/video tokens."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    text = TEXT_TOKENS[name]
    t = torch.full((batch,), 500.0, device=device)
    if name.startswith("wan2.1"):
        f, h, w = _grid(tokens, True)
        return dict(hidden_states=rnd(batch, 16, f, 2 * h, 2 * w), timestep=t,
                    encoder_hidden_states=rnd(batch, text, 4096), return_dict=False)
    if name == "flux":
        _, h, w = _grid(tokens, False)
        ids = torch.zeros(h, w, 3)
        ids[..., 1] = torch.arange(h)[:, None]
        ids[..., 2] = torch.arange(w)[None, :]
        return dict(hidden_states=rnd(batch, h * w, 64),
                    encoder_hidden_states=rnd(batch, text, 4096),
                    pooled_projections=rnd(batch, 768), timestep=t / 1000,
                    img_ids=ids.reshape(-1, 3).to(device),
                    txt_ids=torch.zeros(text, 3, device=device),
                    guidance=torch.full((batch,), 3.5, device=device), return_dict=False)
    if name == "hunyuan-video":
        f, h, w = _grid(tokens, True)
        return dict(hidden_states=rnd(batch, 16, f, 2 * h, 2 * w), timestep=t,
                    encoder_hidden_states=rnd(batch, text, 4096),
                    encoder_attention_mask=torch.ones(batch, text, device=device,
                                                      dtype=torch.int64),
                    pooled_projections=rnd(batch, 768),
                    guidance=torch.full((batch,), 6000.0, device=device), return_dict=False)
    if name == "cogvideox-5b":
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        f, h, w = _grid(tokens, True)
        cos, sin = get_3d_rotary_pos_embed(embed_dim=64, crops_coords=((0, 0), (h, w)),
                                           grid_size=(h, w), temporal_size=f, device=device)
        return dict(hidden_states=rnd(batch, f, 16, 2 * h, 2 * w),
                    encoder_hidden_states=rnd(batch, text, 4096), timestep=t.long(),
                    image_rotary_emb=(cos, sin), return_dict=False)
    _, h, w = _grid(tokens, False)  # sd3.5-medium
    return dict(hidden_states=rnd(batch, 16, 2 * h, 2 * w),
                encoder_hidden_states=rnd(batch, text, 4096),
                pooled_projections=rnd(batch, 2048), timestep=t, return_dict=False)
