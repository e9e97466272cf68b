"""The ring strategy's own backward (ditscale/sp/ring_backward.py) on CPU tensors over gloo
(gloo_util.run_gloo): gradients of q, k, v and the joint text inputs against dense float64
autograd on 2, 3 and 4 ranks (meshes 1 x 2, 1 x 3, 1 x 4, 2 x 2; odd token counts, joint text
with fewer text tokens than ranks, GQA, fewer heads than ranks, batch 2, float32 and bfloat16),
the same bits twice; that the ring path runs (the forward keeps exactly q, k, v, the joint
inputs, the output rows and their log-sum-exp; no Ulysses recomputation, no torch_backward),
also in the backward op torch.compile traces (the eager bits); a rank that finds no ring layout
makes every rank recompute (the decision agreed, once per shape), the gradients still right;
a rank that skips the backward makes the others fail within the group's timeout, naming
ditscale.sp.attention. The references and the loss are test_sp_grad.py's (one spawn per world
size runs every case)."""

from __future__ import annotations

from gloo_util import run_gloo
from test_sp_grad import (BF16, F32, LONELY_TIMEOUT_S, _grads, _reference, check_cases,
                          skipped_backward)

# (strategy, fields, mesh, shape): shape = (batch, seq, text, heads, kv_heads, head_dim, dtype).
CASES_2 = [
    ("ring", {}, (1, 2), (2, 13, 5, 6, 3, 16, F32)),  # GQA, 7 + 6 tokens, text
    ("ring", {}, (1, 2), (1, 9, 0, 3, 3, 8, F32)),  # no text
    ("ring", {}, (1, 2), (1, 9, 3, 1, 1, 8, F32)),  # 1 head on 2 ranks (recompute: none)
    ("ring", {}, (1, 2), (2, 13, 5, 6, 3, 16, BF16)),
]
CASES_3 = [("ring", {}, (1, 3), (1, 10, 2, 4, 2, 8, F32))]  # 4 + 3 + 3 tokens, 1 + 1 + 0 text
CASES_4 = [
    ("ring", {}, (1, 4), (2, 13, 5, 6, 6, 16, F32)),
    ("ring", {}, (1, 4), (1, 11, 0, 4, 2, 8, F32)),  # the forward receives into k, v
    ("ring", {}, (1, 4), (1, 11, 3, 3, 1, 8, F32)),  # 3 heads, 1 kv head; text 1, 1, 1, 0
    ("ring", {}, (2, 2), (1, 11, 3, 8, 4, 8, F32)),
    ("ring", {}, (1, 4), (1, 13, 5, 8, 4, 16, BF16)),
]


def _no_recomputation():
    """Makes every other backward raise and records the ring backward's saved tensors."""
    from ditscale.sp import recompute, ring_backward, torch_backward

    def refuse(*args, **kwargs):
        raise AssertionError("the ring backward recomputed the layer")

    recompute.plan = recompute.run_kept = torch_backward.gradients = refuse
    seen = []
    real = ring_backward.gradients

    def spy(ring, saved, dout, djout):
        seen.append([(tuple(t.shape), t.dtype) for t in saved])
        return real(ring, saved, dout, djout)

    ring_backward.gradients = spy
    return seen


def _expected_saved(rank, world, shape):
    """(shape, dtype) of q, k, v, the joint inputs, the output rows, the lse rows."""
    import torch

    import ditscale.sp as sp
    B, S, T, H, Hk, D, dtype = shape
    dt = getattr(torch, dtype)
    n, rows = sp.shard_range(S, world, rank)[1], sp.shard_range(T, world, rank)[1]
    inputs = [(B, n, H, D), (B, n, Hk, D), (B, n, Hk, D)]
    inputs += [(B, T, H, D), (B, T, Hk, D), (B, T, Hk, D)] if T else []
    return [(s, dt) for s in inputs] + [((B, rows + n, H, D), torch.float32),
                                        ((B, rows + n, H, 1), torch.float32)]


def _cases(rank, world, cases):
    """Per case: (error against dense, the same bits twice, saved tensors as expected)."""
    seen = _no_recomputation()
    results = []
    for i, case in enumerate(cases):
        seen.clear()
        err, bits = _grads(rank, world, *case, 1000 * i)
        _, again = _grads(rank, world, *case, 1000 * i, direct=i == 0)
        want = _expected_saved(rank, world, case[-1])
        same = all(a.equal(b) for a, b in zip(bits, again))
        results.append((err, same, seen == [want, want]))
    return results


