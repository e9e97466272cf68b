"""bench.train.sp_degrees' report pieces without a run: the --runs list, the measured rates and
step-time CV of metrics lines, a predicted row, and the refusals. (The corpus -> runs -> report
chain on 2 gloo ranks: tests/python/test_gpu_multi_script.py.)"""

import pytest

from bench.train import sp_degrees


def _line(step_s, tokens, waits=(0.0, 0.0)):
    return {"step_time_s": step_s, "tokens": tokens, "wait_s": list(waits)}


def test_runs_are_named_degree_lists():
    assert sp_degrees.parse_runs(["mixed=4,1,2", "fixed-4=4"], 4) == {
        "mixed": [1, 2, 4], "fixed-4": [4]}


@pytest.mark.parametrize("items, message", [
    (["mixed"], "--runs: 'mixed' is not NAME=DEGREES"),
    (["=1,2"], "--runs: '=1,2' is not NAME=DEGREES"),
    (["a=3"], "--runs: a: 3 does not divide --world-size 4"),
    (["a=16"], "--runs: 16 is out of range [1, 8]"),
])
def test_bad_runs_are_refused(items, message):
    with pytest.raises(Exception) as info:
        sp_degrees.parse_runs(items, 4)
    assert message in str(info.value)


def test_measured_after_the_warmup():
    lines = [_line(9.0, 1), _line(1.0, 100, (0.5, 0.0)), _line(3.0, 500)]
    m = sp_degrees.measured(lines, 1, "r")
    assert m["steps"] == 2 and m["tokens_per_s"] == pytest.approx(600 / 4.0)
    assert m["step_ms"] == pytest.approx(2000.0) and m["cv"] == pytest.approx(0.5)
    assert m["wait"] == pytest.approx((0.25 / 1.0 + 0.0) / 2)
    with pytest.raises(ValueError, match="--warmup-steps: 2 leaves 1 of the 3 steps of run 'r'"):
        sp_degrees.measured(lines, 2, "r")


def test_a_row_against_the_plan():
    m = {"steps": 2, "tokens_per_s": 800.0, "step_ms": 10.0, "cv": 0.1, "wait": 0.2}
    plan = {"tokens_per_s_per_gpu": 100.0, "step_time_cv": 0.05, "compute_cv": 0.02,
            "samples_unfit": 3, "dropped_samples": 5}
    row = sp_degrees.row("mixed", [1, 2], m, plan, 4)
    assert row == ["mixed", "1,2", 2, 800.0, 10.0, "0.100", "0.200", 400.0, "2.00", "0.050",
                   "0.020", 3]
    assert sp_degrees.row("mixed", [1, 2], m, None, 4)[7:] == ["-"] * 5
