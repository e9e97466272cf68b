"""`ditscale plan`'s simulated noise and memory budget: a noise sigma whose epoch would not show
its mean is refused with its range, the largest one accepted keeps the noise-free mean; samples
over M_mem are reported, and a plan in which every sample is over it is an error (exit 1).
Runs the built CLI (skips without one)."""
import json
import subprocess
from pathlib import Path

import pytest
from cli_util import find_cli

REPO = Path(__file__).resolve().parents[2]
MANIFEST = str(REPO / "examples/manifests/mixed_2k.csv")

CLI = find_cli(["plan"], "--noise")
pytestmark = pytest.mark.skipif(CLI is None, reason="no ditscale CLI binary of this version")


def plan(*extra):
    return subprocess.run([CLI, "plan", "--manifest", MANIFEST, "--model", "wan2.1-1.3b",
                           "--quiet", "--world-size", "8", *extra],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sigma", ["10", "1.5", "1.0000001"])
def test_noise_above_its_range_is_refused(sigma):
    r = plan("--noise", sigma)
    assert r.returncode != 0
    assert f"--noise: {sigma} is out of range [0, 1]" in r.stderr, r.stderr


def test_largest_noise_keeps_the_mean():
    clean = plan("--compare", "--json")
    noisy = plan("--compare", "--json", "--noise", "1")
    assert clean.returncode == 0 and noisy.returncode == 0, clean.stderr + noisy.stderr
    c, n = json.loads(clean.stdout), json.loads(noisy.stdout)
    assert n["noise_sigma"] == 1
    for name, p in n["policies"].items():
        q = c["policies"][name]
        assert p["epoch_time_s"] >= p["lower_bound_s"] > 0
        # The mean-preserving noise leaves the total work (lower bound) near the noise-free one,
        # and makes the ranks of a step differ more, never less.
        assert 0.8 < p["lower_bound_s"] / q["lower_bound_s"] < 1.25, (name, p, q)
        assert p["compute_cv"] > q["compute_cv"], (name, p, q)
        assert p["compute_cv"] > 0.1


def test_every_sample_over_the_memory_budget_is_an_error():
    r = plan("--m-mem", "1")
    assert r.returncode == 1
    assert "every sample (2000 of them) is over the memory budget M_mem = 1 tokens" in r.stderr, \
        r.stderr
    assert "give --m-mem >= " in r.stderr
    assert r.stdout == ""


def test_some_samples_over_the_memory_budget_warn():
    # mixed_2k's samples run from 252 to 75600 tokens; 1166 of them are longer than 20000.
    r = plan("--m-mem", "20000")
    assert r.returncode == 0, r.stderr
    assert "warning: 1166 of 2000 samples (58.3%) are over the memory budget M_mem = 20000 " \
        "tokens (S up to 75600)" in r.stderr, r.stderr
    assert "raise --m-mem to 75600" in r.stderr
    assert "policy" in r.stdout  # the text table is still printed
    j = json.loads(plan("--m-mem", "20000", "--json").stdout)
    assert j["policies"]["balanced"]["samples_over_m_mem"] == 1166
    assert "over the memory budget" not in plan().stderr  # the default M_mem fits every sample
