"""A checkpoint folder's transformer and VAE configs are checked before anything is allocated:
each hostile field (zero / negative sizes, strings, floats, 10^9 layers) is a ValueError naming
the file, the field, the value and the range; a config whose weights would not fit the memory
bound is refused by its size; a config that asks for more tensors than the weight files hold
is refused instead of left half-initialized. The tables cover every constructor argument of
every class, and the published models' configs pass them."""

import inspect
import json
import os
import re
import shutil
import time

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("accelerate")

from ditscale.diffusers import tiny  # noqa: E402
from ditscale.diffusers.checkpoint_config import (check_checkpoint, check_config,  # noqa: E402
                                                   check_sums, files_bytes, model_bytes,
                                                   read_config)
from ditscale.diffusers.checkpoint_ranges import COMPONENTS, RANGES  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny Flux and Wan checkpoints (saved without text encoders)."""
    root = tmp_path_factory.mktemp("checkpoints")
    for name in ("flux", "wan"):
        tiny.make_pipeline(name).save_pretrained(str(root / name))
    return root


def _mutated(saved, tmp_path, name, component, **fields):
    folder = tmp_path / f"{name}-edited"
    shutil.copytree(saved / name, folder)
    path = folder / component / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
    return folder, str(path)


@pytest.mark.parametrize("name, component, fields, message", [
    ("flux", "transformer", dict(attention_head_dim=0), "attention_head_dim: 0 is out of range "
     "[2, 1024]"),
    ("flux", "transformer", dict(num_attention_heads=-3), "num_attention_heads: -3 is out of "
     "range [1, 256]"),
    ("flux", "transformer", dict(num_layers="2"), "num_layers: expected an integer in [1, 256], "
     "got str '2'"),
    ("flux", "transformer", dict(patch_size=0), "patch_size: 0 is out of range [1, 16]"),
    ("flux", "transformer", dict(in_channels=1e12), "in_channels: expected an integer in "
     "[1, 1024], got float 1000000000000.0"),
    ("flux", "transformer", dict(num_layers=1e9), "num_layers: expected an integer in [1, 256]"),
    ("flux", "transformer", dict(num_layers=10**9), "num_layers: 1000000000 is out of range "
     "[1, 256]"),
    ("flux", "transformer", dict(axes_dims_rope=[2] * 9), "axes_dims_rope: a list of 9 items is "
     "out of range [1, 4]"),
    ("flux", "transformer", dict(axes_dims_rope=[2, 2, 2]), "axes_dims_rope: [2, 2, 2] sums to "
     "6, not attention_head_dim 8 (the rotary axes split the head dimension)"),
    ("flux", "transformer", dict(attention_head_dim=16), "axes_dims_rope: [2, 2, 4] sums to 8, "
     "not attention_head_dim 16"),
    ("flux", "vae", dict(block_out_channels=[8, -8]), "block_out_channels[1]: -8 is out of "
     "range [1, 8192]"),
    ("flux", "vae", dict(down_block_types=["Nope"] * 2), "down_block_types[0]: 'Nope' is not "
     "one of DownEncoderBlock2D"),
    ("flux", "vae", dict(scaling_factor=float("nan")), "scaling_factor: nan is out of range"),
    ("wan", "transformer", dict(patch_size=[1, 0, 2]), "patch_size[1]: 0 is out of range "
     "[1, 16]"),
    ("wan", "transformer", dict(rope_max_seq_len=0), "rope_max_seq_len: 0 is out of range"),
    ("wan", "transformer", dict(cross_attn_norm="yes"), "cross_attn_norm: expected true or "
     "false, got str 'yes'"),
    ("wan", "vae", dict(base_dim=0), "base_dim: 0 is out of range [1, 4096]"),
    ("wan", "vae", dict(z_dim=None), "z_dim: null is not allowed"),
])
def test_a_hostile_field_is_named_with_its_file_value_and_range(saved, tmp_path, name,
                                                                 component, fields, message):
    folder, path = _mutated(saved, tmp_path, name, component, **fields)
    begin = time.perf_counter()
    with pytest.raises(ValueError) as info:
        tiny.load_pipeline(name, str(folder))
    assert str(info.value).startswith(f"{path}: "), str(info.value)
    assert message in str(info.value), str(info.value)
    assert time.perf_counter() - begin < 30  # refused before anything is built


def test_the_memory_a_config_implies_is_bounded_before_allocation(saved, tmp_path):
    import psutil

    # every field in range, together ~10^5 GiB of weights: refused by the memory bound
    folder, _ = _mutated(saved, tmp_path, "flux", "transformer", num_layers=200,
                         attention_head_dim=1024, num_attention_heads=64,
                         axes_dims_rope=[256, 384, 384])
    rss = psutil.Process().memory_info().rss
    with pytest.raises(ValueError, match=re.escape(str(folder)) + r": its components take "
                       r"1.16e\+05 GiB in float32 \(transformer 1.16e\+05 GiB, vae .*\): out "
                       r"of range \[0, .*\] GiB, the memory available on cpu"):
        tiny.load_pipeline("flux", str(folder))
    assert psutil.Process().memory_info().rss - rss < 512 << 20
    # the bound is the caller's to set: the tiny checkpoint's few kB pass, 1 kB does not
    sizes = check_checkpoint("flux", str(saved / "flux"),
                             read_config(str(saved / "flux" / "model_index.json")))
    assert set(sizes) == {"transformer", "vae"} and all(0 < v < 1 << 20 for v in sizes.values())
    with pytest.raises(ValueError, match=r"out of range \[0, 9.54e-07\] GiB, the memory "
                       r"available$"):
        tiny.load_pipeline("flux", str(saved / "flux"), memory_bytes=1024)


def test_the_scheduler_and_huge_numbers_are_bounded(saved, tmp_path):
    folder = tmp_path / "wan-scheduler"
    shutil.copytree(saved / "wan", folder)
    path = str(folder / "scheduler" / "scheduler_config.json")
    config = json.loads(open(path).read())
    with open(path, "w") as f:
        json.dump({**config, "num_train_timesteps": 10**12}, f)
    with pytest.raises(ValueError, match=re.escape(path) + ": num_train_timesteps: "
                       "1000000000000 is out of range \\[1, 100000\\]"):
        tiny.load_pipeline("wan", str(folder))
    config_path = str(folder / "transformer" / "config.json")
    with open(config_path, "w") as f:  # 5000 digits: Python's int parser refuses them
        f.write('{"num_layers": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match=re.escape(config_path) + ": cannot read a JSON config"):
        tiny.load_pipeline("wan", str(folder))


def test_a_config_asking_for_more_than_the_weights_hold_is_refused(saved, tmp_path):
    folder, _ = _mutated(saved, tmp_path, "flux", "transformer", num_layers=2)
    with pytest.raises(ValueError, match=re.escape(os.path.join(str(folder), "transformer"))
                       + r": \d+ of the tensors its config.json describes are not in its weight "
                       r"files \(e.g. transformer_blocks.1"):
        tiny.load_pipeline("flux", str(folder))


def test_an_inconsistent_config_is_refused_by_name(saved, tmp_path):
    folder, path = _mutated(saved, tmp_path, "flux", "vae", norm_num_groups=3)
    with pytest.raises(ValueError, match=re.escape(path) + ": diffusers cannot build a "
                       "AutoencoderKL from it: ValueError: num_channels"):
        tiny.load_pipeline("flux", str(folder))


def test_the_index_and_the_config_files_are_checked(saved, tmp_path):
    folder = tmp_path / "flux-index"
    shutil.copytree(saved / "flux", folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["transformer"] = ["diffusers", "SD3Transformer2DModel"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model_index.json: transformer: "
                       "'SD3Transformer2DModel' is not 'FluxTransformer2DModel'"):
        tiny.load_pipeline("flux", str(folder))
    folder, path = _mutated(saved, tmp_path, "wan", "vae")
    with open(path, "w") as f:
        f.write("[" * 100000)
    with pytest.raises(ValueError, match=re.escape(path) + ": cannot read a JSON config"):
        tiny.load_pipeline("wan", str(folder))
    with open(path, "w") as f:
        f.write(" " * (2 << 20))
    with pytest.raises(ValueError, match=re.escape(path) + r": 2097152 bytes is out of range"):
        tiny.load_pipeline("wan", str(folder))


@pytest.mark.parametrize("cls_name", sorted(RANGES))
def test_the_tables_cover_every_constructor_argument(cls_name):
    params = set(inspect.signature(getattr(diffusers, cls_name).__init__).parameters) - {"self"}
    assert set(RANGES[cls_name]) == params


@pytest.mark.parametrize("cls_name", sorted(RANGES))
def test_each_numeric_bound_is_enforced(cls_name):
    """One below the low end and one above the high end of every numeric field, every class."""
    for key, spec in RANGES[cls_name].items():
        if spec.kind not in ("int", "real"):
            continue
        for bad in (spec.lo - 1, spec.hi * 2 + 1):
            bad = int(bad) if spec.kind == "int" else float(bad)
            with pytest.raises(ValueError, match=re.escape(f"x/config.json: {key}: ")):
                check_config(cls_name, {key: bad}, "x/config.json")


@pytest.mark.parametrize("name", tiny.PIPELINES)
def test_the_published_and_tiny_configs_pass(name):
    for size in tiny.SIZES:
        parts = tiny._parts(name, size)
        for key, cls_name in COMPONENTS[name].items():
            if key in parts:
                assert parts[key][0] == cls_name
                config = json.loads(json.dumps(parts[key][1]))
                check_config(cls_name, config, key)
                check_sums(cls_name, config, key)


def test_components_without_a_table_count_by_their_weight_files(saved, tmp_path):
    """The safetensors headers give the bytes in the requested dtype: the transformer's files
    agree with its meta-device build; a text encoder folder adds its own to the bound."""
    folder = saved / "flux" / "transformer"
    config = read_config(str(folder / "config.json"))
    for dtype in (torch.float32, torch.bfloat16):
        assert files_bytes(str(folder), dtype) == model_bytes(
            "FluxTransformer2DModel", config, dtype, "x")
    copy = tmp_path / "flux-encoders"
    shutil.copytree(saved / "flux", copy)
    shutil.copytree(folder, copy / "text_encoder")  # stands for an encoder's weight files
    index = read_config(str(copy / "model_index.json"))
    index["text_encoder"] = ["transformers", "CLIPTextModel"]
    sizes = check_checkpoint("flux", str(copy), index)
    assert sizes["text_encoder"] == sizes["transformer"]
    (copy / "text_encoder" / "diffusion_pytorch_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="text_encoder/diffusion_pytorch_model.safetensors: "
                       "cannot read its safetensors header"):
        check_checkpoint("flux", str(copy), index)
