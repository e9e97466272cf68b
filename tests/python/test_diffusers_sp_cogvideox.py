"""ditscale.diffusers.parallelize for CogVideoXTransformer3DModel, on the shared harness
(diffusers_sp_harness.py: one rank bit-identical, unparallelize, refusals, one gloo spawn of
4 ranks and two groups of 2 for every strategy).

Small random-weight configurations (fp32, 2 blocks, 5 heads of 16, so Ulysses head groups are
uneven on 2 and 4 ranks; 7 text tokens, latents of 45 video tokens, an odd count), one per
variant: CogVideoX 5B-like (rotary embedding), 2B-like (sinusoidal positional embedding, no
rotary), 5B I2V-like (rotary and learned positional embedding), 1.5-like (patch_size_t = 2) and
fused QKV projections. Tolerance: max abs error <= 1e-4 of the output's largest value.
"""

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import CogVideoXTransformer3DModel  # noqa: E402
from diffusers.models.embeddings import get_3d_rotary_pos_embed  # noqa: E402

import ditscale.diffusers as dd  # noqa: E402
from diffusers_sp_harness import SpFamilyTests  # noqa: E402

TEXT, HEIGHT, WIDTH, HEAD_DIM = 7, 6, 10, 16


def frames_of(kind: str) -> int:
    return 6 if kind == "cogvideox-1.5" else 3  # latent frames; 1.5 packs 2 per token


class TestCogVideoX(SpFamilyTests):
    KINDS = ("cogvideox-5b", "cogvideox-2b", "cogvideox-5b-i2v", "cogvideox-1.5", "fused-qkv")
    ERROR_FLOOR = 0.0
    DEVICE_INPUT = "image_rotary_emb"

    def make_model(self, kind, num_layers: int = 2):
        torch.manual_seed(0)
        token_frames = frames_of(kind) // (2 if kind == "cogvideox-1.5" else 1)
        config = dict(num_attention_heads=5, attention_head_dim=HEAD_DIM, in_channels=4,
                      out_channels=4, time_embed_dim=16, text_embed_dim=12,
                      num_layers=num_layers, sample_width=WIDTH, sample_height=HEIGHT,
                      sample_frames=(token_frames - 1) * 4 + 1, max_text_seq_length=TEXT,
                      use_rotary_positional_embeddings=kind != "cogvideox-2b",
                      use_learned_positional_embeddings=kind == "cogvideox-5b-i2v")
        if kind == "cogvideox-1.5":
            config["patch_size_t"] = 2
        model = CogVideoXTransformer3DModel(**config).eval()
        if kind == "fused-qkv":
            model.fuse_qkv_projections()
        return model

    def make_inputs(self, kind, frames=None, height=HEIGHT, width=WIDTH):
        g = torch.Generator().manual_seed(1)
        frames = frames_of(kind) if frames is None else frames
        token_frames = frames // (2 if kind == "cogvideox-1.5" else 1)
        rotary = None
        if kind != "cogvideox-2b":
            grid = (height // 2, width // 2)
            rotary = get_3d_rotary_pos_embed(HEAD_DIM, ((0, 0), grid), grid, token_frames)
        return dict(hidden_states=torch.randn(2, frames, 4, height, width, generator=g),
                    encoder_hidden_states=torch.randn(2, TEXT, 12, generator=g),
                    timestep=torch.tensor([10, 500]), image_rotary_emb=rotary,
                    return_dict=False)

    def too_few_tokens(self, kind, world):
        return self.make_inputs("cogvideox-5b", frames=1, height=2, width=2)  # one video token

    def multi_rank_checks(self, rank, world):
        # rotary tables for another video size
        model = dd.parallelize(self.make_model("cogvideox-5b", 1))
        inputs = self.make_inputs("cogvideox-5b")
        inputs["image_rotary_emb"] = tuple(t[:-1] for t in inputs["image_rotary_emb"])
        with pytest.raises(ValueError, match="cos table has 44 rows; the latents have 45"):
            self.run(model, inputs)
        return {}


def test_refuses_a_mask():
    fam = TestCogVideoX()
    model = dd.parallelize(fam.make_model("cogvideox-5b", 1))
    inputs = fam.make_inputs("cogvideox-5b")
    inputs["attention_kwargs"] = {"attention_mask": torch.ones(2, TEXT + 45, dtype=torch.bool)}
    with pytest.raises(ValueError, match="attention_mask"):
        fam.run(model, inputs)
