"""python -m ditscale.prepare end to end on a generated corpus (tests/python/media_util.py):
the store's contents against the corpus, 1 and 2 gloo ranks giving byte-identical stores and
reports, and an interrupted run resuming to the same bytes without redoing finished shards."""

import csv
import json
import os
import shutil
import subprocess
import sys

import pytest

import ditscale
from ditscale import latent_store as ls
from ditscale.prepare import PrepareOptions, prepare
from ditscale.prepare import group as prepare_group
from gloo_util import free_port, run_gloo
from media_util import make_corpus

SHARD = 8


def _options(media, out, **kw):
    return PrepareOptions(input=str(media), out=str(out), model="tiny", shard_size=SHARD,
                          progress=False, **kw)


def _prepare_rank(rank, world, media, out):
    return prepare(_options(media, out))


def tree(store):
    """{relative path: bytes} of every file under the store."""
    out = {}
    for dirpath, _, files in os.walk(store):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, store)] = f.read()
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("media"), videos=26, images=12)


@pytest.fixture(scope="module")
def one_rank(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "store"
    result = prepare(_options(corpus.root, out))
    return str(out), result


def test_store_matches_the_corpus(corpus, one_rank):
    store, result = one_rank
    assert (result["good"], result["bad"], result["inputs"]) == (38, 3, 41)
    assert result["shards"] == 5 and result["encoded"] == 38 and result["reused"] == 0
    s = ls.LatentStore(store, verify=True)
    s.check_model(latent_channels=4, patch=(1, 2, 2), text_dim=16)
    assert (s.meta.vae, s.meta.text_encoder, s.meta.seed) == ("random:tiny", "random:tiny", 0)
    with open(s.manifest_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["path"] for r in rows] == corpus.good and len(s) == 38
    for i, r in enumerate(rows):
        frames, h, w, fps = corpus.shapes[r["path"]]
        assert (int(r["num_frames"]), int(r["height"]), int(r["width"])) == (frames, h, w)
        assert r["fps"] == ("" if frames == 1 else f"{fps:g}")
        assert r["caption"] == corpus.captions[r["path"]]
        shape = ditscale.train_shape(frames, h, w, fps, s.shape_model)
        sample = s[i]
        assert tuple(sample["latent"].shape) == ls.latent_shape(
            s.meta, shape["frames"], shape["height"], shape["width"])
        assert sample["text"].shape == (len(r["caption"].encode()) + 1, 16)  # bytes + </s>
    with open(os.path.join(store, "report.json")) as f:
        report = json.load(f)
    assert {b["path"] for b in report["bad_files"]} == set(corpus.bad)
    assert (report["good"], report["bad"]) == (38, 3)
    # the sampler and the planner read the manifest with the store's shape rule
    sampler = ditscale.BalancedBatchSampler(s.manifest_path, 0, 1, model=s.shape_model,
                                            policy="equal-token", tail="keep")
    assert sorted(i for b in sampler for i in b) == list(range(38))


def test_bad_file_reasons(one_rank):
    store, _ = one_rank
    with open(os.path.join(store, "bad_files.csv"), newline="") as f:
        reasons = {r["path"]: r["reason"] for r in csv.DictReader(f)}
    assert reasons["clips/bad_empty.mp4"] == "empty file"
    assert reasons["clips/bad_text.mp4"].startswith("unreadable: Invalid data")
    assert reasons["clips/bad_truncated.mp4"].startswith("unreadable:")


def test_two_ranks_give_the_same_bytes(corpus, one_rank, tmp_path):
    out = tmp_path / "two"
    results = run_gloo(_prepare_rank, 2, corpus.root, str(out), timeout_s=600)
    assert [r["encoded"] for r in results] == [38, 38]   # the totals, on every rank
    assert tree(out) == tree(one_rank[0])


class Interrupted(Exception):
    pass


def test_interrupted_run_resumes(corpus, one_rank, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    real = ls.write_shard
    written = []

    def write_then_stop(store, index, *args):
        info = real(store, index, *args)
        written.append(index)
        if len(written) == 2:
            raise Interrupted("stopped after two shards")
        return info
    monkeypatch.setattr(ls, "write_shard", write_then_stop)
    with pytest.raises(prepare_group.RankError, match="Interrupted: stopped after two shards"):
        prepare(_options(corpus.root, out))
    assert not (out / "store.json").exists()
    with pytest.raises(FileNotFoundError, match="unfinished"):
        ls.LatentStore(str(out))
    # what a kill leaves: a half-written tmp file, and a shard file without its done marker
    (out / "shards" / "00002.safetensors.tmp.12345").write_bytes(b"half a shard")
    (out / "shards" / "00003.safetensors").write_bytes(b"not finished")
    written.clear()
    monkeypatch.setattr(ls, "write_shard", lambda store, index, *args: (
        written.append(index), real(store, index, *args))[1])
    result = prepare(_options(corpus.root, out))
    assert written == [2, 3, 4] and result["reused"] == 2 and result["encoded"] == 22
    assert tree(out) == tree(one_rank[0])


def test_resume_refuses_other_settings(corpus, one_rank, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(one_rank[0], out)
    with pytest.raises(prepare_group.RankError, match="started with other inputs or settings"):
        prepare(PrepareOptions(input=corpus.root, out=str(out), model="tiny", shard_size=4,
                               progress=False))


def test_torchrun_cli_equals_one_rank(tmp_path):
    """The command line under torchrun (the ranks make their own gloo group) against one rank
    in this process."""
    c = make_corpus(tmp_path / "m", videos=3, images=2, bad=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["-m", "ditscale.prepare", "--input", c.root, "--model", "tiny", "--device", "cpu",
            "--shard-size", "2", "--no-progress", "--timeout-s", "300"]
    prepare(PrepareOptions(input=c.root, out=str(tmp_path / "a"), model="tiny", shard_size=2,
                           progress=False))
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), *args, "--out",
                          str(tmp_path / "b")], capture_output=True, text=True, env=env,
                         timeout=600)
    assert two.returncode == 0, two.stderr
    assert "5 good, 3 bad" in two.stdout and "3 shards" in two.stdout
    assert tree(tmp_path / "a") == tree(tmp_path / "b")


def test_sigkilled_run_resumes(corpus, one_rank, tmp_path):
    """SIGKILL the command line once two shards are done; a rerun finishes the same bytes."""
    import signal
    import time
    out = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "ditscale.prepare", "--input", corpus.root,
                             "--out", str(out), "--model", "tiny", "--device", "cpu",
                             "--shard-size", str(SHARD), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 600
        while len(list(out.glob("shards/*.done.json"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "ended before 2 shards"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not (out / "store.json").exists()
    result = prepare(_options(corpus.root, out))
    assert result["reused"] >= 2 and result["encoded"] <= 38 - 2 * SHARD
    assert tree(out) == tree(one_rank[0])
