"""bench/train/policies.py and the FSDP2 step on CPU (gloo, tiny model): the sampler inside a
DataLoader feeding the model, the JSONL log and summary, and the gradient of a step whose ranks
run different numbers of micro-batches (the balanced policy's gradient accumulation)."""

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ditscale  # noqa: E402
from ditscale.models import WanDiT, make_config  # noqa: E402
from ditscale.models.training import SyntheticData, per_sample_loss  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "bench" / "train" / "policies.py"
SLOW = pytest.mark.skipif(not os.environ.get("DITSCALE_SLOW_TESTS"),
                          reason="slow: set DITSCALE_SLOW_TESTS=1")


def load_train_module():
    spec = importlib.util.spec_from_file_location("train_dit", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    model = d / "tiny_model.json"
    model.write_text('{"base": "wan2.1-1.3b", "max_frames": 9, "target_fps": 16, '
                     '"buckets": [[64, 64], [64, 128], [128, 64]]}')
    import random

    rng = random.Random(0)
    lines = ["path,caption,num_frames,height,width,fps"]
    for i in range(48):
        h, w = rng.choice([(64, 64), (64, 128), (128, 64), (72, 64)])
        if rng.random() < 0.4:
            lines.append(f'img{i}.jpg,"an image, {i}",1,{h},{w},')
        else:
            lines.append(f'v{i}.mp4,"a ""clip""",{rng.choice([5, 9, 17, 33])},{h},{w},16')
    man = d / "m.csv"
    man.write_text("\n".join(lines) + "\n")
    cost = d / "cost.json"
    cost.write_text('{"kind": "power", "a": 0.05, "b": 2e-4, "p": 1.2}')
    return {"manifest": str(man), "model": str(model), "cost": str(cost)}


def test_dataset_and_sampler_in_a_dataloader(corpus):
    train = load_train_module()
    ds = train.ManifestShapes(corpus["manifest"], corpus["model"])
    m = ditscale.read_manifest(corpus["manifest"])
    assert len(ds) == len(m) == 48
    for i in range(48):
        t = ditscale.train_shape(int(m.num_frames[i]), int(m.height[i]), int(m.width[i]),
                                 float(m.fps[i]), corpus["model"])
        assert ds[i] == {"id": i, "frames": t["frames"], "height": t["height"],
                         "width": t["width"], "seq_len": t["seq_len"]}
    with pytest.raises(IndexError):
        ds[48]
    sampler = ditscale.BalancedBatchSampler(corpus["manifest"], 0, 1, model=corpus["model"],
                                            policy="balanced", m_mem_tokens=256, seed=3)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler,
                                         collate_fn=train.collate_shapes)
    cfg = make_config("tiny", num_layers=1)
    torch.manual_seed(0)
    model = WanDiT(cfg)
    data = SyntheticData(cfg, torch.device("cpu"), torch.float32, seed=0)
    seen = []
    for n, mb in enumerate(loader):
        assert 1 <= len(mb["ids"]) and len(mb["ids"]) * mb["seq_len"] <= 256
        seen += mb["ids"]
        if n < 2:  # feed the model for two micro-batches
            batch = data.for_pixels(mb["ids"], mb["frames"], mb["height"], mb["width"])
            loss = per_sample_loss(model, batch)
            assert loss.shape == (len(mb["ids"]),) and torch.isfinite(loss).all()
            loss.sum().backward()
    assert len(seen) == len(set(seen)) == 48 - sampler.dropped_samples
    with pytest.raises(ValueError, match="mixes training shapes"):
        train.collate_shapes([ds[0], *[ds[i] for i in range(48) if ds[i]["seq_len"]
                                       != ds[0]["seq_len"]][:1]])


