"""A Flux.1-like MMDiT (random weights or a diffusers checkpoint) for sequence-parallel inference.

19 double-stream and 38 single-stream blocks with diffusers' ``FluxTransformer2DModel``
parameter names (``flux_weights.load_diffusers_flux`` loads a checkpoint).
:meth:`FluxMMDiT.forward` takes the LOCAL shard of the image tokens [B, S_local, 64] (and their
ids) and the FULL text [B, T, 4096]; attention goes through a pluggable function
``attn(q, k, v, joint_q=, joint_k=, joint_v=) -> (out, joint_out)`` ([B, S_local | T, H, Dh]):
:func:`sdpa_joint_attention` on one process, ``functools.partial(ditscale.sp.attention, ...)``
sequence-parallel. :func:`shard_tokens` / :func:`gather_tokens` split and reassemble the image
tokens. The architecture, RoPE and numerics: docs/models.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .wan_dit import timestep_embedding

__all__ = [
    "MMDiTConfig",
    "MMDIT_CONFIGS",
    "make_mmdit_config",
    "FluxMMDiT",
    "build_mmdit",
    "init_mmdit_weights",
    "sdpa_joint_attention",
    "image_ids",
    "text_ids",
    "rope_tables",
    "apply_rope_pairs",
    "pack_latents",
    "unpack_latents",
    "shard_range",
    "shard_tokens",
    "gather_tokens",
]

AttnFn = Callable[..., Tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class MMDiTConfig:
    """Architecture. hidden = num_heads * head_dim; sum(axes_dims) == head_dim, each even."""

    name: str
    num_double: int = 19  # double-stream blocks (diffusers: num_layers)
    num_single: int = 38  # single-stream blocks (diffusers: num_single_layers)
    num_heads: int = 24
    head_dim: int = 128
    in_channels: int = 64  # 16 latent channels x 2 x 2 patch
    out_channels: int = 64
    text_dim: int = 4096  # T5-XXL width (diffusers: joint_attention_dim)
    pooled_dim: int = 768  # CLIP pooled width (diffusers: pooled_projection_dim)
    text_len: int = 512
    mlp_ratio: float = 4.0
    axes_dims: Tuple[int, int, int] = (16, 56, 56)
    rope_theta: float = 10000.0
    guidance_embeds: bool = True  # Flux.1-dev: True; Flux.1-schnell: False
    freq_dim: int = 256  # sinusoidal timestep embedding width
    eps: float = 1e-6

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    @property
    def latent_channels(self) -> int:
        return self.in_channels // 4


MMDIT_CONFIGS: Dict[str, MMDiTConfig] = {
    "flux.1-dev": MMDiTConfig("flux.1-dev"),
    "flux.1-schnell": MMDiTConfig("flux.1-schnell", guidance_embeds=False),
    # CPU tests and smoke runs: the same structure at toy widths (hidden 256).
    "tiny": MMDiTConfig("tiny", num_double=2, num_single=4, num_heads=4, head_dim=64,
                        text_dim=64, pooled_dim=32, text_len=16, axes_dims=(16, 24, 24)),
}


def make_mmdit_config(name: str = "flux.1-dev", **overrides) -> MMDiTConfig:
    """A preset of ``MMDIT_CONFIGS`` with any field overridden (e.g. ``num_double=2``)."""
    if name not in MMDIT_CONFIGS:
        raise ValueError(f"unknown MMDiT config {name!r}; known: {sorted(MMDIT_CONFIGS)}")
    cfg = dataclasses.replace(MMDIT_CONFIGS[name], **overrides)
    if cfg.num_double < 0 or cfg.num_single < 0 or cfg.num_double + cfg.num_single < 1:
        raise ValueError(f"num_double ({cfg.num_double}) and num_single ({cfg.num_single}) must "
                         "be >= 0 with at least one block")
    axes = tuple(int(a) for a in cfg.axes_dims)
    if len(axes) != 3 or sum(axes) != cfg.head_dim or any(a <= 0 or a % 2 for a in axes):
        raise ValueError(f"axes_dims {axes} must be 3 positive even sizes summing to head_dim "
                         f"{cfg.head_dim}")
    if cfg.in_channels % 4:
        raise ValueError(f"in_channels {cfg.in_channels} must be latent channels x 4 (2x2 patch)")
    return dataclasses.replace(cfg, axes_dims=axes)


# ---------------------------------------------------------------------------------------------
# Token ids, RoPE, latent packing, sharding.


def image_ids(grid_h: int, grid_w: int, device=None) -> torch.Tensor:
    """Ids [grid_h * grid_w, 3] (float32) of the packed image tokens, row-major: (0, row, col)."""
    rows = torch.arange(grid_h, device=device, dtype=torch.float32)
    cols = torch.arange(grid_w, device=device, dtype=torch.float32)
    ids = torch.zeros(grid_h, grid_w, 3, device=device, dtype=torch.float32)
    ids[..., 1] = rows[:, None]
    ids[..., 2] = cols[None, :]
    return ids.reshape(grid_h * grid_w, 3)


def text_ids(text_len: int, device=None) -> torch.Tensor:
    """Ids [text_len, 3] of the text tokens: all zero (Flux)."""
    return torch.zeros(text_len, 3, device=device, dtype=torch.float32)


def rope_tables(ids: torch.Tensor, axes_dims: Sequence[int], theta: float = 10000.0
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim / 2] (fp32) for token ids [N, 3]: pair j of axis a rotates by
    ids[:, a] * theta^(-2j / axes_dims[a]); angles in fp64 (large positions stay exact)."""
    if ids.dim() != 2 or ids.shape[1] != len(axes_dims):
        raise ValueError(f"ids must be [N, {len(axes_dims)}], got {tuple(ids.shape)}")
    parts = []
    for a, d in enumerate(axes_dims):
        inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=ids.device) / d)
        parts.append(ids[:, a].to(torch.float64)[:, None] * inv[None])
    ang = torch.cat(parts, dim=1)
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates adjacent channel pairs of x [B, N, H, Dh] by cos/sin [N, Dh/2] (fp32 math,
    result in x's dtype): (x0, x1) -> (x0 c - x1 s, x1 c + x0 s)."""
    b, n, h, d = x.shape
    xf = x.float().reshape(b, n, h, d // 2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).reshape(b, n, h, d).to(x.dtype)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C], tokens row-major, features (C, ph, pw) (diffusers'
    Flux packing, which the x_embedder of a real checkpoint expects)."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latents {tuple(latents.shape)}: H and W must be even (2x2 patches)")
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents`: [B, gh*gw, 4C] -> [B, C, 2gh, 2gw]."""
    b, n, f = tokens.shape
    if n != grid_h * grid_w or f % 4:
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match grid {grid_h}x{grid_w}")
    x = tokens.reshape(b, grid_h, grid_w, f // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, f // 4, grid_h * 2, grid_w * 2)


def shard_range(total: int, world: int, rank: int) -> Tuple[int, int]:
    """(begin, count) of rank's tokens: even split, the first total % world ranks one more
    (the same rule as ``ditscale.sp.shard_range``)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard_range: rank {rank} out of range for world {world}")
    base, extra = divmod(int(total), world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def shard_tokens(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank's contiguous shard of x along dim (dim 1 for [B, S, F], dim 0 for ids [S, 3])."""
    begin, count = shard_range(x.shape[dim], world, rank)
    return x.narrow(dim, begin, count).contiguous()


def gather_tokens(x_local: torch.Tensor, total: int, group=None, dim: int = 1) -> torch.Tensor:
    """All-gathers the image shards (uneven allowed) into the full sequence on every rank.

    The shards are padded to the largest one, since all_gather needs equal sizes (NCCL, gloo)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _, count = shard_range(total, world, rank)
    if x_local.shape[dim] != count:
        raise ValueError(f"gather_tokens: rank {rank} holds {x_local.shape[dim]} tokens, expected "
                         f"{count} of {total} over {world} ranks")
    largest = shard_range(total, world, 0)[1]
    if count < largest:
        pad_shape = list(x_local.shape)
        pad_shape[dim] = largest - count
        x_local = torch.cat([x_local, x_local.new_zeros(pad_shape)], dim=dim)
    parts = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, shard_range(total, world, r)[1])
                      for r, p in enumerate(parts)], dim=dim)


# ---------------------------------------------------------------------------------------------
# Attention.


def sdpa_joint_attention(q, k, v, joint_q=None, joint_k=None, joint_v=None):
    """Single-process joint attention: SDPA over [text; image]; returns (out, joint_out).

    q, k, v [B, S, H, Dh]; joint_* [B, T, H, Dh] or None (then joint_out is None)."""
    t = 0 if joint_q is None else joint_q.shape[1]
    if t:
        q, k, v = (torch.cat([j, x], dim=1) for j, x in
                   ((joint_q, q), (joint_k, k), (joint_v, v)))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out = out.transpose(1, 2)
    return (out[:, t:], out[:, :t]) if t else (out, None)


# ---------------------------------------------------------------------------------------------
# AdaLN (fused when possible).


def _use_fused(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    from .. import ops

    return ops.is_available()


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float):
    """LN(x) * (1 + scale) + shift, modulation [B, D]; fp32 math, one rounding to x's dtype."""
    if _use_fused(x):
        from .. import ops

        return ops.adaln(x, scale, shift, eps=eps)
    z = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return (z * (1 + scale.float()[:, None]) + shift.float()[:, None]).to(x.dtype)


def _gated_modulate(res, gate, branch, shift, scale, eps):
    """h = res + gate * branch; returns (h, LN(h) * (1 + scale) + shift)."""
    if _use_fused(res):
        from .. import ops

        return ops.adaln_gated(res, gate, branch, scale, shift, eps=eps)
    h = (res.float() + gate.float()[:, None] * branch.float()).to(res.dtype)
    return h, _modulate(h, shift, scale, eps)


def _gated(res, gate, branch):
    return (res.float() + gate.float()[:, None] * branch.float()).to(res.dtype)


# ---------------------------------------------------------------------------------------------
# Modules (named like diffusers' FluxTransformer2DModel).


class _RMSNorm(nn.Module):
    """RMSNorm over the head dim with a learned weight (fp32 statistics)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (y * self.weight.float()).to(x.dtype)


class _Modulation(nn.Module):
    """diffusers' AdaLayerNormZero / ...Single / ...Continuous parameters: Linear(SiLU(temb))."""

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.linear = nn.Linear(dim, chunks * dim)
        self.chunks = chunks

    def forward(self, temb):
        return self.linear(F.silu(temb)).chunk(self.chunks, dim=1)


class _Embedder(nn.Module):
    """Linear, SiLU, Linear (diffusers' TimestepEmbedding / PixArtAlphaTextProjection)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class _TimeTextEmbed(nn.Module):
    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        self.freq_dim = cfg.freq_dim
        self.timestep_embedder = _Embedder(cfg.freq_dim, cfg.hidden)
        if cfg.guidance_embeds:
            self.guidance_embedder = _Embedder(cfg.freq_dim, cfg.hidden)
        self.text_embedder = _Embedder(cfg.pooled_dim, cfg.hidden)

    def forward(self, timestep, guidance, pooled):
        dtype = self.timestep_embedder.linear_1.weight.dtype
        emb = self.timestep_embedder(timestep_embedding(timestep, self.freq_dim).to(dtype))
        if hasattr(self, "guidance_embedder"):
            if guidance is None:
                raise ValueError("this MMDiT has a guidance embedding (guidance_embeds=True): "
                                 "pass guidance [B] (e.g. 3.5)")
            emb = emb + self.guidance_embedder(
                timestep_embedding(guidance, self.freq_dim).to(dtype))
        return emb + self.text_embedder(pooled.to(dtype))


class _GeluProj(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x):
        return F.gelu(self.proj(x), approximate="tanh")


class _FeedForward(nn.Module):
    """net.0.proj (Linear + GELU tanh), net.1 (dropout in diffusers, no parameters), net.2."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.net = nn.ModuleList([_GeluProj(dim, inner), nn.Identity(), nn.Linear(inner, dim)])

    def forward(self, x):
        for layer in self.net:
            x = layer(x)
        return x


class _Attention(nn.Module):
    """Projections of diffusers' Flux Attention; ``joint`` adds the text-stream projections."""

    def __init__(self, cfg: MMDiTConfig, joint: bool):
        super().__init__()
        d = cfg.hidden
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm_q, self.norm_k = _RMSNorm(cfg.head_dim, cfg.eps), _RMSNorm(cfg.head_dim, cfg.eps)
        if joint:
            self.add_q_proj, self.add_k_proj = nn.Linear(d, d), nn.Linear(d, d)
            self.add_v_proj = nn.Linear(d, d)
            self.norm_added_q = _RMSNorm(cfg.head_dim, cfg.eps)
            self.norm_added_k = _RMSNorm(cfg.head_dim, cfg.eps)
            self.to_out = nn.ModuleList([nn.Linear(d, d)])
            self.to_add_out = nn.Linear(d, d)

    def qkv(self, x, rope, added: bool = False):
        """q, k, v [B, N, H, Dh] of x [B, N, D]: per-head RMSNorm on q, k, then RoPE."""
        if added:
            pq, pk, pv = self.add_q_proj, self.add_k_proj, self.add_v_proj
            nq, nk = self.norm_added_q, self.norm_added_k
        else:
            pq, pk, pv, nq, nk = self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k
        shape = (x.shape[0], x.shape[1], self.heads, self.head_dim)
        q, k, v = nq(pq(x).view(shape)), nk(pk(x).view(shape)), pv(x).view(shape)
        return apply_rope_pairs(q, *rope), apply_rope_pairs(k, *rope), v


def _call_attn(attn: AttnFn, img, txt):
    out, joint_out = attn(img[0], img[1], img[2], joint_q=txt[0], joint_k=txt[1],
                          joint_v=txt[2])
    if out.shape != img[0].shape or joint_out is None or joint_out.shape != txt[0].shape:
        raise ValueError(f"attention function returned out {tuple(out.shape)} and joint_out "
                         f"{None if joint_out is None else tuple(joint_out.shape)}; expected "
                         f"{tuple(img[0].shape)} and {tuple(txt[0].shape)}")
    return out.flatten(2), joint_out.flatten(2)


class FluxDoubleBlock(nn.Module):
    """diffusers FluxTransformerBlock: image and text streams with their own weights."""

    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        d, self.eps = cfg.hidden, cfg.eps
        self.norm1 = _Modulation(d, 6)
        self.norm1_context = _Modulation(d, 6)
        self.attn = _Attention(cfg, joint=True)
        self.ff = _FeedForward(d, cfg.mlp_hidden)
        self.ff_context = _FeedForward(d, cfg.mlp_hidden)

    def forward(self, x, c, temb, rope_img, rope_txt, attn: AttnFn):
        sh1, sc1, g1, sh2, sc2, g2 = self.norm1(temb)
        csh1, csc1, cg1, csh2, csc2, cg2 = self.norm1_context(temb)
        a = _modulate(x, sh1, sc1, self.eps)
        ca = _modulate(c, csh1, csc1, self.eps)
        o_img, o_txt = _call_attn(attn, self.attn.qkv(a, rope_img),
                                  self.attn.qkv(ca, rope_txt, added=True))
        x, m = _gated_modulate(x, g1, self.attn.to_out[0](o_img), sh2, sc2, self.eps)
        x = _gated(x, g2, self.ff(m))
        c, cm = _gated_modulate(c, cg1, self.attn.to_add_out(o_txt), csh2, csc2, self.eps)
        c = _gated(c, cg2, self.ff_context(cm))
        return x, c


class FluxSingleBlock(nn.Module):
    """diffusers FluxSingleTransformerBlock over [text; image], attention and MLP in parallel."""

    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        d, self.eps = cfg.hidden, cfg.eps
        self.norm = _Modulation(d, 3)
        self.proj_mlp = nn.Linear(d, cfg.mlp_hidden)
        self.proj_out = nn.Linear(d + cfg.mlp_hidden, d)
        self.attn = _Attention(cfg, joint=False)

    def forward(self, x, c, temb, rope_img, rope_txt, attn: AttnFn):
        t = c.shape[1]
        h = torch.cat([c, x], dim=1)  # token-wise ops run once over both streams
        shift, scale, gate = self.norm(temb)
        a = _modulate(h, shift, scale, self.eps)
        mlp = F.gelu(self.proj_mlp(a), approximate="tanh")
        o_img, o_txt = _call_attn(attn, self.attn.qkv(a[:, t:], rope_img),
                                  self.attn.qkv(a[:, :t], rope_txt))
        h = _gated(h, gate, self.proj_out(torch.cat([torch.cat([o_txt, o_img], dim=1), mlp], 2)))
        return h[:, t:], h[:, :t]


class FluxMMDiT(nn.Module):
    """The MMDiT. See the module docstring; :meth:`forward` runs on a shard of the image tokens."""

    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden
        self.x_embedder = nn.Linear(cfg.in_channels, d)
        self.context_embedder = nn.Linear(cfg.text_dim, d)
        self.time_text_embed = _TimeTextEmbed(cfg)
        self.transformer_blocks = nn.ModuleList(FluxDoubleBlock(cfg)
                                                for _ in range(cfg.num_double))
        self.single_transformer_blocks = nn.ModuleList(FluxSingleBlock(cfg)
                                                       for _ in range(cfg.num_single))
        self.norm_out = _Modulation(d, 2)
        self.proj_out = nn.Linear(d, cfg.out_channels)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, img: torch.Tensor, img_ids: torch.Tensor, text: torch.Tensor,
                pooled: torch.Tensor, timestep: torch.Tensor,
                guidance: Optional[torch.Tensor] = None, txt_ids: Optional[torch.Tensor] = None,
                attn: Optional[AttnFn] = None) -> torch.Tensor:
        """Velocity of the local image tokens.

        Args:
          img: [B, S_local, in_channels] packed latent tokens of this rank (all of them when
            single-process); img_ids: their ids [S_local, 3] (a shard of :func:`image_ids`).
          text: [B, T, text_dim] T5 states (full, same on every rank); pooled: [B, pooled_dim].
          timestep: [B] in [0, 1] (scaled by 1000 inside, as diffusers); guidance: [B] (e.g. 3.5,
            also scaled by 1000) when cfg.guidance_embeds.
          txt_ids: [T, 3], zeros by default.
          attn: the attention function (module docstring); None: :func:`sdpa_joint_attention`.
        Returns:
          [B, S_local, out_channels] in the model's dtype.
        """
        cfg = self.cfg
        if img.dim() != 3 or img.shape[2] != cfg.in_channels:
            raise ValueError(f"img must be [B, S, {cfg.in_channels}], got {tuple(img.shape)}")
        if text.dim() != 3 or text.shape[2] != cfg.text_dim or text.shape[0] != img.shape[0]:
            raise ValueError(f"text must be [{img.shape[0]}, T, {cfg.text_dim}], got "
                             f"{tuple(text.shape)}")
        if img_ids.shape != (img.shape[1], 3):
            raise ValueError(f"img_ids must be [{img.shape[1]}, 3], got {tuple(img_ids.shape)}")
        attn = attn or sdpa_joint_attention
        dtype = self.x_embedder.weight.dtype
        if txt_ids is None:
            txt_ids = text_ids(text.shape[1], device=img.device)
        rope_img = rope_tables(img_ids, cfg.axes_dims, cfg.rope_theta)
        rope_txt = rope_tables(txt_ids, cfg.axes_dims, cfg.rope_theta)
        # diffusers rounds t and g to the model dtype before scaling; keep that for parity.
        t = timestep.to(dtype).float() * 1000
        g = None if guidance is None else guidance.to(dtype).float() * 1000
        temb = self.time_text_embed(t, g, pooled)
        x = self.x_embedder(img.to(dtype))
        c = self.context_embedder(text.to(dtype))
        for block in self.transformer_blocks:
            x, c = block(x, c, temb, rope_img, rope_txt, attn)
        for block in self.single_transformer_blocks:
            x, c = block(x, c, temb, rope_img, rope_txt, attn)
        scale, shift = self.norm_out(temb)  # scale first (diffusers' AdaLayerNormContinuous)
        return self.proj_out(_modulate(x, shift, scale, cfg.eps))


# ---------------------------------------------------------------------------------------------
# Construction and deterministic random weights.

# Std of the random weights, times 1/sqrt(fan_in). The modulation projections are kept small so
# that the 57-block residual stream stays in range, yet non-zero (AdaLN-Zero's zero gates would
# make every block the identity, hiding attention errors in the SP checks).
_MOD_GAIN = 0.25
_BIAS_STD = 0.02


@torch.no_grad()
def init_mmdit_weights(model: FluxMMDiT, seed: int = 0) -> FluxMMDiT:
    """Deterministic random weights in place: the same seed gives the same weights on every rank
    of the same device type (one generator on the parameters' device, fixed parameter order), in
    any dtype (the fp32 draw rounded)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    modulation = {id(m.linear.weight) for m in model.modules() if isinstance(m, _Modulation)}
    for name, p in model.named_parameters():
        # Drawn in fp32 and rounded, so that a bf16 model holds the fp32 model's weights.
        w = torch.empty(p.shape, dtype=torch.float32, device=device)
        if name.endswith("bias"):
            w.normal_(0.0, _BIAS_STD, generator=gen)
        elif p.dim() == 1:  # RMSNorm weights
            w.normal_(1.0, 0.1, generator=gen)
        else:
            gain = _MOD_GAIN if id(p) in modulation else 1.0
            w.normal_(0.0, gain / math.sqrt(p.shape[1]), generator=gen)
        p.copy_(w)
    return model


def build_mmdit(cfg: MMDiTConfig, device="cpu", dtype=torch.float32, seed: Optional[int] = 0
                ) -> FluxMMDiT:
    """The model built on the meta device, materialised on ``device`` (no CPU copy of the
    weights) in ``dtype`` and initialised from ``seed`` (None: left uninitialised, e.g. to load a
    checkpoint next)."""
    with torch.device("meta"):
        model = FluxMMDiT(cfg)
    model = model.to(dtype=dtype).to_empty(device=torch.device(device))
    if seed is not None:
        init_mmdit_weights(model, seed)
    return model.eval().requires_grad_(False)
