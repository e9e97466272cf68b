"""parallelize_vae on AutoencoderKLCogVideoX (small random weights) on 2 and 4 gloo ranks:
decode equal to the single-process decode (the causal Conv3d's temporal cache across the stock
frame batches, the spatial norm's GroupNorm over every band; odd heights; 1 latent frame and 5),
every rank's convolution FLOPs its share, remove() restoring the stock module."""

import pytest
import torch

from gloo_util import run_gloo

CONFIG = dict(block_out_channels=(8, 8, 8, 8), norm_num_groups=4, layers_per_block=1,
              latent_channels=4, down_block_types=("CogVideoXDownBlock3D",) * 4,
              up_block_types=("CogVideoXUpBlock3D",) * 4)
SHAPES = [(1, 4, 1, 5, 3), (1, 4, 5, 7, 3), (2, 4, 2, 4, 2)]


def _randn(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


def _conv_flops(fn):
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn()
    counts = counter.get_flop_counts()["Global"]
    return sum(v for k, v in counts.items() if "convolution" in str(k))


def _ranks(rank, world):
    from diffusers import AutoencoderKLCogVideoX
    from ditscale.diffusers.parallel_vae import parallelize_vae
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(**CONFIG).eval()
    out = {"rel": []}
    with torch.no_grad():
        for shape in SHAPES:
            z = _randn(shape)
            ref = vae.decode(z).sample
            before = dict(vae.__dict__)
            handle = parallelize_vae(vae)
            got = vae.decode(z).sample
            out["rel"].append(((got - ref).norm() / ref.norm()).item())
            handle.remove()
            assert vae.__dict__.keys() == before.keys()
            assert torch.equal(vae.decode(z).sample, ref)
        z = _randn((1, 4, 2, 8, 3))
        single = _conv_flops(lambda: vae.decode(z))
        parallelize_vae(vae)
        out["flops"] = (_conv_flops(lambda: vae.decode(z)), single)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_cogvideox_decode_parallel(world):
    results = run_gloo(_ranks, world, timeout_s=300)
    for rank, res in enumerate(results):
        for shape, rel in zip(SHAPES, res["rel"]):
            assert rel < 1e-5, (rank, shape, rel)
        band, single = res["flops"]
        rows = [8 // world + (r < 8 % world) for r in range(world)]
        assert band == pytest.approx(single * rows[rank] / 8, rel=0.01), (rank, band, single)
