"""ditscale.diffusers.parallelize for HunyuanVideoTransformer3DModel (CPU).

A small random-weight HunyuanVideo (5 heads of 8: uneven Ulysses head groups on 2 and 4 ranks;
one double- and one single-stream block, one token-refiner block; guidance embedding), batch 2,
a 3 x 2 x 10 latent of patch (1, 2, 2) (15 video tokens: uneven shards) and 6 text tokens with
an encoder_attention_mask that pads the prompts: all valid, both samples padded alike, and
samples padded differently (one attention call per sample).

What is compared: the model's output (the video tokens, all of them) against the
unparallelized module on the same inputs, and the text stream after each block at the valid
text positions (the padded positions are keys for nobody under the stock mask and never reach
the output; there the integration leaves attention outputs of zero, see sp_hunyuan_video).
Under 2 and 4 gloo processes for every strategy; at one rank (the stock processors, bit for
bit, and the sequence-parallel processors' own path), plus the state_dict and the refusals, in
this process.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
from ditscale import sp  # noqa: E402

BATCH, TEXT = 2, 6
VALID_TEXT = ([6, 6], [4, 4], [6, 3])  # valid text tokens per sample
TOLERANCE = 1e-4  # max abs error relative to max(1, max |reference|), fp32


def make_model(**config):
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    return HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=5, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4),
        guidance_embeds=True, **config).eval()


def make_inputs(valid, frames=3, width=10):
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(TEXT)[None] < torch.tensor(valid)[:, None]).long()
    return dict(hidden_states=torch.randn(BATCH, 4, frames, 2, width, generator=g),
                timestep=torch.linspace(10.0, 900.0, BATCH),
                encoder_hidden_states=torch.randn(BATCH, TEXT, 16, generator=g),
                encoder_attention_mask=mask,
                pooled_projections=torch.randn(BATCH, 8, generator=g),
                guidance=torch.linspace(2.0, 6.0, BATCH))


def run(model, inputs):
    """(output, [text stream after each block]) of one forward pass."""
    texts = []
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
    hooks = [b.register_forward_hook(lambda m, a, out: texts.append(out[1])) for b in blocks]
    try:
        with torch.no_grad():
            return model(**inputs).sample, texts
    finally:
        for h in hooks:
            h.remove()


def errors_against(model, reference, inputs, valid):
    """Relative errors of the output and of the valid text positions of every block;
    ``reference``: run() of the stock module on ``inputs``."""
    (out, texts), (ref, ref_texts) = run(model, inputs), reference
    scale = max(1.0, float(ref.abs().max()))
    errors = [float((out - ref).abs().max()) / scale]
    for t, r in zip(texts, ref_texts):
        errors.append(max(float((t[b, :n] - r[b, :n]).abs().max()) / max(1.0, float(r.abs().max()))
                          for b, n in enumerate(valid)))
    return max(errors)


def cases(world):
    """(label, machines, strategy, options) of every strategy on ``world`` ranks."""
    two = 2 if world % 2 == 0 else 1
    return [("ulysses", 1, "ulysses", {}), ("ulysses-overlap", 1, "ulysses-overlap", {}),
            ("ring", 1, "ring", {}),
            ("usp", two, "usp", {}), ("swiftfusion-tas", two, "swiftfusion-tas", {}),
            ("torus-1", two, "torus", {"chunks": 1}), ("torus-2", two, "torus", {"chunks": 2}),
            ("auto", 1, "auto", {})]


def run_all_strategies(rank, world):
    """On every rank: each strategy's relative error (every padding pattern) against the
    unparallelized module, and the refusal of more ranks than video tokens."""
    base = make_model()
    references = {tuple(valid): run(base, make_inputs(valid)) for valid in VALID_TEXT}
    errors = {}
    for label, machines, strategy, options in cases(world):
        model = dd.parallelize(copy.deepcopy(base), mesh=sp.Mesh(machines, world // machines),
                               strategy=strategy, **options)
        for valid in VALID_TEXT:
            errors[f"{label} {valid}"] = errors_against(model, references[tuple(valid)],
                                                        make_inputs(valid), valid)
    model = dd.parallelize(copy.deepcopy(base), strategy="ulysses")
    try:
        with torch.no_grad():
            model(**make_inputs([6, 6], frames=1, width=2 * (world - 1)))
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
    base = make_model()
    model = copy.deepcopy(base)
    before = model.state_dict()
    params = [id(p) for p in model.parameters()]
    assert dd.parallelize(model) is model
    for valid in VALID_TEXT:  # the stock processors at one rank: the same bits
        inputs = make_inputs(valid)
        (out, texts), (ref, ref_texts) = run(model, inputs), run(base, inputs)
        assert torch.equal(out, ref) and all(map(torch.equal, texts, ref_texts)), valid
    after = model.state_dict()
    assert list(after) == list(before)
    for key, tensor in before.items():
        assert after[key].data_ptr() == tensor.data_ptr() and torch.equal(after[key], tensor), key
    assert [id(p) for p in model.parameters()] == params


class ShardedPath:
    """A processor that always takes the sequence-parallel path of the integration's processor
    ``proc`` (on one rank the integration runs the stock processor instead; the shard, rotary and
    gather hooks it leaves out there are identities at one rank)."""

    def __init__(self, proc):
        self.proc = proc

    # The stock signature: diffusers' Attention drops keyword arguments __call__ does not name.
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        return self.proc.sharded(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 image_rotary_emb)


def sharded_path(model):
    for block in list(model.transformer_blocks) + list(model.single_transformer_blocks):
        block.attn.set_processor(ShardedPath(block.attn.processor))
    return model


def test_one_rank_sharded_path_matches_the_stock_module():
    base = make_model()
    model = sharded_path(dd.parallelize(copy.deepcopy(base)))
    for valid in VALID_TEXT:
        inputs = make_inputs(valid)
        assert errors_against(model, run(base, inputs), inputs, valid) <= 1e-6, valid


def test_padded_text_positions_get_zero_attention():
    model = sharded_path(dd.parallelize(make_model()))
    block = model.transformer_blocks[0]
    seen = []
    block.attn.register_forward_hook(lambda m, a, out: seen.append(out[1]))
    run(model, make_inputs([6, 3]))
    bias = block.attn.to_add_out.bias
    assert torch.equal(seen[0][1, 3:], bias.expand(3, -1))  # to_add_out(0)
    assert not torch.equal(seen[0][0, 3:], bias.expand(3, -1))


def test_refuses_what_it_cannot_shard():
    from diffusers.models.transformers.transformer_hunyuan_video import (
        HunyuanVideoAttnProcessor2_0)

    model = dd.parallelize(make_model())
    inputs = make_inputs([6, 6])
    inputs["encoder_attention_mask"] = inputs["encoder_attention_mask"].to("meta")
    with pytest.raises(ValueError, match="encoder_attention_mask is on meta"):
        model(**inputs)

    # A key mask that hides a video token (the processor reads the mask the blocks get).
    attn = model.transformer_blocks[0].attn
    x = torch.randn(BATCH, 15, 40)
    mask = torch.ones(BATCH, 1, 1, 15 + TEXT, dtype=torch.bool)
    mask[0, 0, 0, 2] = False
    with pytest.raises(ValueError, match="masking video tokens"):
        attn.processor.sharded(attn, x, torch.randn(BATCH, TEXT, 40), attention_mask=mask)

    with pytest.raises(ValueError, match="token_replace"):
        dd.parallelize(make_model(image_condition_type="token_replace"))

    class Custom(HunyuanVideoAttnProcessor2_0):
        pass

    model = make_model()
    model.single_transformer_blocks[0].attn.set_processor(Custom())
    with pytest.raises(ValueError, match="single_transformer_blocks.0.attn's processor is Custom"):
        dd.parallelize(model)
