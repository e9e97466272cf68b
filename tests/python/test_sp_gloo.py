"""ditscale.sp.attention on CPU tensors over gloo (one process per rank: gloo_util.run_gloo)
against dense attention of the gathered inputs (float64 on one process): every strategy and chunk
count on meshes 1 x 2, 2 x 1, 1 x 4 and 2 x 2, strategy "auto", odd token counts, joint text, GQA,
uneven Ulysses head groups, batch 2, float32 / bfloat16 / float16; the errors (one-sided transport
on CPU, mixed devices, shapes that differ within the call or across ranks, inputs that require
grad on more than one rank for a strategy without a backward: test_sp_grad.py has the
gradients); torch.compile with
fullgraph=True through the custom op torch.ops.ditscale_sp.attention on 1 and 2 ranks.

Each world size is one run_gloo call whose children run every case (spawning and importing torch
is the expensive part on the 2-core CI machine)."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from gloo_util import run_gloo

# (strategy, fields, mesh, shape): shape = (batch, seq, text, heads, kv_heads, head_dim, dtype).
F32, BF16, F16 = "float32", "bfloat16", "float16"
GQA = (2, 13, 5, 6, 3, 16, F32)  # 13 tokens (7 + 6 on 2 ranks), 5 text, 3 kv heads: 2 + 1 on U=2
EVEN4 = (1, 11, 0, 4, 4, 8, F32)  # 4 kv heads: 2 head chunks of 1 on U=2
UNEVEN4 = (2, 13, 5, 6, 6, 16, F32)  # 4 + 3 + 3 + 3 tokens; 6 heads on U=4: 2, 2, 1, 1
GQA4 = (1, 11, 3, 8, 4, 8, F32)  # U=4: one kv head (two query heads) each

CASES_2 = [
    ("ulysses", {}, (1, 2), GQA),
    ("ulysses", {"ulysses_chunks": 2}, (1, 2), EVEN4),
    ("ulysses-overlap", {}, (1, 2), GQA),
    ("ring", {}, (1, 2), GQA),
    ("usp", {}, (1, 2), GQA),
    ("swiftfusion-tas", {}, (2, 1), GQA),
    ("torus", {"chunks": 1}, (2, 1), GQA),
    ("torus", {"chunks": 2}, (2, 1), GQA),
    ("torus", {"chunks": 3}, (2, 1), GQA),
    ("auto", {}, (1, 2), GQA),
    ("auto", {}, (2, 1), GQA),
    ("ring", {}, (1, 2), (1, 9, 0, 3, 3, 8, F32)),  # 3 heads, no text
    ("ulysses", {}, (1, 2), (1, 9, 4, 3, 3, 8, F32)),  # 3 heads on U=2: 2 + 1
    ("torus", {"chunks": 2}, (2, 1), (2, 13, 5, 6, 3, 16, BF16)),
    ("ulysses", {}, (1, 2), (2, 13, 5, 6, 3, 16, F16)),
]

CASES_4 = [
    ("ulysses", {}, (1, 4), UNEVEN4),
    ("ulysses", {"ulysses_chunks": 2}, (1, 4), (1, 11, 2, 8, 8, 8, F32)),
    ("ulysses-overlap", {}, (1, 4), UNEVEN4),
    ("ring", {}, (1, 4), UNEVEN4),
    ("usp", {}, (2, 2), GQA),
    ("swiftfusion-tas", {}, (2, 2), GQA),
    ("torus", {"chunks": 1}, (2, 2), GQA),
    ("torus", {"chunks": 2}, (2, 2), GQA),
    ("torus", {"chunks": 3}, (2, 2), GQA),
    ("auto", {}, (1, 4), UNEVEN4),
    ("auto", {}, (2, 2), GQA),
    ("ulysses", {}, (1, 4), GQA4),
    ("usp", {}, (2, 2), (2, 13, 5, 6, 3, 16, BF16)),
    ("ulysses-overlap", {}, (1, 4), (1, 9, 2, 30, 30, 8, F32)),  # 30 heads: 8, 8, 7, 7
    # 3 heads on U=2: 2, 1; 10 and 14 tokens: 3, 3, 2, 2 and 4, 4, 3, 3 (rank 1 has ring index 1)
    ("torus", {"chunks": 2}, (2, 2), (1, 10, 3, 3, 3, 8, F32)),
    ("swiftfusion-tas", {}, (2, 2), (2, 14, 0, 4, 2, 8, F32)),
    ("ring", {}, (1, 4), (1, 11, 0, 4, 2, 8, F32)),  # receives into its own k, v buffers
]


def _inputs(shape, seed):
    """Full inputs (the same on every rank: one seed), float64, and their dtype."""
    B, S, T, H, Hk, D, dtype = shape
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def rand(h):
        return torch.randn(B, T + S, h, D, generator=g, dtype=torch.float64).to(dt)

    return rand(H), rand(Hk), rand(Hk), dt


def _dense(q, k, v):
    """Dense attention in float64 of [B, L, H, D] over [B, L, Hk, D]."""
    g = q.shape[2] // k.shape[2]
    k, v = (x.double().repeat_interleave(g, 2).transpose(1, 2) for x in (k, v))
    s = q.double().transpose(1, 2) @ k.transpose(-1, -2) / math.sqrt(q.shape[3])
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def _run_case(rank, world, strategy, fields, mesh_shape, shape, seed):
    import ditscale.sp as sp
    B, S, T, H, Hk, D, dtype = shape
    q, k, v, dt = _inputs(shape, seed)
    ref = _dense(q, k, v)
    begin, count = sp.shard_range(S, world, rank)
    img = slice(T + begin, T + begin + count)
    mesh = sp.Mesh(*mesh_shape)
    args = dict(mesh=mesh, strategy=strategy, **fields)
    if T:
        args.update(joint_q=q[:, :T], joint_k=k[:, :T], joint_v=v[:, :T])
    mine = [x[:, img].clone() for x in (q, k, v)]
    before = [x.clone() for x in mine]
    res = sp.attention(*mine, **args)
    out, text_out = res if T else (res, None)
    assert all(torch.equal(a, b) for a, b in zip(mine, before)), "the inputs were written"
    assert out.dtype == dt and out.shape == (B, count, H, D)
    err = (out.double() - ref[:, img]).abs().max().item()
    if T:
        assert text_out.dtype == dt and text_out.shape == (B, T, H, D)
        err = max(err, (text_out.double() - ref[:, :T]).abs().max().item())
    again = sp.attention(*mine, **args)  # the same bits (the cached program, same inputs)
    same = torch.equal(again[0] if T else again, out)
    bits = [out] + ([text_out] if T else [])
    digest = hashlib.sha256(b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                     for t in bits)).hexdigest()
    return err, same, digest


def _all_cases(rank, world, cases):
    """Every case, then the torus and ring cases again with each rank's attention blocks and
    copies delayed at random (other interleavings of the streams and the ranks: no deadlock,
    the same result)."""
    results = [_run_case(rank, world, *case, seed=i) for i, case in enumerate(cases)]
    import random
    import time
    from ditscale.sp import cpu_executor
    rng = random.Random(rank)
    start = cpu_executor._Run.start

    def delayed(self, op):
        if op.kind != "Send" and op.kind != "Recv" and rng.random() < 0.3:
            time.sleep(rng.random() * 0.003)
        return start(self, op)

    cpu_executor._Run.start = delayed
    try:
        for i, case in enumerate(cases):
            if case[0] in ("torus", "ring"):
                results.append(_run_case(rank, world, *case, seed=i))
    finally:
        cpu_executor._Run.start = start
    return results


def _tolerance(shape):
    return {F32: 2e-5, BF16: 2e-2, F16: 4e-3}[shape[-1]]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)], ids=["2", "4"])
def test_every_strategy_matches_dense(world, cases):
    results = run_gloo(_all_cases, world, cases, timeout_s=150)
    again = [c for c in cases if c[0] in ("torus", "ring")]
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == len(cases) + len(again)
        for case, (err, same, _) in zip(cases + again, per_rank):
            assert err < _tolerance(case[3]), f"rank {rank} {case}: max error {err}"
            assert same, f"rank {rank} {case}: a second call gave other bits"
        digests = {c: d for c, (_, _, d) in zip(map(repr, cases), per_rank)}
        for case, (_, _, d) in zip(again, per_rank[len(cases):]):
            assert digests[repr(case)] == d, f"rank {rank} {case}: other bits when delayed"


def _errors(rank, world):
    """Each failing call's message (or None when it did not fail), on every rank."""
    import ditscale.sp as sp
    from ditscale.sp import gpu_runtime
    mesh = sp.Mesh(1, world)
    q = torch.randn(1, 4 + rank, 2, 8)
    caught = {}

    def expect(name, fn):
        try:
            fn()
            caught[name] = None
        except ValueError as e:
            caught[name] = str(e)

    expect("nvshmem", lambda: sp.attention(q, q, q, mesh=mesh, strategy="ring",
                                           transport="nvshmem"))
    expect("nvshmem-intra", lambda: sp.attention(q, q, q, mesh=mesh, transport="nvshmem-intra"))
    expect("devices", lambda: sp.attention(q, q.to("meta"), q, mesh=mesh, strategy="ring"))
    expect("tokens", lambda: sp.attention(q, q[:, :3], q[:, :3], mesh=mesh, strategy="ring"))
    expect("joint", lambda: sp.attention(q, q, q, mesh=mesh, strategy="ring",
                                         joint_q=q, joint_k=q[:, :2], joint_v=q))
    expect("dtype", lambda: sp.attention(q.double(), q.double(), q.double(), mesh=mesh,
                                         strategy="ring"))
    # Rank r holds 4 + r tokens: 4 + 5 are not shard_range's 5 + 4.
    expect("shards", lambda: sp.attention(q, q, q, mesh=mesh, strategy="ring"))
    cfg = sp.make_config("test", strategy="ring")
    expect("cuda-gloo", lambda: gpu_runtime.attention(q, q, q, None, mesh, cfg, "w"))
    d = 8 if rank == 0 else 16
    p = torch.randn(1, 4, 2, d)
    expect("ranks", lambda: sp.attention(p, p, p, mesh=mesh, strategy="ring"))
    return caught


