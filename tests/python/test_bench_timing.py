"""bench.timing (the one timer of the benchmarks) and bench.reporter (their one header and table),
on the CPU: a scripted clock makes every sample known, so the statistics are checked exactly."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import reporter, timing  # noqa: E402  (bench: the repository root's package)


class ScriptedClock:
    """time.perf_counter / thread_time replaced: the clock moves only when a step says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance_ms(self, ms):
        self.now += ms / 1e3


@pytest.fixture
def clock(monkeypatch):
    c = ScriptedClock()
    monkeypatch.setattr(time, "perf_counter", c)
    monkeypatch.setattr(time, "thread_time", c)
    return c


def steps_of(clock, durations_ms):
    """A function whose k-th call takes durations_ms[k] on the scripted clock."""
    it = iter(durations_ms)
    calls = []

    def fn():
        calls.append(1)
        clock.advance_ms(next(it))

    return fn, calls


def test_percentile_matches_numpy_linear_rule():
    np = pytest.importorskip("numpy")
    xs = [7.0, 1.0, 3.5, 9.25, 2.0, 2.0, 11.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert timing.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    with pytest.raises(ValueError, match="q: 101 is out of range"):
        timing.percentile(xs, 101)
    with pytest.raises(ValueError, match="no samples"):
        timing.percentile([], 50)


@pytest.mark.parametrize("clock_name", ["wall", "thread"])
def test_warmup_is_not_timed_and_the_statistics_are_exact(clock, clock_name):
    # 2 warm-up calls of 100 ms, then 5 samples of 4, 1, 3, 5, 2 ms.
    fn, calls = steps_of(clock, [100, 100, 4, 1, 3, 5, 2])
    t = timing.time_fn(fn, warmup=2, reps=5, clock=clock_name)
    assert len(calls) == 7
    assert t.samples_ms == pytest.approx((4, 1, 3, 5, 2))
    assert (t.median_ms, t.min_ms, t.reps, t.clock) == (pytest.approx(3), pytest.approx(1), 5,
                                                        clock_name)
    assert t.p90_ms == pytest.approx(4.6)  # between 4 and 5, numpy's linear rule
    assert t.summary()["median_ms"] == pytest.approx(3)


def test_calls_per_sample_divide_and_hooks_stay_outside_the_sample(clock):
    fn, calls = steps_of(clock, [1, 1, 2, 2, 3, 3])  # no warm-up: 3 samples of 2 calls
    seen = []

    def flush():  # 50 ms of work before each sample must not count
        seen.append(1)
        clock.advance_ms(50)

    t = timing.time_fn(fn, warmup=0, reps=3, calls=2, clock="wall", before_each=flush,
                       reduce=lambda ms: 10 * ms)
    assert len(seen) == 3 and len(calls) == 6
    assert t.samples_ms == pytest.approx((10, 20, 30))


def test_max_s_stops_after_min_reps(clock):
    fn, calls = steps_of(clock, [400] * 10)  # each call 0.4 s, budget 1 s
    t = timing.time_fn(fn, warmup=0, reps=10, max_s=1.0, min_reps=4, clock="wall")
    assert t.reps == 4 and len(calls) == 4
    fn, _ = steps_of(clock, [400] * 10)
    assert timing.time_fn(fn, warmup=0, reps=10, max_s=1.0, clock="wall").reps == 3
    # the budget starts after the warm-up: 5 s of warm-up, then 10 samples of 50 ms fit in 1 s
    fn, _ = steps_of(clock, [5000] + [50] * 10)
    assert timing.time_fn(fn, warmup=1, reps=10, max_s=1.0, clock="wall").reps == 10


def test_sync_brackets_a_wall_sample(clock):
    order = []
    t = timing.time_fn(lambda: order.append("fn"), warmup=0, reps=1, clock="wall",
                       sync=lambda: order.append("sync"))
    assert order == ["sync", "fn", "sync"] and t.reps == 1


def test_interleaved_alternates_and_pairs_the_rounds(clock):
    order = []

    def make(name, ms):
        def fn():
            order.append(name)
            clock.advance_ms(ms)
        return fn

    res = timing.time_interleaved([make("a", 2), make("b", 3)], warmup=1, rounds=3, reps=2,
                                  clock="wall")
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3
    a, b = res.timings
    assert (a.reps, b.reps) == (6, 6)
    assert (a.median_ms, b.median_ms) == (pytest.approx(2), pytest.approx(3))
    assert res.ratio(0, 1) == pytest.approx(1.5)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"reps": 0}, ValueError, r"reps: 0 is out of range \[1, 1000000\]"),
    ({"warmup": -1}, ValueError, r"warmup: -1 is out of range"),
    ({"calls": True}, TypeError, r"calls: expected an integer"),
    ({"max_s": 0.0}, ValueError, r"max_s: 0 is out of range"),
    ({"reps": 2, "min_reps": 3}, ValueError, r"min_reps: 3 is out of range \[1, 2\]"),
    ({"clock": "gpu"}, ValueError, r"clock: 'gpu' is not one of cuda, wall, thread"),
])
def test_bad_settings_are_refused_with_their_name(kwargs, error, match):
    called = []
    with pytest.raises(error, match=match):
        timing.time_fn(lambda: called.append(1), **{"clock": "wall", **kwargs})
    assert not called  # refused before any call
    with pytest.raises(ValueError, match="fns: no function"):
        timing.time_interleaved([], clock="wall")


def test_a_real_wall_clock_sees_a_sleep():
    t = timing.time_fn(lambda: time.sleep(0.002), warmup=1, reps=3, clock="wall")
    assert t.reps == 3 and t.min_ms >= 2.0 and t.median_ms < 2000


def test_the_header_names_this_checkout_and_the_command():
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    h = reporter.header(["python", "-m", "bench.x", "--out", "a b.md"])
    assert h["commit"].split("+")[0] == head
    assert h["command"] == "python -m bench.x --out 'a b.md'"
    assert h["date"].endswith("UTC") and h["device"]
    lines = reporter.header_lines("T", ["prog"])
    assert lines[0] == "# T" and f"- commit: {h['commit']}" in lines
    assert "- command: `prog`" in lines


def test_the_table_and_the_report():
    t = timing.Timing((1.0, 2.0, 4.0), "wall")
    text = reporter.table(["case", *reporter.TIMING_COLUMNS], [["a|b", *reporter.timing_cells(t)]],
                          digits=2)
    assert text.splitlines() == ["| case | median ms | min ms | p90 ms | reps |",
                                 "|---|---|---|---|---|",
                                 "| a\\|b | 2.00 | 1.00 | 3.60 | 3 |"]
    with pytest.raises(ValueError, match="row 0 has 1 cells, expected 2"):
        reporter.table(["a", "b"], [["x"]])
    rep = reporter.report("R", ["x"], [[1]], notes="why", argv=["p"])
    assert rep.startswith("# R\n") and "why\n\n| x |" in rep
