"""ditscale.prepare's inputs and options: captions from sidecar .txt files, CSV / JSONL /
Parquet tables and WebDataset tars (the same media give the same shards either way), bad table
rows and tar members, frame resampling and resizing, and every option out of its range."""

import csv
import io
import json
import os
import subprocess
import sys
import tarfile
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ditscale import latent_store as ls
from ditscale.prepare import PrepareOptions, prepare
from ditscale.prepare import discover as disc
from ditscale.prepare import frames, options
from ditscale.prepare.probe import Probe
from media_util import make_corpus


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("small"), videos=4, images=2, bad=False)


def _run(inp, out):
    return prepare(PrepareOptions(input=str(inp), out=str(out), model="tiny", shard_size=4,
                                  progress=False))


def _write_tables(c, root):
    rows = [(rel, c.captions[rel]) for rel in c.good]
    with open(os.path.join(root, "t.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["caption", "path"])          # any column order
        w.writerows([(cap, rel) for rel, cap in rows])
    with open(os.path.join(root, "t.jsonl"), "w") as f:
        for rel, cap in rows:
            f.write(json.dumps({"path": rel, "caption": cap}) + "\n\n")
    pq.write_table(pa.table({"path": [r for r, _ in rows], "caption": [c for _, c in rows]}),
                   os.path.join(root, "t.parquet"))


def _write_tar(c, path):
    """The corpus as a WebDataset shard: key.EXT + key.txt (even keys) or key.json (odd)."""
    with tarfile.open(path, "w") as tf:
        for k, rel in enumerate(c.good):
            ext = os.path.splitext(rel)[1]
            tf.add(os.path.join(c.root, rel), arcname=f"s/{k:03d}{ext}")
            cap = c.captions[rel].encode() if k % 2 == 0 else json.dumps(
                {"caption": c.captions[rel]}).encode()
            info = tarfile.TarInfo(f"s/{k:03d}.{'txt' if k % 2 == 0 else 'json'}")
            info.size = len(cap)
            tf.addfile(info, io.BytesIO(cap))
        info = tarfile.TarInfo("s/999.mp4")      # a sample without a caption member
        with open(os.path.join(c.root, c.good[0]), "rb") as f:
            data = f.read()
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))


def test_tables_give_the_folder_order(small):
    _write_tables(small, small.root)
    folder, _ = disc.discover(small.root)
    for name in ("t.csv", "t.jsonl", "t.parquet"):
        items, bad = disc.discover(os.path.join(small.root, name))
        assert bad == [] and items == folder, name


def test_table_and_tar_stores_equal_the_folder_store(small, tmp_path):
    _write_tables(small, small.root)
    _write_tar(small, str(tmp_path / "shard-0000.tar"))
    a, b, t = tmp_path / "folder", tmp_path / "csv", tmp_path / "tar"
    _run(small.root, a)
    _run(os.path.join(small.root, "t.csv"), b)
    result = _run(tmp_path / "shard-0000.tar", t)
    assert result["bad"] == 1
    sa, sb, st = ls.LatentStore(str(a)), ls.LatentStore(str(b)), ls.LatentStore(str(t))
    for s in (sb, st):
        assert [x.sha256 for x in s.meta.shards] == [x.sha256 for x in sa.meta.shards]
    with open(st.manifest_path) as f:
        assert f.readlines()[1].startswith("shard-0000.tar/s/000.")
    with open(os.path.join(str(t), "bad_files.csv")) as f:
        assert "shard-0000.tar/s/999.mp4,no caption member for key s/999" in f.read()


