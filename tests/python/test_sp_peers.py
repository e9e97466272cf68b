"""CPU tests of the SwiftFusion attention benchmark's pieces (bench/sp): the plain-Ulysses peer on
2 gloo processes against single-process SDPA, calibrate's fits on synthetic timings, the
topology JSON it writes, and report.py on a small synthetic result."""

import json
import math
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from bench.common import find_cli  # noqa: E402  (bench: the repository root's package)
from bench.sp import bench_sp_attention as bench  # noqa: E402
from bench.sp import calibrate, peers, report  # noqa: E402

# ------------------------------------------------------------------------------ plain Ulysses


def _ulysses_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        results = {}
        for name, (b, L, h, d) in {"even": (2, 24, 4, 8), "one_head_each": (1, 10, 2, 16)}.items():
            q, k, v = peers.broadcast_inputs((b, L, h, d), torch.float32, torch.device("cpu"),
                                             seed=7)
            ref = peers.sdpa_bshd(q, k, v)
            beg, cnt = peers.shard_range(L, world, rank)
            out = peers.ulysses_attention(*(x.narrow(1, beg, cnt).contiguous() for x in (q, k, v)))
            err, nrm = peers.rel_err_parts(out, ref.narrow(1, beg, cnt))
            results[name] = {"shape": list(out.shape), "rel": math.sqrt(err / nrm),
                             "max_abs": float((out - ref.narrow(1, beg, cnt)).abs().max())}
        # Heads not divisible by the ranks: a clear error before any communication.
        x = torch.zeros(1, 4, 3, 8)
        try:
            peers.ulysses_attention(x, x, x)
            results["bad_heads"] = "no error"
        except ValueError as e:
            results["bad_heads"] = str(e)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_plain_ulysses_gloo_matches_sdpa(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_ulysses_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world,
             join=True)
    for r in range(world):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["even"]["shape"] == [2, 12, 4, 8]
        assert res["one_head_each"]["shape"] == [1, 5, 2, 16]
        for case in ("even", "one_head_each"):
            assert res[case]["rel"] < 1e-5, (r, case, res[case])
        assert "heads 3 not divisible by 2 ranks" in res["bad_heads"]


