"""The own backwards of ulysses-overlap and torus on CPU tensors over gloo (gloo_util.run_gloo):
their programs (Ulysses with the attention cut into calls merged into one accumulator; torus'
chunked Ulysses x ring, its partials merged into rows of the accumulator) transposed by
cpu_backward.py, no Ulysses recomputation. Gradients of q, k, v and the joint text inputs
against dense float64 autograd on 2 to 8 ranks (ulysses-overlap 1 x 2, 1 x 4, 2 x 2; torus
2 x 2 with 2 and 3 chunks, 2 x 3: a ring of 3, 2 x 4, 4 x 2; odd token counts, joint text, GQA,
uneven head groups, no text, batch 2, float32 and bfloat16), the same bits twice; that the own
path runs (the Ulysses recomputation and torch_backward raise; the forward keeps the gathered q
(k, v), the accumulator's output and LSE, not the merged partials), also in the backward op
torch.compile traces (the eager bits); a rank that skips the backward makes the others fail
within the group's timeout, naming ditscale.sp.attention. References and loss:
test_sp_grad.py's (one spawn per world size)."""

from __future__ import annotations

from gloo_util import run_gloo
from test_sp_grad import (BF16, F32, LONELY_TIMEOUT_S, _grads, _reference, check_cases,
                          skipped_backward)

# (strategy, fields, mesh, shape): shape = (batch, seq, text, heads, kv_heads, head_dim, dtype).
CASES_2 = [
    ("ulysses-overlap", {}, (1, 2), (2, 13, 5, 6, 3, 16, F32)),  # GQA: kv heads 2 + 1
    ("ulysses-overlap", {}, (1, 2), (1, 9, 4, 3, 3, 8, F32)),  # 3 heads: 2 + 1
    ("ulysses-overlap", {}, (1, 2), (1, 9, 0, 4, 2, 8, F32)),  # no text
    ("ulysses-overlap", {}, (1, 2), (2, 13, 5, 6, 3, 16, BF16)),
]
CASES_4 = [
    ("ulysses-overlap", {}, (1, 4), (2, 13, 5, 6, 6, 16, F32)),  # 4 + 3 + 3 + 3; heads 2, 2, 1, 1
    ("ulysses-overlap", {}, (1, 4), (1, 11, 3, 8, 4, 8, F32)),  # GQA: one kv head each
    ("ulysses-overlap", {}, (2, 2), (1, 13, 5, 8, 4, 16, BF16)),
    ("torus", {"chunks": 2}, (2, 2), (1, 10, 3, 4, 4, 8, F32)),  # ulysses 2 x ring 2
    ("torus", {"chunks": 3}, (2, 2), (2, 13, 5, 6, 3, 16, F32)),  # GQA, heads 4 + 2
    ("torus", {"chunks": 2}, (2, 2), (1, 11, 0, 8, 4, 8, F32)),  # no text
    ("torus", {"chunks": 2}, (2, 2), (1, 13, 5, 8, 4, 16, BF16)),
]
_REAL = {}  # the functions _spy replaces, as imported
# The buffers the forward keeps: the gathered q (and k, v), the accumulator's output and LSE.
KEPT = {"ulysses-overlap": ["gathered.q", "gathered.k", "gathered.v", "acc.out", "acc.lse"],
        "torus": ["gathered.q", "acc.out", "acc.lse", "kall", "vall"]}


def _spy(eager: bool = True):
    """Makes the Ulysses recomputation (and, with ``eager``, any run of the forward again)
    raise; records the buffer names the forward keeps and the strategy each transposed
    backward runs."""
    from ditscale.sp import cpu_backward, recompute, torch_backward
    real = _REAL.setdefault("fns", (recompute.run_kept, cpu_backward.saved_buffers,
                                    cpu_backward.backward))

    def refuse(*args, **kwargs):
        raise AssertionError("the backward recomputed the layer")

    recompute._ulysses = torch_backward.gradients = refuse
    recompute.run_kept = refuse if eager else real[0]
    seen = []

    def kept(prog):
        found = real[1](prog)
        seen.append(("kept", [prog.buffers[i][0] for i in found]))
        return found

    def backward(prog, *args):
        seen.append(("backward", prog.strategy))
        return real[2](prog, *args)

    cpu_backward.saved_buffers, cpu_backward.backward = kept, backward
    return seen


