"""parallelize_vae on AutoencoderKL (an SD-style VAE with quant convs, a Flux/SD3-style one
without), small random weights, on 2 and 4 gloo ranks: decode equal to the single-process
decode (GroupNorm statistics over every band, the mid-block attention gathered; odd heights,
batch 2; bf16 no further from fp32 than the stock bf16 decode), encode equal to the
single-process encode (Downsample2D's stride-2 convs over the bands; odd latent heights), every
rank's convolution FLOPs its share of the single decode and encode, remove() restoring."""

import pytest
import torch

from gloo_util import run_gloo
from vae_util import conv_flops as _conv_flops  # noqa: E402
from vae_util import refusal as _refusal, rel as _rel, seeded_randn as _randn  # noqa: E402
from vae_util import attention_flops, encode_rel, unknown_processor_refusal  # noqa: E402

BLOCKS = dict(down_block_types=("DownEncoderBlock2D",) * 3,
              up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16),
              norm_num_groups=4, layers_per_block=1)
CONFIGS = {"sd": dict(latent_channels=4, **BLOCKS),
           "flux": dict(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                        **BLOCKS)}
# (config, latent shape [B, C, H, W]): odd heights, uneven bands on 2 and 4 ranks.
CASES = [("sd", (1, 4, 5, 3)), ("sd", (2, 4, 7, 6)), ("flux", (1, 16, 6, 5))]
# (config, image shape [B, 3, H, W]) to encode: 4 input rows a latent row, latent heights 5, 7, 6.
ENCODE = [("sd", (1, 3, 20, 12)), ("sd", (2, 3, 28, 9)), ("flux", (1, 3, 24, 10))]


def _vae(name):
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    return AutoencoderKL(**CONFIGS[name]).eval()


def _bf16_errors(vae, z):
    """(stock bf16, parallel bf16) relative errors against the stock fp32 decode."""
    import copy
    from ditscale.diffusers.parallel_vae import parallelize_vae
    ref = vae.decode(z).sample
    half = copy.deepcopy(vae).to(torch.bfloat16)
    stock = _rel(half.decode(z.bfloat16()).sample.float(), ref)
    handle = parallelize_vae(half)
    parallel = _rel(half.decode(z.bfloat16()).sample.float(), ref)
    handle.remove()
    return stock, parallel


