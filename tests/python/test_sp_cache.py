"""ditscale.diffusers.sp_cache (CPU): diffusers' step caches on parallelized pipelines.

Under 2 gloo processes (one spawn): tiny Wan, Flux, HunyuanVideo (two-call CFG) and CogVideoX
(batched CFG) pipelines with 3 blocks, 6 steps, FirstBlockCache at thresholds that skip some
steps and compute others, PyramidAttentionBroadcast (Wan: refused under the two-call split;
CogVideoX), TaylorSeer and MagCache on Wan, FasterCache on CogVideoX (refused under the CFG
split); each with CFG
parallelism (halves of one rank) and with cfg_parallel=False (sequence parallel over both
ranks): the latents equal the single-process cached pipeline's within fp32 tolerance, the same
bits on both ranks, and differ from the uncached run (the cache did skip). Then, on a group with
a 3 s timeout, two ranks made to diverge on purpose (different thresholds; one rank leaving
before the decision's collective): every rank ends with an error naming the block and the call,
within the timeout. Without processes: the refusals (at enable_cache and at
make_cache_consistent) and the undo.
"""

import copy
import time

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from ditscale import sp  # noqa: E402
from ditscale.diffusers import sp_cache, tiny  # noqa: E402

TOLERANCE = 1e-4  # max abs error relative to max(1, max |reference|), fp32
STEPS = 6
TEXT = 5
GROUP_TIMEOUT_S = 3.0


# Blocks of the test transformers (FirstBlockCache needs a head, a tail and one between).
LAYERS = {"wan": dict(num_layers=3), "cogvideox": dict(num_layers=3),
          "flux": dict(num_layers=2, num_single_layers=1),
          "hunyuan-video": dict(num_layers=2, num_single_layers=1)}


def make(name: str, **layers):
    """The tiny pipeline ``name`` with the transformer blocks of :data:`LAYERS` (or
    ``layers``), the same random weights on every rank."""
    pipe = tiny.make_pipeline(name)
    cls, config = tiny._parts(name, "tiny")["transformer"]
    with torch.random.fork_rng():
        torch.manual_seed(1)
        transformer = getattr(diffusers, cls)(**{**config, **(layers or LAYERS[name])}).eval()
    pipe.register_modules(transformer=transformer)
    return pipe


def call_kwargs(name: str, pipe) -> dict:
    h, w, f = tiny.DEFAULT_SHAPES[name]["tiny"]
    kw = dict(height=h, width=w, num_inference_steps=STEPS, output_type="latent",
              generator=torch.Generator().manual_seed(3))
    kw.update(tiny.make_prompt_embeds(pipe, TEXT, seed=4))
    if name in tiny.VIDEO_PIPELINES:
        kw["num_frames"] = f
    if name in ("flux", "hunyuan-video"):
        kw["true_cfg_scale"] = 4.0
    else:
        kw["guidance_scale"] = 5.0
    return kw


def latents(pipe, name: str) -> torch.Tensor:
    with torch.no_grad():
        out = pipe(**call_kwargs(name, pipe))
    return out.images if hasattr(out, "images") else out.frames


def cache_config(label: str, pipe):
    """The enable_cache config of ``label`` ("fbc:<threshold>", "pab", "taylorseer", "mag")."""
    h = diffusers.hooks
    if label.startswith("fbc:"):
        return diffusers.FirstBlockCacheConfig(threshold=float(label[4:]))
    if label == "pab":
        return diffusers.PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(0, 1000),
            current_timestep_callback=lambda: pipe.current_timestep)
    if label == "taylorseer":
        return h.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2,
                                       cache_identifiers=[r"blocks\.\d+\.attn1"],
                                       taylor_factors_dtype=torch.float32)
    if label == "faster":  # CogVideoX's latents are [B, F, C, H, W]
        return diffusers.FasterCacheConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
            unconditional_batch_skip_range=2, unconditional_batch_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep,
            attention_weight_callback=lambda _: 0.5, tensor_format="BFCHW")
    assert label == "mag"
    return h.MagCacheConfig(threshold=0.5, num_inference_steps=STEPS, retention_ratio=0.0,
                            mag_ratios=[1.0, 0.99, 0.98, 0.97, 0.96, 0.95])


