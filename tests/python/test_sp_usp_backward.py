"""The usp strategy's own backward (ditscale/sp/usp_backward.py) on CPU tensors over gloo
(gloo_util.run_gloo): gradients of q, k, v and the joint text inputs against dense float64
autograd on 4 ranks (mesh 2 x 2: ulysses 2 x ring 2; odd token counts, joint text, GQA, uneven
head groups, no text, batch 2, float32 and bfloat16; swiftfusion-tas and auto, which build the
same program) and 6 ranks (3 x 2: a ring of 3, whose forward overwrites this rank's own block),
the same bits twice; that the usp path runs (the forward keeps exactly the head group's query
rows, output and LSE rows, the last ring block and the text kv rows; no recomputation, no
torch_backward), also in the backward op torch.compile traces (the eager bits); on 2 ranks,
usp of ulysses degree 1 and auto resolved to ring take the ring's own backward; a rank that
skips the backward makes the others fail within the group's timeout, naming
ditscale.sp.attention. References and loss: test_sp_grad.py's (one spawn per world size)."""

from __future__ import annotations

from gloo_util import run_gloo
from test_sp_grad import (BF16, F32, LONELY_TIMEOUT_S, _grads, _reference, check_cases,
                          skipped_backward)

# (strategy, fields, mesh, shape): shape = (batch, seq, text, heads, kv_heads, head_dim, dtype).
CASES_4 = [
    ("usp", {}, (2, 2), (1, 11, 3, 8, 4, 8, F32)),  # 3 + 3 + 3 + 2 tokens, text 2 + 1 rows
    ("usp", {}, (2, 2), (2, 13, 5, 6, 3, 16, F32)),  # heads 4 + 2, kv heads 2 + 1, batch 2
    ("usp", {}, (2, 2), (1, 11, 0, 4, 2, 8, F32)),  # no text
    ("usp", {}, (2, 2), (1, 13, 5, 8, 4, 16, BF16)),
    ("swiftfusion-tas", {}, (2, 2), (1, 11, 3, 8, 4, 8, F32)),
    ("auto", {}, (2, 2), (1, 11, 3, 8, 4, 8, F32)),  # resolves to usp 2 x 2
]
CASES_6 = [
    ("usp", {}, (3, 2), (2, 17, 5, 4, 2, 8, F32)),
    ("usp", {}, (3, 2), (1, 13, 0, 6, 6, 8, F32)),
]
# Plain rings on 2 ranks: the ring's own backward.
CASES_2 = [
    ("usp", {}, (2, 1), (1, 9, 3, 4, 2, 8, F32)),  # ulysses degree 1, ring 2
    ("auto", {}, (1, 2), (1, 11, 3, 8, 4, 8, F32)),  # resolves to ring
]


def _spy():
    """Makes every recomputing backward raise; records (schedule, saved (shape, dtype)) of
    each own backward run."""
    from ditscale.sp import recompute, ring_backward, torch_backward, usp_backward

    def refuse(*args, **kwargs):
        raise AssertionError("the backward recomputed the layer")

    recompute.plan = recompute.run_kept = torch_backward.gradients = refuse
    seen = []
    for name, module in (("ring", ring_backward), ("usp", usp_backward)):
        def spy(state, saved, dout, djout, real=module.backward, name=name):
            seen.append((name, [(tuple(t.shape), str(t.dtype)[6:]) for t in saved]))
            return real(state, saved, dout, djout)

        module.backward = spy
    return seen


