"""parallelize_vae on AutoencoderKLWan (Wan 2.1 and a Wan 2.2-style residual, patched VAE),
small random weights, on 2 and 4 gloo ranks: decode and encode equal to the single-process ones
(odd heights and widths, 1 and many frames, batch 2), every rank's convolution FLOPs its share
of the single decode, refusals (thin bands, latents differing between ranks, unknown classes)
raised on every rank, and remove() giving the stock module back."""

import pytest
import torch

from gloo_util import run_gloo
from vae_util import conv_flops as _conv_flops  # noqa: E402
from vae_util import refusal as _refusal, rel as _rel, seeded_randn as _latents  # noqa: E402
from vae_util import encode_rel  # noqa: E402

# (name, AutoencoderKLWan config): Wan 2.1's layout and Wan 2.2's (residual blocks, patch 2).
CONFIGS = {
    "wan2.1": dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                   temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                   latents_std=[1.0] * 4),
    "wan2.2": dict(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1],
                   num_res_blocks=1, temperal_downsample=[False, True, True], is_residual=True,
                   patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16,
                   latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
}
# (config, latent shape [B, C, T, H, W]): odd heights, 1 frame and several.
CASES = [("wan2.1", (1, 4, 1, 5, 3)), ("wan2.1", (1, 4, 3, 7, 4)), ("wan2.1", (2, 4, 2, 4, 3)),
         ("wan2.2", (1, 4, 2, 5, 3))]
# (config, video shape [B, 3, T, H, W]) to encode: latent heights 5 and 7, 1 and 5 frames.
ENCODE = [("wan2.1", (1, 3, 1, 40, 24)), ("wan2.1", (1, 3, 5, 56, 16)),
          ("wan2.2", (1, 3, 5, 80, 32))]


def _vae(name):
    from diffusers import AutoencoderKLWan
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**CONFIGS[name]).eval()
    for p in vae.parameters():  # weights at a scale where the output is not all clamped
        p.data.mul_(1.5)
    return vae


def _ranks(rank, world):
    from ditscale.diffusers.parallel_vae import parallelize_vae, unparallelize_vae
    out = {"rel": [], "clamped": [], "flops": None}
    vaes = {name: _vae(name) for name in CONFIGS}
    with torch.no_grad():
        for name, shape in CASES:
            vae, z = vaes[name], _latents(shape)
            ref = vae.decode(z).sample
            before = dict(vae.__dict__)
            handle = parallelize_vae(vae)
            got = vae.decode(z).sample
            out["rel"].append(_rel(got, ref))
            out["clamped"].append((ref.abs() == 1).float().mean().item())
            handle.remove()
            assert vae.__dict__.keys() == before.keys()
            assert all(m.__dict__.get("forward") is None for m in vae.modules())
            assert torch.equal(vae.decode(z).sample, ref)  # the stock module, no collective
        out["encode_rel"] = encode_rel([(vaes[n], _latents(s)) for n, s in ENCODE])
        vae, z = vaes["wan2.1"], _latents((1, 4, 2, 8, 3))
        single = _conv_flops(lambda: vae.decode(z))
        parallelize_vae(vae)
        out["flops"] = (_conv_flops(lambda: vae.decode(z)), single)
        out["thin"] = _refusal(lambda: vae.decode(_latents((1, 4, 1, world - 1, 3))))
        mine = (1, 4, 1 + rank, 5, 3)  # rank r passes r + 1 frames
        out["mismatch"] = _refusal(lambda: vae.decode(_latents(mine)))
        out["enc_rows"] = _refusal(lambda: vae.encode(_latents((1, 3, 1, 36, 16))))
        out["twice"] = _refusal(lambda: parallelize_vae(vae))
        unparallelize_vae(vae)
        out["again"] = _refusal(lambda: unparallelize_vae(vae))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_wan_decode_parallel(world):
    results = run_gloo(_ranks, world, timeout_s=300)
    for rank, res in enumerate(results):
        for (name, shape), rel, clamped in zip(CASES, res["rel"], res["clamped"]):
            assert rel < 1e-5, (rank, name, shape, rel)
            assert clamped < 0.5, (name, shape, clamped)  # the comparison is not all +-1
        assert max(res["encode_rel"]) < 1e-5, (rank, res["encode_rel"])
        band, single = res["flops"]
        rows = [8 // world + (r < 8 % world) for r in range(world)]
        assert band == pytest.approx(single * rows[rank] / 8, rel=0.01), (rank, band, single)
        assert "at least 1 row" in res["thin"] and f"over {world} ranks" in res["thin"]
        assert "different shapes" in res["mismatch"] and "rank 1: (1, 4, 2, 5, 3)" in \
            res["mismatch"]
        assert "(-2) a multiple of 8, got (1, 3, 1, 36, 16)" in res["enc_rows"]
        assert "already parallelized" in res["twice"]
        assert "not parallelized" in res["again"]


def test_refused_classes():
    from ditscale.diffusers.parallel_vae import parallelize_vae
    with pytest.raises(ValueError, match="Linear is not supported"):
        parallelize_vae(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="mesh must be a ditscale.sp.Mesh"):
        parallelize_vae(_vae("wan2.1"), mesh="group")


def test_unknown_layer_refused_by_name():
    from ditscale.diffusers.parallel_vae import parallelize_vae
    vae = _vae("wan2.1")
    vae.decoder.up_blocks[0].resnets[0].norm1 = torch.nn.GroupNorm(1, 8)
    with pytest.raises(ValueError, match=r"decoder.up_blocks.0.resnets.0.norm1 is a GroupNorm"):
        parallelize_vae(vae)
    assert "forward" not in vae.decoder.conv_in.__dict__  # a refused call binds nothing
    vae = _vae("wan2.1")
    vae.decoder.conv_in.stride = (1, 2, 1)
    with pytest.raises(ValueError, match=r"decoder.conv_in \(WanCausalConv3d\).*stride 2"):
        parallelize_vae(vae)
