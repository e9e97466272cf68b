"""A checkpoint's text encoders decide how prompts are given: all of them (the texts go
through them), none (stand-in embeddings seeded by the texts, the same seed for the same
texts), or some (refused by name: every prompt would fail inside the pipeline)."""

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from ditscale.diffusers import generation, tiny  # noqa: E402


def _tiny_clip():
    config = transformers.CLIPTextConfig(vocab_size=64, hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         max_position_embeddings=16, projection_dim=8)
    return transformers.CLIPTextModel(config)


def test_no_some_all_encoders():
    base = tiny.make_pipeline("flux")
    assert generation.has_text_encoders(base, "here") is False
    parts = dict(scheduler=base.scheduler, vae=base.vae, transformer=base.transformer)
    some = diffusers.FluxPipeline(text_encoder=_tiny_clip(), tokenizer=None, text_encoder_2=None,
                                  tokenizer_2=None, **parts)
    with pytest.raises(ValueError, match="here: the checkpoint has some of the pipeline's text "
                       "encoders / tokenizers but not text_encoder_2, tokenizer, tokenizer_2"):
        generation.has_text_encoders(some, "here")


def test_stand_in_seeds_follow_the_texts():
    seed = generation.stand_in_seed("a fox", "")
    assert seed == generation.stand_in_seed("a fox", "") and 0 <= seed < 2**63
    assert len({seed, generation.stand_in_seed("a fox", "blur"),
                generation.stand_in_seed("a cat", "")}) == 3
    # the two texts are separated: ("ab", "") and ("a", "b") differ
    assert generation.stand_in_seed("ab", "") != generation.stand_in_seed("a", "b")
