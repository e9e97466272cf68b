"""ditscale.diffusers.parallelize_pipeline (CPU): CFG and sequence parallelism of the five
pipelines against the single-process pipeline, and the pipeline internals the CFG split relies
on (checked on the pinned diffusers).

The pipelines are ditscale.diffusers.tiny's (random weights, 3 heads, prompt embeddings made
locally, odd token counts: 15 image / 9 video tokens), 2 denoising steps, output_type="latent".
Under 2 gloo processes, for every pipeline: guided (CFG split: each half one rank), unguided
(sequence parallel over both ranks) and guided with cfg_parallel=False (sequence parallel over
both ranks, both passes) give the single-process latents within fp32 tolerance, the same bits
on both ranks; the call patterns the split refuses are refused. Under 4 processes a two-call
(Flux) and a batched (CogVideoX) pipeline run the split with halves of 2 ranks (sequence
parallel within each half, uneven Ulysses heads), on the default mesh and on Mesh(2, 2).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from ditscale import sp  # noqa: E402
from ditscale.diffusers import _sp_pipeline as sp_pipeline  # noqa: E402
from ditscale.diffusers import _sp_plan  # noqa: E402
from ditscale.diffusers import tiny  # noqa: E402

TOLERANCE = 1e-4  # max abs error relative to max(1, max |reference|), fp32
PIPELINES = ("flux", "wan", "hunyuan-video", "cogvideox", "sd3")
TWO_CALL = ("flux", "wan", "hunyuan-video")
TEXT = 5


def call_kwargs(name: str, guided: bool, pipe) -> dict:
    """The keyword arguments of a 2-step latent call of the tiny ``name``, guidance on or off
    by each pipeline's own switch (true_cfg_scale for Flux and HunyuanVideo)."""
    h, w, f = tiny.DEFAULT_SHAPES[name]["tiny"]
    kw = dict(height=h, width=w, num_inference_steps=2, output_type="latent",
              generator=torch.Generator().manual_seed(3))
    kw.update(tiny.make_prompt_embeds(pipe, TEXT, seed=4))
    if name in tiny.VIDEO_PIPELINES:
        kw["num_frames"] = f
    if name in ("flux", "hunyuan-video"):
        kw["true_cfg_scale"] = 4.0 if guided else 1.0
    else:
        kw["guidance_scale"] = 5.0 if guided else 1.0
    return kw


def latents(pipe, name: str, guided: bool, **extra) -> torch.Tensor:
    out = pipe(**call_kwargs(name, guided, pipe), **extra)
    return out.images if hasattr(out, "images") else out.frames


def relative_error(out, ref) -> float:
    return float((out - ref).abs().max()) / max(1.0, float(ref.abs().max()))


# ---- tiny.py --------------------------------------------------------------------------------

# Published transformer sizes (billions of parameters): Flux.1 dev 11.9, SD3.5 medium 2.24,
# Wan 2.1 1.3B 1.42, Wan 2.2 A14B 14.3 (each of two), HunyuanVideo 12.8, CogVideoX 5B 5.57.
FULL_PARAMETERS = {"flux": 11.90, "sd3": 2.24, "wan": 1.42, "wan2.2": 14.29,
                   "hunyuan-video": 12.82, "cogvideox": 5.57}


@pytest.mark.parametrize("name", tiny.PIPELINES)
def test_full_size_has_the_published_dimensions(name):
    """Built on the meta device (no memory, no time): the parameter count of each transformer,
    its dtype (fp32-kept modules aside) and the VAE's class."""
    pipe = tiny.make_pipeline(name, "full", device="meta", dtype=torch.bfloat16)
    for attr in ("transformer", "transformer_2"):
        model = getattr(pipe, attr, None)
        if model is None:
            continue
        count = sum(p.numel() for p in model.parameters()) / 1e9
        assert abs(count - FULL_PARAMETERS[name]) < 0.01, (attr, count)
        assert model.dtype == torch.bfloat16
    assert type(pipe).__name__ == tiny.PIPELINE_CLASSES[name]
    assert (getattr(pipe, "transformer_2", None) is not None) == (name == "wan2.2")