def test_shard_range_matches_the_even_split_rule():
    assert [peers.shard_range(10, 4, i) for i in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert peers.shard_range(66048, 2, 1) == (33024, 33024)
    with pytest.raises(ValueError):
        peers.shard_range(10, 2, 2)


# ------------------------------------------------------------------------------ calibration


def test_fit_attention_recovers_known_parameters():
    A, h, L = 640e12, 300.0, 5e-6
    samples = []
    for q, kv, heads in calibrate.ATTENTION_BLOCKS:
        flops = 4.0 * heads * q * kv * 128
        samples.append({"q_tokens": q, "kv_tokens": kv, "flops": flops,
                        "seconds": calibrate.attention_model_s(flops, q, kv, A, h, L)})
    fit = calibrate.fit_attention(samples, launch_s=L)
    assert fit["attention_flops"] == pytest.approx(A, rel=1e-3)
    assert fit["attention_half_tokens"] == pytest.approx(h, rel=1e-2)
    assert fit["rms_rel_err"] < 1e-4
    # 3% multiplicative noise: still close.
    noisy = [dict(s, seconds=s["seconds"] * (1.03 if i % 2 else 0.97))
             for i, s in enumerate(samples)]
    fit = calibrate.fit_attention(noisy, launch_s=L)
    assert fit["attention_flops"] == pytest.approx(A, rel=0.05)
    assert fit["attention_half_tokens"] == pytest.approx(h, rel=0.3)


def test_fit_attention_with_waves():
    """The wave model (ceil(W) / W, W = heads x ceil(q / 128) / slots): a fit with the right slot
    count recovers the parameters; the factor itself matches the C++ topology's cases."""
    assert calibrate.wave_factor(1408, 12, 132) == 1.0
    assert calibrate.wave_factor(33024, 12, 132) == pytest.approx(24 / 23.4545, rel=1e-4)
    assert calibrate.wave_factor(33024, 12, 0) == 1.0
    A, h, L = 640e12, 150.0, 5e-6
    samples = []
    for q, kv, heads in calibrate.ATTENTION_BLOCKS:
        flops = 4.0 * heads * q * kv * 128
        samples.append({"q_tokens": q, "kv_tokens": kv, "heads": heads, "flops": flops,
                        "seconds": calibrate.attention_model_s(flops, q, kv, A, h, L, heads, 132)})
    fit = calibrate.fit_attention(samples, launch_s=L, slots=132)
    assert fit["attention_flops"] == pytest.approx(A, rel=1e-3)
    assert fit["attention_half_tokens"] == pytest.approx(h, rel=1e-2)
    assert fit["attention_slots"] == 132 and fit["rms_rel_err"] < 1e-4
    # The same data fitted without waves is worse: the model is what the fit needs.
    assert calibrate.fit_attention(samples, launch_s=L)["rms_rel_err"] > 10 * fit["rms_rel_err"]


def test_calibrate_fit_refuses_negative_slots(tmp_path, capsys):
    nv, _ = _synthetic_raws()
    (tmp_path / "nv.json").write_text(json.dumps(nv))
    rc = calibrate.main(["fit", str(tmp_path / "nv.json"), "--out-dir", str(tmp_path / "c"),
                         "--attention-slots", "-1"])
    assert rc == 2 and "--attention-slots" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_fit_link_recovers_latency_and_bandwidth():
    lat, bw = 20e-6, 150e9
    sizes = [4096 * 4**i for i in range(12)]
    fit = calibrate.fit_link(sizes, [lat + x / bw for x in sizes])
    assert fit["bandwidth_Bps"] == pytest.approx(bw, rel=1e-6)
    assert fit["latency_s"] == pytest.approx(lat, rel=0.05)  # includes 4-64 KiB of transfer
    with pytest.raises(ValueError):
        calibrate.fit_link([1024, 2048], [1e-3, 0])


def _synthetic_raws():
    def p2p(lat, bw, top):
        sizes = [4096 * 4**i for i in range(12) if 4096 * 4**i <= top]
        return {"bidirectional": [{"bytes": x, "s": lat + x / bw} for x in sizes],
                "unidirectional": [{"bytes": x, "s": lat + x / (1.1 * bw)} for x in sizes]}

    att = []
    for q, kv, heads in calibrate.ATTENTION_BLOCKS:
        f = 4.0 * heads * q * kv * 128
        att.append({"q_tokens": q, "kv_tokens": kv, "heads": heads, "head_dim": 128, "flops": f,
                    "seconds": calibrate.attention_model_s(f, q, kv, 620e12, 200, 4e-6)})
    nv = {"kind": "ditscale-sp-calibration-raw", "link": "nvlink", "gpu": "H200",
          "p2p": p2p(25e-6, 300e9, 256 << 20), "attention": att,
          "all_gather": {"chunk_bytes": 256 << 20, "s": (256 << 20) / 320e9,
                         "received_Bps": 320e9},
          "hbm": {"bytes_moved": 2 << 30, "s": (2 << 30) / 4.2e12},
          "gemm": {"flops": 1e15, "s": 1e15 / 760e12}, "launch_s": 4e-6}
    emu = {"kind": "ditscale-sp-calibration-raw", "link": "emulated", "gpu": "H200",
           "p2p": p2p(120e-6, 1.9e9, 64 << 20),
           "p2p_under_compute": {"bytes": 64 << 20, "alone_s": 0.03, "beside_s": 0.045,
                                 "attention_s": 0.09, "interference": 1 / 3}}
    return nv, emu


def test_interference_from_times():
    # Compute longer than the transfer: t = x / (1 - f).
    assert calibrate.interference_from_times(0.03, 0.06, 0.09) == pytest.approx(0.5)
    # Compute shorter: (1 - f) for a, then full rate: t = x + f * a.
    assert calibrate.interference_from_times(0.03, 0.04, 0.02) == pytest.approx(0.5)
    assert calibrate.interference_from_times(0.03, 0.029, 0.09) == 0  # noise: faster beside
    assert calibrate.interference_from_times(0.03, 3.0, 9.0) == 0.95  # clamped below 1
    with pytest.raises(ValueError):
        calibrate.interference_from_times(0.03, 0.04, 0)


def test_calibrate_fit_writes_topologies(tmp_path):
    nv, emu = _synthetic_raws()
    (tmp_path / "nv.json").write_text(json.dumps(nv))
    (tmp_path / "emu.json").write_text(json.dumps(emu))
    out = tmp_path / "calib"
    rc = calibrate.main(["fit", str(tmp_path / "nv.json"), str(tmp_path / "emu.json"),
                         "--out-dir", str(out)])
    assert rc == 0
    t = json.loads((out / "topology-h200.json").read_text())
    assert t["base"] == "h200-local"
    assert t["intra_bandwidth_GBps"] == pytest.approx(300, rel=1e-3)
    assert t["nic_bandwidth_GBps"] == pytest.approx(1.9, rel=1e-3)
    assert t["attention_tflops"] == pytest.approx(620, rel=1e-2)
    assert t["attention_half_tokens"] == pytest.approx(200, rel=2e-2)
    assert t["hbm_bandwidth_GBps"] == pytest.approx(4200, rel=1e-3)
    assert t["linear_tflops"] == pytest.approx(760, rel=1e-3)
    assert t["inter_compute_interference"] == pytest.approx(0.333, abs=1e-3)
    m = json.loads((out / "topology-h200-nvlink-machines.json").read_text())
    assert m["nic_bandwidth_GBps"] == t["intra_bandwidth_GBps"] and m["gpus_per_machine"] == 1
    assert m["inter_compute_interference"] == 0  # not the socket link's
    summary = json.loads((out / "calibration.json").read_text())
    assert summary["fits"]["intra"]["all_gather_Bps"] == pytest.approx(320e9)
    if find_cli() is not None:  # the simulator accepted both files
        assert set(summary["topology_files"].values()) == {"ok"}


def test_flux_height_width():
    assert calibrate.flux_height_width(36864) == (3072, 3072)
    assert calibrate.flux_height_width(65536) == (4096, 4096)
    h, w = calibrate.flux_height_width(4096 * 3)
    assert (h // 16) * (w // 16) == 4096 * 3


# ------------------------------------------------------------------------------ report


def _run(seq, config, impl, strategy, ms, link="nvlink", mesh=(1, 2), chunks=1, transport="nccl",
         status="ok", note=""):
    return {"seq": seq, "text": 512, "config": config, "impl": impl, "strategy": strategy,
            "chunks": chunks, "transport": transport, "mesh": list(mesh), "link": link,
            "status": status, "ms": ms if status == "ok" else None,
            "ms_repeats": [ms] if status == "ok" else [], "tflops": None, "note": note}


def _doc(link, runs, checks):
    return {"kind": "ditscale-sp-attention-bench", "version": 1, "link": link,
            "emulate_machines": 2 if link == "emulated" else 0, "world_size": 2,
            "host": "test", "gpu": "NVIDIA H200", "torch": "2.11.0", "nccl": "2.28.3",
            "ditscale_sp": True, "ditscale_sp_error": "",
            "shape": {"batch": 1, "text": 512, "heads": 24, "head_dim": 128, "dtype": "bf16",
                      "causal": False},
            "timing": {"warmup": 3, "iters": 5, "repeats": 3, "statistic": "median"},
            "runs": runs, "checks": checks}


def test_report_on_synthetic_results(tmp_path, capsys):
    S = 65536
    nv = _doc("nvlink", [
        _run(S, "1 GPU (SDPA)", "single", "single", 88.3, mesh=(1, 1)),
        _run(S, "plain Ulysses", "peer", "plain-ulysses", 47.3),
        _run(S, "PyTorch CP", "peer", "torch-cp", 46.3),
        _run(S, "ditscale ulysses nccl", "ditscale", "ulysses", 44.0),
        _run(S, "ditscale ulysses nvshmem", "ditscale", "ulysses", 43.0, transport="nvshmem"),
        _run(S, "ditscale torus c2 nccl mesh 2x1", "ditscale", "torus", 45.0, mesh=(2, 1),
             chunks=2),
    ], {"ditscale ulysses nccl": {"rel_err": 4e-3, "ok": True},
        "ditscale ulysses nvshmem": {"rel_err": 5e-2, "ok": False},
        "PyTorch CP": {"ok": False, "error": "RuntimeError: boom"}})
    emu = _doc("emulated", [
        _run(S, "plain Ulysses", "peer", "plain-ulysses", 253.0, link="emulated", mesh=(2, 1)),
        _run(S, "PyTorch CP", "peer", "torch-cp", 175.0, link="emulated", mesh=(2, 1)),
        _run(S, "ditscale torus c4 nccl", "ditscale", "torus", 125.0, link="emulated",
             mesh=(2, 1), chunks=4),
        _run(S, "ditscale ring nccl", "ditscale", "ring", 0, link="emulated", mesh=(2, 1),
             status="skipped", note="time budget (est. 99 s)"),
    ], {})
    nv["header"] = {"device": "NVIDIA H200 x2", "commit": "0123abcd", "torch": "2.11",
                    "date": "2026-12-06 05:00 UTC",
                    "command": "torchrun -m bench.sp.bench_sp_attention"}
    for name, d in (("nv.json", nv), ("emu.json", emu)):
        (tmp_path / name).write_text(json.dumps(d))
    out = tmp_path / "sp.md"
    rc = report.main([str(tmp_path / "nv.json"), str(tmp_path / "emu.json"), "--out", str(out),
                      "--no-png", "--summary"])
    assert rc == 0
    md = out.read_text()
    assert "| configuration | mesh | ms | vs 1 GPU | vs plain Ulysses | vs PyTorch CP" in md
    assert "### S = 65,536 image + 512 text tokens (nvlink)" in md
    assert "### S = 65,536 image + 512 text tokens (emulated)" in md
    # plain Ulysses: 88.3 / 47.3 = 1.87x over one GPU; torus emulated: 175 / 125 = 1.40x over CP.
    row = next(l for l in md.splitlines() if l.startswith("| plain Ulysses | 1x2"))
    assert "| 47.30 | 1.87x | 1.00x | 0.98x |" in row
    row = next(l for l in md.splitlines() if l.startswith("| ditscale torus c4 nccl | 2x1"))
    assert "| 125.0 | 0.71x | 2.02x | 1.40x |" in row  # one GPU comes from the NVLink file
    assert "**FAIL** (5.0e-02)" in md and "**error**: RuntimeError: boom" in md
    assert "skipped: time budget" in md
    # each run's header (bench.reporter), for the runs that carry one
    assert ("| nvlink | NVIDIA H200 x2 | 0123abcd | 2026-12-06 05:00 UTC | "
            "`torchrun -m bench.sp.bench_sp_attention` |") in md
    runs = md[md.index("Runs:"):md.index("Runs:") + 400]
    assert "| emulated |" not in runs.split("\n\n")[1]
    assert "## NCCL vs NVSHMEM" in md and "| 44.00 | 43.00 | 1.02x |" in md
    # Speed-of-light of one GPU is its own time; % of SOL is printed for every measured row.
    row = next(l for l in md.splitlines() if l.startswith("| 1 GPU (SDPA) |"))
    assert "| 88.30 | 100% |" in row
    summary = capsys.readouterr().out
    assert "emulated" in summary and "ditscale torus c4 nccl" in summary
    if find_cli() is not None:
        # Predictions from the h200-local preset (no calibration given); none for the logical
        # 2x1 mesh on NVLink, which has no preset.
        row = next(l for l in md.splitlines() if l.startswith("| ditscale ulysses nccl |"))
        pred = row.split("|")[9].strip()
        assert pred != "-" and float(pred) > 10
        row = next(l for l in md.splitlines() if l.startswith("| ditscale torus c2 nccl mesh"))
        assert row.split("|")[9].strip() == "-"


def test_report_rejects_a_foreign_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"kind": "something-else"}))
    with pytest.raises(SystemExit, match="field 'kind'"):
        report.main([str(p), "--out", str(tmp_path / "o.md"), "--no-png"])


