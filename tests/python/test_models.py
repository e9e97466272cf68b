"""The Wan-2.1-style DiT of ditscale.models (CPU, tiny configs)."""

import math
import random

import pytest

torch = pytest.importorskip("torch")

import ditscale  # noqa: E402
from ditscale.models import (  # noqa: E402
    WanDiT,
    apply_rope,
    latent_shape,
    make_config,
    patchify,
    rope_freqs,
    seq_len_of,
    timestep_embedding,
    unpatchify,
)
from ditscale.models.training import SyntheticData  # noqa: E402
from ditscale.models.wan_dit import _rope_split  # noqa: E402


def tiny(**kw):
    return make_config("tiny", **kw)


def test_configs_match_the_issue():
    small, big = make_config("wan2.1-1.3b"), make_config("wan2.1-14b")
    assert (small.dim, small.num_layers, small.num_heads, small.ffn_dim) == (1536, 30, 12, 8960)
    assert (big.dim, big.num_layers, big.num_heads, big.ffn_dim) == (5120, 40, 40, 13824)
    assert small.text_dim == 4096 and small.text_len == 512 and small.in_channels == 16
    assert make_config("wan2.1-1.3b", num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match="unknown model"):
        make_config("wan9")
    with pytest.raises(ValueError, match="num_layers"):
        make_config("tiny", num_layers=0)
    with pytest.raises(ValueError):
        make_config("tiny", num_heads=3)  # 64 / 3 is not an integer


@pytest.mark.parametrize("trial", range(4))
def test_patchify_round_trip(trial):
    rng = random.Random(trial)
    pt, ph, pw = rng.choice([(1, 2, 2), (1, 1, 1), (2, 2, 2), (1, 2, 4)])
    gt, gh, gw = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 5)
    b, c = rng.randint(1, 3), rng.randint(1, 5)
    x = torch.randn(b, c, gt * pt, gh * ph, gw * pw)
    p = patchify(x, (pt, ph, pw))
    assert p.shape == (b, gt * gh * gw, pt * ph * pw * c)
    assert torch.equal(unpatchify(p, (gt, gh, gw), (pt, ph, pw)), x)
    # Token (0, 0, 0) holds the first patch, features ordered (pt, ph, pw, c).
    first = x[0, :, :pt, :ph, :pw].permute(1, 2, 3, 0).reshape(-1)
    assert torch.equal(p[0, 0], first)


def test_patchify_rejects_bad_shapes():
    with pytest.raises(ValueError, match="not divisible"):
        patchify(torch.randn(1, 16, 1, 3, 4), (1, 2, 2))
    with pytest.raises(ValueError, match="do not match"):
        unpatchify(torch.randn(1, 5, 64), (1, 2, 2), (1, 2, 2))


@pytest.mark.parametrize("fhw", [(1, 256, 256), (17, 480, 832), (81, 720, 1280), (33, 64, 128)])
def test_latent_shape_and_tokens_match_the_planner(fhw):
    f, h, w = fhw
    t, lh, lw = latent_shape(f, h, w)
    assert (t, lh, lw) == (1 + (f - 1) // 4, h // 8, w // 8)
    assert seq_len_of(f, h, w) == t * (h // 16) * (w // 16)
    if (h, w) in ((256, 256), (480, 832), (720, 1280)):  # Wan buckets: shape kept as is
        assert seq_len_of(f, h, w) == ditscale.seq_len(f, h, w, 16.0, "wan2.1-1.3b")
    for bad in [(2, 64, 64), (1, 65, 64), (1, 64, 8), (0, 64, 64)]:
        with pytest.raises(ValueError):
            latent_shape(*bad)


def test_rope_split_and_tables():
    assert _rope_split(128) == (22, 21, 21)  # Wan 2.1 1.3B / 14B head dim
    assert sum(_rope_split(32)) == 16
    grid = (3, 4, 5)
    cos, sin = rope_freqs(grid, 32)
    assert cos.shape == sin.shape == (60, 16) and cos.dtype == torch.float32
    assert torch.allclose(cos**2 + sin**2, torch.ones_like(cos), atol=1e-6)
    # Token 0 is at position (0, 0, 0): no rotation.
    assert torch.equal(cos[0], torch.ones(16)) and torch.equal(sin[0], torch.zeros(16))
    # The frame pairs depend only on the frame index of the token (t, h, w raster order).
    nf = _rope_split(32)[0]
    ang = torch.atan2(sin, cos).view(3, 4, 5, 16)
    assert torch.allclose(ang[:, :, :, :nf], ang[:, :1, :1, :nf].expand(3, 4, 5, nf))
    assert torch.allclose(ang[1, 0, 0, 0], torch.tensor(1.0))  # theta^0 * position 1


def test_rope_is_relative():
    """<R(i) q, R(j) k> depends only on i - j along each axis."""
    torch.manual_seed(0)
    d = 24
    cos, sin = rope_freqs((6, 1, 1), d)
    q, k = torch.randn(1, 1, 1, d).double(), torch.randn(1, 1, 1, d).double()
    rq = apply_rope(q.expand(1, 6, 1, d), cos.double(), sin.double())
    rk = apply_rope(k.expand(1, 6, 1, d), cos.double(), sin.double())
    dots = (rq[0, :, 0] @ rk[0, :, 0].T)
    assert torch.allclose(dots[0, 2], dots[3, 5], atol=1e-5)
    assert torch.allclose(dots[4, 1], dots[5, 2], atol=1e-5)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1).expand(1, 6, 1), atol=1e-6)