def _ranks(rank, world):
    from ditscale.diffusers.parallel_vae import parallelize_vae
    out = {"rel": []}
    vaes = {name: _vae(name) for name in CONFIGS}
    with torch.no_grad():
        for name, shape in CASES:
            vae, z = vaes[name], _randn(shape)
            ref = vae.decode(z).sample
            before = dict(vae.__dict__)
            handle = parallelize_vae(vae)
            out["rel"].append(_rel(vae.decode(z).sample, ref))
            handle.remove()
            assert vae.__dict__.keys() == before.keys()
            assert torch.equal(vae.decode(z).sample, ref)
        out["encode_rel"] = encode_rel([(vaes[n], _randn(s)) for n, s in ENCODE])
        out["bf16"] = _bf16_errors(vaes["sd"], _randn((1, 4, 7, 5)))
        vae, z, x = vaes["sd"], _randn((1, 4, 8, 3)), _randn((1, 3, 32, 12))
        single = (_conv_flops(lambda: vae.decode(z)), _conv_flops(lambda: vae.encode(x)),
                  attention_flops(lambda: vae.decode(z)))
        handle = parallelize_vae(vae)
        out["flops"] = (_conv_flops(lambda: vae.decode(z)), single[0])
        out["encode_flops"] = (_conv_flops(lambda: vae.encode(x)), single[1])
        out["attention_flops"] = (attention_flops(lambda: vae.decode(z)), single[2])
        out["enc_thin"] = _refusal(lambda: vae.encode(_randn((1, 3, 4 * (world - 1), 8))))
        handle.remove()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_kl_decode_parallel(world):
    results = run_gloo(_ranks, world, timeout_s=300)
    for rank, res in enumerate(results):
        for case, rel in zip(CASES, res["rel"]):
            assert rel < 1e-5, (rank, case, rel)
        stock, parallel = res["bf16"]
        assert parallel <= 1.5 * stock + 1e-3, (rank, stock, parallel)
        assert max(res["encode_rel"]) < 1e-5, (rank, res["encode_rel"])
        rows = [8 // world + (r < 8 % world) for r in range(world)]
        band, single = res["attention_flops"]  # the mid block: this band's queries only
        assert single > 0 and band == single * rows[rank] // 8, (rank, band, single)
        for key in ("flops", "encode_flops"):  # halo rows are inputs: exactly the band's share
            band, single = res[key]
            assert band == pytest.approx(single * rows[rank] / 8, rel=0.01), (rank, key, band,
                                                                              single)
        assert f"height >= {4 * world}" in res["enc_thin"], res["enc_thin"]


def test_group_norm_single_rank_matches_stock():
    """World size 1: the band-aware GroupNorm path (float32 Welford statistics combined in
    float64, one fused normalization) against a float64
    F.group_norm, with a large mean beside a small spread: no worse than the stock float32."""
    from ditscale.diffusers.parallel_vae import parallelize_vae
    vae = _vae("sd")
    norm = vae.decoder.conv_norm_out
    x = 100.0 + 0.01 * _randn((2, norm.num_channels, 5, 7))
    stock = norm(x)
    ref = torch.nn.functional.group_norm(x.double(), norm.num_groups, norm.weight.double(),
                                         norm.bias.double(), norm.eps)
    parallelize_vae(vae)
    bands = vae._ditscale_parallel_vae.bands
    bands.start(5)
    try:
        got = norm(x)
    finally:
        bands.stop()
    assert _rel(got, ref) < max(1e-6, _rel(stock, ref))
    assert _rel(got, stock) < 1e-3  # the stock float32 loses ~1e-4 here itself


def _one_rank_decodes(rank, world):
    """Both parallelize (a collective: the mesh of the group), then rank 0 decodes and rank 1
    never joins: rank 0's first collective must end with an error within the group's timeout."""
    import time
    from ditscale.diffusers.parallel_vae import parallelize_vae
    vae = _vae("sd")
    parallelize_vae(vae)
    if rank != 0:
        time.sleep(12)
        return None
    start = time.monotonic()
    try:
        with torch.no_grad():
            vae.decode(_randn((1, 4, 5, 3)))
    except RuntimeError as e:  # gloo's timeout error, named by the layer
        return time.monotonic() - start, type(e).__name__, str(e)
    return time.monotonic() - start, None, "decoded alone"


def test_rank_decoding_alone_times_out():
    elapsed, error, message = run_gloo(_one_rank_decodes, 2, timeout_s=120, pg_timeout_s=4)[0]
    assert error is not None, message
    assert elapsed < 11, (elapsed, message)
    assert message.startswith("parallelize_vae: AutoencoderKL.decode: a collective of the "
                              "parallel VAE failed on rank 0"), message


@pytest.mark.parametrize("chunk", [1, 2500, 7000, 1 << 24])
def test_group_statistics_in_chunks_equal_one_pass(monkeypatch, chunk):
    """GroupNorm's band statistics taken a few groups at a time (a bounded float32 copy) are
    those of one var_mean over the whole activation."""
    from ditscale.diffusers.parallel_vae import layers
    x = (_randn((2, 8, 1000)) * 3 + 1).bfloat16()
    var, mean = torch.var_mean(x.float(), dim=-1, correction=0)
    monkeypatch.setattr(layers, "STATS_CHUNK", chunk)
    m, v = layers._var_mean(x)
    assert m.dtype == v.dtype == torch.float64
    assert torch.equal(m, mean.double()) and torch.equal(v, var.double())


def test_a_mid_block_attention_processor_it_does_not_know_is_refused():
    """The parallel mid block's attention reproduces AttnProcessor2_0 for its band's queries;
    an Attention with another processor is refused by name at parallelize_vae."""
    vae = _vae("sd")
    message = unknown_processor_refusal(vae, vae.decoder.mid_block.attentions[0])
    assert message and "decoder.mid_block.attentions.0 uses MyProcessor" in message, message
