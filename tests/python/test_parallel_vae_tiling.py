"""parallelize_vae with diffusers' tiling on (small tiles, so the tiny random-weight VAEs have
several), on 2 gloo ranks: decode and encode equal to the stock TILED decode / encode on every
rank (AutoencoderKL and AutoencoderKLWan; AutoencoderKLHunyuanVideo and AutoencoderKLCogVideoX),
each rank running only its share of the stock tiles for real (the decoder's conv_in counted on
real inputs), an input below the tile size decoded on bands, ranks whose tiling differs refused
on every rank, remove() giving the stock module back; parallelize_pipeline parallelizing a
tiling VAE (tiny Flux) the same way."""

import pytest
import torch

from gloo_util import run_gloo
from vae_util import seeded_randn as _randn, rel as _rel, refusal as _refusal  # noqa: E402


def _kl():
    from diffusers import AutoencoderKL
    vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16),
                        norm_num_groups=4, layers_per_block=1, latent_channels=4)
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 16, 4  # 3 x 3 tiles below
    return vae


def _wan():
    from diffusers import AutoencoderKLWan
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                           latents_std=[1.0] * 4)
    vae.enable_tiling(32, 32, 24, 24)  # 3 x 2 tiles below
    return vae


def _video(name, prefix):
    import diffusers
    vae = getattr(diffusers, name)(down_block_types=(f"{prefix}DownBlock3D",) * 4,
                                   up_block_types=(f"{prefix}UpBlock3D",) * 4, latent_channels=4,
                                   block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                   norm_num_groups=4)
    if prefix == "HunyuanVideo":
        vae.enable_tiling(32, 32, None, 24, 24)
    else:
        vae.enable_tiling(32, 32, 1 / 4, 1 / 4)
    return vae


# name -> (make, latents [B, C, (F,) H, W] to decode, tiles of it, input to encode, a latent
# below the tile size)
CASES = {
    "kl": (_kl, (2, 4, 7, 9), 9, (1, 3, 36, 28), (1, 4, 4, 3)),
    "wan": (_wan, (1, 4, 2, 7, 5), 6, (1, 3, 5, 56, 40), (1, 4, 2, 4, 3)),
    # HunyuanVideo: 2 frame-wise temporal tiles, each tiled spatially; its encode the same
    "hunyuan": (lambda: _video("AutoencoderKLHunyuanVideo", "HunyuanVideo"), (1, 4, 6, 7, 5), 12,
                (1, 3, 21, 56, 40), (1, 4, 2, 4, 3)),
    "cogvideox": (lambda: _video("AutoencoderKLCogVideoX", "CogVideoX"), (1, 4, 3, 7, 5), 6,
                  (1, 3, 5, 56, 40), (1, 4, 2, 4, 3)),
}


def _case(name, rank):
    from ditscale.diffusers.parallel_vae import parallelize_vae, unparallelize_vae
    make, zshape, _, xshape, small = CASES[name]
    torch.manual_seed(0)
    vae = make().eval()
    z, x, zs = _randn(zshape), _randn(xshape), _randn(small)
    real = [0]  # the decoder's conv_in on real (not meta) inputs: tiles run for real here
    vae.decoder.conv_in.register_forward_pre_hook(
        lambda m, a: real.__setitem__(0, real[0] + (not a[0].is_meta)))
    ref = [vae.decode(z).sample]
    stock_calls, real[0] = real[0], 0
    ref += [vae.encode(x).latent_dist.parameters, vae.decode(zs).sample]
    parallelize_vae(vae)
    real[0] = 0
    dec = vae.decode(z).sample
    out = {"calls": (real[0], stock_calls), "rel": [_rel(dec, ref[0])]}
    out["rel"].append(_rel(vae.encode(x).latent_dist.parameters, ref[1]))
    out["rel"].append(_rel(vae.decode(zs).sample, ref[2]))  # below the tile size: bands
    if rank == 1:
        vae.disable_tiling()
    out["differ"] = _refusal(lambda: vae.decode(z))
    unparallelize_vae(vae)
    assert all("forward" not in m.__dict__ for m in vae.modules())
    vae.enable_tiling()
    assert torch.equal(vae.decode(z).sample, ref[0])  # the stock module, no collective
    return out


def _ranks(rank, world, names):
    with torch.no_grad():
        return {name: _case(name, rank) for name in names}


def _check(results, names):
    for rank, res in enumerate(results):
        for name in names:
            got = res[name]
            assert max(got["rel"]) < 1e-5, (rank, name, got["rel"])
            mine, stock = got["calls"]
            tiles = CASES[name][2]
            per_tile = stock // tiles  # Wan: one call per frame of a tile
            assert mine == per_tile * len(range(rank, tiles, 2)), (rank, name, mine, stock)
            assert "tiling settings differ" in got["differ"], got["differ"]
            assert "rank 0: " in got["differ"] and "float32, tiling on; rank 1: " in \
                got["differ"] and got["differ"].count("tiling off") == 1, got["differ"]


@pytest.mark.parametrize("names", [("kl", "wan"), ("hunyuan", "cogvideox")])
def test_tiled_parallel(names):
    results = run_gloo(_ranks, 2, names, timeout_s=240)
    _check(results, names)


def _pipeline_ranks(rank, world):
    """parallelize_pipeline on a tiny Flux pipeline whose VAE tiles: no warning, the VAE
    parallel (tiles over the ranks), its decode the stock tiled one; unparallelize undoes it."""
    import warnings

    import ditscale.diffusers as dd
    from ditscale.diffusers import _sp_pipeline, tiny

    pipes = [tiny.make_pipeline("flux") for _ in range(2)]
    for pipe in pipes:
        pipe.vae.enable_tiling()
        pipe.vae.tile_sample_min_size, pipe.vae.tile_latent_min_size = 8, 4  # 2x VAE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dd.parallelize_pipeline(pipes[1], strategy="ulysses")
    vae = pipes[1].vae
    assert _sp_pipeline.state_of(pipes[1]).vae is vae and "_decode" in vae.__dict__
    z = _randn((1, vae.config.latent_channels, 9, 7))
    with torch.no_grad():
        rel = _rel(vae.decode(z).sample, pipes[0].vae.decode(z).sample)
    dd.unparallelize_pipeline(pipes[1])
    assert "_decode" not in vae.__dict__
    return rel


def test_pipeline_parallelizes_a_tiling_vae():
    assert max(run_gloo(_pipeline_ranks, 2, timeout_s=120)) < 1e-5
