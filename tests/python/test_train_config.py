"""``python -m ditscale.train``'s configuration and its errors, in-process (no process group
starts: every error is found before): ranges, TOML keys, a store of another model, a missing
shard, a checkpoint of another model; the docs' field table and examples/train.toml are the
declarations' own."""

import json
import os
import shutil

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

from ditscale.train import config as tc, docgen  # noqa: E402
from ditscale.train.cli import main  # noqa: E402
from train_util import REPO, make_toy_store  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_toy_store(tmp_path_factory.mktemp("toy") / "store", n=8)


def _error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ditscale.train: error: "), err
    return err[0]


def _base(store, out):
    from ditscale import ops

    fused = [] if ops.is_available() else ["--no-fused-adaln"]
    return ["--store", str(store), "--out", str(out), "--model", "tiny", "--device", "cpu",
            *fused]


def test_defaults_toml_and_flags(tmp_path, store):
    toml = tmp_path / "t.toml"
    toml.write_text('steps = 7\nmodel = "tiny"\n[optim]\nlr = 0.002\n[data]\ntail = "keep"\n')
    cfg = tc.load_config(["--config", str(toml), "--store", store, "--out", str(tmp_path),
                          "--steps", "9", "--no-tensorboard"])
    assert (cfg.steps, cfg.lr, cfg.tail, cfg.tensorboard, cfg.model) == (9, 0.002, "keep",
                                                                         False, "tiny")
    assert cfg.warmup_steps == tc.BY_NAME["warmup_steps"].default
    # the example config loads (its required fields given as flags)
    cfg = tc.load_config(["--config", str(REPO / "examples" / "train.toml"), "--store", store,
                          "--out", str(tmp_path)])
    assert cfg.policy == "balanced"


@pytest.mark.parametrize("argv, msg", [
    (["--lr", "5"], "lr: 5 is out of range [0, 1]"),
    (["--steps", "0"], "steps: 0 is out of range [1, 1000000000]"),
    (["--ema-decay", "1"], "ema_decay: 1 is out of range [0, 0.999999]"),
    (["--num-workers", "65"], "num_workers: 65 is out of range [0, 64]"),
    (["--validation-frames", "6"], "validation_frames: 6 is not 4k + 1"),
    (["--validation-width", "40"], "validation_width: 40 is not a multiple of 16"),
    (["--policy", "fast"], "policy: 'fast' is not one of equal-token, adaptive, balanced"),
    (["--model", "huge"], "model: 'huge' is neither a preset"),
])
def test_out_of_range(tmp_path, store, capsys, argv, msg):
    assert msg in _error(capsys, _base(store, tmp_path / "run") + argv)


def test_required_and_toml_errors(tmp_path, store, capsys):
    assert "store: required" in _error(capsys, ["--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:  # argparse: a flag that is no number
        main(_base(store, tmp_path) + ["--steps", "1.5"])
    assert e.value.code == 2 and "argument --steps: '1.5' is not an integer" in \
        capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nsteps = 3\n")
    assert "unknown key 'steps' in [optim] (it belongs in the top level)" in _error(
        capsys, _base(store, tmp_path) + ["--config", str(bad)])
    bad.write_text("[optim]\nlr = -1.0\n")
    msg = _error(capsys, _base(store, tmp_path) + ["--config", str(bad)])
    assert str(bad) in msg and "lr: -1 is out of range [0, 1]" in msg
    bad.write_text("[trainer]\nx = 1\n")
    assert "unknown table [trainer]" in _error(capsys, _base(store, tmp_path) +
                                               ["--config", str(bad)])
    bad.write_text("steps = \n")
    assert "not valid TOML" in _error(capsys, _base(store, tmp_path) + ["--config", str(bad)])


def _edit_store_json(src, dst, **fields):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "store.json")
    d = json.load(open(path))
    d.update(fields)
    json.dump(d, open(path, "w"))
    return str(dst)


def test_store_of_another_model(tmp_path, store, capsys):
    other = make_toy_store(tmp_path / "c8", n=4, channels=8)
    msg = _error(capsys, _base(other, tmp_path / "run"))
    assert "made for model 'tiny', not this one: latent_channels 8 (the model has 4)" in msg
    other = make_toy_store(tmp_path / "t32", n=4, text_dim=32)
    assert "text_dim 32 (the model has 16)" in _error(capsys, _base(other, tmp_path / "run"))
    patched = _edit_store_json(store, tmp_path / "p", patch=[1, 4, 4])
    assert "patch [1, 4, 4] (the model has [1, 2, 2])" in _error(
        capsys, _base(patched, tmp_path / "run"))


def test_missing_shard(tmp_path, store, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(store, broken)
    os.remove(broken / "shards" / "00000.safetensors")
    assert "missing shard shards/00000.safetensors (ids 0..7)" in _error(
        capsys, _base(broken, tmp_path / "run"))
    assert "no such latent store folder" in _error(capsys, _base(tmp_path / "nowhere",
                                                                 tmp_path / "run"))


def test_checkpoint_of_another_model(tmp_path, store, capsys):
    from ditscale.train import checkpoint

    ck = tmp_path / "run" / "checkpoints" / "step-000000004"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(json.dumps({"format": checkpoint.FORMAT, "step": 4,
                                              "model": {"dim": 128, "num_layers": 2}}))
    msg = _error(capsys, _base(store, tmp_path / "run"))
    assert f"checkpoint {str(ck)!r} is of another model: dim 128 (run: 24)" in msg
    msg = _error(capsys, _base(store, tmp_path / "run") + ["--resume", "never"])
    assert "resume: 'never' but" in msg
    assert "is not a checkpoint folder" in _error(
        capsys, _base(store, tmp_path / "run") + ["--resume", str(tmp_path / "none")])


def test_docs_and_example_are_generated():
    text = (REPO / "docs" / "train.md").read_text()
    begin, end = "<!-- fields:begin -->\n", "<!-- fields:end -->"
    table = text[text.index(begin) + len(begin): text.index(end)]
    assert table == docgen.markdown_table(), "regenerate: python -m ditscale.train.docgen"
    assert (REPO / "examples" / "train.toml").read_text() == docgen.example_toml(), \
        "regenerate: python -m ditscale.train.docgen --toml > examples/train.toml"
    assert len(tc.FIELDS) == len(tc.BY_NAME)
