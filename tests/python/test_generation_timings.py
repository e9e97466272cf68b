"""Per-stage timings of a pipeline call (``generation.timed_call`` / ``StageTimer``): each stage
gets the time spent in it (a delay put into the VAE decoder shows in ``vae_decode`` only, one
put into the transformer in each step), the steps are counted, the caller's step callback is
chained, and the pipeline gets its methods and hooks back; every pipeline family times."""

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from ditscale.diffusers import generation, tiny  # noqa: E402
from ditscale.diffusers.stage_timer import KEYS, StageTimer  # noqa: E402

DELAY = 0.2


def _kwargs(pipe, name, steps=2):
    height, width, frames = tiny.DEFAULT_SHAPES[name]["tiny"]
    guidance = generation.DEFAULT_GUIDANCE[name]
    embeds = tiny.make_prompt_embeds(pipe, 7, negative=guidance > 1)
    return generation.call_kwargs(name, height=height, width=width, frames=frames, steps=steps,
                                  guidance=guidance, seeds=[0], device=torch.device("cpu"),
                                  embeds=embeds)


def _sleep(seconds):
    def hook(module, args, output=None):
        time.sleep(seconds)
    return hook


def test_each_stage_gets_its_own_time():
    pipe = tiny.make_pipeline("sd3")
    pre_hooks = dict(pipe.transformer._forward_pre_hooks)
    slow_vae = pipe.vae.decoder.register_forward_hook(_sleep(DELAY))
    slow_step = pipe.transformer.register_forward_hook(_sleep(DELAY / 4))
    seen = []

    def on_step(p, step, timestep, callback_kwargs):
        seen.append(step)
        return callback_kwargs

    try:
        out, timer = generation.timed_call(pipe, _kwargs(pipe, "sd3", steps=3),
                                           torch.device("cpu"), on_step=on_step)
    finally:
        slow_vae.remove()
        slow_step.remove()
    with timer.stage("output_encoding"):
        generation.encode_png(generation.to_uint8(generation.output_array(out, False))[0])
    t = timer.as_dict()
    assert list(t) == [k for k in KEYS if k in t] and set(t) == set(KEYS), t
    assert seen == [0, 1, 2] and len(t["steps"]) == 3
    assert all(s >= DELAY / 4 for s in t["steps"]), t  # SD3 with CFG: one batched forward
    assert t["vae_decode"] >= DELAY and t["denoising"] < 3 * DELAY, t
    assert sum(t["steps"]) <= t["denoising"] + 1e-9
    inside = t["text_encoding"] + t["denoising"] + t["vae_decode"]
    assert inside <= t["pipeline"] and abs(t["other"] - (t["pipeline"] - inside)) < 1e-9
    assert 0 < t["output_encoding"] < t["pipeline"]
    # the pipeline is stock again: its methods are the class's, no hook of the timer is left
    assert "encode_prompt" not in pipe.__dict__ and "decode" not in pipe.vae.__dict__
    assert dict(pipe.transformer._forward_pre_hooks) == pre_hooks


def test_a_callback_result_is_passed_on_and_a_second_call_accumulates():
    pipe = tiny.make_pipeline("flux")
    timer = StageTimer("cpu")
    for _ in range(2):
        with timer.attach(pipe):
            pipe(**_kwargs(pipe, "flux"), callback_on_step_end=timer.step_callback())
    t = timer.as_dict()
    assert len(t["steps"]) == 4 and t["denoising"] >= sum(t["steps"][2:])
    assert "output_encoding" not in t


@pytest.mark.parametrize("name", tiny.PIPELINES)
def test_every_family_is_timed(name):
    pipe = tiny.make_pipeline(name)
    _, timer = generation.timed_call(pipe, _kwargs(pipe, name), "cpu")
    t = timer.as_dict()
    assert {"text_encoding", "denoising", "vae_decode", "pipeline", "other"} <= set(t), t
    assert len(t["steps"]) == 2 and all(v >= 0 for k, v in t.items() if k != "steps")