# Per family the caches run (thresholds chosen from the tiny models' metrics: mixed decisions
# with margins of at least 0.01 to the threshold).
# PyramidAttentionBroadcast under Wan's two-call CFG split is refused (checked below).
# FasterCache (CogVideoX: a batched [uncond; cond] call) is refused under any CFG split (below).
CASES = {"wan": ("fbc:0.1", "fbc:0.2", "fbc:0.3", "pab", "taylorseer", "mag"),
         "cogvideox": ("fbc:0.4", "fbc:0.5", "pab", "faster"),
         "flux": ("fbc:0.25",), "hunyuan-video": ("fbc:0.25",)}
MODES = ("split", "sp")  # CFG parallelism (halves of 1 rank), cfg_parallel=False (SP over 2)
REFUSED = {("wan", "pab", "split"): "blocks.0.attn1: pyramid_attention_broadcast (its one cache "
                                    "is shared",
           ("cogvideox", "faster", "split"): "(root): faster_cache_denoiser (it approximates the "
                                             "unconditional rows of a batch [uncond; cond]"}


def parallel(name: str, mode: str, mesh=None):
    pipe = dd.parallelize_pipeline(make(name), mesh=mesh, strategy="ulysses",
                                   cfg_parallel=mode == "split")
    return pipe


def relative_error(out, ref) -> float:
    return float((out - ref).abs().max()) / max(1.0, float(ref.abs().max()))


def compare_all(rank, world):
    results = {}
    for name, labels in CASES.items():
        plain = latents(make(name), name)
        for label in labels:
            ref_pipe = make(name)
            ref_pipe.transformer.enable_cache(cache_config(label, ref_pipe))
            ref = latents(ref_pipe, name)
            for mode in MODES:
                if (name, label, mode) in REFUSED:
                    continue
                pipe = parallel(name, mode)
                pipe.transformer.enable_cache(cache_config(label, pipe))
                got = latents(pipe, name)
                results[(name, label, mode)] = (relative_error(got, ref),
                                                relative_error(ref, plain), got)
    for name, label, mode in REFUSED:
        pipe = parallel(name, mode)
        pipe.transformer.enable_cache(cache_config(label, pipe))
        results[("refused", name, label)] = _outcome(lambda: latents(pipe, name))
    return results, diverge(rank)


def _outcome(fn):
    start = time.monotonic()
    try:
        fn()
        return "no error", time.monotonic() - start
    except RuntimeError as e:
        return str(e), time.monotonic() - start


