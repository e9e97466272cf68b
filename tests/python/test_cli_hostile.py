"""Hostile inputs of `ditscale plan` and `ditscale fit` (issue 20): every one ends in a clear
error naming the option or field, its value and range, and a non-zero exit; never a signal, a
silent clamp, or exit 0 on output that was lost. Runs the built CLI (skips without one)."""
import json
import subprocess
from pathlib import Path

import pytest
from cli_util import find_cli

REPO = Path(__file__).resolve().parents[2]
MANIFEST = str(REPO / "examples/manifests/mixed_2k.csv")
BENCH = str(REPO / "examples/manifests/bench_example.csv")


CLI = find_cli(["fit"], "--accept-poor-fit")
pytestmark = pytest.mark.skipif(CLI is None, reason="no ditscale CLI binary of this version")


def run(*args, stdout=subprocess.PIPE):
    return subprocess.run([CLI, *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=120)


def plan(*extra, stdout=subprocess.PIPE):
    return run("plan", "--manifest", MANIFEST, "--model", "wan2.1-1.3b", "--quiet", *extra,
               stdout=stdout)


@pytest.mark.parametrize("opt,value,expect", [
    ("--mem-safety", "-0.5", "--mem-safety: -0.5 is out of range [0, 0.99]"),
    ("--m-mem", "-1", "--m-mem: -1 is out of range [0, "),
    ("--seed", "-1", "--seed: -1 is out of range [0, 18446744073709551615]"),
    ("--seed", "18446744073709551616", "--seed: 18446744073709551616 is out of range"),
    ("--epoch", "-1", "--epoch: -1 is out of range [0, 9223372036854775807]"),
    ("--noise", "inf", "--noise: inf is out of range [0, 1]"),
    ("--gpu-mem-gib", "nan", "--gpu-mem-gib: nan is out of range"),
    ("--world-size", "1000000000", "--world-size: 1000000000 is out of range [1, 1048576]"),
])
def test_plan_option_out_of_range(opt, value, expect):
    args = [opt, value] if opt == "--world-size" else ["--world-size", "8", opt, value]
    r = plan(*args)
    assert r.returncode != 0
    assert expect in r.stderr, r.stderr


def test_plan_budget_below_one_sample_is_an_error():
    r = plan("--world-size", "8", "--budget", "5")
    assert r.returncode == 1
    assert "rank budget 5 s is below the cost of the most expensive sample" in r.stderr


def test_plan_model_whose_strides_overflow(tmp_path):
    model = tmp_path / "m.json"
    model.write_text('{"base":"wan2.1-1.3b","vae_stride_hw":65536,"patch_h":65536}')
    r = run("plan", "--manifest", MANIFEST, "--model", str(model), "--world-size", "8")
    assert r.returncode == 1  # not -SIGFPE
    assert "vae_stride_hw: 65536 is out of range [1, 64]" in r.stderr, r.stderr


def test_plan_without_a_step_fails_and_large_drops_warn():
    r = plan("--world-size", "1999", "--policy", "balanced")
    assert r.returncode == 1
    assert "the plan has no step" in r.stderr and "world size 1999" in r.stderr, r.stderr
    r = plan("--world-size", "100", "--policy", "equal-token", "--json")
    assert r.returncode == 0, r.stderr
    assert "warning: policy equal-token drops" in r.stderr, r.stderr
    frac = json.loads(r.stdout)["policies"]["equal-token"]["dropped_fraction"]
    assert 0.1 < frac < 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize("extra", [[], ["--out", "/dev/full"], ["--emit-batches", "/dev/full"],
                                   ["--report", "/dev/full"]])
def test_plan_write_errors(extra):
    with open("/dev/full", "w") as full:
        r = plan("--world-size", "8", "--json", *extra,
                 stdout=full if not extra else subprocess.PIPE)
    assert r.returncode == 1
    name = "stdout" if not extra else "/dev/full"
    assert f"error writing {name}: No space left on device" in r.stderr, r.stderr


def test_fit_degenerate_data_fails(tmp_path):
    flat = tmp_path / "flat.csv"
    flat.write_text("batch_size,seq_len,step_time_s,peak_mem_bytes\n" +
                    "".join(f"{b},{s},0.5,1e9\n" for s in (1024, 2048, 4096) for b in (1, 2)))
    r = run("fit", str(flat))
    assert r.returncode == 1
    assert "unusable fit" in r.stderr and "do not grow" in r.stderr, r.stderr
    r = run("plan", "--manifest", MANIFEST, "--model", "wan2.1-1.3b", "--world-size", "8",
            "--bench", str(flat))
    assert r.returncode == 1 and "unusable fit" in r.stderr, r.stderr
    r = run("fit", str(flat), "--accept-poor-fit", "--json")
    assert r.returncode == 0 and "unusable fit accepted" in r.stderr
    r = run("fit", str(tmp_path))
    assert r.returncode == 1 and "not a regular file" in r.stderr, r.stderr
    r = run("fit", BENCH, "--gpu-mem-gib", "nan")
    assert r.returncode != 0 and "--gpu-mem-gib: nan is out of range" in r.stderr
    out = tmp_path / "cost.json"
    r = run("fit", BENCH, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["kind"] == "power"
