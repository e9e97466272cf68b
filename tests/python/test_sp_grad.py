"""Gradients of the multi-rank ditscale.sp.attention on CPU tensors over gloo (gloo_util.run_gloo)
against dense float64 autograd on one process: every strategy (ulysses with 1 and 2 head chunks,
ulysses-overlap, ring, usp, swiftfusion-tas, torus with 2 and 3 chunks, auto) on 2 and 4 ranks,
odd token counts, joint text tokens, GQA, uneven head groups, batch 2, float32 and bfloat16, the
custom op called directly, only some inputs requiring grad, the same bits twice, two subgroups
of 2 ranks at once; a backward whose peer never comes fails within the timeout, a double
backward is refused; a compiled step (fullgraph, aot_eager) equals the eager one; another
device is refused with inputs that require grad. The schedules' own backwards are tested further
by test_sp_ring_backward.py and test_sp_usp_backward.py.

The upstream gradients differ per rank (image and text outputs alike): the dense loss is the sum
of every rank's. A rank's joint-input gradient is that of the heads (ring: the text rows) it
computed, so their sum over the ranks is compared with the dense one. One run_gloo call per
world size runs every case."""

from __future__ import annotations

import math

import pytest
import torch

from gloo_util import run_gloo

# (strategy, fields, mesh, shape): shape = (batch, seq, text, heads, kv_heads, head_dim, dtype).
F32, BF16 = "float32", "bfloat16"
GQA = (2, 13, 5, 6, 3, 16, F32)  # GQA, 7 + 6 tokens on 2 ranks, text; U=2: kv heads 2 + 1
CASES_2 = [
    ("ulysses", {}, (1, 2), GQA),
    ("ulysses", {}, (1, 2), (1, 9, 4, 3, 3, 8, F32)),  # 3 heads on U=2: 2 + 1
    ("ulysses", {"ulysses_chunks": 2}, (1, 2), (1, 11, 2, 4, 4, 8, F32)),  # 2 chunks of 1 head
    ("ulysses", {}, (1, 2), (1, 9, 0, 4, 2, 8, F32)),  # no text
    ("ulysses", {}, (1, 2), (2, 13, 5, 6, 3, 16, BF16)),
    ("ulysses-overlap", {}, (1, 2), GQA),
    ("ring", {}, (1, 2), GQA),
    ("ring", {}, (1, 2), (1, 9, 0, 3, 3, 8, F32)),  # 3 heads, no text
    ("ring", {}, (1, 2), (1, 9, 3, 1, 1, 8, F32)),  # 1 head on 2 ranks: the ring's own backward
    # 1 head, ulysses degree 1: a plain ring, the ring's own backward
    ("usp", {"ulysses_degree": 1, "ring_degree": 2}, (1, 2), (1, 9, 3, 1, 1, 8, F32)),
    ("usp", {}, (1, 2), GQA),
    ("swiftfusion-tas", {}, (2, 1), GQA),
    ("torus", {"chunks": 2}, (2, 1), GQA),
    ("torus", {"chunks": 2}, (2, 1), (2, 13, 5, 6, 3, 16, BF16)),
    ("auto", {}, (2, 1), GQA),
]
CASES_4 = [
    ("ulysses", {}, (1, 4), (2, 13, 5, 6, 6, 16, F32)),  # 4 + 3 + 3 + 3 tokens; heads 2, 2, 1, 1
    ("ulysses", {}, (1, 4), (1, 11, 3, 8, 4, 8, F32)),  # GQA: one kv head (two query heads) each
    ("ulysses", {"ulysses_chunks": 2}, (1, 4), (1, 11, 2, 8, 8, 8, F32)),
    ("ulysses", {}, (1, 4), (1, 9, 2, 30, 30, 8, F32)),  # 30 heads: 8, 8, 7, 7
    ("ulysses", {}, (1, 4), (1, 13, 5, 8, 4, 16, BF16)),
    ("ulysses-overlap", {}, (1, 4), (2, 13, 5, 6, 6, 16, F32)),
    ("ring", {}, (1, 4), (2, 13, 5, 6, 6, 16, F32)),
    ("ring", {}, (1, 4), (1, 11, 0, 4, 2, 8, F32)),  # receives into its own k, v buffers
    ("ring", {}, (1, 4), (1, 11, 3, 3, 1, 8, F32)),  # 3 heads on 4 ranks
    ("usp", {}, (2, 2), (1, 11, 3, 8, 4, 8, F32)),
    ("usp", {}, (2, 2), (1, 13, 5, 8, 4, 16, BF16)),
    ("swiftfusion-tas", {}, (2, 2), (2, 14, 0, 4, 2, 8, F32)),
    ("torus", {"chunks": 2}, (2, 2), (1, 10, 3, 4, 4, 8, F32)),
    ("torus", {"chunks": 3}, (2, 2), (1, 11, 3, 8, 4, 8, F32)),
]


