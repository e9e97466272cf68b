"""The Ulysses x ring attention over PyTorch's transfers (ditscale/sp/torch_usp.py: CUDA tensors
that require grad take it; here the same code on CPU tensors over gloo, called directly) against
dense float64 autograd (test_sp_grad.py's references): 2 ranks (ulysses, ring) and 4 (ulysses
1 x 4, ring, usp 2 x 2, swiftfusion-tas 2 x 2), odd token counts, joint text with fewer text
tokens than ranks, GQA, fewer kv heads than the Ulysses degree, uneven heads, bfloat16, batch 2;
its forward output against the CPU executor's (the op's), the decomposition (U, R, placement)
the executors' program has, the same bits twice, what the forward keeps; a rank that skips the
backward makes the other fail within the group's timeout; which strategies the op's CUDA autograd
path gives it (custom_op._torch_usp_layout). One spawn per world size."""

from __future__ import annotations

import torch

from gloo_util import run_gloo
from test_sp_grad import BF16, F32, _reference, lonely_backward

# (strategy, mesh, shape, (U, R, Ulysses outer)): shape = (batch, seq, text, heads, kv_heads,
# head_dim, dtype).
CASES_2 = [
    ("ulysses", (1, 2), (2, 13, 5, 6, 3, 16, F32), (2, 1, False)),  # GQA, 7 + 6 tokens
    ("ring", (1, 2), (2, 13, 5, 6, 3, 16, F32), (1, 2, False)),
    ("ring", (1, 2), (1, 9, 1, 2, 1, 8, BF16), (1, 2, False)),  # 1 text token on 2 ranks
    ("ulysses-overlap", (1, 2), (1, 11, 3, 4, 2, 8, F32), (2, 1, False)),  # as ulysses
]
CASES_4 = [
    ("ulysses", (1, 4), (2, 13, 5, 6, 6, 16, F32), (4, 1, False)),  # heads 2, 2, 1, 1
    ("ulysses", (1, 4), (1, 11, 3, 8, 2, 8, F32), (4, 1, False)),  # 2 kv heads on U = 4
    ("ring", (1, 4), (1, 11, 3, 3, 1, 8, F32), (1, 4, False)),  # text rows 1, 1, 1, 0
    ("usp", (2, 2), (1, 11, 3, 8, 4, 8, F32), (2, 2, False)),
    ("usp", (2, 2), (1, 11, 3, 6, 3, 8, F32), (2, 2, False)),  # kv heads 2 + 1
    ("usp", (2, 2), (1, 11, 3, 4, 1, 8, F32), (2, 2, False)),  # 1 kv head on U = 2
    ("usp", (2, 2), (1, 13, 5, 8, 4, 16, BF16), (2, 2, False)),
    ("swiftfusion-tas", (2, 2), (2, 14, 0, 4, 2, 8, F32), (2, 2, True)),
    ("swiftfusion-tas", (2, 2), (1, 11, 1, 4, 2, 8, F32), (2, 2, True)),
]
PG_TIMEOUT_S = 10  # the 2-rank spawn's group timeout (its last case skips a backward)


def _inputs(rank, world, shape, full):
    import ditscale.sp as sp
    S, T, dt = shape[1], shape[2], getattr(torch, shape[-1])
    begin, count = sp.shard_range(S, world, rank)
    mine = [x[:, T + begin:T + begin + count].to(dt).requires_grad_() for x in full]
    joint = [x[:, :T].to(dt).requires_grad_() for x in full] if T else [None] * 3
    return mine, joint


def _run(rank, world, strategy, mesh, shape, seed):
    """(out, joint_out, every input's gradient, the saved tensors' shapes) of one step."""
    import ditscale.sp as sp
    from ditscale.sp import torch_usp
    full, ups, _, _ = _reference(shape, seed, world)
    mine, joint = _inputs(rank, world, shape, full)
    cfg = sp.make_config("t", strategy=strategy)
    out, jout = torch_usp.attention(*mine, *joint, mesh=sp.Mesh(*mesh), cfg=cfg)
    saved = [tuple(t.shape) for t in out.grad_fn.saved_tensors]
    loss = out.double().mul(ups[rank][0]).sum()
    if shape[2]:
        loss = loss + jout.double().mul(ups[rank][1]).sum()
    loss.backward()
    grads = [x.grad for x in mine + joint if x is not None]
    return out.detach(), jout.detach(), grads, saved


def _expected_saved(rank, shape, lay):
    """Query rows, own k, v block, text k, v of the head group, out and lse rows."""
    B, T, D = shape[0], shape[2], shape[5]
    u, i = lay.coords
    rows = lay.text[i][1] + lay.chunk(i)
    h, hk = lay.heads(u)[1], lay.kv[u][1]
    kept = [(B, rows, h, D), (B, lay.chunk(i), hk, D), (B, lay.chunk(i), hk, D)]
    kept += [(B, T, hk, D)] * (2 if T else 0)
    return kept + [(B, rows, h, D), (B, rows, h, 1)]


def _forward_error(mine, joint, out, jout, strategy, mesh) -> float:
    """max |torch_usp's output - the op's| (the CPU executor's schedule, no grad)."""
    import ditscale.sp as sp
    kw = {}
    if joint[0] is not None:
        kw = dict(zip(("joint_q", "joint_k", "joint_v"), (x.detach() for x in joint)))
    with torch.no_grad():
        ref = sp.attention(*(x.detach() for x in mine), mesh=sp.Mesh(*mesh), strategy=strategy,
                           **kw)
    if not kw:
        return (out - ref).abs().max().item()
    return max((out - ref[0]).abs().max().item(), (jout - ref[1]).abs().max().item())


