"""ditscale.BalancedBatchSampler with a sequence-parallel degree per micro-batch (``sp_degrees``).

A mixed corpus on 8 ranks with a small M_mem, so that the balanced planner gives degrees 1, 2
and 4: every rank of an aligned group lists the group's micro-batches identically (same order),
the union over ranks with each micro-batch counted once (by its group's first rank) is every
planned sample exactly once, ``micro_batch_degrees()`` follows iteration and resume, the plan
is deterministic, a state round-trips and one saved with other degrees is refused, bad degrees
are refused with name, value and range. See docs/balance.md ("In PyTorch").
"""

import json

import pytest

import ditscale
from test_sampler import write_csv

WORLD, M_MEM = 8, 60000


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("m") / "mixed.csv", 400, seed=4)


def _sampler(manifest, rank, degrees=(1, 2, 4), **kw):
    kw = dict(dict(seed=3, m_mem_tokens=M_MEM, sp_degrees=degrees), **kw)
    return ditscale.BalancedBatchSampler(manifest, rank, WORLD, **kw)


def _cells(samplers, k):
    """rank -> [(degree, ids)] of step k."""
    return {r: list(zip(s.cell_degrees(k, r), s.cell(k, r))) for r, s in enumerate(samplers)}


def test_groups_list_their_micro_batches_and_each_sample_is_trained_once(manifest):
    samplers = [_sampler(manifest, r) for r in range(WORLD)]
    s0 = samplers[0]
    assert s0.sp_degrees == [1, 2, 4] and s0.plan_summary["sp_degrees"] == [1, 2, 4]
    assert all(s.plan_summary["plan_fingerprint"] == s0.plan_summary["plan_fingerprint"]
               for s in samplers)
    seen, used = [], set()
    for k in range(s0.num_steps):
        cells = _cells(samplers, k)
        for r, cell in cells.items():
            degrees = [d for d, _ in cell]
            assert degrees == sorted(degrees, reverse=True), (k, r, degrees)
            for d in set(degrees):
                mine = [ids for e, ids in cell if e == d]
                assert mine == [ids for e, ids in cells[r // d * d] if e == d], (k, r, d)
            seen += [i for d, ids in cell if r % d == 0 for i in ids]
            used |= set(degrees)
    assert used == {1, 2, 4}  # the corpus and M_mem make every degree useful
    assert len(seen) == len(set(seen))
    assert len(seen) + s0.dropped_samples == s0.plan_summary["num_planned_samples"]


def test_micro_batch_degrees_follow_iteration_and_resume(manifest):
    s = _sampler(manifest, 5)
    degrees = s.micro_batch_degrees()
    cells = [d for k in range(s.num_steps) for d in s.cell_degrees(k, 5)]
    assert degrees == cells and len(degrees) == s.num_micro_batches
    assert set(degrees) == {1, 2, 4}
    batches = list(s)
    assert len(batches) == len(degrees)
    assert s.micro_batch_degrees() == degrees  # a finished epoch starts over
    t = _sampler(manifest, 5)
    it = iter(t)
    head = [next(it) for _ in range(7)]
    state = json.loads(json.dumps(t.state_dict()))
    u = _sampler(manifest, 5)
    u.load_state_dict(state)
    assert u.micro_batch_degrees() == degrees[7:]
    assert head + list(u) == batches
    plain = ditscale.BalancedBatchSampler(manifest, 5, WORLD, seed=3, m_mem_tokens=M_MEM)
    assert plain.sp_degrees == [] and set(plain.micro_batch_degrees()) == {1}


def test_deterministic_and_states_of_other_degrees_are_refused(manifest):
    a, b = _sampler(manifest, 2), _sampler(manifest, 2, degrees=[4, 1, 2])  # any order
    assert list(a.iter_steps()) == list(b.iter_steps())
    assert a.state_dict() == b.state_dict()
    other = _sampler(manifest, 2, degrees=[1, 2]).state_dict(consumed_steps=1)
    none = ditscale.BalancedBatchSampler(manifest, 2, WORLD, seed=3, m_mem_tokens=M_MEM)
    for state in (other, none.state_dict(consumed_steps=1)):
        with pytest.raises(ditscale.Error, match="plan_fingerprint.*sp_degrees included"):
            a.load_state_dict(state)
    with pytest.raises(ditscale.Error, match="plan_fingerprint"):
        none.load_state_dict(a.state_dict(consumed_steps=1))
    a.load_state_dict(b.state_dict(consumed_steps=2))
    assert a.state_dict()["step"] == 2


@pytest.mark.parametrize("degrees,error,match", [
    ([3], ValueError, r"^sp_degrees: 3 is not a power of two in \[1, 8\]$"),
    ([1, 16], ValueError, r"^sp_degrees: 16 is out of range \[1, 8\]$"),
    ([0], ValueError, r"^sp_degrees: 0 is out of range \[1, 8\]$"),
    ([1, 2, 2], ValueError, r"^sp_degrees: 2 is given twice$"),
    ([], ValueError, r"^sp_degrees: the list is empty"),
    ("1,2", TypeError, r"^sp_degrees: expected None or a list of integers"),
    ([1, 2.0], TypeError, r"^sp_degrees: expected an integer, got float 2.0$"),
    ([True], TypeError, r"^sp_degrees: expected an integer, got bool True$"),
])
def test_bad_degrees_are_refused(manifest, degrees, error, match):
    with pytest.raises(error, match=match):
        _sampler(manifest, 0, degrees=degrees)


def test_degrees_need_the_world_size_and_the_balanced_policy(manifest):
    with pytest.raises(ValueError, match=r"^sp_degrees: 8 must be at most the world size 4 "
                                         r"and divide it$"):
        ditscale.BalancedBatchSampler(manifest, 0, 4, sp_degrees=[1, 8])
    with pytest.raises(ValueError, match=r"^sp_degrees: needs policy 'balanced' \(got "
                                         r"'adaptive'\)$"):
        _sampler(manifest, 0, policy="adaptive")