def _op_is_eager(rank, world):
    """The backward op torch.compile traces (custom_op.attention_backward_op: the ring forward
    again, then its backward) gives the eager backward's bits, through the ring backward, in
    contiguous tensors (a compiled graph views them as its fake kernel's)."""
    import torch

    import ditscale.sp as sp
    from ditscale.sp import custom_op
    from ditscale.sp.config import config_text
    seen = _no_recomputation()
    full, ups, _, _ = _reference((1, 11, 3, 4, 2, 8, F32), 5, world)
    begin, count = sp.shard_range(11, world, rank)
    xs = [x[:, 3 + begin:3 + begin + count].float() for x in full]
    xs += [x[:, :3].float() for x in full]
    xs = [x.requires_grad_() for x in xs]
    cfg, mesh = sp.make_config("t", strategy="ring"), sp.Mesh(1, world)
    out, tout = sp.attention(*xs[:3], mesh=mesh, config=cfg, joint_q=xs[3], joint_k=xs[4],
                             joint_v=xs[5])
    dout, dtout = ups[rank][0].float(), ups[rank][1].float()
    eager = torch.autograd.grad((out, tout), xs, (dout, dtout))
    by_op = custom_op.attention_backward_op(*(x.detach() for x in xs), dout, dtout,
                                            *custom_op.mesh_args(mesh), config_text(cfg))
    contiguous = all(g.is_contiguous() for g in by_op)  # as the op's fake kernel's
    return len(seen) == 2 and contiguous and all(a.equal(b) for a, b in zip(eager, by_op))


def _two_ranks(rank, world):
    return _cases(rank, world, CASES_2), _op_is_eager(rank, world)


def test_ring_backward_on_two_ranks():
    results = run_gloo(_two_ranks, 2, timeout_s=300)
    check_cases([cases for cases, _ in results], CASES_2)
    assert all(same for _, same in results)


def _one_rank_without_layout(rank, world):
    """Rank 2 finds no ring layout (ring_backward.layout forced to None there): every rank
    takes the recomputation (recompute.own None, recompute.run_kept; never the ring backward),
    the gradients still right. Per rank: (error against dense, {what: calls}) of two calls of
    one shape (a ring of 4 that is not transposable; the agreement memoised: one look-up)."""
    from ditscale.sp import recompute, ring_backward

    real = {"layout": ring_backward.layout, "run_kept": recompute.run_kept,
            "gradients": ring_backward.gradients, "own": recompute.own}
    calls = {"layout": 0, "run_kept": 0, "gradients": 0, "own": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            result = fn(*args, **kwargs)
            calls[name] += name != "own" or result is None  # own: the None results
            return result
        return run

    fns = dict(real, layout=(lambda *args: None) if rank == 2 else real["layout"])
    ring_backward.layout, ring_backward.gradients = (counted(n, fns[n])
                                                     for n in ("layout", "gradients"))
    recompute.run_kept, recompute.own = (counted(n, fns[n]) for n in ("run_kept", "own"))
    try:  # a shape of its own: the agreed None stays memoised for its program
        case = ("ring", {}, (1, 4), (1, 9, 3, 4, 2, 8, F32))
        errors = [_grads(rank, world, *case, 7, direct=d)[0] for d in (False, True)]
    finally:
        ring_backward.layout, ring_backward.gradients = real["layout"], real["gradients"]
        recompute.run_kept, recompute.own = real["run_kept"], real["own"]
    return max(errors), calls


def _four_ranks(rank, world):
    return _one_rank_without_layout(rank, world), _cases(rank, world, CASES_4)


def test_ring_backward_on_four_ranks():
    results = run_gloo(_four_ranks, 4, timeout_s=400)
    check_cases([cases for _, cases in results], CASES_4)
    for rank, ((err, calls), _) in enumerate(results):
        assert err < 2e-5, (rank, err)
        assert calls == {"layout": 1, "own": 2, "run_kept": 2, "gradients": 0}, (rank, calls)


def _three_ranks_then_one_skips(rank, world):
    """A ring of 3 against dense; then rank 2 never runs the backward: ranks 0 and 1 fail within
    the group's timeout."""
    import ditscale.sp as sp
    checked = _cases(rank, world, CASES_3)
    return checked, skipped_backward(rank, 2, sp.Mesh(1, world), "ring", (1, 4, 2, 8), False)


def test_a_rank_that_skips_the_ring_backward_fails_the_others():
    results = run_gloo(_three_ranks_then_one_skips, 3, timeout_s=120,
                       pg_timeout_s=LONELY_TIMEOUT_S)
    check_cases([checked for checked, _ in results], CASES_3)
    assert results[2][1] is None
    for rank in (0, 1):
        msg, seconds = results[rank][1]
        assert msg.startswith(f"ditscale.sp.attention: rank {rank}: ring backward, block of "
                              f"step 0: the "), msg
        assert f"did not complete within {LONELY_TIMEOUT_S} s" in msg, msg
        assert seconds < LONELY_TIMEOUT_S + 3, seconds