def test_bad_rows_and_captions(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"")
    (tmp_path / "b.png").write_bytes(b"x")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe")
    items, bad = disc.discover(str(tmp_path))
    assert items == [] and [(x.path, x.reason.split(" (")[0]) for x in bad] == [
        ("a.mp4", "no caption"), ("b.png", "caption is not UTF-8")]
    (tmp_path / "t.csv").write_text("path,caption\n,x\nc.txt,y\nd.mp4\ne.mp4,ok\n")
    items, bad = disc.discover(str(tmp_path / "t.csv"))
    assert [(x.path, x.reason) for x in bad] == [
        ("t.csv:2", "no path"), ("c.txt", "not a media file (.mp4, .webm, .mov, .mkv, .png, "
                                          ".jpg, .jpeg, .webp)"),
        ("d.mp4", "no caption in the table")]
    assert [x.path for x in items] == ["e.mp4"]
    (tmp_path / "t.jsonl").write_text('{"path": "e.mp4", "caption": "ok"}\n{oops\n[1]\n')
    items, bad = disc.discover(str(tmp_path / "t.jsonl"))
    assert [x.path for x in items] == ["e.mp4"]
    assert bad[0].path == "t.jsonl:2" and bad[0].reason.startswith("not JSON")
    assert (bad[1].path, bad[1].reason) == ("t.jsonl:3", "no path")
    (tmp_path / "u.csv").write_text("file,caption\n")
    with pytest.raises(ValueError, match="u.csv: the header must have columns path and caption"):
        disc.discover(str(tmp_path / "u.csv"))
    (tmp_path / "x.tar").write_bytes(b"not a tar" * 100)
    items, bad = disc.discover(str(tmp_path / "x.tar"))
    assert bad[0].path == "x.tar" and bad[0].reason.startswith("unreadable tar")


def test_missing_media_of_a_table_is_a_bad_file(tmp_path):
    (tmp_path / "t.csv").write_text("path,caption\nnope.mp4,a caption\n")
    result = _run(tmp_path / "t.csv", tmp_path / "store")
    assert (result["good"], result["bad"]) == (0, 1)
    s = ls.LatentStore(str(tmp_path / "store"))
    assert len(s) == 0
    with open(tmp_path / "store" / "bad_files.csv") as f:
        assert f.read() == "path,reason\nnope.mp4,no such file\n"


def _fake(times):
    return [types.SimpleNamespace(time=t, n=k) for k, t in enumerate(times)]


def test_frames_resampled_by_timestamp():
    # 30 fps, 20 frames -> 8 fps: train_shape keeps floor(19 * 8 / 30) + 1 = 6 -> 5 frames
    probe = Probe(20, 40, 72, 30.0)
    targets = frames.target_times(probe, 5, 0.0, 8.0)
    chosen, n = frames._select(iter(_fake([k / 30 for k in range(20)])), targets, 30.0)
    # nearest to 0, 3.75, 7.5 (a tie: the earlier), 11.25, 15
    assert n == 20 and [f.n for f in chosen] == [0, 4, 7, 11, 15]
    # below the model's fps: consecutive frames, no resampling
    slow = Probe(9, 40, 72, 6.0)
    chosen, _ = frames._select(iter(_fake([0.5 + k / 6 for k in range(9)])),
                               frames.target_times(slow, 5, 0.5, 8.0), 6.0)
    assert [f.n for f in chosen] == [0, 1, 2, 3, 4]


def test_resize_covers_then_center_crops():
    img = np.zeros((40, 72, 3), np.uint8)
    img[:, 36:] = 255                                   # right half white
    x = frames.resize_crop(img, 16, 32)
    assert x.shape == (3, 16, 32) and x.dtype == torch.float32
    assert x.min() == -1 and x.max() == 1
    assert torch.all(x[:, :, :14] == -1) and torch.allclose(x[:, :, 18:], torch.ones(3, 16, 14))
    tall = frames.resize_crop(np.full((96, 64, 3), 51, np.uint8), 48, 32)
    assert tall.shape == (3, 48, 32) and torch.allclose(tall, torch.full_like(tall, -0.6))


@pytest.mark.parametrize("kw,match", [
    (dict(shard_size=0), r"--shard-size: 0 is out of range \[1, 65536\]"),
    (dict(shard_size=65537), r"--shard-size: 65537 is out of range"),
    (dict(seed=-1), r"--seed: -1 is out of range \[0, 9223372036854775807\]"),
    (dict(timeout_s=float("nan")), r"--timeout-s: nan is out of range \[1, 86400\]"),
    (dict(timeout_s=0.5), r"--timeout-s: 0.5 is out of range"),
    (dict(model="wan9"), "--model: 'wan9' is not one of tiny, wan2.1-1.3b, wan2.1-14b"),
    (dict(device="tpu"), "--device: 'tpu' is not one of cpu, cuda"),
    (dict(dtype="float16"), "--dtype: 'float16' is not one of float32, bfloat16"),
    (dict(out=""), "--out: expected a path"),
])
def test_bad_options(kw, match):
    args = dict(input="in", out="out", model="tiny")
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        PrepareOptions(**args)


