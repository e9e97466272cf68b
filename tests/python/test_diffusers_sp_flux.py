"""ditscale.diffusers.parallelize for FluxTransformer2DModel (CPU).

A small random-weight Flux (5 heads of 8: uneven Ulysses head groups on 2 and 4 ranks; one
double- and one single-stream block; guidance embedding), batch 2, 15 image tokens (odd: uneven
shards) and 5 text tokens, with ControlNet residuals. Under 2 and 4 gloo processes every
strategy gives the unparallelized module's output on the same inputs; at one rank (no process
group) the output, the state_dict and the refusals are checked in this process.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from ditscale import sp  # noqa: E402

IMAGE, TEXT, BATCH = 15, 5, 2
TOLERANCE = 1e-4  # max abs error relative to max(1, max |reference|), fp32


def make_model():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=5, joint_attention_dim=16, pooled_projection_dim=8,
        guidance_embeds=True, axes_dims_rope=(2, 2, 4)).eval()


def make_inputs(image=IMAGE, text=TEXT, batch=BATCH):
    g = torch.Generator().manual_seed(1)
    side = (image + 2) // 3
    ids = torch.stack([torch.zeros(image), torch.arange(image) // side,
                       torch.arange(image) % side], 1)
    return dict(
        hidden_states=torch.randn(batch, image, 4, generator=g),
        encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
        pooled_projections=torch.randn(batch, 8, generator=g),
        timestep=torch.linspace(0.2, 0.8, batch), img_ids=ids, txt_ids=torch.zeros(text, 3),
        guidance=torch.linspace(2.0, 4.0, batch),
        controlnet_block_samples=[torch.randn(batch, image, 40, generator=g)],
        controlnet_single_block_samples=[torch.randn(batch, image, 40, generator=g)])


def relative_error(out, ref):
    return float((out - ref).abs().max()) / max(1.0, float(ref.abs().max()))


def cases(world):
    """(label, machines, strategy, options) of every strategy on ``world`` ranks."""
    two = 2 if world % 2 == 0 else 1
    return [("ulysses", 1, "ulysses", {}), ("ulysses-overlap", 1, "ulysses-overlap", {}),
            ("ring", 1, "ring", {}),
            ("usp", two, "usp", {}), ("swiftfusion-tas", two, "swiftfusion-tas", {}),
            ("torus-1", two, "torus", {"chunks": 1}), ("torus-2", two, "torus", {"chunks": 2}),
            ("auto", 1, "auto", {})]


def run_all_strategies(rank, world):
    """On every rank: each strategy's relative error against the unparallelized module, and the
    refusal of a mesh with more ranks than image tokens."""
    base, inputs = make_model(), make_inputs()
    with torch.no_grad():
        ref = base(**inputs).sample
        errors = {}
        for label, machines, strategy, options in cases(world):
            model = dd.parallelize(copy.deepcopy(base), mesh=sp.Mesh(machines, world // machines),
                                   strategy=strategy, **options)
            errors[label] = relative_error(model(**inputs).sample, ref)
        model = dd.parallelize(copy.deepcopy(base), strategy="ulysses")
        try:
            model(**make_inputs(image=world - 1))
            refusal = ""
        except ValueError as e:
            refusal = str(e)
    return errors, refusal


@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_matches_the_stock_module_under_gloo(world):
    gloo_util = pytest.importorskip("gloo_util")
    results = gloo_util.run_gloo(run_all_strategies, world, timeout_s=240)
    for rank, (errors, refusal) in enumerate(results):
        bad = {k: e for k, e in errors.items() if not e <= TOLERANCE}
        assert not bad, f"rank {rank}: relative errors above {TOLERANCE}: {bad}"
        assert "cannot be split" in refusal and str(world) in refusal, refusal


def test_one_rank_matches_the_stock_module_and_keeps_the_state_dict():
    model, inputs = make_model(), make_inputs()
    before = model.state_dict()
    params = [id(p) for p in model.parameters()]
    with torch.no_grad():
        ref = model(**inputs).sample
        assert dd.parallelize(model) is model
        out = model(**inputs).sample
        no_controlnet = {k: v for k, v in inputs.items() if not k.startswith("controlnet")}
        ref2 = make_model()(**no_controlnet).sample
        out2 = model(**no_controlnet).sample
    assert torch.equal(out, ref)  # the stock processors at one rank: the same bits
    assert torch.equal(out2, ref2)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, tensor in before.items():
        assert after[key] is tensor or (after[key].data_ptr() == tensor.data_ptr()
                                        and torch.equal(after[key], tensor)), key
    assert [id(p) for p in model.parameters()] == params


def test_fused_qkv_projections():
    model, inputs = make_model(), make_inputs()
    with torch.no_grad():
        ref = model(**inputs).sample
        model.fuse_qkv_projections()
        dd.parallelize(model)
        assert model.transformer_blocks[0].attn.fused_projections
        assert relative_error(model(**inputs).sample, ref) <= 1e-5


def test_compiles_without_graph_breaks_at_one_rank():
    model, inputs = make_model(), make_inputs()
    with torch.no_grad():
        ref = model(**inputs).sample
        dd.parallelize(model)
        torch._dynamo.reset()
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(**inputs).sample
    assert relative_error(out, ref) <= 1e-6


def test_refuses_what_it_cannot_shard():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    with pytest.raises(ValueError, match="class 'Linear' is not supported"):
        dd.parallelize(torch.nn.Linear(2, 2))

    model = make_model()
    dd.parallelize(model)
    with pytest.raises(ValueError, match="already parallelized"):
        dd.parallelize(model)
    inputs = make_inputs()
    inputs["hidden_states"] = inputs["hidden_states"].to("meta")
    with pytest.raises(ValueError, match="hidden_states is on meta"):
        model(**inputs)
    for key in ("attention_mask", "ip_adapter_image_embeds"):
        with pytest.raises(ValueError, match=key):
            model(**make_inputs(), joint_attention_kwargs={key: torch.ones(1)})

    class Custom(FluxAttnProcessor):
        pass

    model = make_model()
    model.single_transformer_blocks[0].attn.set_processor(Custom())
    with pytest.raises(ValueError, match="block 1's attention processor is Custom"):
        dd.parallelize(model)

    model = make_model()
    model._parallel_config = object()  # what diffusers' enable_parallelism leaves
    with pytest.raises(ValueError, match="enable_parallelism"):
        dd.parallelize(model)