def test_errors_name_the_problem():
    got = run_gloo(_errors, 2, timeout_s=90)
    for rank, caught in enumerate(got):
        assert "one-sided" in caught["nvshmem"] and "'nvshmem'" in caught["nvshmem"]
        assert "'nvshmem-intra'" in caught["nvshmem-intra"]
        assert "k is torch.float32 on meta" in caught["devices"]
        assert "k has shape (1, 3, 2, 8), expected (1, " in caught["tokens"]
        assert "joint_k has shape" in caught["joint"]
        assert "torch.float64" in caught["dtype"]
        assert f"rank 0 holds 4 image tokens, its share of 9 on 2 ranks is 5" in caught["shards"]
        assert "CUDA tensors need an NCCL process group, the mesh's group has backend 'gloo'" \
            in caught["cuda-gloo"]
        assert "disagree on the layer's head_dim: rank 0 has 8, rank 1 16" in caught["ranks"]


def _grad(rank, world):
    """On 2 ranks: inputs that require grad (any one of q, k, v) give an output autograd records
    (every strategy has a backward on CPU: test_sp_grad.py); the same inputs under no_grad,
    detached or in inference mode, and the op called directly under no_grad, give an output that
    does not require grad, matching dense attention."""
    import ditscale.sp as sp
    from ditscale.sp import custom_op
    from ditscale.sp.config import config_text
    mesh = sp.Mesh(1, world)
    q, k, v, _ = _inputs((1, 9, 0, 2, 2, 8, F32), 3)
    begin, count = sp.shard_range(9, world, rank)
    mine = [x[:, begin:begin + count].clone().requires_grad_() for x in (q, k, v)]
    ref = _dense(q, k, v)[:, begin:begin + count]
    tracked = []  # only one of q, k, v requiring grad: the output is recorded (ring has a backward)
    for which in range(3):
        args = [t if i == which else t.detach() for i, t in enumerate(mine)]
        tracked.append(sp.attention(*args, mesh=mesh, strategy="ring").requires_grad)
    with torch.no_grad():
        no_grad = sp.attention(*mine, mesh=mesh, strategy="ring")
    with torch.inference_mode():
        inference = sp.attention(*mine, mesh=mesh, strategy="ring")
    detached = sp.attention(*(t.detach() for t in mine), mesh=mesh, strategy="ring")
    args = (None, None, None, *custom_op.mesh_args(mesh),
            config_text(sp.make_config("t", strategy="ring")))
    with torch.no_grad():
        direct = custom_op.attention_op(*mine, *args)[0]
    outs = (no_grad, inference, detached, direct)
    errs = [(o.double() - ref).abs().max().item() for o in outs]
    return tracked, errs, [o.requires_grad for o in outs]