def test_report_png(tmp_path):
    pytest.importorskip("matplotlib")
    d = _doc("nvlink", [_run(4096, "1 GPU (SDPA)", "single", "single", 1.0, mesh=(1, 1)),
                        _run(4096, "plain Ulysses", "peer", "plain-ulysses", 0.8)], {})
    (tmp_path / "r.json").write_text(json.dumps(d))
    assert report.main([str(tmp_path / "r.json"), "--out", str(tmp_path / "r.md")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "![ms per attention layer](r.png)" in (tmp_path / "r.md").read_text()


# ------------------------------------------------------------------------------ bench options


def test_bench_configurations():
    a = bench.parse_args(["--seq", "4096"])
    cfgs = bench.configs(a, have_sp=True)
    names = [c.name for c in cfgs]
    # 3 baselines + 2 transports x (5 strategies + torus with 3 chunk counts).
    assert len(cfgs) == 3 + 2 * 8 and len(set(names)) == len(names)
    assert "ditscale ulysses-overlap nvshmem" in names
    assert "ditscale torus c4 nvshmem" in names and names[0] == "1 GPU (SDPA)"
    h = bench.configs(bench.parse_args(["--seq", "4096", "--head-chunks", "1", "2"]), have_sp=True)
    assert "ditscale ulysses h2 nccl" in [c.name for c in h] and len(h) == len(cfgs) + 2
    e = bench.parse_args(["--emulate-machines", "2", "--meshes", "auto", "2x1"])
    assert e.transports == ["nccl", "nvshmem-intra"]
    assert (e.warmup, e.iters, e.repeats) == (1, 2, 2)
    with pytest.raises(SystemExit):  # NVSHMEM between emulated machines would bypass the link
        bench.parse_args(["--emulate-machines", "2", "--transports", "nvshmem"])
    assert len(bench.configs(e, have_sp=False)) == 3
    with pytest.raises(SystemExit):
        bench.parse_args(["--strategies", "zigzag"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--meshes", "2by1"])