def test_timestep_embedding():
    e = timestep_embedding(torch.tensor([0.0, 500.0]), 256)
    assert e.shape == (2, 256) and e.dtype == torch.float32
    assert torch.equal(e[0, :128], torch.ones(128)) and torch.equal(e[0, 128:], torch.zeros(128))
    assert math.isclose(e[1, 0].item(), math.cos(500.0), abs_tol=1e-6)


def _inputs(cfg, b=2, t=2, h=4, w=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, cfg.in_channels, t, h, w, generator=g),
            torch.rand(b, generator=g) * 1000,
            torch.randn(b, cfg.text_len, cfg.text_dim, generator=g))


def test_forward_shape_zero_head_and_determinism():
    cfg = tiny()
    torch.manual_seed(1)
    m = WanDiT(cfg)
    x, t, text = _inputs(cfg, b=2, t=3, h=4, w=6)
    y = m(x, t, text)
    assert y.shape == x.shape
    assert torch.count_nonzero(y) == 0  # AdaLN-Zero style: zero head at init
    torch.nn.init.normal_(m.head.weight, std=0.05)
    y1 = m(x, t, text)
    assert torch.isfinite(y1).all() and y1.abs().max() > 0
    torch.manual_seed(1)
    m2 = WanDiT(cfg)
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2(x, t, text), y1)
    # The text changes the output (cross-attention), the timestep too.
    assert not torch.allclose(m(x, t, text + 1), y1)
    assert not torch.allclose(m(x, t + 100, text), y1)
    with pytest.raises(ValueError, match="latents must be"):
        m(x[:, :8], t, text)


def test_params_of_the_full_1_3b_config():
    """Parameter count of the full 1.3B shape, from the layer formula (no allocation)."""
    cfg = make_config("wan2.1-1.3b")
    d, f, L = cfg.dim, cfg.ffn_dim, cfg.num_layers
    attn = 4 * (d * d + d) + 2 * d
    block = 2 * attn + 2 * d + (d * f + f + f * d + d) + 6 * d
    total = (64 * d + d) + (4096 * d + d + d * d + d) + (256 * d + d + d * d + d) + \
        (d * 6 * d + 6 * d) + L * block + (d * 64 + 64) + 2 * d
    small = make_config("wan2.1-1.3b", num_layers=1)
    m = WanDiT(small)
    assert m.num_params() == total - (L - 1) * block
    assert 1.2e9 < total < 1.5e9


def _fused_available():
    try:
        from ditscale import ops
    except Exception:  # noqa: BLE001
        return False
    return ops.is_available()


@pytest.mark.skipif(not _fused_available(), reason="ditscale.ops (the _C extension) not built")
def test_fused_and_eager_adaln_paths_agree():
    cfg = tiny(num_layers=3)
    torch.manual_seed(3)
    eager = WanDiT(cfg, fused_adaln=False)
    torch.nn.init.normal_(eager.head.weight, std=0.05)
    with torch.no_grad():
        for blk in eager.blocks:  # a non-trivial norm3 affine
            blk.norm3.weight.uniform_(0.5, 1.5)
            blk.norm3.bias.normal_(0, 0.1)
    fused = WanDiT(cfg, fused_adaln=True)
    fused.load_state_dict(eager.state_dict())
    x, t, text = _inputs(cfg, b=2, t=2, h=4, w=4, seed=5)
    y0, y1 = eager(x, t, text), fused(x, t, text)
    assert torch.allclose(y0, y1, rtol=1e-4, atol=1e-5), (y0 - y1).abs().max()
    g0 = torch.autograd.grad((y0 * y0).sum(), list(eager.parameters()))
    g1 = torch.autograd.grad((y1 * y1).sum(), list(fused.parameters()))
    for (name, _), a, b in zip(eager.named_parameters(), g0, g1):
        assert torch.allclose(a, b, rtol=2e-3, atol=1e-5), f"{name}: {(a - b).abs().max()}"


def test_synthetic_data_is_a_function_of_seed_epoch_and_id():
    cfg = tiny()
    d = SyntheticData(cfg, torch.device("cpu"), torch.float32, seed=7)
    a = d.micro_batch([3, 9], (2, 4, 4), epoch=1)
    b = d.micro_batch([9], (2, 4, 4), epoch=1)
    assert torch.equal(a.x_t[1], b.x_t[0]) and torch.equal(a.target[1], b.target[0])
    assert torch.equal(a.text[1], b.text[0]) and torch.equal(a.t[1], b.t[0])
    assert not torch.equal(a.x_t[0], a.x_t[1])
    c = d.micro_batch([9], (2, 4, 4), epoch=2)
    assert not torch.equal(c.x_t[0], b.x_t[0])
    assert a.tokens == 2 * 2 * 2 * 2 and a.x_t.shape == (2, 16, 2, 4, 4)
    assert ((a.t > 0) & (a.t < 1000)).all()
    other = SyntheticData(cfg, torch.device("cpu"), torch.float32, seed=8)
    e = other.micro_batch([9], (2, 4, 4), 1)
    assert not torch.equal(e.x_t[0], b.x_t[0])


def test_patch_embedding_is_a_conv3d():
    """Linear over patchify == Conv3d(kernel = stride = patch) with the weight permuted."""
    torch.manual_seed(4)
    c, d, patch = 16, 24, (1, 2, 2)
    lin = torch.nn.Linear(c * 4, d).double()
    x = torch.randn(2, c, 3, 6, 8).double()
    y = lin(patchify(x, patch))  # [B, N, d]
    w = lin.weight.view(d, *patch, c).permute(0, 4, 1, 2, 3)  # [d, C, pt, ph, pw]
    conv = torch.nn.functional.conv3d(x, w, lin.bias, stride=patch)  # [B, d, 3, 3, 4]
    assert torch.allclose(y, conv.flatten(2).transpose(1, 2), atol=1e-12)
