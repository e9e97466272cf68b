"""`ditscale sp simulate/plan`: strategy names parsed at the edge (--strategy, --strategies name
every valid strategy when refused) and Ulysses head chunks given by --ulysses-chunks, apart from
torus's token chunks (--chunks). Runs the built CLI (skips without one)."""
import json
import subprocess

import pytest
from cli_util import find_cli

CLI = find_cli(["sp", "simulate"], "--ulysses-chunks")
pytestmark = pytest.mark.skipif(CLI is None, reason="no ditscale CLI binary with --ulysses-chunks")

NAMES = "ulysses, ulysses-overlap, ring, usp, swiftfusion-tas, torus"


def sp(*args):
    return subprocess.run([CLI, "sp", *args, "--machines", "1"], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args,expect", [
    (["simulate", "--strategy", "zigzag"], f"--strategy: 'zigzag' is not one of {NAMES}"),
    (["simulate", "--strategy", "Ring"], f"--strategy: 'Ring' is not one of {NAMES}"),
    (["plan", "--strategies", "ring,zigzag"], f"--strategies: 'zigzag' is not one of {NAMES}"),
    (["simulate", "--strategy", "ulysses", "--chunks", "2"],
     "--chunks: 2 token chunks are torus's; ulysses head chunks: --ulysses-chunks 2"),
    (["simulate", "--strategy", "ring", "--chunks", "2"],
     "--chunks: 2 token chunks: only torus cuts its all-to-all into token chunks, not ring"),
    (["simulate", "--strategy", "torus", "--ulysses-chunks", "2"],
     "--ulysses-chunks: 2 head chunks: only ulysses cuts its head group into chunks, not torus"),
    (["simulate", "--strategy", "ulysses", "--ulysses-chunks", "65"],
     "--ulysses-chunks: 65 is out of range [1, 64]"),
    (["simulate", "--strategy", "ulysses", "--ulysses-chunks", "-1"],
     "--ulysses-chunks: -1 is out of range [1, 64]"),
    # flux: 24 heads on 8 GPUs, 3 per Ulysses rank.
    (["simulate", "--strategy", "ulysses", "--ulysses-chunks", "4"],
     "--ulysses-chunks: ulysses in 4 head chunks needs >= 4 kv heads per Ulysses rank; the "
     "smallest group has 3"),
    (["plan", "--ulysses-chunks", "0"], "--ulysses-chunks: 0 is out of range [1, 64]"),
])
def test_refusals_name_the_option_and_value(args, expect):
    r = sp(*args)
    assert r.returncode > 0, (r.returncode, r.stderr)
    assert expect in r.stderr, r.stderr


def test_ulysses_head_chunks_are_their_own_field():
    r = sp("simulate", "--strategy", "ulysses", "--ulysses-chunks", "2", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert (j["strategy"], j["ulysses_chunks"], j["torus_chunks"]) == ("ulysses", 2, 1)
    assert "ulysses_chunks=2" in j["name"]
    r = sp("simulate", "--strategy", "torus", "--chunks", "2", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert (j["ulysses_chunks"], j["torus_chunks"]) == (1, 2)


def test_plan_enumerates_head_chunks_only_when_asked():
    base = ["plan", "--strategies", "ulysses", "--transports", "nccl", "--no-sm-partitions",
            "--top", "0", "--json"]
    plain = json.loads(sp(*base).stdout)
    assert [c["ulysses_chunks"] for c in plain["candidates"]] == [1]
    r = sp(*base, "--ulysses-chunks", "1,2,4")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert sorted(c["ulysses_chunks"] for c in j["candidates"]) == [1, 2]
    assert len(j["skipped"]) == 1 and "ulysses_chunks=4" in j["skipped"][0], j["skipped"]
