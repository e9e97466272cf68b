"""parallelize_vae on the causal 3-D video VAEs, AutoencoderKLHunyuanVideo and
AutoencoderKLCogVideoX (small random weights), on 2 and 4 gloo ranks: decode equal to the
single-process decode (HunyuanVideo: replicate padding at the image border, the mid block's
frame-causal attention on the gathered input, temporal tiles of 6 latent frames; CogVideoX: the
causal Conv3d's temporal cache across the stock frame batches, the spatial norm's GroupNorm over
every band; both: odd heights, 1 latent frame and many), encode equal to the single-process
encode (the stride-2 causal convs / down-samplers and temporal down-sampling over the bands, odd
latent heights, 1 frame and 9), every rank's convolution FLOPs its share of the single decode
and encode, remove() restoring the stock module."""

import pytest
import torch

from gloo_util import run_gloo
from vae_util import seeded_randn as _randn, conv_flops as _conv_flops  # noqa: E402
from vae_util import attention_flops, encode_rel, unknown_processor_refusal  # noqa: E402

SMALL = dict(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
             norm_num_groups=4)
# class -> (its block types' prefix, latent shapes [B, C, F, H, W])
CASES = {
    "AutoencoderKLHunyuanVideo": ("HunyuanVideo",
                                  [(1, 4, 1, 5, 3), (1, 4, 6, 7, 3), (2, 4, 2, 4, 2)]),
    "AutoencoderKLCogVideoX": ("CogVideoX", [(1, 4, 1, 5, 3), (1, 4, 5, 7, 3), (2, 4, 2, 4, 2)]),
}
# images [B, 3, F, H, W] to encode (8 input rows a latent row): latent heights 5, 7, 4.
ENCODE = [(1, 3, 1, 40, 16), (1, 3, 9, 56, 8), (2, 3, 1, 32, 8)]


def _make(name: str):
    import diffusers

    prefix = CASES[name][0]
    torch.manual_seed(0)
    return getattr(diffusers, name)(down_block_types=(f"{prefix}DownBlock3D",) * 4,
                                    up_block_types=(f"{prefix}UpBlock3D",) * 4, **SMALL).eval()


def _ranks(rank, world, name):
    from ditscale.diffusers.parallel_vae import parallelize_vae
    vae = _make(name)
    out = {"rel": []}
    with torch.no_grad():
        for shape in CASES[name][1]:
            z = _randn(shape)
            ref = vae.decode(z).sample
            before = dict(vae.__dict__)
            handle = parallelize_vae(vae)
            got = vae.decode(z).sample
            out["rel"].append(((got - ref).norm() / ref.norm()).item())
            handle.remove()
            assert vae.__dict__.keys() == before.keys()
            assert torch.equal(vae.decode(z).sample, ref)
        out["encode_rel"] = encode_rel([(vae, _randn(s)) for s in ENCODE])
        z, x = _randn((1, 4, 2, 8, 3)), _randn((1, 3, 5, 64, 8))
        single = (_conv_flops(lambda: vae.decode(z)), _conv_flops(lambda: vae.encode(x)),
                  attention_flops(lambda: vae.decode(z)))
        parallelize_vae(vae)
        out["flops"] = (_conv_flops(lambda: vae.decode(z)), single[0])
        out["encode_flops"] = (_conv_flops(lambda: vae.encode(x)), single[1])
        out["attention_flops"] = (attention_flops(lambda: vae.decode(z)), single[2])
    return out


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("world", [2, 4])
def test_decode_parallel(name, world):
    results = run_gloo(_ranks, world, name, timeout_s=300)
    for rank, res in enumerate(results):
        for shape, rel in zip(CASES[name][1], res["rel"]):
            assert rel < 1e-5, (rank, shape, rel)
        assert max(res["encode_rel"]) < 1e-5, (rank, res["encode_rel"])
        rows = [8 // world + (r < 8 % world) for r in range(world)]
        band, single = res["attention_flops"]  # the mid block: this band's queries only
        assert band == single * rows[rank] // 8, (rank, band, single)
        assert (single > 0) == (name == "AutoencoderKLHunyuanVideo")  # CogVideoX: no attention
        for key in ("flops", "encode_flops"):  # halo rows are inputs: exactly the band's share
            band, single = res[key]
            assert band == pytest.approx(single * rows[rank] / 8, rel=0.01), (rank, key, band,
                                                                              single)


def test_a_mid_block_attention_processor_it_does_not_know_is_refused():
    """The parallel mid block reproduces AttnProcessor2_0's attention for its band's queries; an
    attention with another processor is refused by name at parallelize_vae."""
    vae = _make("AutoencoderKLHunyuanVideo")
    message = unknown_processor_refusal(vae, vae.decoder.mid_block.attentions[0])
    assert message and "decoder.mid_block.attentions.0 uses MyProcessor" in message, message
