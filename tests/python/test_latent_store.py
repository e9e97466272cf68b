"""The latent store's writer and reader (python/ditscale/latent_store.py): a round trip, the
done markers that make a prepare resumable, and every error of a damaged or foreign store."""

import json
import os

import pytest
import torch

from ditscale import latent_store as ls


def _samples(first, n, channels=4, text_dim=16):
    g = torch.Generator().manual_seed(first)
    out = []
    for k in range(n):
        latent = torch.randn(channels, 1 + k % 3, 2, 4, generator=g)
        text = torch.randn(3 + k, text_dim, generator=g)
        out.append((latent, text))
    return out


def _meta(shards, channels=4, text_dim=16):
    return ls.StoreMeta(model="tiny", latent_channels=channels, vae_stride=(4, 8, 8),
                        patch=(1, 2, 2), text_dim=text_dim, max_text_tokens=32, fps=8.0,
                        num_samples=sum(s.count for s in shards), shards=tuple(shards),
                        vae="random:tiny", text_encoder="random:tiny", shape_model="model.json")


def make_store(root, sizes=(3, 2)):
    """A finished store of shards of the given sizes; returns (path, samples by id)."""
    store = str(root / "store")
    shards, samples, first = [], [], 0
    for k, n in enumerate(sizes):
        part = _samples(first, n)
        shards.append(ls.write_shard(store, k, first, part))
        samples += part
        first += n
    with open(os.path.join(store, ls.MANIFEST_CSV), "w") as f:
        f.write("path,num_frames,height,width,fps,caption\n")
    ls.write_store_json(store, _meta(shards))
    return store, samples


def test_round_trip(tmp_path):
    store, samples = make_store(tmp_path)
    s = ls.LatentStore(store, verify=True)
    assert len(s) == 5 and s.meta.model == "tiny" and s.meta.patch == (1, 2, 2)
    assert s.meta.seed == 0
    assert s.manifest_path == os.path.join(os.path.abspath(store), "manifest.csv")
    for i in (4, 0, 3, 1, 2):   # random access across shards
        got = s[i]
        assert got["id"] == i and got["latent"].dtype == torch.bfloat16
        assert torch.equal(got["latent"], samples[i][0].to(torch.bfloat16))
        assert torch.equal(got["text"], samples[i][1].to(torch.bfloat16))
    assert s.shard_of(2) == 0 and s.shard_of(3) == 1
    with pytest.raises(IndexError, match="out of range"):
        s[5]
    assert ls.latent_shape(s.meta, 9, 32, 48) == (4, 3, 4, 6)


def test_shape_model_resolves_to_the_store_file(tmp_path):
    store, _ = make_store(tmp_path)
    s = ls.LatentStore(store)
    assert s.shape_model == "model.json"   # no such file: the name as written
    with open(os.path.join(store, "model.json"), "w") as f:
        f.write("{}")
    assert ls.LatentStore(store).shape_model == os.path.join(os.path.abspath(store), "model.json")


def test_shards_are_byte_identical_across_writes(tmp_path):
    shas = {ls.write_shard(str(tmp_path / str(k)), 0, 0, _samples(0, 3)).sha256 for k in range(6)}
    assert len(shas) == 1


def test_finished_shard(tmp_path):
    store = str(tmp_path / "s")
    info = ls.write_shard(store, 0, 0, _samples(0, 2))
    assert ls.finished_shard(store, 0, 0, 2) == info
    assert ls.finished_shard(store, 0, 0, 3) is None       # another plan of ids
    assert ls.finished_shard(store, 1, 2, 2) is None       # never written
    with open(os.path.join(store, info.file), "r+b") as f:  # a damaged file is redone
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    assert ls.finished_shard(store, 0, 0, 2) is None
    os.remove(os.path.join(store, info.file))
    assert ls.finished_shard(store, 0, 0, 2) is None