def test_grad_mode_decides_whether_the_output_is_recorded_on_two_ranks():
    for tracked, errs, requires_grad in run_gloo(_grad, 2, timeout_s=90):
        assert tracked == [True] * 3
        assert max(errs) < 2e-5 and requires_grad == [False] * 4


def test_one_rank_attention_is_differentiable():
    import ditscale.sp as sp
    q, k, v, _ = _inputs((1, 7, 3, 4, 2, 8, F32), 5)
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    dense = [x.clone().double().requires_grad_() for x in (q, k, v)]
    out, text_out = sp.attention(mine[0][:, 3:], mine[1][:, 3:], mine[2][:, 3:],
                                 mesh=sp.Mesh(1, 1), joint_q=mine[0][:, :3],
                                 joint_k=mine[1][:, :3], joint_v=mine[2][:, :3])
    torch.cat([text_out, out], 1).square().sum().backward()
    _dense(*dense).square().sum().backward()
    for got, want in zip(mine, dense):
        assert (got.grad.double() - want.grad).abs().max().item() < 1e-4


def _compiled(rank, world):
    """The fullgraph-compiled (first: nothing run eagerly before) and the eager result of a small
    function around sp.attention, on the default group and on a subgroup; Dynamo's graphs."""
    import torch.distributed as dist

    import ditscale.sp as sp
    meshes = [sp.Mesh(1, world), sp.Mesh(1, world, dist.new_group(list(range(world))))]
    g = torch.Generator().manual_seed(7)
    q, k, v, tq = (torch.randn(2, 6, 4, 8, generator=g) for _ in range(4))
    graphs = []

    def record(gm, example_inputs):  # Dynamo's graph, then AOTAutograd (the fake kernel)
        graphs.append(gm.code)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    same = []
    for mesh in meshes:
        def layer(q, k, v, tq):
            out, text_out = sp.attention(q * 2, k, v, mesh=mesh, strategy="ring", joint_q=tq,
                                         joint_k=tq, joint_v=tq)
            return out.relu() + 1, text_out

        compiled = torch.compile(layer, backend=record, fullgraph=True)(q, k, v, tq)
        same += [torch.equal(a, b) for a, b in zip(layer(q, k, v, tq), compiled)]
    return same, [c.count("ditscale_sp.attention") for c in graphs]


