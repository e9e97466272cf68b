"""ditscale.diffusers.parallelize for SD3Transformer2DModel (CPU).

A small random-weight SD3.5-like model (5 heads of 8: uneven Ulysses head groups on 2 and 4
ranks; two JointTransformerBlocks: the first with dual attention (attn2 over the image), the last
context_pre_only; RMS q/k norms; the patch embedding's cropped positional embedding), batch 2,
a 10 x 6 latent of patch 2 (15 image tokens: uneven shards) and 5 text tokens, with ControlNet
residuals and skip_layers. Under 2 and 4 gloo processes every strategy gives the unparallelized
module's output on the same inputs; at one rank the output, the state_dict and the refusals are
checked in this process.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from ditscale import sp  # noqa: E402

BATCH, TEXT = 2, 5
TOLERANCE = 1e-4  # max abs error relative to max(1, max |reference|), fp32


def make_model():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=5, joint_attention_dim=16, caption_projection_dim=40,
        pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16,
        dual_attention_layers=(0,), qk_norm="rms_norm").eval()


def make_inputs(height=10, width=6, batch=BATCH, controlnet=True):
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, height, width, generator=g),
                  encoder_hidden_states=torch.randn(batch, TEXT, 16, generator=g),
                  pooled_projections=torch.randn(batch, 8, generator=g),
                  timestep=torch.linspace(10.0, 900.0, batch))
    if controlnet:
        tokens = (height // 2) * (width // 2)
        inputs["block_controlnet_hidden_states"] = [torch.randn(batch, tokens, 40, generator=g)]
    return inputs


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
    """On every rank: each strategy's relative error against the unparallelized module (plus
    skip_layers under ulysses), and the refusal of more ranks than image tokens."""
    base, inputs = make_model(), make_inputs()
    with torch.no_grad():
        ref = base(**inputs).sample
        ref_skip = base(**inputs, skip_layers=[0]).sample
        errors = {}
        for label, machines, strategy, options in cases(world):
            model = dd.parallelize(copy.deepcopy(base), mesh=sp.Mesh(machines, world // machines),
                                   strategy=strategy, **options)
            errors[label] = relative_error(model(**inputs).sample, ref)
            if label == "ulysses":
                errors["skip_layers"] = relative_error(model(**inputs, skip_layers=[0]).sample,
                                                       ref_skip)
        model = dd.parallelize(copy.deepcopy(base), strategy="ulysses")
        try:
            model(**make_inputs(height=2, width=2 * (world - 1), controlnet=False))
            refusal = ""
        except ValueError as e:
            refusal = str(e)
    return errors, refusal


@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_matches_the_stock_module_under_gloo(world):
    gloo_util = pytest.importorskip("gloo_util")
    results = gloo_util.run_gloo(run_all_strategies, world, timeout_s=240)
    for rank, (errors, refusal) in enumerate(results):
        assert set(errors) == {c[0] for c in cases(world)} | {"skip_layers"}
        bad = {k: e for k, e in errors.items() if not e <= TOLERANCE}
        assert not bad, f"rank {rank}: relative errors above {TOLERANCE}: {bad}"
        assert "cannot be split" in refusal and str(world) in refusal, refusal


def test_one_rank_matches_the_stock_module_and_keeps_the_state_dict():
    model, inputs = make_model(), make_inputs()
    before = model.state_dict()
    params = [id(p) for p in model.parameters()]
    with torch.no_grad():
        ref = model(**inputs).sample
        ref_skip = model(**inputs, skip_layers=[1]).sample
        assert dd.parallelize(model) is model
        out = model(**inputs).sample
        out_skip = model(**inputs, skip_layers=[1]).sample
    assert torch.equal(out, ref)  # the stock processors at one rank: the same bits
    assert torch.equal(out_skip, ref_skip)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, tensor in before.items():
        assert after[key].data_ptr() == tensor.data_ptr() and torch.equal(after[key], tensor), key
    assert [id(p) for p in model.parameters()] == params


def test_compiles_without_graph_breaks_at_one_rank():
    model, inputs = make_model(), make_inputs()
    with torch.no_grad():
        ref = model(**inputs).sample
        dd.parallelize(model)
        torch._dynamo.reset()
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(**inputs).sample
    assert relative_error(out, ref) <= 1e-6


def test_refuses_what_it_cannot_shard():
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    model = make_model()
    dd.parallelize(model)
    inputs = make_inputs()
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"].to("meta")
    with pytest.raises(ValueError, match="encoder_hidden_states is on meta"):
        model(**inputs)
    for key in ("attention_mask", "ip_adapter_image_embeds"):
        with pytest.raises(ValueError, match=key):
            model(**make_inputs(), joint_attention_kwargs={key: torch.ones(1)})

    class Custom(JointAttnProcessor2_0):
        pass

    model = make_model()
    model.transformer_blocks[0].attn2.set_processor(Custom())
    with pytest.raises(ValueError, match="transformer_blocks.0.attn2's attention processor"):
        dd.parallelize(model)

    model = make_model()
    model.fuse_qkv_projections()
    with pytest.raises(ValueError, match="FusedJointAttnProcessor2_0"):
        dd.parallelize(model)