def _cases(rank, world, cases):
    """Per case: (error against dense, the same bits twice, the own path ran)."""
    seen = _spy()
    results = []
    for i, case in enumerate(cases):
        want = [("kept", KEPT[case[0]]), ("backward", case[0])] * 2
        seen.clear()
        err, bits = _grads(rank, world, *case, 1000 * i)
        _, again = _grads(rank, world, *case, 1000 * i, direct=i == 0)
        same = all(a.equal(b) for a, b in zip(bits, again))
        results.append((err, same, seen == want))
    return results


def _op_is_eager(rank, world, strategy, mesh, fields):
    """The backward op torch.compile traces (the schedule's forward again, then its program
    transposed) gives the eager backward's bits, in contiguous tensors."""
    import torch

    import ditscale.sp as sp
    from ditscale.sp import custom_op
    from ditscale.sp.config import config_text
    seen = _spy(eager=False)
    full, ups, _, _ = _reference((1, 11, 3, 8, 4, 8, F32), 5, world)
    begin, count = sp.shard_range(11, world, rank)
    xs = [x[:, 3 + begin:3 + begin + count].float() for x in full]
    xs += [x[:, :3].float() for x in full]
    xs = [x.requires_grad_() for x in xs]
    cfg, mesh = sp.make_config("t", strategy=strategy, **fields), sp.Mesh(*mesh)
    out, tout = sp.attention(*xs[:3], mesh=mesh, config=cfg, joint_q=xs[3], joint_k=xs[4],
                             joint_v=xs[5])
    dout, dtout = ups[rank][0].float(), ups[rank][1].float()
    eager = torch.autograd.grad((out, tout), xs, (dout, dtout))
    by_op = custom_op.attention_backward_op(*(x.detach() for x in xs), dout, dtout,
                                            *custom_op.mesh_args(mesh), config_text(cfg))
    contiguous = all(g.is_contiguous() for g in by_op)
    ran = [s for s in seen if s[0] == "backward"] == [("backward", strategy)] * 2
    return ran and contiguous and all(a.equal(b) for a, b in zip(eager, by_op))


def _one_skips(rank, world):
    """The last rank never runs the backward: the others fail within the group's timeout."""
    import ditscale.sp as sp
    return skipped_backward(rank, world - 1, sp.Mesh(1, world), "ulysses-overlap")


def _two_ranks(rank, world):
    return _cases(rank, world, CASES_2), _op_is_eager(rank, world, "ulysses-overlap", (1, 2), {})


def _four_ranks(rank, world):
    cases, eager = _cases(rank, world, CASES_4), _op_is_eager(rank, world, "torus", (2, 2),
                                                              {"chunks": 2})
    return cases, _one_skips(rank, world), eager  # the skip last: it leaves transfers behind


def test_ulysses_overlap_backward_on_two_ranks():
    results = run_gloo(_two_ranks, 2, timeout_s=300)
    check_cases([cases for cases, _ in results], CASES_2)
    assert all(eager for _, eager in results)


def test_ulysses_overlap_backward_on_four_ranks():
    results = run_gloo(_four_ranks, 4, timeout_s=400, pg_timeout_s=LONELY_TIMEOUT_S)
    check_cases([cases for cases, _, _ in results], CASES_4)
    assert all(eager for _, _, eager in results)
    assert results[3][1] is None
    for rank in (0, 1, 2):
        msg, seconds = results[rank][1]
        assert msg.startswith("ditscale.sp.attention: ulysses-overlap backward (its program "
                              "transposed): "), msg
        assert f"did not complete within {LONELY_TIMEOUT_S} s" in msg, msg
        assert seconds < LONELY_TIMEOUT_S + 3, seconds


CASES_6 = [  # ulysses 2 x ring 3: chunks forwarded along a ring of 3
    ("torus", {"chunks": 2}, (2, 3), (1, 17, 5, 4, 2, 8, F32)),
    ("torus", {"chunks": 3}, (2, 3), (2, 13, 0, 6, 6, 8, F32)),
]


def test_torus_backward_on_a_ring_of_three():
    check_cases(run_gloo(_cases, 6, CASES_6, timeout_s=400), CASES_6)


CASES_8 = [  # ulysses 2 x ring 4 and ulysses 4 x ring 2
    ("torus", {"chunks": 2}, (2, 4), (1, 19, 5, 8, 4, 8, F32)),
    ("torus", {"chunks": 3}, (4, 2), (1, 17, 3, 8, 4, 8, F32)),
]


def test_torus_backward_on_eight_ranks():
    check_cases(run_gloo(_cases, 8, CASES_8, timeout_s=400), CASES_8)