def test_compile_fullgraph_two_ranks():
    for same, ops_per_graph in run_gloo(_compiled, 2, timeout_s=120):
        assert same == [True] * 4
        assert ops_per_graph == [1, 1]  # one graph per function, each holding the op


def test_compile_fullgraph_one_rank():
    import ditscale.sp as sp
    mesh = sp.Mesh(1, 1)
    q = torch.randn(1, 5, 2, 8)

    def layer(x):
        return sp.attention(x, x, x, mesh=mesh, strategy="torus", chunks=2) * 3

    torch._dynamo.reset()
    got = torch.compile(layer, backend="aot_eager", fullgraph=True)(q)
    assert torch.allclose(got, layer(q), atol=1e-6)


def test_one_sided_transport_on_cpu_without_a_process_group():
    import ditscale.sp as sp
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="transport 'nvshmem' is one-sided .NVSHMEM: CUDA tensors"):
        sp.attention(q, q, q, mesh=sp.Mesh(1, 2), transport="nvshmem")
    with pytest.raises(ValueError, match="a mesh of 2 ranks needs torch.distributed initialized"):
        sp.attention(q, q, q, mesh=sp.Mesh(1, 2), strategy="ring")
    # One rank: nothing is transported, SDPA runs whatever the transport.
    assert sp.attention(q, q, q, mesh=sp.Mesh(1, 1), transport="nvshmem").shape == q.shape


