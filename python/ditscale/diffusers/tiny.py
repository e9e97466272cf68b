"""Pipelines built from configs with random weights (no download), and local checkpoints.

``make_pipeline(name, size="tiny", device="cpu", dtype=torch.float32, seed=0)``: the diffusers
pipeline ``name`` (:data:`PIPELINES`) from its components' configs, every weight drawn from
``seed``, at size tiny (CPU tests), small (real widths, few blocks) or full (the published
dimensions); text encoders None, prompts as :func:`make_prompt_embeds`.
``load_pipeline(name, weights_dir, device, dtype)``: a local checkpoint folder, its configs
checked first (``checkpoint_config``). The pipelines, sizes and shapes:
docs/diffusers/pipelines.md ("Random-weight pipelines and local checkpoints").
"""

from __future__ import annotations

import os
from typing import Dict, Tuple

import torch

from .._checks import check_choice, check_int

PIPELINES = ("flux", "sd3", "wan", "wan2.2", "hunyuan-video", "cogvideox")
SIZES = ("tiny", "small", "full")

# small: the full model's widths, heads and VAE with only these block counts (config keys).
SMALL_BLOCKS = {"flux": dict(num_layers=2, num_single_layers=4),
                "sd3": dict(num_layers=4, dual_attention_layers=(0, 1)),
                "wan": dict(num_layers=4), "wan2.2": dict(num_layers=4),
                "hunyuan-video": dict(num_layers=2, num_single_layers=4, num_refiner_layers=1),
                "cogvideox": dict(num_layers=4)}
VIDEO_PIPELINES = ("wan", "wan2.2", "hunyuan-video", "cogvideox")

# name -> the diffusers pipeline class of that name.
PIPELINE_CLASSES = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline",
                    "wan": "WanPipeline", "wan2.2": "WanPipeline",
                    "hunyuan-video": "HunyuanVideoPipeline", "cogvideox": "CogVideoXPipeline"}

# name -> size -> (height, width, frames) in pixels / frames (frames 1 for images).
DEFAULT_SHAPES: Dict[str, Dict[str, Tuple[int, int, int]]] = {
    "flux": {"tiny": (12, 20, 1), "small": (512, 512, 1), "full": (1024, 1024, 1)},
    "sd3": {"tiny": (12, 20, 1), "small": (512, 512, 1), "full": (1024, 1024, 1)},
    "wan": {"tiny": (48, 16, 9), "small": (480, 832, 17), "full": (480, 832, 81)},
    "wan2.2": {"tiny": (48, 16, 9), "small": (480, 832, 17), "full": (720, 1280, 81)},
    "hunyuan-video": {"tiny": (48, 16, 9), "small": (320, 512, 17), "full": (544, 960, 61)},
    "cogvideox": {"tiny": (24, 8, 9), "small": (480, 720, 17), "full": (480, 720, 49)},
}

# name -> size -> text tokens of the prompt embeddings (full: the pipelines' usual lengths).
TEXT_TOKENS = {"flux": (7, 512, 512), "sd3": (7, 333, 333), "wan": (7, 512, 512),
               "wan2.2": (7, 512, 512), "hunyuan-video": (7, 256, 256),
               "cogvideox": (7, 226, 226)}


# ---- configs ------------------------------------------------------------------------------------

def _kl_vae(size: str, scaling: float, shift: float) -> dict:
    """AutoencoderKL of Flux / SD3 (16 latent channels, 8x) or a 2x tiny one (4 channels)."""
    if size == "full":
        blocks, channels, groups, layers = 4, (128, 256, 512, 512), 32, 2
        latent = 16
    else:
        blocks, channels, groups, layers = 2, (8, 8), 4, 1
        latent = 4
    return dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * blocks,
                up_block_types=("UpDecoderBlock2D",) * blocks, block_out_channels=channels,
                layers_per_block=layers, latent_channels=latent, norm_num_groups=groups,
                sample_size=1024 if size == "full" else 32, scaling_factor=scaling,
                shift_factor=shift, use_quant_conv=False, use_post_quant_conv=False)


def _flux(size: str) -> dict:
    if size == "full":
        model = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                     attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                     pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    else:
        model = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                     attention_head_dim=8, num_attention_heads=3, joint_attention_dim=16,
                     pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    sched = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)
    return dict(transformer=("FluxTransformer2DModel", model),
                vae=("AutoencoderKL", _kl_vae(size, 0.3611, 0.1159)),
                scheduler=("FlowMatchEulerDiscreteScheduler", sched))


