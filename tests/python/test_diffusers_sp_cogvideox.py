"""ditscale.diffusers.parallelize for CogVideoXTransformer3DModel against the stock module.

Small random-weight configurations (fp32, 2 blocks, 5 heads of 16, so Ulysses head groups are
uneven on 2 and 4 ranks; 7 text tokens, latents of 45 video tokens, an odd count), one per
variant: CogVideoX 5B-like (rotary embedding), 2B-like (sinusoidal positional embedding, no
rotary), 5B I2V-like (rotary and learned positional embedding), 1.5-like (patch_size_t = 2) and
fused QKV projections. At world size 1 the parallelized module gives the stock output bit for
bit; on 4 gloo processes, and on their two groups of 2, every strategy gives it within fp32
tolerance (max abs error <= 1e-4 of the output's largest value), the state_dict is unchanged,
and bad input is refused with errors that name it.
"""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import CogVideoXTransformer3DModel  # noqa: E402
from diffusers.models.embeddings import get_3d_rotary_pos_embed  # noqa: E402

import ditscale.diffusers as dd  # noqa: E402
from ditscale import sp  # noqa: E402

KINDS = ("cogvideox-5b", "cogvideox-2b", "cogvideox-5b-i2v", "cogvideox-1.5", "fused-qkv")
TEXT, HEIGHT, WIDTH, HEAD_DIM = 7, 6, 10, 16
TOLERANCE = 1e-4


def frames_of(kind: str) -> int:
    return 6 if kind == "cogvideox-1.5" else 3  # latent frames; 1.5 packs 2 per token


def make_model(kind: str, num_layers: int = 2) -> CogVideoXTransformer3DModel:
    torch.manual_seed(0)
    token_frames = frames_of(kind) // (2 if kind == "cogvideox-1.5" else 1)
    config = dict(num_attention_heads=5, attention_head_dim=HEAD_DIM, in_channels=4,
                  out_channels=4, time_embed_dim=16, text_embed_dim=12, num_layers=num_layers,
                  sample_width=WIDTH, sample_height=HEIGHT, sample_frames=(token_frames - 1) * 4 + 1,
                  max_text_seq_length=TEXT,
                  use_rotary_positional_embeddings=kind != "cogvideox-2b",
                  use_learned_positional_embeddings=kind == "cogvideox-5b-i2v")
    if kind == "cogvideox-1.5":
        config["patch_size_t"] = 2
    model = CogVideoXTransformer3DModel(**config).eval()
    if kind == "fused-qkv":
        model.fuse_qkv_projections()
    return model


def make_inputs(kind: str, frames=None, height=HEIGHT, width=WIDTH) -> dict:
    g = torch.Generator().manual_seed(1)
    frames = frames_of(kind) if frames is None else frames
    token_frames = frames // (2 if kind == "cogvideox-1.5" else 1)
    rotary = None
    if kind != "cogvideox-2b":
        grid = (height // 2, width // 2)
        rotary = get_3d_rotary_pos_embed(HEAD_DIM, ((0, 0), grid), grid, token_frames)
    return dict(hidden_states=torch.randn(2, frames, 4, height, width, generator=g),
                encoder_hidden_states=torch.randn(2, TEXT, 12, generator=g),
                timestep=torch.tensor([10, 500]), image_rotary_emb=rotary, return_dict=False)


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
    assert dd.parallelize(model, strategy="ring") is model
    assert same_state(model.state_dict(), state)
    assert torch.equal(run(model, inputs), ref)


def test_refuses_inputs_on_another_device():
    model = dd.parallelize(make_model("cogvideox-5b", 1))
    inputs = make_inputs("cogvideox-5b")
    inputs["image_rotary_emb"] = tuple(t.to("meta") for t in inputs["image_rotary_emb"])
    with pytest.raises(ValueError, match="image_rotary_emb is on meta"):
        run(model, inputs)


def test_refuses_custom_processors_and_masks():
    from diffusers.models.attention_processor import AttnProcessor2_0

    model = make_model("cogvideox-5b", 1)
    model.transformer_blocks[0].attn1.set_processor(AttnProcessor2_0())
    with pytest.raises(ValueError, match=r"attn1's attention processor is AttnProcessor2_0"):
        dd.parallelize(model)
    model = dd.parallelize(make_model("cogvideox-5b", 1))
    inputs = make_inputs("cogvideox-5b")
    inputs["attention_kwargs"] = {"attention_mask": torch.ones(2, TEXT + 45, dtype=torch.bool)}
    with pytest.raises(ValueError, match="attention_mask"):
        run(model, inputs)


# ---- several processes (gloo) ------------------------------------------------------------------

# The variants other than the first differ from it before and after the attention only: they run
# the strategies of different kinds of schedule (all-to-all, ring, torus).
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
    """{(world, kind, strategy): relative error} of every variant on the ranks of ``group`` (a
    process group of ``world`` ranks)."""
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
    # fewer video tokens than ranks: latents of 1 frame of 2 x 2 make one token
    model = dd.parallelize(make_model("cogvideox-2b", 1))
    with pytest.raises(ValueError, match=f"1 image/video tokens cannot be split over {world}"):
        run(model, make_inputs("cogvideox-2b", frames=1, height=2, width=2))
    # rotary tables for another video size
    model = dd.parallelize(make_model("cogvideox-5b", 1))
    inputs = make_inputs("cogvideox-5b")
    inputs["image_rotary_emb"] = tuple(t[:-1] for t in inputs["image_rotary_emb"])
    with pytest.raises(ValueError, match="cos table has 44 rows; the latents have 45"):
        run(model, inputs)


def test_every_strategy_matches_stock_under_gloo_on_4_and_2_ranks():
    gloo_util = pytest.importorskip("gloo_util")  # tests/python/gloo_util.py
    results = gloo_util.run_gloo(_rank_main, 4, timeout_s=240)
    for rank, errors in enumerate(results):
        assert len(errors) == 2 * (8 + (len(KINDS) - 1) * len(SOME_STRATEGIES))
        bad = {key: err for key, err in errors.items() if not err <= TOLERANCE}
        assert not bad, f"rank {rank}: errors above {TOLERANCE}: {bad}"