def _case(rank, world, strategy, mesh, shape, seed):
    """(gradient error / max |dense grad|, forward error against the executor, same bits twice,
    (U, R, outer), the saved shapes as expected)."""
    import torch.distributed as dist

    import ditscale.sp as sp
    from ditscale.sp import torch_usp_layout
    S, T = shape[1:3]
    full, _, dense, _ = _reference(shape, seed, world)
    out, jout, grads, saved = _run(rank, world, strategy, mesh, shape, seed)
    again = _run(rank, world, strategy, mesh, shape, seed)[2]
    begin, count = sp.shard_range(S, world, rank)
    errs = [(g.double() - w[:, T + begin:T + begin + count]).abs().max().item()
            for g, w in zip(grads[:3], dense)]
    for g, w in zip(grads[3:], dense):
        total = g.double()
        dist.all_reduce(total)
        errs.append((total - w[:, :T]).abs().max().item())
    mine, joint = _inputs(rank, world, shape, full)
    lay = torch_usp_layout.layout_for(mine[0], mine[1], T, sp.Mesh(*mesh),
                                      sp.make_config("t", strategy=strategy))
    fwd = 0.0  # the executors refuse fewer kv heads than U (kv_rep > 1): nothing to compare
    if lay.kv_rep == 1:
        fwd = _forward_error(mine, joint, out, jout, strategy, mesh)
    same = all(torch.equal(a, b) for a, b in zip(grads, again))
    scale = max(w.abs().max().item() for w in dense)
    return (max(errs) / scale, fwd, same, (lay.U, lay.R, lay.outer),
            saved == _expected_saved(rank, shape, lay))


def _skipped(rank, world):
    """(message, seconds) of rank 0's backward when rank 1 never runs it; None on rank 1."""
    import ditscale.sp as sp
    from ditscale.sp import torch_usp
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    out, _ = torch_usp.attention(q, q, q, mesh=sp.Mesh(1, world),
                                 cfg=sp.make_config("t", strategy="ring"))
    return lonely_backward(out, rank, 1, PG_TIMEOUT_S + 3)  # alive: leaving closes the pair


def _taken(rank, world):
    """{strategy: whether the op's CUDA autograd path would take torch_usp} for a small layer."""
    import ditscale.sp as sp
    from ditscale.sp import custom_op
    q = torch.randn(1, 5 - rank, 4, 8)
    return {s: custom_op._torch_usp_layout(q, q, None, sp.Mesh(1, world),
                                           sp.make_config("t", strategy=s)) is not None
            for s in ("ulysses", "ring", "usp", "torus", "ulysses-overlap")}


def _all(rank, world, cases, skip):
    results = [_case(rank, world, *case[:3], 100 * n) for n, case in enumerate(cases)]
    if not skip:
        return results, None
    return results, (_taken(rank, world), _skipped(rank, world))


def _check(results, cases):
    for per_rank, _ in results:
        for (strategy, mesh, shape, degrees), (err, fwd, same, got, kept) in zip(cases,
                                                                                  per_rank):
            bf16 = shape[-1] == BF16
            assert err < (1e-2 if bf16 else 2e-5), (strategy, shape, err)
            assert fwd <= (1e-2 if bf16 else 1e-5), (strategy, shape, fwd)
            assert same, (strategy, shape)
            assert got == degrees, (strategy, shape, got)
            assert kept, (strategy, shape)


def test_torch_usp_on_two_ranks():
    results = run_gloo(_all, 2, CASES_2, True, timeout_s=300, pg_timeout_s=PG_TIMEOUT_S)
    _check(results, CASES_2)
    (taken, failed), (_, skipper) = results[0][1], results[1][1]
    assert taken == {"ulysses": True, "ring": True, "usp": True, "torus": False,
                     "ulysses-overlap": True}, taken
    assert skipper is None and failed is not None
    msg, seconds = failed
    assert msg.startswith("ditscale.sp.attention: rank 0: torch_usp backward, block of step 0: "
                          "the "), msg
    assert f"did not complete within {PG_TIMEOUT_S} s" in msg, msg
    assert seconds < PG_TIMEOUT_S + 5, seconds


def test_torch_usp_on_four_ranks():
    _check(run_gloo(_all, 4, CASES_4, False, timeout_s=400), CASES_4)



class _Late:
    """A coalesced batch's one work that never completes."""

    def wait(self, timeout):
        raise RuntimeError(f"timed out after {timeout.total_seconds():g} s")


def _coalesced(rank, world):
    import ditscale.sp as sp
    from ditscale.sp import ring_backward
    ring_backward.dist.batch_isend_irecv = lambda ops: [_Late()]
    link = ring_backward.Link(sp.Mesh(1, 1), 3.0, "torch_usp backward")
    t = torch.zeros(2)
    try:
        ring_backward.exchange(link, [(1, t, 5)], [(2, t.clone(), 5)], "step 0 of 2")
    except RuntimeError as e:
        return str(e)
    return None


def test_a_coalesced_batch_that_times_out_names_its_peers():
    """NCCL coalesces a batch of transfers into one work (not runnable here: on one gloo rank the
    batch call is replaced by one that returns such a work, timing out): the error names every
    peer of the batch."""
    msg, = run_gloo(_coalesced, 1, timeout_s=60)
    assert msg == ("ditscale.sp.attention: rank 0: torch_usp backward, step 0 of 2: the "
                   "transfers with ranks [1, 2] did not complete within 3 s (a rank that skips "
                   "the backward?): timed out after 3 s"), msg
