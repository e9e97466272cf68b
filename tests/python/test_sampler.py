"""ditscale.BalancedBatchSampler with a real torch DataLoader (CPU only)."""

import json
import random

import pytest

import ditscale

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

RESOLUTIONS = [(256, 256), (480, 832), (720, 1280), (1024, 768), (360, 640), (832, 480)]


class IdDataset(Dataset):
    """Item i is the sample id i itself, so a batch shows which ids the sampler chose."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return i


def write_csv(path, n, seed=0, bad_rows=()):
    """A mixed image/video corpus with quoted captions (commas, doubled quotes, newlines)."""
    rng = random.Random(seed)
    lines = ["path,caption,num_frames,height,width,fps,aesthetic"]
    for i in range(n):
        h, w = rng.choice(RESOLUTIONS)
        image = rng.random() < 0.3
        frames = 1 if image else rng.randint(17, 240)
        fps = "" if image else rng.choice(["24", "30", "16"])
        caption = f'"clip {i}: a ""red"", fast car,\nat night"' if i % 7 == 0 else f'"clip {i}"'
        if i in bad_rows:
            h = -h
        lines.append(f"v/{i}.mp4,{caption},{frames},{h},{w},{fps},{rng.random():.3f}")
    path.write_text("\n".join(lines) + "\n")
    return path


def run_loader(sampler, n, num_workers=0):
    loader = DataLoader(IdDataset(n), batch_sampler=sampler, num_workers=num_workers)
    return [batch.tolist() for batch in loader]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("m") / "mixed.csv", 600, seed=1)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("policy,tail", [("balanced", "drop"), ("adaptive", "keep"),
                                         ("equal-token", "drop"), ("balanced", "keep")])
def test_dataloader_exactly_once_across_ranks(manifest, num_workers, policy, tail):
    n, world = 600, 4
    seen, steps = [], set()
    dropped = None
    for rank in range(world):
        s = ditscale.BalancedBatchSampler(manifest, rank, world, policy=policy, tail=tail,
                                          seed=42, m_mem_tokens=200_000)
        batches = run_loader(s, n, num_workers)
        assert len(batches) == len(s) == s.num_micro_batches
        assert all(len(b) > 0 for b in batches)
        steps.add(s.num_steps)
        dropped = s.dropped_samples
        seen.extend(i for b in batches for i in b)
    assert len(steps) == 1, "ranks disagree on the number of steps"
    assert len(seen) == len(set(seen)), "an id was yielded twice"
    assert set(seen) <= set(range(n))
    assert len(seen) + dropped == n
    if tail == "keep":
        assert dropped == 0 and sorted(seen) == list(range(n))


def test_ranks_agree_on_the_global_plan(manifest):
    samplers = [ditscale.BalancedBatchSampler(manifest, r, 3, seed=9) for r in range(3)]
    fps = {s.state_dict()["plan_fingerprint"] for s in samplers}
    assert len(fps) == 1
    # Each rank's own cells are what any rank sees as that rank's cells.
    for r, s in enumerate(samplers):
        mine = [mb for k in range(s.num_steps) for mb in samplers[0].cell(k, r)]
        assert mine == list(s)


def test_deterministic_across_instances_and_seeds(manifest):
    a = list(ditscale.BalancedBatchSampler(manifest, 1, 2, seed=5))
    b = list(ditscale.BalancedBatchSampler(manifest, 1, 2, seed=5))
    c = list(ditscale.BalancedBatchSampler(manifest, 1, 2, seed=6))
    assert a == b
    assert a != c


def test_set_epoch_changes_order_and_comes_back(manifest):
    s = ditscale.BalancedBatchSampler(manifest, 0, 2, seed=5)
    e0 = list(s)
    assert list(s) == e0, "a finished epoch starts over without set_epoch"
    s.set_epoch(1)
    assert s.epoch == 1
    e1 = list(s)
    assert e1 != e0
    assert sorted(i for b in e1 for i in b) != [i for b in e1 for i in b]  # shuffled
    s.set_epoch(0)
    assert list(s) == e0
    t = ditscale.BalancedBatchSampler(manifest, 0, 2, seed=5, epoch=1)
    assert list(t) == e1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resume_mid_epoch_single_process_loader(manifest, seed):
    n = 600
    full = run_loader(ditscale.BalancedBatchSampler(manifest, 1, 3, seed=seed, epoch=2), n)
    k = random.Random(seed).randrange(1, len(full))
    s = ditscale.BalancedBatchSampler(manifest, 1, 3, seed=seed, epoch=2)
    it = iter(DataLoader(IdDataset(n), batch_sampler=s))
    head = [next(it).tolist() for _ in range(k)]
    state = s.state_dict()
    state = json.loads(json.dumps(state))  # survives a JSON checkpoint
    t = ditscale.BalancedBatchSampler(manifest, 1, 3, seed=seed, epoch=0)
    t.load_state_dict(state)
    t.set_epoch(2)  # a resumed loop calls set_epoch(epoch) again: the position is kept
    tail = run_loader(t, n)
    assert head + tail == full


def test_resume_with_prefetching_workers(manifest):
    n = 600
    full = run_loader(ditscale.BalancedBatchSampler(manifest, 0, 2, seed=3), n)
    s = ditscale.BalancedBatchSampler(manifest, 0, 2, seed=3)
    it = iter(DataLoader(IdDataset(n), batch_sampler=s, num_workers=2))
    k = len(full) // 3
    head = [next(it).tolist() for _ in range(k)]
    state = s.state_dict(consumed_micro_batches=k)
    assert s.state_dict() != state  # the workers made the sampler run ahead of the loop
    del it
    t = ditscale.BalancedBatchSampler(manifest, 0, 2, seed=3)
    t.load_state_dict(state)
    assert head + run_loader(t, n, num_workers=2) == full


def test_steps_flags_and_step_resume(manifest):
    s = ditscale.BalancedBatchSampler(manifest, 2, 4, seed=11, m_mem_tokens=150_000)
    flags = s.last_micro_batch_flags()
    pairs = list(s.iter_micro_batches())
    assert [last for _, last in pairs] == flags
    assert sum(flags) == s.num_steps  # tail=drop: every rank has work in every step
    steps = list(s.iter_steps())
    assert len(steps) == s.num_steps
    assert [mb for st in steps for mb in st] == [ids for ids, _ in pairs]
    assert [len(st) for st in steps] == s.micro_batches_per_step()
    # Step mode: one item per step, len == num_steps on every rank.
    st = ditscale.BalancedBatchSampler(manifest, 2, 4, seed=11, m_mem_tokens=150_000,
                                       mode="step")
    assert len(st) == st.num_steps and list(st) == steps
    # Resume after k whole steps (what a training loop counts).
    k = st.num_steps // 2
    state = s.state_dict(consumed_steps=k)
    assert (state["step"], state["micro_batch"]) == (k, 0)
    r = ditscale.BalancedBatchSampler(manifest, 2, 4, seed=11, m_mem_tokens=150_000,
                                      mode="step")
    r.load_state_dict(state)
    assert list(r) == steps[k:]


def test_balanced_plan_summary(manifest):
    s = ditscale.BalancedBatchSampler(manifest, 0, 8, m_mem_tokens=4 * 75_600)
    summary = s.plan_summary
    for key in ("compute_cv", "num_steps", "dropped_samples", "epoch_time_s", "lower_bound_s",
                "bubble_fraction", "tokens_per_s_per_gpu", "rows_total", "policy"):
        assert key in summary, key
    assert summary["policy"] == "balanced"
    assert summary["rows_total"] == 600 and summary["rows_skipped"] == 0
    assert summary["num_steps"] == s.num_steps
    assert 0 <= summary["compute_cv"] < 1
    assert summary["epoch_time_s"] >= summary["lower_bound_s"] > 0


def test_bad_manifest_path_and_row_raise_with_file_and_line(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(ditscale.Error, match="nope.csv"):
        ditscale.BalancedBatchSampler(missing, 0, 1)
    bad = write_csv(tmp_path / "bad.csv", 30, bad_rows={5})
    # Data row 5 starts on line 7 + 1: the caption of row 0 spans two lines.
    with pytest.raises(ditscale.Error, match=r"bad\.csv:8: column 'height'"):
        ditscale.BalancedBatchSampler(bad, 0, 1)
    with pytest.raises(ditscale.Error, match=r"bad\.csv:8"):
        ditscale.read_manifest(str(bad))


def test_skip_bad_rows_counts_and_never_yields_them(tmp_path):
    bad = write_csv(tmp_path / "bad.csv", 50, bad_rows={3, 20, 21})
    m = ditscale.read_manifest(str(bad), skip_bad_rows=True)
    assert (m.rows_total, m.rows_skipped, len(m)) == (50, 3, 47)
    assert 3 not in m.ids.tolist() and 22 in m.ids.tolist()
    assert len(m.skipped_examples) == 3 and "bad.csv" in m.skipped_examples[0]
    seen = []
    for rank in range(2):
        s = ditscale.BalancedBatchSampler(bad, rank, 2, skip_bad_rows=True, tail="keep")
        assert s.plan_summary["rows_skipped"] == 3
        seen += [i for b in run_loader(s, 50) for i in b]
    assert sorted(seen) == sorted(set(range(50)) - {3, 20, 21})


def test_jsonl_manifest(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [{"path": f"{i}.mp4", "num_frames": 49 if i % 2 else 1, "height": 480, "width": 832,
             "fps": 24 if i % 2 else 0, "text": "a, \"b\""} for i in range(40)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = ditscale.BalancedBatchSampler(path, 0, 1, tail="keep")
    assert sorted(i for b in s for i in b) == list(range(40))


def test_argument_errors(manifest):
    with pytest.raises(ditscale.Error, match="policy"):
        ditscale.BalancedBatchSampler(manifest, 0, 1, policy="fastest")
    with pytest.raises(ditscale.Error, match="tail"):
        ditscale.BalancedBatchSampler(manifest, 0, 1, tail="wrap")
    with pytest.raises(ValueError, match=r"^rank: 2 is out of range \[0, 1\]$"):
        ditscale.BalancedBatchSampler(manifest, 2, 2)
    with pytest.raises(ValueError, match="mode"):
        ditscale.BalancedBatchSampler(manifest, 0, 1, mode="sample")
    with pytest.raises(ditscale.Error):
        ditscale.BalancedBatchSampler(manifest, 0, 1, model="no-such-model")
    s = ditscale.BalancedBatchSampler(manifest, 0, 2, seed=1)
    other = ditscale.BalancedBatchSampler(manifest, 0, 2, seed=2).state_dict()
    with pytest.raises(ditscale.Error, match="seed"):
        s.load_state_dict(other)
    wrong_world = ditscale.BalancedBatchSampler(manifest, 0, 3, seed=1).state_dict()
    with pytest.raises(ditscale.Error, match="world_size"):
        s.load_state_dict(wrong_world)
    with pytest.raises(ValueError):
        s.state_dict(consumed_steps=s.num_steps + 1)


def test_seq_len_and_train_shape():
    assert "wan2.1-1.3b" in ditscale.model_presets()
    # Wan 2.1: S = (1 + (F-1)/4) * (H/16) * (W/16); 81 frames at 16 fps, 480x832 is a bucket.
    assert ditscale.seq_len(81, 480, 832, 16.0) == 21 * 30 * 52
    for frames, h, w, fps in [(1, 512, 512, 0.0), (121, 720, 1280, 24.0), (200, 360, 640, 30.0)]:
        t = ditscale.train_shape(frames, h, w, fps, model="wan2.1-1.3b")
        assert (t["frames"] - 1) % 4 == 0 and t["frames"] <= 81
        latent = 1 + (t["frames"] - 1) // 4
        assert t["seq_len"] == latent * (t["height"] // 16) * (t["width"] // 16)
    with pytest.raises(ValueError, match=r"^num_frames: 0 is out of range \[1, 2147483647\]$"):
        ditscale.seq_len(0, 480, 832)


def test_cost_json_and_fitted_bench(manifest, tmp_path):
    a, b, p, m0, m1 = 0.3, 2e-10, 1.85, 35e9, 1.5e6
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"kind": "power", "a": a, "b": b, "p": p,
                                "memory": {"m0": m0, "m1": m1}}))
    expected_m_mem = int((141 * 2**30 * 0.9 - m0) // m1)
    s = ditscale.BalancedBatchSampler(manifest, 0, 2, cost=cost)
    assert s.plan_summary["cost_source"] == f"json:{cost}"
    assert s.plan_summary["p"] == pytest.approx(p)
    assert abs(s.plan_summary["m_mem_tokens"] - expected_m_mem) <= 1
    bench = tmp_path / "bench.csv"
    rows = ["batch_size,seq_len,step_time_s,peak_mem_bytes"]
    for bs in (1, 2, 4):
        for seq in (4096, 16384, 32760, 75600):
            rows.append(f"{bs},{seq},{a + b * bs * seq**p!r},{m0 + m1 * bs * seq!r}")
    bench.write_text("\n".join(rows) + "\n")
    f = ditscale.BalancedBatchSampler(manifest, 0, 2, bench=bench)
    assert f.plan_summary["cost_source"].startswith("fit:")
    assert f.plan_summary["p"] == pytest.approx(p, abs=1e-3)
    assert abs(f.plan_summary["m_mem_tokens"] - expected_m_mem) <= 2
    with pytest.raises(ditscale.Error, match="at most one"):
        ditscale.BalancedBatchSampler(manifest, 0, 2, cost=cost, bench=bench)
    bad = tmp_path / "bad_cost.json"
    bad.write_text('{"kind": "power", "a": "fast"}')
    with pytest.raises(ditscale.Error, match="bad_cost.json"):
        ditscale.BalancedBatchSampler(manifest, 0, 2, cost=bad)
