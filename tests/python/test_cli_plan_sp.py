"""`ditscale plan --sp-degrees`: the degree list's range errors, `1` planning exactly as without
the option, the degrees chosen in the text, --json and --emit-batches outputs (aligned groups,
every sample once), and the fixed-degree rows of --compare. Runs the built CLI (skips without
one). Docs: docs/balance.md, "Sequence parallelism per micro-batch"."""
import json
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
from cli_util import find_cli

REPO = Path(__file__).resolve().parents[2]
MANIFEST = str(REPO / "examples/manifests/mixed_2k.csv")

CLI = find_cli(["plan"], "--sp-degrees")
pytestmark = pytest.mark.skipif(CLI is None, reason="no ditscale CLI binary of this version")


def plan(*extra, world="8"):
    return subprocess.run([CLI, "plan", "--manifest", MANIFEST, "--model", "wan2.1-14b",
                           "--quiet", "--world-size", world, *extra],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("degrees,world,message", [
    ("3", "8", "--sp-degrees: 3 is not a power of two in [1, 8]"),
    ("16", "16", "--sp-degrees: 16 is not a power of two in [1, 8]"),
    ("0", "8", "--sp-degrees: 0 is not a power of two in [1, 8]"),
    ("1,8", "4", "--sp-degrees: 8 must be at most the world size 4 and divide it"),
    ("4", "6", "--sp-degrees: 4 must be at most the world size 6 and divide it"),
    ("1,1", "8", "--sp-degrees: 1 is given twice"),
    ("1,x", "8", "--sp-degrees: 'x' is not an integer"),
    ("1,", "8", "--sp-degrees: '1,' is not a list"),
])
def test_degree_list_out_of_range_is_refused(degrees, world, message):
    r = plan("--sp-degrees", degrees, world=world)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert r.stdout == ""


def test_degrees_need_the_balanced_policy():
    r = plan("--sp-degrees", "1,2", "--policy", "adaptive")
    assert r.returncode != 0
    assert "--sp-degrees 1,2 needs --policy balanced" in r.stderr, r.stderr


def test_degree_one_plans_as_without_the_option(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    r1 = plan("--emit-batches", str(a), "--m-mem", "20000")
    r2 = plan("--emit-batches", str(b), "--m-mem", "20000", "--sp-degrees", "1")
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert a.read_bytes() == b.read_bytes()
    assert "sp_degree" not in a.read_text()
    assert r1.stderr == r2.stderr  # the warning about samples over M_mem included


def test_degrees_in_json_and_text():
    # mixed_2k runs up to S = 75600: over M_mem = 20000, those need 4 ranks.
    r = plan("--m-mem", "20000", "--sp-degrees", "1,2,4,8", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    run = j["policies"]["balanced sp=1,2,4,8"]
    assert run["sp_degrees"] == [1, 2, 4, 8]
    assert run["samples_unfit"] == 0
    per = run["per_degree"]
    assert sum(v["tokens"] for v in per.values()) == run["tokens"]
    assert "4" in per or "8" in per
    assert 0 < run["comm_fraction"] < 0.5
    text = plan("--m-mem", "20000", "--sp-degrees", "1,2,4,8")
    assert "sequence parallelism (micro-batches / share of tokens per degree)" in text.stdout
    assert "balanced sp=1,2,4,8" in text.stdout


def test_samples_fitting_no_degree_are_dropped_and_counted():
    r = plan("--m-mem", "20000", "--sp-degrees", "1,2", "--json", "--tail", "keep")
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)["policies"]["balanced sp=1,2"]
    assert run["samples_unfit"] > 0
    assert run["dropped_samples"] == run["samples_unfit"]
    assert run["samples"] + run["dropped_samples"] == 2000
    warned = plan("--m-mem", "20000", "--sp-degrees", "1,2", "--tail", "keep")
    assert (f"warning: policy balanced sp=1,2 drops {run['samples_unfit']} of 2000 samples: over "
            "M_mem = 20000 tokens per rank at every degree of --sp-degrees") in warned.stderr


def test_compare_adds_fixed_degree_rows():
    r = plan("--m-mem", "20000", "--sp-degrees", "1,2,4,8", "--compare", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["policies"]
    for name in ["equal-token", "adaptive", "balanced", "balanced sp=1,2,4,8", "balanced sp=1",
                 "balanced sp=2", "balanced sp=4", "balanced sp=8"]:
        assert name in p, sorted(p)
    assert p["balanced sp=1"]["comm_fraction"] == 0
    assert p["balanced sp=1"]["samples_unfit"] > 0  # over M_mem on one rank: dropped
    assert p["balanced sp=8"]["per_degree"].keys() == {"8"}
    assert p["balanced sp=8"]["comm_fraction"] > 0


def test_emitted_groups_are_aligned_and_every_sample_is_trained_once(tmp_path):
    out = tmp_path / "b.jsonl"
    r = plan("--m-mem", "20000", "--sp-degrees", "1,2,4,8", "--tail", "keep",
             "--emit-batches", str(out))
    assert r.returncode == 0, r.stderr
    ranks_of = defaultdict(list)  # (step, ids) -> [(rank, degree, group)]
    for line in out.read_text().splitlines():
        e = json.loads(line)
        assert len(e["sp_degree"]) == len(e["sp_group"]) == len(e["micro_batches"])
        for ids, d, g in zip(e["micro_batches"], e["sp_degree"], e["sp_group"]):
            assert g == e["rank"] // d
            ranks_of[(e["step"], tuple(ids))].append((e["rank"], d, g))
    trained = []
    for (_, ids), entries in ranks_of.items():
        d, g = entries[0][1], entries[0][2]
        assert sorted(r for r, _, _ in entries) == list(range(g * d, g * d + d))
        trained += ids
    assert sorted(trained) == sorted(set(trained))
    assert len(trained) == 2000


def test_unknown_topology_is_refused():
    r = plan("--sp-degrees", "1,8", "--sp-topology", "nope")
    assert r.returncode == 1
    assert "nope: column 'cluster': neither a preset" in r.stderr, r.stderr


def test_no_sample_fitting_any_degree_is_an_error_and_out_has_the_degrees(tmp_path):
    r = plan("--m-mem", "30", "--sp-degrees", "1,2,4,8")  # the shortest sample: 252 tokens
    assert r.returncode == 1
    assert "no sample fits the memory budget M_mem = 30 tokens per rank at any" in r.stderr
    out = tmp_path / "plan.json"
    r = plan("--m-mem", "20000", "--sp-degrees", "2,8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["sp_degrees"] == [2, 8] and set(s["per_degree"]) <= {"2", "8"}


def test_budget_sweep_plans_with_the_degrees():
    r = plan("--m-mem", "20000", "--sp-degrees", "1,2,4,8", "--budget-sweep", "--json")
    assert r.returncode == 0, r.stderr
    sweep = json.loads(r.stdout)["budget_sweep"]
    assert len(sweep) >= 2
    assert all(row["tokens_per_s_per_gpu"] > 0 for row in sweep)
