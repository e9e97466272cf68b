"""Wan's rotary table in the shape rule: its limit is the real one (the largest side and frame
count it allows run through the tiny pipeline, one patch more fails inside diffusers), and
``shape_error`` names the field, the value and the allowed range."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from ditscale.diffusers import generation, tiny  # noqa: E402


def _call(pipe, name, height, width, frames):
    embeds = tiny.make_prompt_embeds(pipe, 7, negative=False)
    kw = generation.call_kwargs(name, height=height, width=width, frames=frames, steps=1,
                                guidance=1.0, seeds=[0], device=torch.device("cpu"),
                                embeds=embeds)
    return pipe(**kw).frames


@pytest.mark.parametrize("name", ["wan", "wan2.2"])
def test_wan_rule_is_the_rotary_tables_limit(name):
    pipe = tiny.make_pipeline(name)
    rule = generation.shape_rule(name, pipe)
    rows = pipe.transformer.config.rope_max_seq_len  # 64 patches per axis (tiny)
    assert (rule.pixel_multiple, rule.frame_step) == (16, 4)
    assert (rule.max_side, rule.max_frames) == (rows * 16, 1 + (rows - 1) * 4) == (1024, 253)
    assert generation.shape_error(rule, 16, 1024, 1) is None
    assert generation.shape_error(rule, 16, 16, 253) is None
    assert generation.shape_error(rule, 16, 1040, 1) == (
        "width 1040 is above 1024: out of range [16, 1024] (the largest side covered by Wan's "
        "rotary table, rope_max_seq_len 64 patches per axis)")
    assert generation.shape_error(rule, 1040, 16, 1).startswith("height 1040 is above 1024")
    assert generation.shape_error(rule, 16, 16, 257) == (
        "frames 257 is above 253: out of range [1, 253] (the most frames covered by Wan's "
        "rotary table, rope_max_seq_len 64 patches per axis)")


def test_the_limit_is_exact():
    pipe = tiny.make_pipeline("wan")
    assert _call(pipe, "wan", 16, 1024, 1).shape == (1, 1, 16, 1024, 3)
    assert _call(pipe, "wan", 16, 16, 253).shape == (1, 253, 16, 16, 3)
    for height, width, frames in ((16, 1040, 1), (16, 16, 257)):  # what the rule refuses
        with pytest.raises(RuntimeError, match="is invalid for input of size"):
            _call(pipe, "wan", height, width, frames)


def test_other_rules_keep_their_limits():
    sd3 = generation.shape_rule("sd3", tiny.make_pipeline("sd3"))
    assert (sd3.max_side, sd3.max_frames) == (64, 0)
    assert generation.shape_error(sd3, 68, 64, 1) == (
        "height 68 is above 64: out of range [4, 64] (the largest side covered by the model's "
        "position embedding)")
    flux = generation.shape_rule("flux", tiny.make_pipeline("flux"))
    assert (flux.max_side, flux.max_frames) == (0, 0)