def _rand(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _dense(q, k, v):
    """Dense attention in float64 of [B, L, H, D] over [B, L, Hk, D]."""
    g = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(g, 2).transpose(1, 2) for x in (k, v))
    s = q.transpose(1, 2) @ k.transpose(-1, -2) / math.sqrt(q.shape[3])
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def _reference(shape, seed, world):
    """Full q, k, v (float64, rounded to the dtype), every rank's upstream gradients
    (image [B, count, H, D], text [B, T, H, D]), and the dense gradients of q, k, v."""
    import ditscale.sp as sp
    B, S, T, H, Hk, D, dtype = shape
    dt = getattr(torch, dtype)
    full = [_rand((B, T + S, h, D), seed + i).to(dt).double() for i, h in enumerate((H, Hk, Hk))]
    ups = [(_rand((B, sp.shard_range(S, world, r)[1], H, D), seed + 10 + r),
            _rand((B, T, H, D), seed + 100 + r)) for r in range(world)]
    dense = [x.clone().requires_grad_() for x in full]
    out = _dense(*dense)
    loss = out[:, :T].mul(sum(t for _, t in ups)).sum() if T else 0.0
    for r, (g_img, _) in enumerate(ups):
        begin, count = sp.shard_range(S, world, r)
        loss = loss + out[:, T + begin:T + begin + count].mul(g_img).sum()
    loss.backward()
    return full, ups, [x.grad for x in dense], dt


def _grads(rank, world, strategy, fields, mesh, shape, seed, direct=False):
    """This rank's gradients (q, k, v image shards; joint q, k, v summed over the ranks)."""
    import torch.distributed as dist

    import ditscale.sp as sp
    from ditscale.sp import custom_op
    from ditscale.sp.config import config_text
    B, S, T, H, Hk, D, _ = shape
    full, ups, dense, dt = _reference(shape, seed, world)
    begin, count = sp.shard_range(S, world, rank)
    mine = [x[:, T + begin:T + begin + count].to(dt).requires_grad_() for x in full]
    joint = [x[:, :T].to(dt).requires_grad_() for x in full] if T else []
    cfg = sp.make_config("t", strategy=strategy, **fields)
    if direct:
        out, jout = custom_op.attention_op(*mine, *(joint or [None] * 3),
                                           *custom_op.mesh_args(sp.Mesh(*mesh)),
                                           config_text(cfg))
    else:
        res = sp.attention(*mine, mesh=sp.Mesh(*mesh), config=cfg,
                           **dict(zip(("joint_q", "joint_k", "joint_v"), joint)))
        out, jout = res if T else (res, None)
    loss = out.double().mul(ups[rank][0]).sum()
    if T:
        loss = loss + jout.double().mul(ups[rank][1]).sum()
    loss.backward()
    errs, bits = [], []
    for x, want in zip(mine, dense):
        assert x.grad.dtype == dt
        errs.append((x.grad.double() - want[:, T + begin:T + begin + count]).abs().max().item())
        bits.append(x.grad.clone())
    for x, want in zip(joint, dense):
        total = x.grad.double()
        dist.all_reduce(total)
        errs.append((total - want[:, :T]).abs().max().item())
        bits.append(x.grad.clone())
    scale = max(w.abs().max().item() for w in dense)
    return max(errs) / scale, bits


