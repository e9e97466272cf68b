"""The ranges of the component configs a checkpoint folder may hold, one table per class.

:data:`RANGES` maps a diffusers class name (the transformers and VAEs of the pipelines of
:data:`ditscale.diffusers.tiny.PIPELINES`) to ``{config field: Field}``: its JSON type and
range (every constructor argument of the class is listed; a test holds the tables to the
signatures); :data:`SUMS` relates fields that must agree; :data:`SCHEDULER` bounds the fields
that size a scheduler's tables.
``checkpoint_config`` checks a ``config.json`` against them before any module is built; the
bounds are generous (the largest published models sit well inside), the memory a config
implies is bounded separately. See docs/diffusers/pipelines.md (local checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class Field:
    """``kind``: "int", "real", "bool", "str" or a list of one of them ("ints", "reals",
    "bools", "strs"); ``lo``/``hi``: the range of each number; ``count``: the item count
    range of a list; ``choices``: the allowed strings (empty: any of at most 64 characters);
    ``null``: JSON null (the class default) allowed."""

    kind: str
    lo: float = 0
    hi: float = 0
    count: Tuple[int, int] = (0, 0)
    choices: Tuple[str, ...] = ()
    null: bool = False


def Int(lo: int, hi: int, null: bool = False) -> Field:
    return Field("int", lo, hi, null=null)


def Real(lo: float, hi: float, null: bool = False) -> Field:
    return Field("real", lo, hi, null=null)


def Bool() -> Field:
    return Field("bool")


def Str(*choices: str, null: bool = False) -> Field:
    return Field("str", choices=choices, null=null)


def Ints(lo: int, hi: int, count: Tuple[int, int], null: bool = False) -> Field:
    return Field("ints", lo, hi, count, null=null)


def Reals(lo: float, hi: float, count: Tuple[int, int], null: bool = False) -> Field:
    return Field("reals", lo, hi, count, null=null)


def Bools(count: Tuple[int, int]) -> Field:
    return Field("bools", count=count)


def Strs(choices: Tuple[str, ...], count: Tuple[int, int]) -> Field:
    return Field("strs", count=count, choices=choices)


# Shared bounds (the published models: at most 60 blocks, 48 heads of 128, widths <= 13824).
LAYERS, MORE_LAYERS = Int(1, 256), Int(0, 256)
HEADS, HEAD_DIM = Int(1, 256), Int(2, 1024)
LATENT = Int(1, 1024)  # latent / patchified channels
WIDTH = Int(1, 65536)  # text, projection and feed-forward widths
PATCH = Int(1, 16)
EPS = Real(0.0, 1.0)
THETA = Real(1.0, 1e9)
SCALE = Real(1e-6, 1e6)
SHIFT = Real(-1e6, 1e6, null=True)
STATS = Reals(-1e6, 1e6, (1, 1024), null=True)  # latents_mean / latents_std per channel
PIXELS = Int(1, 64)  # image channels
LEVELS = Ints(1, 8192, (1, 8))  # a VAE's channels per level
PER_LEVEL = Int(1, 16)  # layers / res blocks per VAE level
GROUPS = Int(1, 1024)
ACT = Str()

_KL_BLOCKS = (("DownEncoderBlock2D",), ("UpDecoderBlock2D",))
_HY_BLOCKS = (("HunyuanVideoDownBlock3D",), ("HunyuanVideoUpBlock3D",))
_COG_BLOCKS = (("CogVideoXDownBlock3D",), ("CogVideoXUpBlock3D",))

RANGES: Dict[str, Dict[str, Field]] = {
    "FluxTransformer2DModel": dict(
        patch_size=PATCH, in_channels=LATENT, out_channels=Int(1, 1024, null=True),
        num_layers=LAYERS, num_single_layers=MORE_LAYERS, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=WIDTH, pooled_projection_dim=WIDTH,
        guidance_embeds=Bool(), axes_dims_rope=Ints(2, 1024, (1, 4))),
    "SD3Transformer2DModel": dict(
        sample_size=Int(1, 4096), patch_size=PATCH, in_channels=LATENT, num_layers=LAYERS,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=WIDTH,
        caption_projection_dim=WIDTH, pooled_projection_dim=WIDTH, out_channels=LATENT,
        pos_embed_max_size=Int(1, 4096), dual_attention_layers=Ints(0, 255, (0, 256)),
        qk_norm=Str(null=True)),
    "WanTransformer3DModel": dict(
        patch_size=Ints(1, 16, (3, 3)), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
        in_channels=LATENT, out_channels=LATENT, text_dim=WIDTH, freq_dim=Int(2, 8192),
        ffn_dim=WIDTH, num_layers=LAYERS, cross_attn_norm=Bool(), qk_norm=Str(null=True),
        eps=EPS, image_dim=Int(1, 65536, null=True), added_kv_proj_dim=Int(1, 65536, null=True),
        rope_max_seq_len=Int(1, 65536), pos_embed_seq_len=Int(1, 1 << 20, null=True)),
    "HunyuanVideoTransformer3DModel": dict(
        in_channels=LATENT, out_channels=LATENT, num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM, num_layers=LAYERS, num_single_layers=MORE_LAYERS,
        num_refiner_layers=Int(1, 64), mlp_ratio=Real(0.01, 64.0), patch_size=PATCH,
        patch_size_t=PATCH, qk_norm=Str(), guidance_embeds=Bool(), text_embed_dim=WIDTH,
        pooled_projection_dim=WIDTH, rope_theta=THETA, rope_axes_dim=Ints(2, 1024, (1, 4)),
        image_condition_type=Str(null=True)),
    "CogVideoXTransformer3DModel": dict(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=LATENT,
        out_channels=Int(1, 1024, null=True), flip_sin_to_cos=Bool(), freq_shift=Int(0, 1024),
        time_embed_dim=WIDTH, ofs_embed_dim=Int(1, 65536, null=True), text_embed_dim=WIDTH,
        num_layers=LAYERS, dropout=EPS, attention_bias=Bool(), sample_width=Int(1, 4096),
        sample_height=Int(1, 4096), sample_frames=Int(1, 4096), patch_size=PATCH,
        patch_size_t=Int(1, 16, null=True), temporal_compression_ratio=Int(1, 64),
        max_text_seq_length=Int(1, 65536), activation_fn=ACT, timestep_activation_fn=ACT,
        norm_elementwise_affine=Bool(), norm_eps=EPS, spatial_interpolation_scale=SCALE,
        temporal_interpolation_scale=SCALE, use_rotary_positional_embeddings=Bool(),
        use_learned_positional_embeddings=Bool(), patch_bias=Bool()),
    "AutoencoderKL": dict(
        in_channels=PIXELS, out_channels=PIXELS, down_block_types=Strs(_KL_BLOCKS[0], (1, 8)),
        up_block_types=Strs(_KL_BLOCKS[1], (1, 8)), block_out_channels=LEVELS,
        layers_per_block=PER_LEVEL, act_fn=ACT, latent_channels=LATENT, norm_num_groups=GROUPS,
        sample_size=Int(1, 65536), scaling_factor=SCALE, shift_factor=SHIFT,
        latents_mean=STATS, latents_std=STATS, force_upcast=Bool(), use_quant_conv=Bool(),
        use_post_quant_conv=Bool(), mid_block_add_attention=Bool()),
    "AutoencoderKLWan": dict(
        base_dim=Int(1, 4096), decoder_base_dim=Int(1, 4096, null=True), z_dim=LATENT,
        dim_mult=Ints(1, 64, (1, 8)), num_res_blocks=PER_LEVEL,
        attn_scales=Reals(0.0, 1e6, (0, 8)), temperal_downsample=Bools((0, 8)), dropout=EPS,
        latents_mean=STATS, latents_std=STATS, is_residual=Bool(), in_channels=PIXELS,
        out_channels=PIXELS, patch_size=Int(1, 16, null=True),
        scale_factor_temporal=Int(1, 64, null=True), scale_factor_spatial=Int(1, 64, null=True)),
    "AutoencoderKLHunyuanVideo": dict(
        in_channels=PIXELS, out_channels=PIXELS, latent_channels=LATENT,
        down_block_types=Strs(_HY_BLOCKS[0], (1, 8)), up_block_types=Strs(_HY_BLOCKS[1], (1, 8)),
        block_out_channels=LEVELS, layers_per_block=PER_LEVEL, act_fn=ACT,
        norm_num_groups=GROUPS, scaling_factor=SCALE, spatial_compression_ratio=Int(1, 64),
        temporal_compression_ratio=Int(1, 64), mid_block_add_attention=Bool()),
    "AutoencoderKLCogVideoX": dict(
        in_channels=PIXELS, out_channels=PIXELS, down_block_types=Strs(_COG_BLOCKS[0], (1, 8)),
        up_block_types=Strs(_COG_BLOCKS[1], (1, 8)), block_out_channels=LEVELS,
        latent_channels=LATENT, layers_per_block=PER_LEVEL, act_fn=ACT, norm_eps=EPS,
        norm_num_groups=GROUPS, temporal_compression_ratio=Real(1.0, 64.0),
        sample_height=Int(1, 65536), sample_width=Int(1, 65536), scaling_factor=SCALE,
        shift_factor=SHIFT, latents_mean=STATS, latents_std=STATS, force_upcast=Bool(),
        use_quant_conv=Bool(), use_post_quant_conv=Bool(), invert_scale_latents=Bool()),
}

# class -> (list field, field): the list's sum must equal the field (the rotary axes split the
# head dimension; diffusers checks it only inside the first forward).
SUMS: Dict[str, Tuple[str, str]] = {
    "FluxTransformer2DModel": ("axes_dims_rope", "attention_head_dim"),
    "HunyuanVideoTransformer3DModel": ("rope_axes_dim", "attention_head_dim"),
}

# Any scheduler's fields that size what it allocates (the step tables), checked where present:
# the schedulers' classes vary between checkpoints, these names do not.
SCHEDULER: Dict[str, Field] = dict(
    num_train_timesteps=Int(1, 100000), trained_betas=Reals(0.0, 1.0, (1, 100000), null=True),
    solver_order=Int(1, 3), steps_offset=Int(0, 100000), base_image_seq_len=Int(1, 1 << 24),
    max_image_seq_len=Int(1, 1 << 24))

# pipeline name -> component -> the class its checkpoint folder must hold (where the index
# lists the component).
COMPONENTS: Dict[str, Dict[str, str]] = {
    "flux": dict(transformer="FluxTransformer2DModel", vae="AutoencoderKL"),
    "sd3": dict(transformer="SD3Transformer2DModel", vae="AutoencoderKL"),
    "wan": dict(transformer="WanTransformer3DModel", transformer_2="WanTransformer3DModel",
                vae="AutoencoderKLWan"),
    "wan2.2": dict(transformer="WanTransformer3DModel", transformer_2="WanTransformer3DModel",
                   vae="AutoencoderKLWan"),
    "hunyuan-video": dict(transformer="HunyuanVideoTransformer3DModel",
                          vae="AutoencoderKLHunyuanVideo"),
    "cogvideox": dict(transformer="CogVideoXTransformer3DModel", vae="AutoencoderKLCogVideoX"),
}

