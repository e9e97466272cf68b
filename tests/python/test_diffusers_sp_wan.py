"""ditscale.diffusers.parallelize for WanTransformer3DModel against the stock module.

Three small random-weight configurations (fp32, 2 blocks, 5 heads of 12, so Ulysses head groups
are uneven on 2 and 4 ranks; latents [2, 4, 3, 6, 10], patch (1, 2, 2): 45 video tokens, an odd
count): Wan 2.1 T2V (one timestep per sample), Wan 2.2 TI2V (one timestep per video token) and
Wan 2.1 I2V (CLIP image tokens through add_k_proj). At world size 1 the parallelized module gives
the stock output bit for bit; on 4 gloo processes, and on their two groups of 2, every strategy
gives it within fp32 tolerance (max abs error <= 1e-4 of the output's largest value), the
state_dict is unchanged, and bad input is refused with errors that name it.
"""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import WanTransformer3DModel  # noqa: E402

import ditscale.diffusers as dd  # noqa: E402
from ditscale import sp  # noqa: E402

KINDS = ("wan2.1", "wan2.2-ti2v", "wan2.1-i2v")
LATENT = (2, 4, 3, 6, 10)  # B, C, F, H, W
VIDEO_TOKENS = 3 * 3 * 5
TOLERANCE = 1e-4


def make_model(kind: str, num_layers: int = 2) -> WanTransformer3DModel:
    torch.manual_seed(0)
    config = dict(patch_size=(1, 2, 2), num_attention_heads=5, attention_head_dim=12,
                  in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=40,
                  num_layers=num_layers, rope_max_seq_len=64)
    if kind == "wan2.1-i2v":
        config.update(image_dim=8, added_kv_proj_dim=60)
    return WanTransformer3DModel(**config).eval()