def _sd3(size: str) -> dict:
    if size == "full":  # SD3.5 medium
        model = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24,
                     attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                     caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                     pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                     qk_norm="rms_norm")
    else:
        model = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                     attention_head_dim=8, num_attention_heads=3, joint_attention_dim=16,
                     caption_projection_dim=24, pooled_projection_dim=8, out_channels=4,
                     pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")
    return dict(transformer=("SD3Transformer2DModel", model),
                vae=("AutoencoderKL", _kl_vae(size, 1.5305, 0.0609)),
                scheduler=("FlowMatchEulerDiscreteScheduler", dict(shift=3.0)))


def _wan_vae(size: str) -> dict:
    if size == "full":
        return {}  # AutoencoderKLWan's defaults are Wan 2.1's VAE
    return dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                latents_std=[1.5, 2.0, 1.0, 2.5])


def _wan_model(size: str, big: bool) -> dict:
    if size == "full":
        heads, ffn, layers = (40, 13824, 40) if big else (12, 8960, 30)
        return dict(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128,
                    in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=ffn,
                    num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                    eps=1e-6, rope_max_seq_len=1024)
    return dict(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=8,
                in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32,
                num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                rope_max_seq_len=64)


def _wan(size: str, version: str) -> dict:
    big = version == "2.2"
    sched = dict(prediction_type="flow_prediction", use_flow_sigmas=True,
                 num_train_timesteps=1000, flow_shift=12.0 if big else 3.0)
    parts = dict(transformer=("WanTransformer3DModel", _wan_model(size, big)),
                 vae=("AutoencoderKLWan", _wan_vae(size)),
                 scheduler=("UniPCMultistepScheduler", sched))
    if big:
        parts["transformer_2"] = ("WanTransformer3DModel", _wan_model(size, big))
        # A14B's boundary; the tiny one's lies within a 2-step schedule (t = 1000, 923), so
        # that a short run uses both transformers
        parts["boundary_ratio"] = 0.875 if size == "full" else 0.95
    return parts


def _hunyuan(size: str) -> dict:
    if size == "full":
        model = dict(in_channels=16, out_channels=16, num_attention_heads=24,
                     attention_head_dim=128, num_layers=20, num_single_layers=40,
                     num_refiner_layers=2, patch_size=2, patch_size_t=1, guidance_embeds=True,
                     text_embed_dim=4096, pooled_projection_dim=768, rope_axes_dim=(16, 56, 56))
        vae = {}  # AutoencoderKLHunyuanVideo's defaults are HunyuanVideo's VAE
    else:
        model = dict(in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=8,
                     num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
                     patch_size=2, patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
                     pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
        vae = dict(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                   norm_num_groups=4)
    return dict(transformer=("HunyuanVideoTransformer3DModel", model),
                vae=("AutoencoderKLHunyuanVideo", vae),
                scheduler=("FlowMatchEulerDiscreteScheduler", dict(shift=7.0)))


def _cogvideox(size: str) -> dict:
    if size == "full":  # CogVideoX 5B
        model = dict(num_attention_heads=48, attention_head_dim=64, in_channels=16,
                     out_channels=16, time_embed_dim=512, text_embed_dim=4096, num_layers=42,
                     sample_width=90, sample_height=60, sample_frames=49, patch_size=2,
                     use_rotary_positional_embeddings=True)
        vae = dict(scaling_factor=0.7)
    else:
        model = dict(num_attention_heads=3, attention_head_dim=16, in_channels=4, out_channels=4,
                     time_embed_dim=8, text_embed_dim=16, num_layers=1, sample_width=2,
                     sample_height=6, sample_frames=9, patch_size=2,
                     use_rotary_positional_embeddings=True)
        blocks = 3
        vae = dict(down_block_types=("CogVideoXDownBlock3D",) * blocks,
                   up_block_types=("CogVideoXUpBlock3D",) * blocks,
                   block_out_channels=(8,) * blocks, latent_channels=4, layers_per_block=1,
                   norm_num_groups=4, temporal_compression_ratio=4, sample_height=24,
                   sample_width=8, scaling_factor=0.7)
    sched = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                 clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                 set_alpha_to_one=True, snr_shift_scale=1.0, timestep_spacing="trailing")
    return dict(transformer=("CogVideoXTransformer3DModel", model),
                vae=("AutoencoderKLCogVideoX", vae),
                scheduler=("CogVideoXDDIMScheduler", sched))


def _parts(name: str, size: str) -> dict:
    """The components' (class name, config) of ``name`` at ``size``."""
    if size == "small":
        parts = _parts(name, "full")
        cls, config = parts["transformer"]
        for key in ("transformer", "transformer_2"):
            if key in parts:
                parts[key] = (cls, {**config, **SMALL_BLOCKS[name]})
        return parts
    if name == "flux":
        return _flux(size)
    if name == "sd3":
        return _sd3(size)
    if name in ("wan", "wan2.2"):
        return _wan(size, "2.2" if name == "wan2.2" else "2.1")
    if name == "hunyuan-video":
        return _hunyuan(size)
    return _cogvideox(size)