def test_tiny_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = tiny.make_pipeline("wan", seed=5), tiny.make_pipeline("wan", seed=5)
    assert torch.equal(torch.get_rng_state(), before)
    for (ka, va), (kb, vb) in zip(a.transformer.state_dict().items(),
                                  b.transformer.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    c = tiny.make_pipeline("wan", seed=6)
    assert not torch.equal(c.transformer.proj_out.weight, a.transformer.proj_out.weight)
    e1 = tiny.make_prompt_embeds(a, 5, batch=2, seed=1)
    e2 = tiny.make_prompt_embeds(a, 5, batch=2, seed=1)
    assert sorted(e1) == ["negative_prompt_embeds", "prompt_embeds"]
    assert all(torch.equal(e1[k], e2[k]) for k in e1) and e1["prompt_embeds"].shape == (2, 5, 16)
    hunyuan = tiny.make_prompt_embeds(tiny.make_pipeline("hunyuan-video"), 5, negative=False)
    assert sorted(hunyuan) == ["pooled_prompt_embeds", "prompt_attention_mask", "prompt_embeds"]


def test_tiny_refuses_bad_arguments():
    with pytest.raises(ValueError, match="make_pipeline: name: 'sdxl' is not one of flux"):
        tiny.make_pipeline("sdxl")
    with pytest.raises(ValueError, match="make_pipeline: size: 'huge' is not one of tiny, small, full"):
        tiny.make_pipeline("flux", size="huge")
    with pytest.raises(ValueError, match=r"make_pipeline: seed: -1 is out of range"):
        tiny.make_pipeline("flux", seed=-1)
    with pytest.raises(ValueError, match="dtype torch.int32 is not a floating-point"):
        tiny.make_pipeline("flux", dtype=torch.int32)
    pipe = tiny.make_pipeline("sd3")
    with pytest.raises(ValueError, match=r"make_prompt_embeds: text_tokens: 0 is out of range"):
        tiny.make_prompt_embeds(pipe, 0)
    with pytest.raises(ValueError, match=r"make_prompt_embeds: batch: 65 is out of range"):
        tiny.make_prompt_embeds(pipe, 3, batch=65)


# ---- the internals (single process) -------------------------------------------------------

def record_calls(pipe):
    """Records every transformer call of ``pipe``: (cache context, hidden_states batch,
    id(hidden_states), whether its two batch halves are equal, skip_layers set)."""
    calls, context = [], [None]
    for attr in ("transformer", "transformer_2"):
        t = getattr(pipe, attr, None)
        if t is None:
            continue
        stock = getattr(t, "cache_context", None)  # SD3Transformer2DModel has none
        if stock is not None:
            def cache_context(name, _stock=stock, **kwargs):
                context[0] = name
                return _stock(name, **kwargs)

            t.cache_context = cache_context  # an instance attribute: the stock class is kept

        def hook(module, args, kwargs, _attr=attr):
            h = kwargs["hidden_states"]
            half = h.shape[0] // 2
            calls.append((_attr, context[0], h.shape[0], id(h),
                          h.shape[0] % 2 == 0 and torch.equal(h[:half], h[half:]),
                          kwargs.get("skip_layers") is not None))
            context[0] = None

        t.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


@pytest.mark.parametrize("name", PIPELINES + ("wan2.2",))
def test_the_pinned_pipelines_call_the_transformer_as_the_split_expects(name):
    """guided -> per step ("cond", "uncond") on the same latents (two-call) or one call of the
    [latents; latents] batch 2B (batched); unguided -> one call of batch B per step; and the
    criterion of SPECS agrees with what the pipeline did."""
    spec = sp_pipeline.SPECS[dd.SUPPORTED_PIPELINES[tiny.PIPELINE_CLASSES[name]]]
    for guided in (True, False):
        pipe = tiny.make_pipeline(name)
        calls = record_calls(pipe)
        kwargs = call_kwargs(name, guided, pipe)
        with torch.no_grad():
            pipe(**kwargs)
        bound = sp_pipeline.inspect.signature(type(pipe).__call__).bind(pipe, **kwargs)
        bound.apply_defaults()
        assert spec.guided(bound.arguments) == guided
        if not guided:
            assert len(calls) == 2 and all(c[2] == 1 for c in calls), calls
        elif spec.pattern == "two-call":
            assert [c[1] for c in calls] == ["cond", "uncond"] * 2, calls
            assert all(a[3] == b[3] and a[0] == b[0] for a, b in zip(calls[::2], calls[1::2]))
            assert all(c[2] == 1 for c in calls)
        else:
            assert [c[1] for c in calls] == [spec.contexts[0]] * 2, calls
            assert all(c[2] == 2 and c[4] and not c[5] for c in calls), calls
    if name == "wan2.2":  # 2 steps: the first above the boundary, the second below
        assert [c[0] for c in calls] == ["transformer", "transformer_2"]


SKIP_LAYERS = dict(skip_guidance_layers=[0], skip_layer_guidance_start=0.0,
                   skip_layer_guidance_stop=1.0)


def test_sd3_skip_layer_guidance_adds_a_batch_b_call_with_skip_layers():
    pipe = tiny.make_pipeline("sd3")
    calls = record_calls(pipe)
    with torch.no_grad():
        pipe(**call_kwargs("sd3", True, pipe), **SKIP_LAYERS)
    # skipped layers from step i > 2 * 0.0 on: step 1 of 2
    assert [(c[2], c[5]) for c in calls] == [(2, False), (2, False), (1, True)], calls


def test_half_mesh_members():
    f = sp_pipeline.half_members
    assert f([0, 1, 2, 3], 2, 2) == ((1, 2), [[0, 1], [2, 3]])  # whole machines
    assert f([0, 1, 2, 3], 1, 4) == ((1, 2), [[0, 1], [2, 3]])
    assert f(list(range(6)), 3, 2) == ((3, 1), [[0, 2, 4], [1, 3, 5]])  # half of each machine
    assert f([4, 5, 6, 7, 8, 9, 10, 11], 4, 2) == ((2, 2), [[4, 5, 6, 7], [8, 9, 10, 11]])
    assert f([0, 1, 2], 1, 3) is None and f([0], 1, 1) is None


def test_pending_output_refuses_every_use_until_filled():
    pending = sp_pipeline._pending(torch.zeros(2, 3))
    for use in (lambda p: p + 1, lambda p: p.shape, lambda p: p.float(), lambda p: repr(p),
                lambda p: p[0], lambda p: torch.cat([p, p])):
        with pytest.raises(RuntimeError, match="'cond' output was used before"):
            use(pending)
    value = torch.arange(6.0).reshape(2, 3)
    sp_pipeline._fill(pending, value)
    out = pending * 2 - 1
    assert type(out) is torch.Tensor and torch.equal(out, value * 2 - 1)
    assert pending.shape == (2, 3)
    with pytest.raises(RuntimeError, match="float64"):
        sp_pipeline._fill(sp_pipeline._pending(torch.zeros(1)), torch.zeros(1, dtype=torch.float64))


def test_one_rank_is_the_stock_pipeline_and_keeps_classes_and_state():
    for name in ("flux", "wan2.2"):
        ref = latents(tiny.make_pipeline(name), name, True)
        pipe = tiny.make_pipeline(name)
        classes = {k: type(getattr(pipe, k)) for k in ("transformer", "transformer_2")
                   if getattr(pipe, k, None) is not None}
        states = {k: {n: v.clone() for n, v in getattr(pipe, k).state_dict().items()}
                  for k in classes}
        pipe_class = type(pipe)
        assert dd.parallelize_pipeline(pipe) is pipe
        assert isinstance(pipe, pipe_class) and type(pipe).__name__ == pipe_class.__name__
        for k, cls in classes.items():
            module = getattr(pipe, k)
            assert isinstance(module, cls) and type(module).__name__ == cls.__name__
            after = module.state_dict()
            assert after.keys() == states[k].keys()
            assert all(torch.equal(after[n], states[k][n]) for n in after)
        assert torch.equal(latents(pipe, name, True), ref)


def test_refusals():
    import diffusers

    unsupported = object.__new__(diffusers.StableDiffusionXLPipeline)  # refused by class name
    with pytest.raises(ValueError, match="pipeline class 'StableDiffusionXLPipeline' is not "
                                         "supported; supported: CogVideoXPipeline, "):
        dd.parallelize_pipeline(unsupported)
    pipe = tiny.make_pipeline("wan")
    with pytest.raises(TypeError, match="cfg_parallel must be True or False, got int 1"):
        dd.parallelize_pipeline(pipe, cfg_parallel=1)
    with pytest.raises(TypeError, match="mesh must be a ditscale.sp.Mesh or None, got tuple"):
        dd.parallelize_pipeline(pipe, mesh=(1, 2))
    with pytest.raises(ValueError, match="a mesh of 2 ranks needs torch.distributed initialized"):
        dd.parallelize_pipeline(pipe, mesh=sp.Mesh(1, 2))
    assert sp_pipeline.state_of(pipe) is None  # nothing changed
    assert _sp_plan.context_of(pipe.transformer) is None
    with pytest.raises(ValueError, match="strategy"):
        dd.parallelize_pipeline(tiny.make_pipeline("wan"), strategy="spiral")
    dd.parallelize_pipeline(pipe)
    with pytest.raises(ValueError, match="this WanPipeline is already parallelized"):
        dd.parallelize_pipeline(pipe)
    kwargs = call_kwargs("wan", True, pipe)
    kwargs["prompt_embeds"] = kwargs["prompt_embeds"].to("meta")
    with pytest.raises(ValueError, match="encoder_hidden_states is on meta"):
        pipe(**kwargs)
    other = tiny.make_pipeline("wan")
    other.transformer = tiny.make_pipeline("flux").transformer
    with pytest.raises(ValueError, match="transformer is a FluxTransformer2DModel"):
        dd.parallelize_pipeline(other)
    look_alike = type("FluxPipeline", (), {})()  # named like diffusers' class, not it
    with pytest.raises(ValueError, match="pipeline class 'FluxPipeline' of module "
                                         f"'{__name__}' is not diffusers' FluxPipeline"):
        dd.parallelize_pipeline(look_alike)


def _hooks(module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def _processors(module) -> dict:
    return {n: m.processor for n, m in module.named_modules() if hasattr(m, "processor")}


def test_unparallelize_pipeline_gives_the_stock_pipeline_back():
    name = "wan2.2"
    pipe = tiny.make_pipeline(name)
    ref = latents(pipe, name, True)
    pipe_class = type(pipe)
    parts = {k: getattr(pipe, k) for k in ("transformer", "transformer_2")}
    stock = {k: (type(t), _processors(t)) for k, t in parts.items()}
    dd.parallelize_pipeline(pipe)
    with pytest.raises(ValueError, match="belongs to a parallelized pipeline"):
        dd.unparallelize(pipe.transformer)
    assert dd.unparallelize_pipeline(pipe) is pipe
    assert type(pipe) is pipe_class and sp_pipeline.state_of(pipe) is None
    for k, t in parts.items():
        cls, processors = stock[k]
        assert type(t) is cls and _hooks(t) == 0 and _sp_plan.record_of(t) is None
        assert all(p is processors[n] for n, p in _processors(t).items())
    assert torch.equal(latents(pipe, name, True), ref)
    with pytest.raises(ValueError, match="this WanPipeline is not parallelized"):
        dd.unparallelize_pipeline(pipe)
    assert dd.unparallelize(dd.parallelize_pipeline(pipe)) is pipe  # the same through unparallelize
    assert type(pipe) is pipe_class


# ---- multi-process ------------------------------------------------------------------------

def _banded_decode(pipe, name: str):
    """The parallelized pipeline's VAE decodes in bands over both ranks: its decode of one
    latent against the stock VAE of the same weights."""
    assert sp_pipeline.state_of(pipe).vae is pipe.vae and "_decode" in pipe.vae.__dict__
    stock = tiny.make_pipeline(name).vae
    channels = stock.config.latent_channels
    z = torch.randn(1, channels, 9, 7, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, got = stock.decode(z).sample, pipe.vae.decode(z).sample
    return relative_error(got, ref), got


def compare_all(rank, world):
    """On every rank: per (pipeline, mode) the relative error against the single-process
    pipeline and the latents (the test compares them across ranks)."""
    results = {}
    for name in PIPELINES + ("wan2.2",):
        for mode in ("split", "unguided", "no-cfg-parallel"):
            guided = mode != "unguided"
            with torch.no_grad():
                ref = latents(tiny.make_pipeline(name), name, guided)
            pipe = dd.parallelize_pipeline(tiny.make_pipeline(name), strategy="ulysses",
                                           cfg_parallel=mode != "no-cfg-parallel")
            assert (sp_pipeline.state_of(pipe).halves is not None) == (mode != "no-cfg-parallel")
            got = latents(pipe, name, guided)
            results[(name, mode)] = (relative_error(got, ref), got)
            if mode == "split" and name in ("flux", "sd3"):  # undone: the stock pipeline's bits
                results[(name, "vae decode")] = _banded_decode(pipe, name)
                dd.unparallelize_pipeline(pipe)
                assert torch.equal(latents(pipe, name, guided), ref), name
                assert "_decode" not in pipe.vae.__dict__, name  # the stock VAE back
    with torch.no_grad():  # SD3's skip-layer pass (batch B) beside the split one
        ref = latents(tiny.make_pipeline("sd3"), "sd3", True, **SKIP_LAYERS)
    got = latents(dd.parallelize_pipeline(tiny.make_pipeline("sd3")), "sd3", True, **SKIP_LAYERS)
    results[("sd3", "split+skip-layers")] = (relative_error(got, ref), got)
    return results, refusals(rank)


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return "no error"


def refusals(rank) -> dict:
    """The call patterns a CFG split refuses, driven by hand on a split Flux pipeline."""
    pipe = dd.parallelize_pipeline(tiny.make_pipeline("flux"))
    state = sp_pipeline.state_of(pipe)
    t = pipe.transformer
    inputs = dict(hidden_states=torch.randn(1, 15, 16), timestep=torch.full((1,), 0.5),
                  guidance=torch.full((1,), 3.5), encoder_hidden_states=torch.randn(1, 5, 16),
                  pooled_projections=torch.randn(1, 8), txt_ids=torch.zeros(5, 3),
                  img_ids=torch.zeros(15, 3), return_dict=False)
    out = {}
    state.mode = "split"
    with torch.no_grad():
        out["no context"] = _error(lambda: t(**inputs))
        with t.cache_context("cond"):
            pending = t(**inputs)[0]
        out["pending used"] = _error(lambda: pending + 1)
        with t.cache_context("cond"):
            out["cond twice"] = _error(lambda: t(**inputs))
        with t.cache_context("uncond"):
            out["other latents"] = _error(lambda: t(**dict(inputs, hidden_states=inputs[
                "hidden_states"] + 1)))
        t_state = getattr(t, sp_pipeline.ATTR_CFG)
        t_state.first = t_state.pending = None
    out["grad"] = _error(lambda: t(**inputs))
    state.mode = "idle"

    class Unpaired:  # a pipeline body that makes a "cond" call and returns
        @staticmethod
        def __call__(self, **kwargs):
            with torch.no_grad(), self.transformer.cache_context("cond"):
                return self.transformer(**inputs)

    out["unpaired"] = _error(lambda: sp_pipeline._run(
        pipe, Unpaired, (), dict(true_cfg_scale=4.0, negative_prompt="x")))
    out["disagree"] = _error(lambda: pipe(**call_kwargs("flux", rank == 0, pipe)))
    from diffusers import FirstBlockCacheConfig

    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    out["cache"] = _error(lambda: pipe(**call_kwargs("flux", True, pipe)))
    return out


def test_every_pipeline_matches_the_single_process_one_under_2_processes():
    gloo_util = pytest.importorskip("gloo_util")
    results = gloo_util.run_gloo(compare_all, 2, timeout_s=240)
    (errors0, refused), (errors1, _) = results
    bad = {k: e for k, (e, _) in errors0.items() if not e <= TOLERANCE}
    assert not bad, f"relative errors above {TOLERANCE}: {bad}"
    for key in errors0:
        assert torch.equal(errors0[key][1], errors1[key][1]), f"{key}: ranks differ"
    expect = {"no context": "cache_context None; the step's first call is expected under 'cond'",
              "pending used": "'cond' output was used before its 'uncond' call",
              "cond twice": "cache_context 'cond' while the 'cond' call before it waits",
              "other latents": "another 'hidden_states' than the 'cond' call",
              "grad": "gradients enabled",
              "unpaired": "'cond' transformer call that no 'uncond' call followed",
              "disagree": "1 of 2 ranks run this pipeline call with guidance",
              "cache": "no error"}  # FirstBlockCache decides alike under the split: sp_cache
    for key, text in expect.items():
        assert text in refused[key], (key, refused[key])


HALF_CASES = (("default mesh", None, "ulysses"), ("2x2", (2, 2), "ring"),
              ("2x2", (2, 2), "auto"))


def split_on_halves_of_2(rank, world):
    results = {}
    for name in ("flux", "cogvideox"):
        with torch.no_grad():
            ref = latents(tiny.make_pipeline(name), name, True)
        for label, shape, strategy in HALF_CASES:
            mesh = sp.Mesh(*shape) if shape else None
            pipe = dd.parallelize_pipeline(tiny.make_pipeline(name), mesh=mesh, strategy=strategy)
            assert sp_pipeline.state_of(pipe).halves.mesh.size == 2
            got = latents(pipe, name, True)
            results[(name, label, strategy)] = (relative_error(got, ref), got)
    return results


def test_split_with_sequence_parallel_halves_under_4_processes():
    gloo_util = pytest.importorskip("gloo_util")
    results = gloo_util.run_gloo(split_on_halves_of_2, 4, timeout_s=300)
    bad = {k: e for k, (e, _) in results[0].items() if not e <= TOLERANCE}
    assert not bad, f"relative errors above {TOLERANCE}: {bad}"
    for rank in range(1, 4):
        for key, (_, got) in results[rank].items():
            assert torch.equal(got, results[0][key][1]), f"{key}: rank {rank} differs"