def test_attention_config_memo_follows_the_environment(monkeypatch):
    from ditscale.sp import Config, make_config
    from ditscale.sp.api import _attention_config
    monkeypatch.delenv("DITSCALE_SP_COMM_SMS", raising=False)
    ring = Config(strategy="ring")
    assert _attention_config("w", ring, {}) == make_config("w", ring)
    assert _attention_config("w", ring, {}).comm_sms == 0
    monkeypatch.setenv("DITSCALE_SP_COMM_SMS", "4")
    assert _attention_config("w", ring, {}).comm_sms == 4
    assert _attention_config("w", None, {"strategy": "torus", "chunks": 3}).torus_chunks == 3
    with pytest.raises(ValueError, match="chunks: 0 is out of range"):
        _attention_config("w", None, {"strategy": "torus", "chunks": 0})
    with pytest.raises(TypeError, match="chunks: expected an integer, got bool"):  # not as 1
        _attention_config("w", None, {"strategy": "torus", "chunks": True})


def test_rank_program_binding_and_loader():
    from ditscale import _core
    from ditscale.sp import cpu_executor
    layer = dict(machines=1, gpus_per_machine=2, batch=1, seq=9, text=2, heads=3, kv_heads=3,
                 head_dim=8, dtype_bytes=4)
    from ditscale.sp.config import config_text
    import ditscale.sp as sp

    def text(**fields):
        return config_text(sp.make_config("t", strategy="ring", **fields))

    raw = _core.sp_rank_program(**layer, config=text(), rank=1)
    assert (raw["rank"], raw["ring_degree"], raw["image_token_count"]) == (1, 2, 4)
    prog = cpu_executor.load_program(raw, "ring")
    kinds = {op.kind for op in prog.ops}
    assert {"Send", "Recv", "Attention", "Merge"} <= kinds
    assert sorted(i for units in prog.units for u in units for i in u) == list(range(len(prog.ops)))
    with pytest.raises(_core.Error, match=r"rank: 2 is out of range \[0, 1\]"):
        _core.sp_rank_program(**layer, config=text(), rank=2)
    with pytest.raises(_core.Error, match="strategy: 'auto' is not one of"):
        _core.sp_rank_program(**layer, config=text().replace("=ring", "=auto"), rank=0)
    one_sided = _core.sp_rank_program(**layer, config=text(transport="nvshmem"), rank=0)
    with pytest.raises(ValueError, match="is a (Put|Signal|Wait): the CPU executor runs "
                                         "two-sided transports only"):
        cpu_executor.load_program(one_sided, "ring nvshmem")
