"""CPU tests of ditscale.sp: shards, meshes from process groups (gloo), emulated machines, the
planner/simulator (ditscale._core) and the single-rank path. The configuration (sp.Config) and the
runtime ops' configuration dict: test_sp_config.py. The GPU executor is tested in tests/gpu."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ditscale.sp as sp


def test_shard_range_is_even_and_covers_everything():
    for seq, world in ((1031, 2), (65536, 8), (7, 4), (3, 3)):
        spans = [sp.shard_range(seq, world, r) for r in range(world)]
        assert spans[0][0] == 0
        for (b0, c0), (b1, _) in zip(spans, spans[1:]):
            assert b0 + c0 == b1
        assert sum(c for _, c in spans) == seq
        assert max(c for _, c in spans) - min(c for _, c in spans) <= 1
        assert [c for _, c in spans] == sorted((c for _, c in spans), reverse=True)
    with pytest.raises(ValueError, match="rank 2 not in"):
        sp.shard_range(10, 2, 2)


def test_emulate_machines_sets_host_ids(monkeypatch):
    # emulate_machines writes these directly; monkeypatch restores them after the test.
    monkeypatch.setattr(sp.meshes, "_EMULATED_MACHINES", sp.meshes._EMULATED_MACHINES)
    monkeypatch.setenv("NCCL_HOSTID", os.environ.get("NCCL_HOSTID", ""))
    monkeypatch.setenv("DITSCALE_EMULATED_MACHINES", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    ids = set()
    for r in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(r))
        assert sp.emulate_machines(2) == r // 2
        ids.add(os.environ["NCCL_HOSTID"])
    assert len(ids) == 2
    assert sp.emulated_machines() == 2
    with pytest.raises(ValueError, match="cannot be split"):
        sp.emulate_machines(3)


def test_mesh_validates_sizes():
    with pytest.raises(ValueError, match="must be >= 1"):
        sp.Mesh(0, 2)
    m = sp.Mesh(2, 4)
    assert m.size == 8 and m.rank == 0


def _mesh_worker(rank, world, port, host_ids, out):
    os.environ["NCCL_HOSTID"] = host_ids[rank]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        m = sp.Mesh.from_process_group()
        out[rank] = (m.machines, m.gpus_per_machine, m.rank)
    except ValueError as e:
        out[rank] = str(e)
    dist.destroy_process_group()


def _run_mesh(host_ids):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = len(host_ids)
    out = mp.Manager().dict()
    mp.start_processes(_mesh_worker, args=(world, port, host_ids, out), nprocs=world,
                       start_method="spawn")
    return [out[r] for r in range(world)]


def test_mesh_from_process_group_groups_hosts():
    assert _run_mesh(["a", "a", "b", "b"]) == [(2, 2, r) for r in range(4)]
    assert _run_mesh(["a", "a"]) == [(1, 2, 0), (1, 2, 1)]
    bad = _run_mesh(["a", "b", "a"])
    assert all("not consecutive" in x for x in bad)


def test_plan_and_predict_use_the_simulator():
    mesh = sp.Mesh(2, 2)
    r = sp.plan(mesh, batch=1, seq=65536, text=512, heads=24, head_dim=128, one_sided=False)
    ranked = r["ranked"]
    assert ranked and all(not c["one_sided"] for c in ranked)
    times = [c["predicted_layer_s"] for c in ranked]
    assert times == sorted(times) and times[0] > 0
    best = ranked[0]
    t = sp.predict(mesh, strategy=best["strategy"], batch=1, seq=65536, text=512, heads=24,
                   head_dim=128, chunks=best["torus_chunks"], ulysses_degree=best["ulysses_degree"],
                   ring_degree=best["ring_degree"], comm_sms=best["comm_sms"])
    assert t == pytest.approx(best["predicted_layer_s"], rel=1e-9)
    # Emulated machines: the planner keeps 4 of the H200's SMs for NCCL's socket kernels; without
    # SM partitions no candidate does.
    assert best["comm_sms"] == 4
    whole = sp.plan(mesh, batch=1, seq=65536, text=512, heads=24, head_dim=128, one_sided=False,
                    sm_partitions=False)["ranked"]
    assert all(c["comm_sms"] == 0 for c in whole) and len(whole) * 2 == len(ranked)
    # On one machine Ulysses moves 4x (S/N)*H*d per rank; over a socket link it is much slower.
    fast = sp.predict(sp.Mesh(1, 2), strategy="ulysses", batch=1, seq=65536, text=512, heads=24,
                      head_dim=128)
    slow = sp.predict(sp.Mesh(2, 1), strategy="ulysses", batch=1, seq=65536, text=512, heads=24,
                      head_dim=128)
    assert slow > 2 * fast
    # Ulysses in head chunks: same bytes, the all-to-all pipelined; more chunks than kv heads per
    # rank is refused naming the field.
    chunked = sp.predict(sp.Mesh(1, 2), strategy="ulysses", ulysses_chunks=2, batch=1,
                         seq=65536, text=512, heads=24, head_dim=128)
    assert 0 < chunked <= fast * 1.05
    with pytest.raises(RuntimeError, match="ulysses_chunks"):
        sp.predict(sp.Mesh(1, 2), strategy="ulysses", ulysses_chunks=13, batch=1, seq=1024,
                   text=0, heads=24, head_dim=64)
    with pytest.raises(ValueError, match="strategy: 'nonsense' is not one of"):
        sp.predict(mesh, strategy="nonsense", batch=1, seq=1024, text=0, heads=8, head_dim=64)


def test_single_rank_attention_is_dense_attention_with_joint_tokens():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 10, 4, 8, dtype=torch.float64) for _ in range(3))
    tq, tk, tv = (torch.randn(2, 3, 4, 8, dtype=torch.float64) for _ in range(3))
    out, jout = sp.attention(q, k, v, mesh=None, joint_q=tq, joint_k=tk, joint_v=tv)
    Q, K, V = (torch.cat([a, b], 1) for a, b in ((tq, q), (tk, k), (tv, v)))
    s = torch.einsum("bqhd,bkhd->bhqk", Q, K) / 8 ** 0.5
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), V)
    torch.testing.assert_close(out, ref[:, 3:])
    torch.testing.assert_close(jout, ref[:, :3])
    assert sp.attention(q, k, v, mesh=sp.Mesh(1, 1)).shape == q.shape
    with pytest.raises(ValueError, match="go together"):
        sp.attention(q, k, v, mesh=None, joint_q=tq)
    with pytest.raises(ValueError, match="transport: 'carrier-pigeon' is not one of"):
        sp.attention(q, k, v, mesh=None, transport="carrier-pigeon")


def test_default_topology_follows_the_environment(monkeypatch):
    monkeypatch.delenv("DITSCALE_SP_TOPOLOGY", raising=False)
    assert sp.default_topology() == "h200-local"
    monkeypatch.setenv("DITSCALE_SP_TOPOLOGY", "p4de")
    assert sp.default_topology() == "p4de"
    # The planner takes it: p4de's links differ from h200-local's.
    a = sp.predict(sp.Mesh(2, 1), strategy="ring", batch=1, seq=16384, text=0, heads=8,
                   head_dim=128)
    b = sp.predict(sp.Mesh(2, 1), strategy="ring", batch=1, seq=16384, text=0, heads=8,
                   head_dim=128, topology="h200-local")
    assert a != b


def test_transports_and_emulated_machines_refuse_nvshmem(monkeypatch):
    assert sp.TRANSPORTS == ("nccl", "nvshmem", "nvshmem-intra")
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    monkeypatch.setattr(sp.meshes, "_EMULATED_MACHINES", 2)
    with pytest.raises(ValueError, match="emulated.*nvshmem-intra"):
        sp.attention(q, k, v, mesh=sp.Mesh(2, 1), strategy="ring", transport="nvshmem")
    with pytest.raises(ValueError, match="emulated.*nvshmem-intra"):
        sp.attention(q, k, v, mesh=sp.Mesh(2, 2), strategy="auto", transport="nvshmem")
    # Allowed transports get past the check (and fail on the CPU tensors instead).
    for t in ("nccl", "nvshmem-intra"):
        with pytest.raises(ValueError, match="CUDA tensors"):
            sp.attention(q, k, v, mesh=sp.Mesh(2, 1), strategy="ring", transport=t)
    # One emulated machine, or a mesh of one machine: nothing crosses an emulated link.
    assert sp.attention(q, k, v, mesh=sp.Mesh(1, 1), transport="nvshmem").shape == q.shape
    monkeypatch.setattr(sp.meshes, "_EMULATED_MACHINES", 0)
    with pytest.raises(ValueError, match="CUDA tensors"):
        sp.attention(q, k, v, mesh=sp.Mesh(2, 1), strategy="ring", transport="nvshmem")
    with pytest.raises(ValueError, match="transport: 'nvshmem-inter'"):
        sp.attention(q, k, v, mesh=sp.Mesh(2, 1), transport="nvshmem-inter")


def test_best_candidate_for_each_transport():
    ranked = [{"transport": "nvshmem", "one_sided": True, "name": "a"},
              {"transport": "nvshmem-intra", "one_sided": True, "name": "b"},
              {"transport": "nccl", "one_sided": False, "name": "c"}]
    best = sp.planning.best_for_transport
    assert best(ranked, "nvshmem-intra", sp.Mesh(2, 2))["name"] == "b"
    assert best(ranked, "nccl", sp.Mesh(2, 2))["name"] == "c"
    # One machine: the planner lists the plain one-sided schedule only.
    assert best(ranked[:1] + ranked[2:], "nvshmem-intra", sp.Mesh(1, 4))["name"] == "a"
    with pytest.raises(RuntimeError, match="no configuration for transport"):
        best(ranked[2:], "nvshmem", sp.Mesh(2, 2))


def test_plan_lists_intra_one_sided_across_machines_only():
    kw = dict(batch=1, seq=16384, text=512, heads=24, head_dim=128)
    ranked = sp.plan(sp.Mesh(2, 2), one_sided=True, **kw)["ranked"]
    by_transport = {}
    for c in ranked:
        by_transport.setdefault(c["transport"], []).append(c)
        assert c["one_sided"] == (c["transport"] != "nccl")
        assert c["one_sided_inter"] == (c["transport"] != "nvshmem-intra")
    assert set(by_transport) == {"nccl", "nvshmem", "nvshmem-intra"}
    assert len(by_transport["nvshmem-intra"]) == len(by_transport["nvshmem"])
    best = by_transport["nvshmem-intra"][0]
    assert "one-sided intra / two-sided inter" in best["name"]
    t = sp.predict(sp.Mesh(2, 2), strategy=best["strategy"], chunks=best["torus_chunks"],
                   ulysses_degree=best["ulysses_degree"], ring_degree=best["ring_degree"],
                   transport="nvshmem-intra", comm_sms=best["comm_sms"], **kw)
    assert t == pytest.approx(best["predicted_layer_s"], rel=1e-9)
    one = sp.plan(sp.Mesh(1, 4), one_sided=True, **kw)["ranked"]
    assert {c["transport"] for c in one} == {"nccl", "nvshmem"}
    two_sided = sp.plan(sp.Mesh(2, 2), one_sided=False, **kw)["ranked"]
    assert {c["transport"] for c in two_sided} == {"nccl"}
    with pytest.raises(ValueError, match="transport: 'shm'"):
        sp.predict(sp.Mesh(2, 2), strategy="ring", transport="shm", **kw)


def test_timeline_and_describe_validate_the_transport():
    # The transport is checked before any runtime is touched (so also without a GPU).
    for fn in (sp.timeline, sp.describe):
        with pytest.raises(ValueError, match="transport: 'udp'"):
            fn(sp.Mesh(2, 1), "ring", transport="udp", device=torch.device("cpu"))
    assert callable(sp.set_trace)


def test_run_local_validates_its_arguments_before_the_gpu():
    from ditscale._experimental import sp_local
    q = torch.zeros(1, 8, 2, 4)
    with pytest.raises(ValueError, match="go together"):
        sp_local.run_local(q, q, q, strategy="ring", gpus_per_machine=2, joint_q=q)
    with pytest.raises(ValueError, match="strategy: 'auto' is not a configuration"):
        sp_local.run_local(q, q, q, strategy="auto", gpus_per_machine=2)
    with pytest.raises(ValueError, match="run_local: layers: 0 is out of range"):
        sp_local.run_local(q, q, q, strategy="ring", gpus_per_machine=2, layers=0)
    with pytest.raises(ValueError, match="replay_compute: iters: 0 is out of range"):
        sp_local.replay_compute("ring", machines=1, gpus_per_machine=2, seq=64, heads=2, iters=0)
    with pytest.raises(ValueError, match="replay_compute: heads: 0 is out of range"):
        sp_local.replay_compute("ring", machines=1, gpus_per_machine=2, seq=64, heads=0)


def test_comm_sms_from_the_environment(monkeypatch):
    monkeypatch.delenv("DITSCALE_SP_COMM_SMS", raising=False)
    assert sp.make_config("t", strategy="ring").comm_sms == 0
    monkeypatch.setenv("DITSCALE_SP_COMM_SMS", "4")
    assert sp.make_config("t", strategy="ring").comm_sms == 4
    assert sp.make_config("t", strategy="ring", comm_sms=0).comm_sms == 0  # explicit wins
    assert sp.make_config("t").comm_sms is None  # auto: the planner's choice
    for bad, why in (("-4", "-4 is out of range"), ("four", "'four' is not an integer")):
        monkeypatch.setenv("DITSCALE_SP_COMM_SMS", bad)
        with pytest.raises(ValueError, match=f"DITSCALE_SP_COMM_SMS: {why}"):
            sp.make_config("t", strategy="ring")