def _all_cases(rank, world, cases):
    results = []
    for i, case in enumerate(cases):
        err, bits = _grads(rank, world, *case, 1000 * i)
        _, again = _grads(rank, world, *case, 1000 * i, direct=i == 0)
        results.append((err, all(torch.equal(a, b) for a, b in zip(bits, again))))
    return results


def _check(results, cases):
    for per_rank in results:
        for case, (err, same) in zip(cases, per_rank):
            tol = 1e-2 if case[-1][-1] == BF16 else 2e-5
            assert err < tol, (case, err)
            assert same, case


def test_every_strategy_gradients_on_two_ranks():
    _check(run_gloo(_all_cases, 2, CASES_2, timeout_s=300), CASES_2)


def test_every_strategy_gradients_on_four_ranks():
    _check(run_gloo(_all_cases, 4, CASES_4, timeout_s=400), CASES_4)


def _partial(rank, world):
    """Only q requires grad (k, v detached): q's gradient, none for k, v."""
    import ditscale.sp as sp
    shape = (1, 9, 0, 4, 2, 8, F32)
    full, ups, dense, _ = _reference(shape, 7, world)
    begin, count = sp.shard_range(9, world, rank)
    q, k, v = (x[:, begin:begin + count].float() for x in full)
    q.requires_grad_()
    out = sp.attention(q, k, v, mesh=sp.Mesh(1, world), strategy="ulysses")
    out.double().mul(ups[rank][0]).sum().backward()
    return (q.grad.double() - dense[0][:, begin:begin + count]).abs().max().item()


def test_ulysses_gradient_of_q_alone():
    assert max(run_gloo(_partial, 2, timeout_s=90)) < 2e-5


def _refusals(rank, world):
    """Without a backward (another device), inputs that require grad are refused before any
    transfer of the layer."""
    import ditscale.sp as sp
    from ditscale.sp import custom_op
    from ditscale.sp.config import config_text
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    caught = {}
    try:  # no backward on the GPU runtime (meta tensors are refused the same way)
        m = torch.randn(1, 4, 2, 8, device="meta", requires_grad=True)
        sp.attention(m, m, m, mesh=sp.Mesh(1, 2), strategy="ulysses")
    except NotImplementedError as e:
        caught["meta"] = str(e)
    try:
        m = torch.randn(1, 4, 2, 8, device="meta", requires_grad=True)
        custom_op.attention_op(m, m, m, None, None, None, *custom_op.mesh_args(sp.Mesh(1, 2)),
                               config_text(sp.make_config("t", strategy="ring")))
    except NotImplementedError as e:
        caught["op"] = str(e)
    return caught


def test_calls_without_a_backward_refuse_inputs_that_require_grad():
    for caught in run_gloo(_refusals, 2, timeout_s=90):
        assert sorted(caught) == ["meta", "op"]
        for key, name in (("meta", "ulysses"), ("op", "ring")):
            msg = caught[key]
            assert f"not supported yet for strategy {name!r} on meta tensors (" in msg, msg
            assert ("(gradients: every strategy on CPU tensors over gloo and CUDA tensors over "
                    "NCCL, eagerly and under torch.compile)") in msg
        assert caught["op"].startswith("ditscale_sp::attention: q, k, v require grad")


