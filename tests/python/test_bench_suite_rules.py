"""The rules of the benchmark suite (bench/README.md, docs/results.md), checked on the tree: result
files named <what>_<hardware>_<YYYY-MM> and each indexed in docs/results.md; one timer (no
benchmark keeps a private one); lent-GPU scripts named by what they run, with no card or issue
number in their names or text."""

import itertools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
NAME = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*_[a-z0-9]+(?:-[a-z0-9]+)*_20\d\d-(0[1-9]|1[0-2])"
                  r"(\.[a-z]+)?$")
TIMERS = re.compile(r"perf_counter|thread_time|timeit|Event\(enable_timing")
# Measurements that bench.timing's one span per sample cannot express, each with its reason in
# the code: file -> how many timer mentions it may hold.
TIMER_EXCEPTIONS = {"bench/sp/calibrate.py": 4}  # p2p_under_compute: two streams at once


def expand_braces(text: str):
    """`a-{x,y}_b{2,4}` -> the four names, as a shell would expand them."""
    parts = re.split(r"\{([^{}]*)\}", text)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def indexed_names():
    text = (REPO / "docs" / "results.md").read_text()
    names = set()
    for span in re.findall(r"`([^`]+)`|\]\(([^)]+)\)", text):
        for s in filter(None, span):
            for name in expand_braces(s):
                names.add(name.rstrip("/").rsplit("/", 1)[-1])
    return names


def test_the_brace_expansion():
    assert expand_braces("a-{x,y}_h{2,4}.json") == ["a-x_h2.json", "a-x_h4.json", "a-y_h2.json",
                                                    "a-y_h4.json"]
    assert expand_braces("plain.md") == ["plain.md"]


@pytest.mark.parametrize("entry", sorted(p.name for p in RESULTS.iterdir()))
def test_each_result_is_named_and_indexed(entry):
    assert NAME.match(entry), f"bench/results/{entry}: not <what>_<hardware>_<YYYY-MM>[.ext]"
    assert entry in indexed_names(), f"bench/results/{entry} is not in docs/results.md"


def test_the_name_rule_can_fail():
    for bad in ("sp-h200x2.md", "gpu-issue20-h200", "adaln_h200_2026-13.md", "Adaln_h200_2026-12"):
        assert not NAME.match(bad), bad
    assert NAME.match("adaln-kernel_h100_2026-11.md")


def bench_sources():
    for path in sorted((REPO / "bench").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel == "bench/timing.py" or rel.startswith("bench/serve/"):
            continue  # the timer itself; the server's load generator (its own clock of requests)
        yield rel, path.read_text()


def test_no_benchmark_keeps_a_private_timer():
    found = {rel: len(TIMERS.findall(text)) for rel, text in bench_sources()}
    extra = {rel: n for rel, n in found.items() if n > TIMER_EXCEPTIONS.get(rel, 0)}
    assert not extra, f"time with bench.timing instead: {extra}"
    assert found.get("bench/sp/calibrate.py") == TIMER_EXCEPTIONS["bench/sp/calibrate.py"]


LEASE_SCRIPTS = sorted((REPO / "tools").glob("gpu_*.sh"))


def test_the_lent_gpu_scripts_are_named_by_what_they_run():
    names = {p.name for p in LEASE_SCRIPTS}
    assert {"gpu_check.sh", "gpu_bench.sh", "gpu_compare.sh", "gpu_kernels.sh",
            "gpu_train.sh"} <= names
    assert not list((REPO / "bench").rglob("*_run.sh"))
    for name in names:
        assert not re.search(r"[ahbl]\d{2,3}|issue", name, re.I), name


@pytest.mark.parametrize("script", LEASE_SCRIPTS, ids=lambda p: p.name)
def test_no_issue_number_in_a_script(script):
    text = script.read_text()
    assert not re.search(r"\bissues?\s*#?\d|#\d+\b", text, re.I), script.name