def _expected_usp(rank, world, strategy, mesh, shape):
    """(shape, dtype) of what the forward keeps on rank r of Ulysses index u, ring index i
    (usp: ulysses degree U = GPUs per machine, r = i * U + u; swiftfusion-tas: U = machines,
    r = u * R + i): query rows (text rows T_i of the ring split, then ring chunk i: the shards
    of the ranks of ring index i), output and LSE rows, the k, v block of ring index
    (i + 1) mod R, the text k, v rows; head group u (even split of kv heads)."""
    import ditscale.sp as sp
    B, S, T, H, Hk, D, dtype = shape
    outer = strategy == "swiftfusion-tas"
    U = mesh[0] if outer else mesh[1]
    R = world // U
    u, i = divmod(rank, R) if outer else divmod(rank, U)[::-1]
    hk = sp.shard_range(Hk, U, u)[1]
    h = hk * (H // Hk)

    def chunk(j):
        return sum(sp.shard_range(S, world, x * R + j if outer else j * U + x)[1]
                   for x in range(U))

    rows = sp.shard_range(T, R, i)[1] + chunk(i)
    block = (B, chunk((i + 1) % R), hk, D)
    kept = [((B, rows, h, D), dtype), ((B, rows, h, D), "float32"), ((B, rows, h, 1), "float32"),
            (block, dtype), (block, dtype)]
    return kept + ([((B, T, hk, D), dtype)] * 2 if T else [])


def _cases(rank, world, cases, usp=True):
    """Per case: (error against dense, the same bits twice, the own backward ran as expected:
    usp keeping what _expected_usp says, or the ring's)."""
    seen = _spy()
    results = []
    for i, case in enumerate(cases):
        seen.clear()
        err, bits = _grads(rank, world, *case, 1000 * i)
        _, again = _grads(rank, world, *case, 1000 * i, direct=i == 0)
        same = all(a.equal(b) for a, b in zip(bits, again))
        if usp:
            strategy = "usp" if case[0] == "auto" else case[0]  # auto: usp on a 2 x 2 mesh
            want = ("usp", _expected_usp(rank, world, strategy, case[2], case[3]))
            ran = seen == [want, want]
        else:
            ran = [name for name, _ in seen] == ["ring", "ring"]
        results.append((err, same, ran))
    return results


def _op_is_eager(rank, world):
    """The backward op torch.compile traces (custom_op.attention_backward_op: the usp forward
    again, then its backward) gives the eager backward's bits, in contiguous tensors."""
    import torch

    import ditscale.sp as sp
    from ditscale.sp import custom_op
    from ditscale.sp.config import config_text
    seen = _spy()
    full, ups, _, _ = _reference((1, 11, 3, 8, 4, 8, F32), 5, world)
    begin, count = sp.shard_range(11, world, rank)
    xs = [x[:, 3 + begin:3 + begin + count].float() for x in full]
    xs += [x[:, :3].float() for x in full]
    xs = [x.requires_grad_() for x in xs]
    cfg, mesh = sp.make_config("t", strategy="usp"), sp.Mesh(2, 2)
    out, tout = sp.attention(*xs[:3], mesh=mesh, config=cfg, joint_q=xs[3], joint_k=xs[4],
                             joint_v=xs[5])
    dout, dtout = ups[rank][0].float(), ups[rank][1].float()
    eager = torch.autograd.grad((out, tout), xs, (dout, dtout))
    by_op = custom_op.attention_backward_op(*(x.detach() for x in xs), dout, dtout,
                                            *custom_op.mesh_args(mesh), config_text(cfg))
    contiguous = all(g.is_contiguous() for g in by_op)
    ran = [name for name, _ in seen] == ["usp", "usp"]
    return ran and contiguous and all(a.equal(b) for a, b in zip(eager, by_op))


def _one_skips(rank, world):
    """The last rank never runs the backward: the others fail within the group's timeout."""
    import ditscale.sp as sp
    return skipped_backward(rank, 3, sp.Mesh(2, 2), "usp")


def _four_ranks(rank, world):
    return _cases(rank, world, CASES_4), _op_is_eager(rank, world), _one_skips(rank, world)


def test_usp_backward_on_four_ranks():
    results = run_gloo(_four_ranks, 4, timeout_s=400, pg_timeout_s=LONELY_TIMEOUT_S)
    check_cases([cases for cases, _, _ in results], CASES_4)
    assert all(eager for _, eager, _ in results)
    assert results[3][2] is None
    for rank in (0, 1, 2):
        msg, seconds = results[rank][2]
        assert msg.startswith("ditscale.sp.attention: "), msg
        assert "usp backward" in msg and f"did not complete within {LONELY_TIMEOUT_S} s" in msg
        assert seconds < LONELY_TIMEOUT_S + 3, seconds


def test_usp_backward_on_a_ring_of_three():
    check_cases(run_gloo(_cases, 6, CASES_6, timeout_s=400), CASES_6)


def test_plain_rings_take_the_ring_backward():
    check_cases(run_gloo(_cases, 2, CASES_2, False, timeout_s=300), CASES_2)