def _env():
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def test_train_world_size_1(corpus, tmp_path, monkeypatch, capsys):
    """In-process (no torchrun): the single-process path of init_distributed."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    # Absent now (the single-process path); init_distributed writes them and monkeypatch's undo
    # restores the original state afterwards.
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)
    train = load_train_module()
    log = tmp_path / "log.jsonl"
    rc = train.main(["--manifest", corpus["manifest"], "--model", "tiny", "--num-layers", "1",
                     "--shape-model", corpus["model"], "--device", "cpu", "--policy", "balanced",
                     "--steps", "3", "--warmup-steps", "1", "--m-mem", "256", "--cost",
                     corpus["cost"], "--no-fused-adaln", "--log-json", str(log)])
    assert rc == 0
    stdout = capsys.readouterr().out
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    ranks = [x for x in lines if x["type"] == "rank_step"]
    steps = [x for x in lines if x["type"] == "step"]
    summary = [x for x in lines if x["type"] == "summary"]
    assert [x["step"] for x in ranks] == [0, 1, 2] and len(steps) == 3 and len(summary) == 1
    for x in ranks:
        assert x["compute_s"] > 0 and x["wait_s"] >= 0 and x["sync_s"] > 0
        assert x["step_s"] >= x["compute_s"] + x["wait_s"]
        assert x["tokens"] > 0 and 1 <= x["micro_batches"] and x["samples"] >= 1
    s = summary[0]
    assert len(s["loss"]) == 3 and all(math.isfinite(v) and 0.5 < v < 10 for v in s["loss"])
    assert s["timed_steps"] == 2 and s["tokens"] == sum(x["tokens"] for x in ranks[1:])
    m = s["measured"]
    assert m["compute_cv"] == 0 and m["tokens_per_s"] > 0  # one rank: no imbalance
    p = s["predicted"]
    assert p["steps"] == 2 and p["tokens_per_s"] > 0
    assert s["plan"]["policy"] == "balanced"
    assert "== summary" in stdout and "measured / predicted tokens/s" in stdout


def test_predict_steps_charges_a_per_step_and_a_mb_per_micro_batch():
    """The prediction of train_dit (the simulator's formula): a + sum_i (a_mb + B_i * Work(S_i))
    per (step, rank), 0 for a rank without work; cost files without a_mb read as a_mb = 0."""
    train = load_train_module()

    class Sampler:
        cells = {(0, 0): [[0, 1], [2]], (0, 1): [[3]], (1, 0): [], (1, 1): [[4, 5, 6]]}

        def cell(self, k, r):
            return self.cells[(k, r)]

    class Shapes:
        def shape(self, i):
            return (1, 64, 64, 100 if i < 3 else 200)

    base = {"kind": "quadratic", "a": 0.5, "c1": 0.01, "c2": 0.0}
    old = train.predict_steps(Sampler(), Shapes(), base, [0, 1], 2)
    assert old.ravel().tolist() == pytest.approx([0.5 + 3 * 1.0, 0.5 + 2.0, 0.0, 0.5 + 3 * 2.0])
    new = train.predict_steps(Sampler(), Shapes(), dict(base, a_mb=0.25), [0, 1], 2)
    # Rank 0 of step 0 runs 2 micro-batches, the others 1.
    assert (new - old).ravel().tolist() == pytest.approx([0.5, 0.25, 0.0, 0.25])


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_fsdp_bf16_keeps_modulation_and_rope_fp32(monkeypatch):
    """With bf16 parameters under FSDP2, the timestep MLP runs in fp32 and the blocks receive
    fp32 modulation and RoPE tables (no input casting), as Wan computes them."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)
    from ditscale.models.training import StepRunner, build_model, init_distributed

    env = init_distributed("cpu", 60)
    try:
        cfg = make_config("tiny", num_layers=1)
        model, opt = build_model(cfg, env.device, fused_adaln=False, dtype=torch.bfloat16)
        seen = {}
        model.blocks[0].register_forward_pre_hook(
            lambda mod, args: seen.update(x=args[0].dtype, e0=args[1].dtype, rope=args[3][0].dtype))
        model.time_projection.register_forward_hook(
            lambda mod, args, out: seen.update(time=out.dtype))
        data = SyntheticData(cfg, env.device, torch.bfloat16, seed=0)
        st = StepRunner(model, opt, env.device).step([data.micro_batch([0, 1], (1, 2, 2))], 0.5)
        assert not st.oom and math.isfinite(st.loss_sum)
        assert seen == {"x": torch.bfloat16, "e0": torch.float32, "rope": torch.float32,
                        "time": torch.float32}
        assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master shards
    finally:
        torch.distributed.destroy_process_group()


CELLS = {0: [[0, 1]], 1: [[2], [3, 4]]}  # rank -> micro-batches: 1 vs 2 micro-batches
SHAPES = {0: (2, 4, 4), 1: (2, 4, 4), 2: (2, 4, 4), 3: (1, 4, 6), 4: (1, 4, 6)}


def _fused_available():
    try:
        from ditscale import ops
    except Exception:  # noqa: BLE001
        return False
    return ops.is_available()


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from ditscale.models.training import StepRunner, build_model, init_distributed

    env = init_distributed("cpu", 60)
    cfg = make_config("tiny", num_layers=2, head_init_std=0.05)
    data = SyntheticData(cfg, env.device, torch.float32, seed=5)
    mbs = [data.micro_batch(ids, SHAPES[ids[0]]) for ids in CELLS[rank]]
    result = {}
    runs = [("timed", False), ("native", False)] + ([("timed", True)] if _fused_available() else [])
    for mode, fused in runs:
        model, _ = build_model(cfg, env.device, fused_adaln=fused, dtype=torch.float32, seed=11)
        runner = StepRunner(model, torch.optim.SGD(model.parameters(), lr=1.0), env.device,
                            sync_mode=mode)
        st = runner.step(mbs, world / 5)
        assert not st.oom and st.micro_batches == len(CELLS[rank]) and st.samples == \
            sum(map(len, CELLS[rank]))
        assert (st.wait_s >= 0) if mode == "timed" else math.isnan(st.wait_s)
        result[(mode, fused)] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    # Out of memory on rank 0 only: both ranks must learn it from the step's flag (no hang).
    model, opt = build_model(cfg, env.device, fused_adaln=False, dtype=torch.float32, seed=11)
    st = StepRunner(model, opt, env.device).step(mbs, world / 5,
                                                 fail_above_tokens=0 if rank == 0 else None)
    assert st.oom and st.wait_s >= 0
    if rank == 0:
        torch.save(result, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_unequal_micro_batches_give_the_global_mean_gradient(tmp_path):
    """Ranks with 1 and 2 micro-batches (no collective mismatch), SGD lr 1: in both sync modes
    the update must be the gradient of the mean per-sample loss over all 5 samples of the
    step. Also: an out-of-memory on one rank abandons the step on both."""
    import torch.multiprocessing as mp

    out = tmp_path / "params.pt"
    mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True,
                       start_method="spawn")
    result = torch.load(out)
    cfg = make_config("tiny", num_layers=2, head_init_std=0.05)
    torch.manual_seed(11)
    ref = WanDiT(cfg)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    data = SyntheticData(cfg, torch.device("cpu"), torch.float32, seed=5)
    loss = sum(per_sample_loss(ref, data.micro_batch(ids, SHAPES[ids[0]])).sum()
               for cells in CELLS.values() for ids in cells) / 5
    loss.backward()
    assert ("timed", False) in result and ("native", False) in result
    assert (("timed", True) in result) == _fused_available()
    for (mode, fused), after in result.items():
        rtol, atol = (2e-3, 1e-6) if fused else (1e-4, 1e-7)
        for n, p in ref.named_parameters():
            delta = before[n] - after[n]  # SGD, lr 1: the gradient
            assert torch.allclose(delta, p.grad, rtol=rtol, atol=atol), \
                f"{mode} fused={fused} {n}: {(delta - p.grad).abs().max()}"
            assert delta.abs().max() > 0, f"{mode} fused={fused} {n}: no gradient"


@SLOW
def test_train_two_ranks_torchrun(corpus, tmp_path):
    log = tmp_path / "log2.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), str(TRAIN), "--manifest", corpus["manifest"],
           "--model", "tiny", "--num-layers", "1", "--shape-model", corpus["model"],
           "--device", "cpu", "--policy", "balanced", "--steps", "3", "--m-mem", "256",
           "--no-fused-adaln", "--log-json", str(log)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert sorted({(x["step"], x["rank"]) for x in lines if x["type"] == "rank_step"}) == \
        [(k, r) for k in range(3) for r in range(2)]
    assert lines[-1]["type"] == "summary" and lines[-1]["world_size"] == 2