def make_inputs(kind: str, latent=LATENT) -> dict:
    g = torch.Generator().manual_seed(1)
    batch = latent[0]
    tokens = latent[2] * (latent[3] // 2) * (latent[4] // 2)
    if kind == "wan2.2-ti2v":
        timestep = torch.randint(0, 1000, (batch, tokens), generator=g)
    else:
        timestep = torch.tensor([10, 500][:batch])
    # I2V: the attention splits the context at 512 text tokens (diffusers hard-codes it).
    text = 512 if kind == "wan2.1-i2v" else 7
    inputs = dict(hidden_states=torch.randn(*latent, generator=g), timestep=timestep,
                  encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                  return_dict=False)
    if kind == "wan2.1-i2v":
        inputs["encoder_hidden_states_image"] = torch.randn(batch, 5, 8, generator=g)
    return inputs


def run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


def same_state(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---- world size 1 ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_world_size_1_is_bit_identical_and_keeps_the_state_dict(kind):
    model = make_model(kind)
    inputs = make_inputs(kind)
    ref = run(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    assert dd.parallelize(model, strategy="ulysses") is model
    assert same_state(model.state_dict(), state)
    assert [id(p) for p in model.parameters()] == params
    assert torch.equal(run(model, inputs), ref)


def test_refuses_other_classes_and_twice():
    with pytest.raises(ValueError, match="class 'Linear' is not supported"):
        dd.parallelize(torch.nn.Linear(2, 2))
    model = dd.parallelize(make_model("wan2.1", 1))
    with pytest.raises(ValueError, match="already parallelized"):
        dd.parallelize(model)


def test_refuses_a_bad_mesh_argument():
    with pytest.raises(TypeError, match="mesh must be a ditscale.sp.Mesh"):
        dd.parallelize(make_model("wan2.1", 1), mesh=2)


def test_refuses_inputs_on_another_device():
    model = dd.parallelize(make_model("wan2.1", 1))
    inputs = make_inputs("wan2.1")
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"].to("meta")
    with pytest.raises(ValueError, match="encoder_hidden_states is on meta"):
        run(model, inputs)


def test_refuses_custom_processors_and_no_blocks():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class Custom(WanAttnProcessor):
        pass

    model = make_model("wan2.1", 1)
    model.blocks[0].attn2.set_processor(Custom())
    with pytest.raises(ValueError, match=r"blocks\[0\].attn2's attention processor is Custom"):
        dd.parallelize(model)
    with pytest.raises(ValueError, match="no blocks"):
        dd.parallelize(make_model("wan2.1", 0))


def test_self_attention_refuses_a_mask():
    model = dd.parallelize(make_model("wan2.1", 1))
    attn = model.blocks[0].attn1
    x = torch.randn(1, 4, 60)
    with pytest.raises(ValueError, match="attention_mask"):
        attn(x, None, torch.ones(1, 1, 4, 4, dtype=torch.bool), None)


# ---- several processes (gloo) ------------------------------------------------------------------

# The configurations other than the first differ from it before and after the attention only:
# they run the strategies of different kinds of schedule (all-to-all, ring, torus).
SOME_STRATEGIES = ("ulysses", "ring", "torus-2")


def strategy_cases(world: int):
    """(label, mesh (machines, gpus) or None = the group's own, strategy, options)."""
    two = (2, world // 2)
    return [("ulysses", None, "ulysses", {}),
            ("ulysses-overlap", None, "ulysses-overlap", {}),
            ("ring", None, "ring", {}),
            ("usp", two, "usp", {}),
            ("swiftfusion-tas", two, "swiftfusion-tas", {}),
            ("torus-1", two, "torus", {"chunks": 1}),
            ("torus-2", two, "torus", {"chunks": 2}),
            ("auto", None, "auto", {})]


def _errors_on(group, world: int) -> dict:
    """{(world, kind, strategy): relative error} of every configuration on the ranks of
    ``group`` (a process group of ``world`` ranks)."""
    errors = {}
    for kind in KINDS:
        model = make_model(kind)
        inputs = make_inputs(kind)
        ref = run(model, inputs)
        for label, shape, strategy, options in strategy_cases(world):
            if kind != KINDS[0] and label not in SOME_STRATEGIES:
                continue
            copied = copy.deepcopy(model)
            state = copied.state_dict()
            mesh = (sp.Mesh(*shape, group=group) if shape
                    else sp.Mesh.from_process_group(group))
            dd.parallelize(copied, mesh=mesh, strategy=strategy, **options)
            assert same_state(copied.state_dict(), state), (kind, label)
            errors[(world, kind, label)] = relative_error(run(copied, inputs), ref)
    return errors


def _rank_main(rank: int, world: int) -> dict:
    """On 4 ranks: every case on all 4, then on two groups of 2 ({0, 1} and {2, 3}); the
    refusals that need several ranks."""
    import torch.distributed as dist

    errors = _errors_on(None, world)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    errors.update(_errors_on(pairs[rank // 2], 2))
    _check_multi_rank_refusals(world)
    return errors


def _check_multi_rank_refusals(world: int) -> None:
    with pytest.raises(ValueError, match=f"has {2 * world} ranks, the process group {world}"):
        sp.Mesh(2, world)
    # fewer video tokens than ranks: latents [1, 4, 1, 2, 2] make one token
    model = dd.parallelize(make_model("wan2.1", 1))
    with pytest.raises(ValueError, match=f"1 image/video tokens cannot be split over {world}"):
        run(model, make_inputs("wan2.1", (1, 4, 1, 2, 2)))
    # per-token timesteps of the wrong length
    model = dd.parallelize(make_model("wan2.2-ti2v", 1))
    inputs = make_inputs("wan2.2-ti2v")
    inputs["timestep"] = inputs["timestep"][:, :-1]
    with pytest.raises(ValueError, match=f"timestep has {VIDEO_TOKENS - 1} values per sample"):
        run(model, inputs)
    # one timestep per sample given as [B, 1] broadcasts, as in the stock module
    model = make_model("wan2.2-ti2v", 1)
    inputs = make_inputs("wan2.2-ti2v")
    inputs["timestep"] = inputs["timestep"][:, :1]
    ref = run(model, inputs)
    assert relative_error(run(dd.parallelize(model), inputs), ref) <= TOLERANCE


def test_every_strategy_matches_stock_under_gloo_on_4_and_2_ranks():
    gloo_util = pytest.importorskip("gloo_util")  # tests/python/gloo_util.py
    results = gloo_util.run_gloo(_rank_main, 4, timeout_s=240)
    for rank, errors in enumerate(results):
        assert len(errors) == 2 * (8 + 2 * len(SOME_STRATEGIES))
        bad = {key: err for key, err in errors.items() if not err <= TOLERANCE}
        assert not bad, f"rank {rank}: errors above {TOLERANCE}: {bad}"
