"""The simulator's attention model as bound for calibrate.py (python/src/sp_sim_bindings.cc):
the values of Topology::WaveFactor / AttentionSeconds, and every argument range-checked with its
name, value and range."""

import math

import pytest

from ditscale import _core


def test_wave_factor_matches_the_formula():
    # 12 heads x ceil(1408 / 128) = 132 CTAs: one whole wave on 132 SMs.
    assert _core.sp_wave_factor(1408, 12, 132) == 1.0
    waves = 12 * math.ceil(33024 / 128) / 132
    assert _core.sp_wave_factor(33024, 12, 132) == pytest.approx(math.ceil(waves) / waves)
    assert _core.sp_wave_factor(33024, 12, 0) == 1.0  # no wave model
    assert _core.sp_wave_factor(0, 12, 132) == 1.0
    assert _core.sp_wave_factor(256, 1, 132, tile=64) == pytest.approx(132 / 4)


def test_attention_seconds_matches_the_formula():
    f, q, kv, a, h, launch = 1e12, 4096.0, 8192.0, 600e12, 200.0, 5e-6
    eff = (q / (q + h)) * (kv / (kv + h))
    assert _core.sp_attention_seconds(f, q, kv, a, h, launch) == pytest.approx(
        launch + f / (a * eff), rel=1e-12)
    wave = _core.sp_wave_factor(q, 24, 132)
    assert _core.sp_attention_seconds(f, q, kv, a, h, launch, 24, 132) == pytest.approx(
        launch + f * wave / (a * eff), rel=1e-12)
    assert _core.sp_attention_seconds(0, 0, 0, a, h, launch) == launch  # no work: the launch


@pytest.mark.parametrize("kwargs, text", [
    (dict(q_tokens=-1.0), "q_tokens: -1 is out of range [0, 1e+12]"),
    (dict(q_tokens=math.nan), "q_tokens: nan is out of range [0, 1e+12]"),
    (dict(batch_heads=math.inf), "batch_heads: inf is out of range [0, 1e+09]"),
    (dict(slots=-3), "slots: -3 is out of range [0, 1048576]"),
    (dict(tile=0), "tile: 0 is out of range [1, 1048576]"),
])
def test_wave_factor_refuses_bad_arguments(kwargs, text):
    args = dict(q_tokens=4096.0, batch_heads=24.0, slots=132, tile=128)
    args.update(kwargs)
    with pytest.raises(_core.Error) as e:
        _core.sp_wave_factor(**args)
    assert text in str(e.value)


@pytest.mark.parametrize("kwargs, text", [
    (dict(attention_flops=0.0), "attention_flops: 0 is out of range [1, 1e+18]"),
    (dict(half_tokens=-5.0), "half_tokens: -5 is out of range [0, 1e+12]"),
    (dict(launch_s=2.0), "launch_s: 2 is out of range [0, 1]"),
    (dict(flops=math.nan), "flops: nan is out of range [0, 1e+30]"),
    (dict(kv_tokens=0.0), "attention block with no tokens: q_tokens=4096 kv_tokens=0"),
])
def test_attention_seconds_refuses_bad_arguments(kwargs, text):
    args = dict(flops=1e12, q_tokens=4096.0, kv_tokens=4096.0, attention_flops=600e12,
                half_tokens=200.0, launch_s=5e-6)
    args.update(kwargs)
    with pytest.raises(_core.Error) as e:
        _core.sp_attention_seconds(**args)
    assert text in str(e.value)
