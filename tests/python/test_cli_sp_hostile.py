"""Hostile inputs of `ditscale sp simulate` and `ditscale sp plan` (issue 20): every one ends in a
clear error naming the option or field, its value and range, and a non-zero exit (never a signal
or exit 0); the planner on a large mesh finishes within a bound. Runs the built CLI (skips
without one; CI builds build/tools/ditscale)."""
import subprocess
import time
from pathlib import Path

import pytest
from cli_util import find_cli

REPO = Path(__file__).resolve().parents[2]


CLI = find_cli(["sp", "plan"], "--mem-limit-gb")
pytestmark = pytest.mark.skipif(CLI is None, reason="no ditscale CLI binary with `sp`")


def sp(*args, timeout=120):
    return subprocess.run([CLI, "sp", *args], capture_output=True, text=True, timeout=timeout)


def simulate(*extra):
    return sp("simulate", "--strategy", "usp", *extra)


def plan(*extra):
    return sp("plan", *(() if "--top" in extra else ("--top", "1")), *extra)


def assert_fails(r, expect):
    assert r.returncode > 0, (r.returncode, r.stderr)  # an error exit, not a signal
    assert expect in r.stderr, r.stderr
    assert "column 'seq_tokens'" not in r.stderr, r.stderr


# Options of both commands, each out of its range.
COMMON = [
    (["--machines", "1000"], "--machines: 1000 is out of range [1, 256]"),
    (["--gpus-per-machine", "5000"], "--gpus-per-machine: 5000 is out of range [1, 72]"),
    (["--gpus-per-machine", "-1"], "--gpus-per-machine: -1 is out of range [1, 72]"),
    (["--height", "0"], "--height: 0 is out of range [16, 16384]"),
    (["--width", "-5"], "--width: -5 is out of range [16, 16384]"),
    (["--model", "wan2.1-14b", "--frames", "1000000"],
     "--frames: 1000000 is out of range [1, 16384]"),
    (["--batch", "0"], "--batch: 0 is out of range [1, 1024]"),
    (["--model", "wan2.1-14b", "--duration-s", "nan"],
     "--duration-s: nan is out of range [0.001, 3600]"),
    (["--model", "wan2.1-14b", "--duration-s", "inf"],
     "--duration-s: inf is out of range [0.001, 3600]"),
    (["--model", "wan2.1-14b", "--duration-s", "-1"],
     "--duration-s: -1 is out of range [0.001, 3600]"),
    (["--chunks", "100000"], "--chunks: 100000 is out of range [1, 64]"),
]


@pytest.mark.parametrize("run", [simulate, plan], ids=["simulate", "plan"])
@pytest.mark.parametrize("args,expect", COMMON, ids=[" ".join(a) for a, _ in COMMON])
def test_option_out_of_range(run, args, expect):
    assert_fails(run(*args), expect)


@pytest.mark.parametrize("run,args,expect", [
    (plan, ["--top", "-1"], "--top: -1 is out of range [0, 1048576]"),
    (plan, ["--mem-limit-gb", "nan"], "--mem-limit-gb: nan is out of range [0, 1e+06]"),
    (simulate, ["--comm-sms", "-1"], "--comm-sms: -1 is out of range [0, 65536]"),
    (simulate, ["--comm-sms", "8"],
     "--comm-sms: p4de: topology 'p4de' describes no SM partitions"),
], ids=["top", "mem-limit-gb", "comm-sms", "comm-sms-no-partitions"])
def test_command_option_out_of_range(run, args, expect):
    assert_fails(run(*args), expect)


@pytest.mark.parametrize("args,expect", [
    (["--ulysses", "3"], "--ulysses: 3 does not divide the 8 ranks of the mesh (1 x 8 GPUs)"),
    (["--machines", "2", "--ring", "3"],
     "--ring: 3 does not divide the 16 ranks of the mesh (2 x 8 GPUs)"),
    (["--ulysses", "2", "--ring", "2"],
     "--ulysses 2 x --ring 2 = 4 is not the 8 ranks of the mesh (1 x 8 GPUs)"),
])
def test_degrees_that_do_not_fit_the_mesh(args, expect):
    assert_fails(simulate(*args), expect)