def _compiled_step(rank, world):
    """{strategy: max |compiled - eager| of the gradients} of a loss of sp.attention (joint
    text, GQA) under torch.compile(fullgraph=True, backend="aot_eager") and eagerly."""
    import ditscale.sp as sp
    shape = (1, 11, 3, 4, 2, 8, F32)
    full, ups, _, _ = _reference(shape, 77, world)
    begin, count = sp.shard_range(11, world, rank)
    mesh = sp.Mesh(1, world)
    result = {}
    for strategy in ("ulysses", "ring"):
        def step(q, k, v, tq, tk, tv):
            out, tout = sp.attention(q, k, v, mesh=mesh, strategy=strategy, joint_q=tq,
                                     joint_k=tk, joint_v=tv)
            return out.mul(ups[rank][0].float()).sum() + tout.mul(ups[rank][1].float()).sum()

        inputs = [x[:, 3 + begin:3 + begin + count].float() for x in full]
        inputs += [x[:, :3].float() for x in full]
        grads = []
        for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
            xs = [x.clone().requires_grad_() for x in inputs]
            grads.append(torch.autograd.grad(fn(*xs), xs))
        result[strategy] = max((a - b).abs().max().item() for a, b in zip(*grads))
    return result


def test_a_compiled_step_equals_the_eager_one():
    for result in run_gloo(_compiled_step, 2, timeout_s=300):
        assert result.keys() == {"ulysses", "ring"}
        assert max(result.values()) <= 1e-6, result


# The backward through PyTorch's collectives (torch_backward.py: CUDA tensors over NCCL use it;
# here the same code on CPU tensors over gloo): (world, shape).
TORCH_CASES = [
    (2, (2, 13, 5, 6, 3, 16, F32)),  # GQA, text, heads 3 + 3
    (2, (1, 9, 0, 3, 3, 8, F32)),  # 3 heads: 2 + 1, no text
    (4, (1, 11, 3, 3, 1, 8, F32)),  # 3 heads on 4 ranks (one rank has none), 1 kv head
    (4, (2, 13, 5, 6, 6, 16, BF16)),
]


def _torch_backward(rank, world):
    import torch.distributed as dist

    import ditscale.sp as sp
    from ditscale.sp import torch_backward
    errors = []
    for w, shape in TORCH_CASES:
        if w != world:
            continue
        B, S, T, H, Hk, D, dtype = shape
        full, ups, dense, dt = _reference(shape, 31, world)
        begin, count = sp.shard_range(S, world, rank)
        mine = [x[:, T + begin:T + begin + count].to(dt) for x in full]
        joint = tuple(x[:, :T].to(dt) for x in full) if T else None
        g = torch_backward.gradients(*mine, joint, ups[rank][0].to(dt),
                                     ups[rank][1].to(dt) if T else None, sp.Mesh(1, world))
        errs = [(g[n].double() - w_[:, T + begin:T + begin + count]).abs().max().item()
                for n, w_ in zip(("q", "k", "v"), dense)]
        for n, w_ in zip(("text_q", "text_k", "text_v"), dense if T else ()):
            total = g[n].double()
            dist.all_reduce(total)
            errs.append((total - w_[:, :T]).abs().max().item())
        errors.append(max(errs) / max(x.abs().max().item() for x in dense))
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_the_backward_through_torch_collectives_matches_dense(world):
    cases = [s for w, s in TORCH_CASES if w == world]
    for errors in run_gloo(_torch_backward, world, timeout_s=200):
        assert len(errors) == len(cases)
        for shape, err in zip(cases, errors):
            assert err < (1e-2 if shape[-1] == BF16 else 2e-5), (shape, err)


LONELY_TIMEOUT_S = 5


def _lonely_backward(rank, world):
    """Rank 1 never runs the backward (it stays in the group, alive, past the timeout): rank 0's
    fails within the group's timeout, naming the transfer (no hang); rank 1's double backward is
    refused before any transfer."""
    import time

    import ditscale.sp as sp
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    out = sp.attention(q, q, q, mesh=sp.Mesh(1, world), strategy="ulysses")
    twice = None
    if rank == 1:
        try:
            torch.autograd.grad(out.sum(), q, create_graph=True)
        except NotImplementedError as e:
            twice = str(e)
        time.sleep(LONELY_TIMEOUT_S + 2)  # leaving would close the pair: another error
        return twice
    try:
        torch.autograd.grad(out.sum(), q)  # no transfer matched: rank 1's failed at once
    except RuntimeError as e:
        return str(e)
    return None