def diverge(rank) -> dict:
    """Two ranks made to diverge on a group with a short timeout: (message, seconds) per case."""
    import datetime

    # one group per case that breaks its group (gloo closes a pair that timed out)
    short, short2 = (torch.distributed.new_group([0, 1], timeout=datetime.timedelta(
        seconds=GROUP_TIMEOUT_S)) for _ in range(2))
    out = {}
    pipe = parallel("wan", "sp", mesh=sp.Mesh(1, 2, group=short))
    threshold = 0.0 if rank == 0 else 100.0  # rank 0 always computes, rank 1 always skips
    pipe.transformer.enable_cache(diffusers.FirstBlockCacheConfig(threshold=threshold))
    out["thresholds"] = _outcome(lambda: latents(pipe, "wan"))

    pipe = parallel("wan", "sp", mesh=sp.Mesh(1, 2, group=short))
    pipe.transformer.enable_cache(diffusers.FirstBlockCacheConfig(threshold=0.2))
    if rank == 1:  # leaves the group right before the second decision's collective
        def leave(self, sums, group, where):
            raise RuntimeError(f"rank 1 leaves at {where}")
        hook = [h for _, h in sp_cache._hooks(pipe.transformer) if sp_cache.is_consistent(h)][0]
        hook._ditscale_reduce = leave.__get__(hook)
    out["left"] = _outcome(lambda: latents(pipe, "wan"))
    if rank == 1:
        time.sleep(GROUP_TIMEOUT_S + 1)  # alive, but out of the collective: rank 0 must time out

    pipe = parallel("wan", "sp", mesh=sp.Mesh(1, 2, group=short2))
    pipe.transformer.enable_cache(diffusers.FirstBlockCacheConfig(threshold=0.0))
    if rank == 1:  # leaves inside the blocks, after the ranks agreed to compute them
        calls = []

        def leave_attention(module, args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("rank 1 leaves before blocks.1.attn1")
        pipe.transformer.blocks[1].attn1.register_forward_pre_hook(leave_attention)
    out["left-in-block"] = _outcome(lambda: latents(pipe, "wan"))
    if rank == 1:
        time.sleep(GROUP_TIMEOUT_S + 1)
    return out


def test_caches_match_the_single_process_run_and_diverging_ranks_fail_fast():
    gloo_util = pytest.importorskip("gloo_util")
    results = gloo_util.run_gloo(compare_all, 2, timeout_s=300)
    (r0, d0), (r1, d1) = results
    for rank, r in enumerate((r0, r1)):
        for (name, label, mode), words in REFUSED.items():
            message = r.pop(("refused", name, label))[0]
            assert f"CFG parallelism of a {name} pipeline" in message, (rank, message)
            assert words in message, (rank, message)
    assert set(r0) == {(n, lb, m) for n, labels in CASES.items() for lb in labels
                       for m in MODES} - set(REFUSED)
    bad = {k: e for k, (e, _, _) in r0.items() if not e <= TOLERANCE}
    assert not bad, f"relative errors above {TOLERANCE}: {bad}"
    for key, (_, _, got) in r1.items():
        assert torch.equal(got, r0[key][2]), f"{key}: the ranks differ"
    unused = {k for k, (_, change, _) in r0.items() if change < 1e-3}
    assert not unused, f"the cache skipped nothing in {unused}"
    for rank, d in enumerate((d0, d1)):
        message, seconds = d["thresholds"]
        assert "ranks disagree" in message, (rank, message)
        assert "FirstBlockCache at 'blocks.0', cache context 'cond', step 2" in message, message
        assert seconds < GROUP_TIMEOUT_S, (rank, seconds)
    assert "rank 1 leaves at FirstBlockCache at 'blocks.0'" in d1["left"][0], d1["left"]
    message, seconds = d0["left"]
    assert "the collective of the decision failed" in message and "'blocks.0'" in message, message
    assert seconds < GROUP_TIMEOUT_S + 5, seconds
    assert "rank 1 leaves before blocks.1.attn1" in d1["left-in-block"][0], d1["left-in-block"]
    message, seconds = d0["left-in-block"]  # the sp attention's transfer, not the cache's
    assert "ditscale.sp (CPU): rank 0:" in message and f"within {GROUP_TIMEOUT_S:g} s" in message, \
        message
    assert seconds < GROUP_TIMEOUT_S + 5, seconds


# ---- one process ----------------------------------------------------------------------------

def _refusal(fn) -> str:
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


@pytest.mark.parametrize("config,named", [
    (lambda: diffusers.hooks.MagCacheConfig(calibrate=True, num_inference_steps=4),
     "MagCacheConfig(calibrate=True)"),
    (lambda: diffusers.hooks.SeaCacheConfig(), "SeaCacheConfig"),
    (lambda: diffusers.hooks.TextKVCacheConfig(), "TextKVCacheConfig"),
    (lambda: object(), "object"),
])
def test_refused_at_enable_cache_with_its_name(config, named):
    pipe = parallel("wan", "sp")  # one process: a mesh of one rank
    message = _refusal(lambda: pipe.transformer.enable_cache(config()))
    assert f"{named} is refused on a sequence-parallel transformer" in message, message
    assert not pipe.transformer.is_cache_enabled  # refused before any change


def test_block_caches_need_two_blocks():
    pipe = dd.parallelize_pipeline(make("wan", num_layers=1))
    sp_cache.make_cache_consistent(pipe.transformer)
    message = _refusal(lambda: pipe.transformer.enable_cache(
        diffusers.FirstBlockCacheConfig(threshold=0.1)))
    assert "FirstBlockCacheConfig needs at least 2 transformer blocks" in message, message
    assert "WanTransformer3DModel has 1" in message, message


def test_refused_at_parallelize_when_enabled_before():
    pipe = make("wan")
    pipe.transformer.enable_cache(diffusers.hooks.TextKVCacheConfig())
    message = _refusal(lambda: dd.parallelize_pipeline(pipe))
    assert "TextKVCacheConfig is refused" in message, message
    assert not hasattr(pipe, "_ditscale_pipeline")  # refused before any change stayed
    assert "enable_cache" not in pipe.transformer.__dict__
    message = _refusal(lambda: sp_cache.make_cache_consistent(make("wan").transformer))
    assert "is not parallelized" in message, message


def test_refused_at_enable_cache_after_parallelize():
    pipe = dd.parallelize_pipeline(make("wan"))
    message = _refusal(lambda: pipe.transformer.enable_cache(
        diffusers.hooks.TextKVCacheConfig()))
    assert "TextKVCacheConfig is refused" in message, message


def test_fbc_enabled_before_is_converted_and_the_undo_restores_the_stock_cache():
    pipe = dd.parallelize_pipeline(make("wan"))
    t = pipe.transformer
    t.enable_cache(diffusers.FirstBlockCacheConfig(threshold=0.2))
    sp_cache.make_cache_consistent(t)
    sp_cache.make_cache_consistent(t)  # idempotent
    assert sum(sp_cache.is_consistent(h) for _, h in sp_cache._hooks(t)) == 1
    assert sp_cache.unsafe_stateful_hooks(t) == []
    assert t.enable_cache.__self__ is t
    copied = copy.deepcopy(t)
    assert copied.enable_cache.__self__ is copied  # the copy's check is of the copy
    ref = latents(pipe, "wan")
    sp_cache.remove_cache_consistency(t)
    assert "enable_cache" not in t.__dict__
    assert not any(sp_cache.is_consistent(h) for _, h in sp_cache._hooks(t))
    assert sp_cache.unsafe_stateful_hooks(t) == ["blocks.0: fbc_leader_block_hook "
                                                 "(FBCHeadBlockHook)"]
    t.disable_cache()
    t.enable_cache(diffusers.hooks.TextKVCacheConfig())  # the stock method again: no check
    t.disable_cache()
    t.enable_cache(diffusers.FirstBlockCacheConfig(threshold=0.2))
    assert torch.equal(latents(pipe, "wan"), ref)  # 1 rank: the stock cache's result


# ---- --cache (cache_option, examples/generate.py) -------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("first-block", "--cache: 'first-block' is not none or one of first-block:THRESHOLD"),
    ("taylorseer:2", "is not none or one of"),
    ("teacache:0.1", "is not none or one of"),
    ("first-block:x", "--cache first-block:threshold: 'x' is not a number in [0, 1]"),
    ("first-block:1.5", "--cache first-block:threshold: 1.5 is out of range [0, 1]"),
    ("first-block:nan", "--cache first-block:threshold: nan is out of range [0, 1]"),
])
def test_cache_option_is_range_checked(text, message):
    from ditscale.diffusers.cache_option import parse_cache

    with pytest.raises(ValueError) as info:
        parse_cache("--cache", text)
    assert message in str(info.value), str(info.value)