@pytest.mark.parametrize("run", [simulate, plan], ids=["simulate", "plan"])
@pytest.mark.parametrize("args,expect", [
    # Over kMaxTokens (2^24) of one sequence.
    (["--model", "wan2.1-14b", "--height", "16384", "--width", "16384", "--frames", "16384"],
     "--height 16384, --width 16384, --frames 16384: 4296015872 tokens (16384x16384, "
     "4097 latent frames) exceed the limit of 16777216 tokens"),
    (["--model", "wan2.1-14b", "--height", "16384", "--width", "16384"],
     "--height 16384, --width 16384: 22020096 tokens (16384x16384, 21 latent frames) exceed "
     "the limit of 16777216 tokens"),
    # Over the schedule's ranks x tokens (2^28).
    (["--model", "wan2.1-14b", "--height", "16384", "--width", "16384", "--frames", "61",
      "--machines", "4"],
     "--height 16384, --width 16384, --frames 61: 16777216 tokens (16777216 image + 0 text) on "
     "32 ranks (4 x 8 GPUs) exceed the schedule limit of 8388608 tokens on 32 ranks "
     "(268435456 rank-tokens)"),
    (["--model", "cogvideox-5b", "--height", "16384", "--width", "16384", "--duration-s", "2",
      "--machines", "8"],
     "--height 16384, --width 16384, --duration-s 2: 5243106 tokens (5242880 image + 226 text) "
     "on 64 ranks (8 x 8 GPUs) exceed the schedule limit of 4194304 tokens on 64 ranks"),
    # Fewer image tokens than ranks.
    (["--height", "16", "--width", "16"],
     "--height 16, --width 16: S = 1 image tokens, fewer than the 8 ranks (1 x 8 GPUs): each "
     "rank needs at least one"),
], ids=["frames", "default-frames", "rank-tokens", "duration", "too-short"])
def test_sequence_reported_against_its_options(run, args, expect):
    assert_fails(run(*args), expect)


def cluster_file(tmp_path, body):
    f = tmp_path / "cluster.json"
    f.write_text(body)
    return str(f)


@pytest.mark.parametrize("run", [simulate, plan], ids=["simulate", "plan"])
def test_hostile_cluster_files(run, tmp_path):
    f = cluster_file(tmp_path, '{"base": "p4de",\n "nic_bandwidth_GBps": 40,\n'
                               ' "nic_bandwidth_GBps": 42}\n')
    assert_fails(run("--cluster", f), f"--cluster: {f}:")
    assert_fails(run("--cluster", f), "duplicate key 'nic_bandwidth_GBps'")
    f = cluster_file(tmp_path, '{"base": "p4de",\n "nic_bandwidth_GBps": 1e400}\n')
    assert_fails(run("--cluster", f), f"--cluster: {f}:")
    assert_fails(run("--cluster", f), "number overflow parsing '1e400'")
    f = cluster_file(tmp_path, '{"base": "p4de", "nic_bandwidth_GBps": -1}\n')
    assert_fails(run("--cluster", f), f"--cluster: {f}: column 'nic_bandwidth_GBps': -1 is out "
                                      "of range [0.001, 100000]")
    assert_fails(run("--cluster", str(tmp_path)), f"--cluster: {tmp_path}: not a regular file")
    f = cluster_file(tmp_path, '{"base": "p4de", "nic_bandwidth_GBps": 42}\n')
    r = run("--cluster", f, "--machines", "2")
    assert r.returncode == 0, r.stderr


def test_plan_on_a_large_mesh_is_bounded():
    t0 = time.monotonic()
    r = sp("plan", "--machines", "32", "--model", "wan2.1-14b", "--top", "1", timeout=60)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 60
    assert "cluster p4de (32 x 8 GPUs)" in r.stdout and " wins: " in r.stdout, r.stdout