def test_a_backward_without_its_peer_fails_within_the_timeout():
    lonely, twice = run_gloo(_lonely_backward, 2, timeout_s=90, pg_timeout_s=LONELY_TIMEOUT_S)
    assert lonely is not None and lonely.startswith(
        "ditscale.sp.attention: ulysses backward (its program transposed): ditscale.sp (CPU "
        "backward): rank 0: gradient of "), lonely
    assert "did not complete within 5 s" in lonely
    assert twice == ("ditscale.sp.attention: no double backward on more than one rank "
                     "(create_graph=True)")


def _subgroups(rank, world):
    """Two meshes of 2 ranks at once ({0, 1} and {2, 3}: subgroups, ranks of the group differ
    from the global ones), each against its own dense reference."""
    import torch.distributed as dist

    import ditscale.sp as sp
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair, local = divmod(rank, 2)
    shape = (1, 9, 3, 4, 2, 8, F32)
    full, ups, dense, _ = _reference(shape, 50 + pair, 2)
    begin, count = sp.shard_range(9, 2, local)
    mine = [x[:, 3 + begin:3 + begin + count].float().requires_grad_() for x in full]
    joint = [x[:, :3].float().requires_grad_() for x in full]
    out, jout = sp.attention(*mine, mesh=sp.Mesh(1, 2, groups[pair]), strategy="ulysses",
                             joint_q=joint[0], joint_k=joint[1], joint_v=joint[2])
    (out.double().mul(ups[local][0]).sum() + jout.double().mul(ups[local][1]).sum()).backward()
    errs = [(x.grad.double() - w[:, 3 + begin:3 + begin + count]).abs().max().item()
            for x, w in zip(mine, dense)]
    for x, w in zip(joint, dense):
        total = x.grad.double()
        dist.all_reduce(total, group=groups[pair])
        errs.append((total - w[:, :3]).abs().max().item())
    return max(errs)


def test_ulysses_gradients_on_two_subgroups_at_once():
    assert max(run_gloo(_subgroups, 4, timeout_s=120)) < 2e-5


def check_cases(results, cases):
    """Every rank's (error against dense, same bits twice, the own backward ran) per case, the
    error within float32 (2e-5) or bf16 (1e-2) tolerance: the own-backward tests' verdict."""
    for per_rank in results:
        assert len(per_rank) == len(cases)
        for case, (err, same, ran) in zip(cases, per_rank):
            tol = 1e-2 if case[-1][-1] == BF16 else 2e-5
            assert err < tol, (case, err)
            assert same, case
            assert ran, case


def skipped_backward(rank, skipper, mesh, strategy, shape=(1, 3, 4, 8), joint=True):
    """(message, seconds) of this rank's failed backward of a small layer (q = k = v of
    ``shape``, 2 joint text tokens if ``joint``) on ``mesh`` by ``strategy`` when rank
    ``skipper`` never runs it (it stays in the group, alive, past LONELY_TIMEOUT_S: leaving
    would close the pairs, another error); None on the skipper or when nothing failed."""
    import ditscale.sp as sp
    q = torch.randn(*shape, requires_grad=True)
    kw = {}
    if joint:
        t = torch.randn(shape[0], 2, *shape[2:])
        kw = dict(joint_q=t, joint_k=t, joint_v=t)
    out = sp.attention(q, q, q, mesh=mesh, strategy=strategy, **kw)
    out = out[0] if isinstance(out, tuple) else out
    return lonely_backward(out, rank, skipper, LONELY_TIMEOUT_S + 3)


def lonely_backward(out, rank, skipper, sleep_s):
    """(message, seconds) of this rank's failed backward of ``out`` when rank ``skipper`` never
    runs it (it sleeps ``sleep_s`` in the group instead); None on the skipper or when nothing
    failed."""
    import time

    if rank == skipper:
        time.sleep(sleep_s)
        return None
    start = time.monotonic()
    try:
        out.sum().backward()
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return None