def test_cache_option_gives_the_diffusers_config():
    from ditscale.diffusers.cache_option import parse_cache

    assert parse_cache("--cache", "none") is None
    config = parse_cache("--cache", "first-block:0.1")
    assert isinstance(config, diffusers.FirstBlockCacheConfig) and config.threshold == 0.1


def test_generate_runs_with_a_cache_and_names_a_refused_one(tmp_path):
    import os
    import subprocess
    import sys

    import ditscale

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "examples", "generate.py")
    package_dir = os.path.dirname(os.path.dirname(ditscale.__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (package_dir, os.environ.get("PYTHONPATH")) if p))
    runs = {pipeline: subprocess.Popen(
        [sys.executable, script, "--device", "cpu", "--pipeline", pipeline, "--steps", "4",
         "--cache", cache, "--out", str(tmp_path / f"{pipeline}.{ext}")], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for pipeline, cache, ext in (("flux", "first-block:0.2", "png"),
                                     ("wan", "first-block:0.1", "mp4"))}
    out = {name: p.communicate(timeout=240)[0] for name, p in runs.items()}
    assert runs["flux"].returncode == 0 and (tmp_path / "flux.png").exists(), out["flux"]
    assert runs["wan"].returncode == 2, out["wan"]  # the tiny Wan has 1 block
    assert "generate.py: error: ditscale.diffusers cache: FirstBlockCacheConfig needs at least " \
           "2 transformer blocks" in out["wan"], out["wan"]
    assert "Traceback" not in out["wan"], out["wan"]