def test_unfinished_and_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such latent store"):
        ls.LatentStore(str(tmp_path / "nope"))
    store = str(tmp_path / "s")
    ls.write_shard(store, 0, 0, _samples(0, 2))     # shards but no store.json yet
    with pytest.raises(FileNotFoundError, match="unfinished"):
        ls.LatentStore(store)
    store, _ = make_store(tmp_path / "m")
    os.remove(os.path.join(store, "shards", "00001.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"missing shard shards/00001.safetensors"):
        ls.LatentStore(store)


def _edit(store, fn):
    p = os.path.join(store, "store.json")
    with open(p) as f:
        d = json.load(f)
    fn(d)
    with open(p, "w") as f:
        json.dump(d, f)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(version=2), r"version: 2 is out of range \[1, 1\]"),
    (lambda d: d.update(format="x"), "format: 'x' is not one of"),
    (lambda d: d.pop("text_dim"), "missing field 'text_dim'"),
    (lambda d: d.update(latent_channels=0), r"latent_channels: 0 is out of range \[1, 4096\]"),
    (lambda d: d.update(latent_channels=True), "latent_channels: expected an integer"),
    (lambda d: d.update(patch=[1, 2]), r"patch: expected \[t, h, w\]"),
    (lambda d: d.update(vae_stride=[4, 8, 65]), r"vae_stride\[2\]: 65 is out of range"),
    (lambda d: d.update(fps=float("nan")), "fps: nan is out of range"),
    (lambda d: d.update(num_samples=6), "shards hold 5 samples, num_samples is 6"),
    (lambda d: d.update(latent_dtype="float16"), "latent_dtype: 'float16' is not one of"),
    (lambda d: d["shards"][1].update(first_id=4), r"shards\[1\]: first_id: 4 is out of range"),
    (lambda d: d["shards"][0].update(file="../x.safetensors"), "is not shards/NNNNN"),
    (lambda d: d["shards"][0].update(sha256="abc"), "sha256: 'abc' is not 64"),
    (lambda d: d["shards"][0].update(count=0), r"count: 0 is out of range"),
    (lambda d: d.update(seed=-1), r"seed: -1 is out of range"),
])
def test_bad_store_json(tmp_path, edit, match):
    store, _ = make_store(tmp_path)
    _edit(store, edit)
    with pytest.raises(ValueError, match=match) as e:
        ls.LatentStore(store)
    assert "store.json" in str(e.value)


def test_not_json(tmp_path):
    store, _ = make_store(tmp_path)
    with open(os.path.join(store, "store.json"), "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        ls.LatentStore(store)


def test_verify_finds_a_changed_shard(tmp_path):
    store, _ = make_store(tmp_path)
    _edit(store, lambda d: d["shards"][0].update(sha256="0" * 64))
    ls.LatentStore(store)   # without verify: only presence is checked
    with pytest.raises(ValueError, match="00000.safetensors: sha256 differs"):
        ls.LatentStore(store, verify=True)


def test_check_model(tmp_path):
    store, _ = make_store(tmp_path)
    s = ls.LatentStore(store)
    s.check_model(latent_channels=4, patch=(1, 2, 2), text_dim=16)
    with pytest.raises(ValueError, match=r"made for model 'tiny'.*latent_channels 4 \(the model "
                                         r"has 16\).*text_dim 16 \(the model has 4096\)"):
        s.check_model(latent_channels=16, patch=[1, 2, 2], text_dim=4096)
    with pytest.raises(ValueError, match=r"patch \[1, 2, 2\] \(the model has \[2, 2, 2\]\)"):
        s.check_model(patch=(2, 2, 2))


def test_a_shard_of_the_wrong_model(tmp_path):
    store, _ = make_store(tmp_path)
    ls.write_shard(store, 1, 3, _samples(3, 2, channels=8))   # same ids, other channels
    _edit(store, lambda d: d["shards"][1].update(sha256=ls.sha256_of(
        os.path.join(store, "shards", "00001.safetensors"))))
    s = ls.LatentStore(store)
    s[0]
    with pytest.raises(ValueError, match=r"sample 3 has latent torch.bfloat16 \[8, 1, 2, 4\]"):
        s[3]


def test_a_damaged_shard(tmp_path):
    store, _ = make_store(tmp_path)
    with open(os.path.join(store, "shards", "00001.safetensors"), "wb") as f:
        f.write(b"\xff" * 16)
    s = ls.LatentStore(store)
    s[0]
    with pytest.raises(ValueError, match="shard shards/00001.safetensors is not a safetensors"):
        s[3]
    with pytest.raises(ValueError, match="00001.safetensors: sha256 differs"):
        ls.LatentStore(store, verify=True)


def test_pickles_without_open_shards(tmp_path):
    import pickle
    store, samples = make_store(tmp_path)
    s = ls.LatentStore(store)
    s[0]
    copy = pickle.loads(pickle.dumps(s))
    assert copy._open == {} and torch.equal(copy[4]["latent"], samples[4][0].to(torch.bfloat16))


def test_reopens_after_fork(tmp_path):
    store, samples = make_store(tmp_path)
    s = ls.LatentStore(store)
    s[0]
    s._pid = -1     # as a forked DataLoader worker sees it
    assert torch.equal(s[1]["text"], samples[1][1].to(torch.bfloat16)) and s._pid == os.getpid()