def test_bad_options_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as e:
        options.from_args(["--input", "i", "--out", "o", "--model", "tiny", "--shard-size", "0"])
    assert e.value.code == 2
    assert "--shard-size: 0 is out of range [1, 65536]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        options.from_args(["--input", "i", "--out", "o", "--model", "tiny", "--seed", "1.5"])
    assert "--seed: invalid int value" in capsys.readouterr().err


def test_cli_errors_are_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "ditscale.prepare", "--input",
                        str(tmp_path / "nothing"), "--out", str(tmp_path / "s"), "--model",
                        "tiny", "--device", "cpu", "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--input: " in r.stderr and "no such file or folder" in r.stderr


def test_prefetched_keeps_order_and_errors():
    from ditscale.prepare.shards import prefetched
    assert list(prefetched(lambda x: x * x, range(7))) == [0, 1, 4, 9, 16, 25, 36]
    assert list(prefetched(lambda x: x, [])) == [] and list(prefetched(str, [5], 3)) == ["5"]

    def fail_at_3(x):
        if x == 3:
            raise ValueError("three")
        return x
    got = []
    with pytest.raises(ValueError, match="three"):
        for x in prefetched(fail_at_3, range(6)):
            got.append(x)
    assert got == [0, 1, 2]


def test_local_encoder_folders_equal_the_random_weights(small, tmp_path):
    """--vae / --text-encoder from a pipeline folder (vae/, text_encoder/, tokenizer/) holding
    the preset's seed-0 random weights give the same shards as the random weights."""
    from ditscale.prepare import encoders, presets
    preset = presets.get_preset("tiny")
    pipe = tmp_path / "pipe"
    vae, _ = encoders.load_vae(preset, None, torch.device("cpu"), torch.float32, 0)
    vae.save_pretrained(str(pipe / "vae"))
    enc, tok, _ = encoders.load_text_encoder(preset, None, torch.device("cpu"), torch.float32, 0)
    enc.save_pretrained(str(pipe / "text_encoder"))
    tok.save_pretrained(str(pipe / "tokenizer"))
    a = _run(small.root, tmp_path / "random")
    b = prepare(PrepareOptions(input=small.root, out=str(tmp_path / "local"), model="tiny",
                               shard_size=4, vae=str(pipe), text_encoder=str(pipe),
                               progress=False))
    assert a["good"] == b["good"] == 6
    sa, sb = ls.LatentStore(str(tmp_path / "random")), ls.LatentStore(str(tmp_path / "local"))
    assert [x.sha256 for x in sa.meta.shards] == [x.sha256 for x in sb.meta.shards]
    assert sb.meta.vae == str(pipe) and sa.meta.vae == "random:tiny"


def test_bad_encoder_folders(small, tmp_path):
    from ditscale.prepare import encoders, presets
    with pytest.raises(ValueError, match=r"--vae: .*: no config.json in it or in vae/"):
        encoders.load_vae(presets.get_preset("tiny"), str(tmp_path), "cpu", torch.float32, 0)
    enc, tok, _ = encoders.load_text_encoder(presets.get_preset("tiny"), None, "cpu",
                                             torch.float32, 0)
    enc.save_pretrained(str(tmp_path / "te"))
    tok.save_pretrained(str(tmp_path / "te"))
    with pytest.raises(ValueError, match=r"--text-encoder: .*te: width 16, the wan2.1-1.3b "
                                         r"transformer's text_dim is 4096"):
        encoders.load_text_encoder(presets.get_preset("wan2.1-1.3b"), str(tmp_path / "te"),
                                   "cpu", torch.float32, 0)