# ---- building -----------------------------------------------------------------------------------

def _cast(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype``, its ``_keep_in_fp32_modules`` (names of submodules or
    parameters) left in float32."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for mod_name, module in model.named_modules():
        if keep & set(mod_name.split(".")):
            continue
        for p_name, p in module.named_parameters(recurse=False):
            if p_name not in keep and p.is_floating_point():
                p.data = p.data.to(dtype)
        for b_name, b in module.named_buffers(recurse=False):
            if b.is_floating_point():
                module._buffers[b_name] = b.to(dtype)
    return model


def _none_components(cls) -> dict:
    """None for every text encoder, tokenizer and image encoder argument of ``cls``."""
    import inspect

    names = inspect.signature(cls.__init__).parameters
    return {n: None for n in names
            if n.startswith(("text_encoder", "tokenizer", "image_encoder", "feature_extractor"))}


def make_pipeline(name: str, size: str = "tiny", device="cpu", dtype=torch.float32,
                  seed: int = 0):
    """The pipeline ``name`` (see the module) with random weights drawn from ``seed``
    ([0, 2^63 - 1]) on ``device`` in ``dtype``, in eval mode. The global RNG state is left as
    it was."""
    import diffusers

    check_choice("make_pipeline: name", name, PIPELINES)
    check_choice("make_pipeline: size", size, SIZES)
    check_int("make_pipeline: seed", seed, 0, 2**63 - 1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"make_pipeline: dtype {dtype!r} is not a floating-point torch.dtype")
    device = torch.device(device)
    parts = _parts(name, size)
    components = {}
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for key in ("transformer", "transformer_2", "vae"):
            if key not in parts:
                continue
            cls_name, config = parts[key]
            with torch.device(device):  # random init where the model runs
                model = getattr(diffusers, cls_name)(**config)
            components[key] = _cast(model, dtype).eval()
    sched_name, sched_config = parts["scheduler"]
    components["scheduler"] = getattr(diffusers, sched_name)(**sched_config)
    cls = getattr(diffusers, PIPELINE_CLASSES[name])
    components.update(_none_components(cls))
    if "boundary_ratio" in parts:
        components["boundary_ratio"] = parts["boundary_ratio"]
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---- prompt embeddings --------------------------------------------------------------------------

def _family(pipe) -> str:
    from . import SUPPORTED_PIPELINES, family_of

    return family_of(pipe, SUPPORTED_PIPELINES, "pipeline", "make_prompt_embeds")


def _text_dims(pipe) -> Tuple[int, int]:
    """(per-token text width, pooled width or 0) of ``pipe``'s transformer."""
    cfg = pipe.transformer.config
    family = _family(pipe)
    if family in ("flux", "sd3"):
        return cfg.joint_attention_dim, cfg.pooled_projection_dim
    if family == "hunyuan_video":
        return cfg.text_embed_dim, cfg.pooled_projection_dim
    if family == "wan":
        return cfg.text_dim, 0
    return cfg.text_embed_dim, 0  # cogvideox


def make_prompt_embeds(pipe, text_tokens: int, batch: int = 1, negative: bool = True,
                       seed: int = 0) -> dict:
    """Keyword arguments of ``pipe(...)`` standing in for the text encoders' output:
    deterministic random tensors (standard normal, from ``seed``; not the embedding of any
    text) on the transformer's device and dtype.

    ``prompt_embeds`` [batch, text_tokens, C_txt]; Flux, SD3 and HunyuanVideo also
    ``pooled_prompt_embeds`` [batch, C_pool]; HunyuanVideo ``prompt_attention_mask``
    [batch, text_tokens] (all ones: every token valid); with ``negative`` the same for the
    negative prompt (``negative_prompt_embeds``, ...: what classifier-free guidance needs).
    ``text_tokens``: [1, 4096]; ``batch``: [1, 64]; ``seed``: [0, 2^63 - 1]."""
    check_int("make_prompt_embeds: text_tokens", text_tokens, 1, 4096)
    check_int("make_prompt_embeds: batch", batch, 1, 64)
    check_int("make_prompt_embeds: seed", seed, 0, 2**63 - 1)
    width, pooled = _text_dims(pipe)
    device, dtype = pipe.transformer.device, pipe.transformer.dtype  # dtype: not the fp32-kept
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    out = {}
    for prefix in ("", "negative_") if negative else ("",):
        out[f"{prefix}prompt_embeds"] = rnd(batch, text_tokens, width)
        if pooled:
            out[f"{prefix}pooled_prompt_embeds"] = rnd(batch, pooled)
        if _family(pipe) == "hunyuan_video":
            out[f"{prefix}prompt_attention_mask"] = torch.ones(
                batch, text_tokens, dtype=torch.int64, device=device)
    return out


def default_text_tokens(name: str, size: str) -> int:
    """The text length :func:`make_prompt_embeds` is given for ``name`` at ``size``."""
    check_choice("default_text_tokens: name", name, PIPELINES)
    return TEXT_TOKENS[name][SIZES.index(check_choice("default_text_tokens: size", size, SIZES))]


# ---- local checkpoints --------------------------------------------------------------------------

def _read_index(weights_dir: str, where: str) -> dict:
    """``weights_dir``'s model_index.json (a ValueError naming ``where`` when unreadable)."""
    from .checkpoint_config import read_config

    try:
        return read_config(os.path.join(weights_dir, "model_index.json"))
    except ValueError as e:
        raise ValueError(f"{where}: cannot read its model_index.json: {e}") from e


def _index_components(cls, index: dict, where: str) -> dict:
    """None for each component of ``cls`` that the checkpoint's model_index.json ``index`` lists
    as ``[null, null]`` (what ``save_pretrained`` writes for a None component, e.g. a pipeline
    saved without text encoders; ``from_pretrained`` refuses such a checkpoint unless the
    component is passed). An index of another pipeline class is a ValueError (``from_pretrained``
    would build ``cls`` around the other pipeline's models, or fail deep inside)."""
    import inspect

    saved = index.get("_class_name")
    if saved is not None and saved != cls.__name__:
        raise ValueError(f"{where} holds a {saved} checkpoint (model_index.json), not a "
                         f"{cls.__name__}")
    names = inspect.signature(cls.__init__).parameters
    return {k: None for k, v in index.items()
            if k in names and isinstance(v, (list, tuple)) and v
            and all(x is None for x in v)}


def _check_all_loaded(pipe, weights_dir: str) -> None:
    """Every weight of the transformer(s) and VAE came from the files: a config.json that asks
    for more layers than its weight files hold leaves the rest on the meta device (diffusers
    only warns), which is a ValueError naming the component's folder and a missing tensor."""
    for key in ("transformer", "transformer_2", "vae"):
        model = getattr(pipe, key, None)
        if not isinstance(model, torch.nn.Module):
            continue
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        missing = [n for n, t in tensors if t.is_meta]
        if missing:
            raise ValueError(f"{os.path.join(weights_dir, key)}: {len(missing)} of the tensors "
                             f"its config.json describes are not in its weight files (e.g. "
                             f"{missing[0]}): the config does not match the weights")


def load_pipeline(name: str, weights_dir: str, device="cpu", dtype=torch.float32,
                  memory_bytes=None):
    """The pipeline ``name`` from the local diffusers checkpoint folder ``weights_dir`` (its
    ``model_index.json`` and component folders), on ``device`` in ``dtype``; nothing is
    downloaded. Components the checkpoint was saved without (``[null, null]`` in its index,
    e.g. no text encoders) stay None. A missing folder or file, or a checkpoint of another
    pipeline class, is a ValueError naming the folder. Before anything is built, the transformer
    and VAE configs are checked against their ranges and the memory their weights take against
    ``memory_bytes`` (default: the memory available; ``checkpoint_config.check_checkpoint``):
    a ValueError naming the file, the field, the value and the range."""
    import diffusers

    from .checkpoint_config import check_checkpoint

    check_choice("load_pipeline: name", name, PIPELINES)
    where = f"load_pipeline: weights folder {weights_dir!r}"
    if not os.path.isdir(weights_dir):
        raise ValueError(f"{where} does not exist or is not a folder")
    if not os.path.isfile(os.path.join(weights_dir, "model_index.json")):
        raise ValueError(f"{where} has no model_index.json (not a diffusers checkpoint folder)")
    cls = getattr(diffusers, PIPELINE_CLASSES[name])
    index = _read_index(weights_dir, where)
    absent = _index_components(cls, index, where)
    check_checkpoint(name, weights_dir, index, dtype=dtype, device=device,
                     memory_bytes=memory_bytes)
    try:
        pipe = cls.from_pretrained(weights_dir, local_files_only=True, dtype=dtype, **absent)
    except (OSError, ValueError, EnvironmentError) as e:
        raise ValueError(f"{where}: cannot load a {cls.__name__} from it: {e}") from e
    if name == "wan2.2" and getattr(pipe, "transformer_2", None) is None:
        raise ValueError(f"{where}: a Wan 2.2 A14B checkpoint has transformer_2; this one has "
                         f"none (use --pipeline wan)")
    _check_all_loaded(pipe, weights_dir)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe
