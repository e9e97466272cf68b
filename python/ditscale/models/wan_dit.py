"""A Wan-2.1-style video Diffusion Transformer (random weights) for training benchmarks.

latents [B, 16, T, H, W] -> patchify (1, 2, 2) -> N = T * (H / 2) * (W / 2) tokens of ``dim``
-> 30 / 40 blocks (self-attention with 3D RoPE, cross-attention to the text, MLP, each with its
AdaLN modulation in fp32) -> head -> unpatchify. ``fused_adaln=True`` computes the AdaLN parts
with ``ditscale.ops.adaln`` / ``adaln_gated`` (each block's residuals fused into the next norm),
``False`` with the eager formula; the two are numerically equivalent.
``sequence_parallel(mesh)`` splits the video tokens over a mesh of ranks (self-attention through
``ditscale.sp.attention``, differentiable; the output gathered on every rank). The architecture,
the fused schedule and the RoPE split: docs/models.md.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "WanConfig",
    "CONFIGS",
    "make_config",
    "WanDiT",
    "patchify",
    "unpatchify",
    "latent_shape",
    "seq_len_of",
    "rope_freqs",
    "apply_rope",
    "timestep_embedding",
]

# VAE compression of Wan 2.1 (time 4, space 8); a video of F = 4k + 1 frames.
VAE_STRIDE = (4, 8, 8)


@dataclasses.dataclass(frozen=True)
class WanConfig:
    """Architecture of the DiT. dim must be divisible by num_heads, head_dim even."""

    name: str
    dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    in_channels: int = 16  # latent channels
    out_channels: int = 16
    patch: Tuple[int, int, int] = (1, 2, 2)  # (t, h, w)
    text_dim: int = 4096  # umT5 embedding width
    text_len: int = 512  # padded text length
    freq_dim: int = 256  # sinusoidal timestep embedding width
    eps: float = 1e-6
    rope_theta: float = 10000.0
    head_init_std: float = 0.0  # 0: zero output head (Wan); > 0: N(0, std) (tests)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_numel(self) -> int:
        return self.patch[0] * self.patch[1] * self.patch[2]


CONFIGS: Dict[str, WanConfig] = {
    "wan2.1-1.3b": WanConfig("wan2.1-1.3b", dim=1536, num_layers=30, num_heads=12, ffn_dim=8960),
    "wan2.1-14b": WanConfig("wan2.1-14b", dim=5120, num_layers=40, num_heads=40, ffn_dim=13824),
    # For CPU tests: same structure, toy widths.
    "tiny": WanConfig(
        "tiny", dim=64, num_layers=2, num_heads=2, ffn_dim=128, text_dim=32, text_len=8
    ),
}


def make_config(name: str, num_layers: Optional[int] = None, **overrides) -> WanConfig:
    """A preset (``CONFIGS``) with ``num_layers`` and any other field overridden."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(CONFIGS)}")
    cfg = CONFIGS[name]
    if num_layers is not None:
        overrides["num_layers"] = int(num_layers)
    cfg = dataclasses.replace(cfg, **overrides)
    if cfg.num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {cfg.num_layers}")
    if cfg.dim % cfg.num_heads or cfg.head_dim % 2:
        raise ValueError(f"dim {cfg.dim} / num_heads {cfg.num_heads} must be an even integer")
    if cfg.head_dim // 2 < 3:
        raise ValueError(f"head_dim {cfg.head_dim} too small for 3D RoPE (needs >= 6)")
    return cfg


# ---------------------------------------------------------------------------------------------
# Shapes.


def latent_shape(frames: int, height: int, width: int) -> Tuple[int, int, int]:
    """Latent (t, h, w) of a pixel clip: t = 1 + (F - 1) / 4, h = H / 8, w = W / 8.

    F must be 4k + 1 and H, W multiples of 16 (latent multiples of the 2x2 patch)."""
    if frames < 1 or (frames - 1) % VAE_STRIDE[0]:
        raise ValueError(f"frames must be 4k + 1, got {frames}")
    if height % 16 or width % 16 or height < 16 or width < 16:
        raise ValueError(f"height and width must be positive multiples of 16, got {height}x{width}")
    return 1 + (frames - 1) // VAE_STRIDE[0], height // VAE_STRIDE[1], width // VAE_STRIDE[2]


def seq_len_of(frames: int, height: int, width: int, patch=(1, 2, 2)) -> int:
    """Tokens S of a pixel clip: (1 + (F-1)/4) * (H/16) * (W/16) for Wan 2.1."""
    t, h, w = latent_shape(frames, height, width)
    return (t // patch[0]) * (h // patch[1]) * (w // patch[2])


def patchify(x: torch.Tensor, patch: Sequence[int]) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, N, pt*ph*pw*C] with tokens in (t, h, w) raster order and each
    token's features ordered (pt, ph, pw, C)."""
    b, c, t, h, w = x.shape
    pt, ph, pw = patch
    if t % pt or h % ph or w % pw:
        raise ValueError(f"latent {tuple(x.shape)} is not divisible by the patch {tuple(patch)}")
    x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(0, 2, 4, 6, 3, 5, 7, 1)  # b, T', H', W', pt, ph, pw, c
    return x.reshape(b, (t // pt) * (h // ph) * (w // pw), pt * ph * pw * c)


def unpatchify(x: torch.Tensor, grid: Sequence[int], patch: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`patchify`: [B, N, pt*ph*pw*C] and grid (T', H', W') -> [B, C, T, H, W]."""
    b, n, f = x.shape
    gt, gh, gw = grid
    pt, ph, pw = patch
    c = f // (pt * ph * pw)
    if n != gt * gh * gw or c * pt * ph * pw != f:
        raise ValueError(f"tokens {tuple(x.shape)} do not match grid {tuple(grid)}, patch {patch}")
    x = x.reshape(b, gt, gh, gw, pt, ph, pw, c)
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # b, c, T', pt, H', ph, W', pw
    return x.reshape(b, c, gt * pt, gh * ph, gw * pw)


# ---------------------------------------------------------------------------------------------
# Embeddings.


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding [B, dim] (cos half, then sin half) of timesteps t [B], fp32 out."""
    half = dim // 2
    freqs = torch.pow(
        10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half
    )
    args = t.to(torch.float64)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1).float()


def _rope_split(head_dim: int) -> Tuple[int, int, int]:
    c = head_dim // 2
    return c - 2 * (c // 3), c // 3, c // 3


def rope_freqs(
    grid: Sequence[int], head_dim: int, theta: float = 10000.0, device=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [N, head_dim / 2] (fp32) for a latent token grid (T', H', W').

    Pair i of the head dim rotates by pos_axis * theta^(-2j / d_axis) where the first
    ``_rope_split(head_dim)[0]`` pairs use the frame index, the next the row, the last the column;
    d_axis = 2 * pairs_of_axis (Wan's per-axis frequency ladders)."""
    parts = []
    for axis, (pairs, size) in enumerate(zip(_rope_split(head_dim), grid)):
        d_axis = 2 * pairs
        inv = theta ** (-torch.arange(0, d_axis, 2, dtype=torch.float64, device=device) / d_axis)
        pos = torch.arange(size, dtype=torch.float64, device=device)
        ang = pos[:, None] * inv[None]  # [size, pairs]
        shape = [1, 1, 1, pairs]
        shape[axis] = size
        parts.append(ang.reshape(shape).expand(*grid, pairs))
    ang = torch.cat(parts, dim=-1).reshape(-1, head_dim // 2)
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates adjacent channel pairs of x [B, N, H, d] by the angles of cos/sin [N, d/2]
    (computed in fp32, result in x's dtype)."""
    b, n, h, d = x.shape
    xf = x.float().reshape(b, n, h, d // 2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    return out.reshape(b, n, h, d).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Blocks.


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float):
    """Eager AdaLN: LN(x) * (1 + scale) + shift in fp32 (modulation [B, 1, D]), rounded to x's
    dtype."""
    return (_layer_norm(x, eps).float() * (1 + scale) + shift).to(x.dtype)


def _gated(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x + gate * y).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: WanConfig, kv_dim: int):
        super().__init__()
        d = cfg.dim
        self.num_heads, self.head_dim, self.eps = cfg.num_heads, cfg.head_dim, cfg.eps
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(kv_dim, d)
        self.v = nn.Linear(kv_dim, d)
        self.o = nn.Linear(d, d)
        self.norm_q = nn.RMSNorm(d, eps=cfg.eps)
        self.norm_k = nn.RMSNorm(d, eps=cfg.eps)

    sp = None  # the model's sequence-parallel context (WanDiT.sequence_parallel), self-attention

    def forward(self, x, context=None, rope=None):
        b, n, _ = x.shape
        kv = x if context is None else context
        q = self.norm_q(self.q(x)).view(b, n, self.num_heads, self.head_dim)
        k = self.norm_k(self.k(kv)).view(b, kv.shape[1], self.num_heads, self.head_dim)
        v = self.v(kv).view(b, kv.shape[1], self.num_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if context is None and self.sp is not None and self.sp.size > 1:  # this rank's tokens
            out = self.sp.attention(q.contiguous(), k.contiguous(), v.contiguous())
            return self.o(out.reshape(b, n, -1).to(x.dtype))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class WanBlock(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        d = cfg.dim
        self.eps = cfg.eps
        self.self_attn = _Attention(cfg, d)
        self.norm3 = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=True)
        self.cross_attn = _Attention(cfg, d)
        self.ffn = nn.Sequential(nn.Linear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(cfg.ffn_dim, d))
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)

    def mod(self, e0: torch.Tensor) -> List[torch.Tensor]:
        """(shift1, scale1, gate1, shift2, scale2, gate2), each [B, 1, D] fp32 (views)."""
        return list((self.modulation.float() + e0).chunk(6, dim=1))

    def forward(self, x, e0, context, rope, fused: bool = False):
        """Eager: x [B, N, D] -> [B, N, D]. Fused: x is the pending (residual, gate, branch)
        triple (see forward_fused). Called through __call__ so that FSDP's hooks run."""
        if fused:
            return self.forward_fused(x, e0, context, rope)
        sh1, sc1, g1, sh2, sc2, g2 = self.mod(e0)
        x = _gated(x, g1, self.self_attn(_modulate(x, sh1, sc1, self.eps), rope=rope))
        x = (x + self.cross_attn(self.norm3(x), context)).to(x.dtype)
        return _gated(x, g2, self.ffn(_modulate(x, sh2, sc2, self.eps)))

    def forward_fused(self, pending, e0, context, rope):
        """Fused block. pending is (x, None, None) for the first block or the previous block's
        (residual, gate, branch) whose sum is this block's input; returns this block's
        (residual, gate2, mlp_out) for the next fused norm."""
        from .. import ops

        sh1, sc1, g1, sh2, sc2, g2 = self.mod(e0)
        res, gate, branch = pending
        if gate is None:
            y = ops.adaln(res, sc1, sh1, eps=self.eps)
        else:
            res, y = ops.adaln_gated(res, gate, branch, sc1, sh1, eps=self.eps)
        attn = self.self_attn(y, rope=rope)
        zero = torch.zeros_like(g1)
        res, y = ops.adaln_gated(res, g1, attn, zero, zero, weight=self.norm3.weight,
                                 bias=self.norm3.bias, eps=self.norm3.eps)
        cross = self.cross_attn(y, context)
        res, y = ops.adaln_gated(res, torch.ones_like(g1), cross, sc2, sh2, eps=self.eps)
        return res, g2, self.ffn(y)


class WanDiT(nn.Module):
    """The DiT. ``forward(latents [B, C, T, H, W], t [B] (0..1000), text [B, L, text_dim])``
    returns the predicted velocity, same shape as latents, in the compute dtype."""

    def __init__(self, cfg: WanConfig, fused_adaln: bool = False):
        super().__init__()
        self.cfg = cfg
        self.fused_adaln = bool(fused_adaln)
        d = cfg.dim
        self.patch_embedding = nn.Linear(cfg.in_channels * cfg.patch_numel, d)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, d),
                                            nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(),
                                            nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(WanBlock(cfg) for _ in range(cfg.num_layers))
        self.head = nn.Linear(d, cfg.out_channels * cfg.patch_numel)
        self.head_modulation = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
        self._rope_cache: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.init_weights()

    def init_weights(self) -> None:
        """Wan's init: Xavier-uniform linears with zero bias, N(0, 0.02) text/time embeddings,
        a zero output head (the model predicts 0 at step 0) unless cfg.head_init_std > 0."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        for seq in (self.text_embedding, self.time_embedding):
            for m in seq.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
        if self.cfg.head_init_std > 0:
            nn.init.normal_(self.head.weight, std=self.cfg.head_init_std)
        else:
            nn.init.zeros_(self.head.weight)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def sequence_parallel(self, mesh=None, strategy: str = "ulysses", **options) -> "WanDiT":
        """Splits the video tokens over ``mesh`` (a ``ditscale.sp.Mesh``; None: the default
        process group's): every rank calls the model with the full inputs, holds its
        ``ditscale.sp.shard_range`` share of the tokens through the blocks (self-attention by
        ``ditscale.sp.attention`` with ``strategy`` and ``options``, cross-attention and MLP
        local) and gets the full output. Differentiable: each rank's gradients are partials
        that sum over the mesh to the single-process ones (docs/diffusers.md, "Training").
        Returns the model."""
        from ..diffusers._sp_context import make_context

        ctx = make_context("WanDiT.sequence_parallel", mesh, strategy, options)
        self.__dict__["sp"] = ctx  # not a submodule, not a parameter
        for block in self.blocks:
            block.self_attn.__dict__["sp"] = ctx
        return self

    def _rope(self, grid, device):
        key = (tuple(grid), str(device))
        if key not in self._rope_cache:
            if len(self._rope_cache) > 64:
                self._rope_cache.clear()
            self._rope_cache[key] = rope_freqs(grid, self.cfg.head_dim, self.cfg.rope_theta,
                                               device=device)
        return self._rope_cache[key]

    def forward(self, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor):
        cfg = self.cfg
        if latents.dim() != 5 or latents.shape[1] != cfg.in_channels:
            raise ValueError(f"latents must be [B, {cfg.in_channels}, T, H, W], got "
                             f"{tuple(latents.shape)}")
        b, _, lt, lh, lw = latents.shape
        grid = (lt // cfg.patch[0], lh // cfg.patch[1], lw // cfg.patch[2])
        dtype = self.patch_embedding.weight.dtype
        x = self.patch_embedding(patchify(latents.to(dtype), cfg.patch))
        context = self.text_embedding(text.to(dtype))
        # Timestep path in fp32 (Wan): autocast off; the sinusoid is given in the dtype of the
        # time MLP's weights (FSDP keeps them fp32, see training.build_model), results in fp32.
        with torch.autocast(device_type=latents.device.type, enabled=False):
            sinusoid = timestep_embedding(t, cfg.freq_dim).to(self.time_embedding[0].weight.dtype)
            e = self.time_embedding(sinusoid).float()
            e0 = self.time_projection(e).float().unflatten(1, (6, cfg.dim))
        rope = self._rope(grid, x.device)
        tokens, sp = x.shape[1], self.__dict__.get("sp")
        if sp is not None and sp.size > 1:  # this rank's tokens and their rotary rows
            x, rope = sp.shard(x, 1), tuple(sp.shard(r, 0) for r in rope)
        hm = (self.head_modulation.float() + e[:, None]).chunk(2, dim=1)  # shift, scale
        if self.fused_adaln:
            from .. import ops

            pending = (x, None, None)
            for block in self.blocks:
                pending = block(pending, e0, context, rope, fused=True)
            _, y = ops.adaln_gated(*pending, hm[1], hm[0], eps=cfg.eps)
        else:
            for block in self.blocks:
                x = block(x, e0, context, rope)
            y = _modulate(x, hm[0], hm[1], cfg.eps)
        out = self.head(y)
        if sp is not None and sp.size > 1:
            out = sp.gather(out, 1, tokens)
        return unpatchify(out, grid, cfg.patch)

