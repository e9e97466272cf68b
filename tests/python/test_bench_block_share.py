"""bench.sp.block_share on the CPU (a tiny block): the report and JSON rows, one Ulysses rank's
share doing 1 / d of the block's self-attention FLOPs, and the refused options."""

import json
import sys

import pytest

from bench_util import REPO, run_bench


def _run(args, tmp_path):
    return run_bench("bench.sp.block_share", args, tmp_path)


def test_dry_run_writes_rows_and_json(tmp_path):
    pytest.importorskip("diffusers")
    r = _run(["--device", "cpu", "--models", "tiny", "--tokens", "64,101", "--degrees", "2,3,4",
              "--reps", "1", "--json", str(tmp_path / "eff.json")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln.split("|") for ln in (tmp_path / "sp-block-share.md").read_text().splitlines()
            if ln.startswith("| tiny |")]
    # 8 heads: degree 3 does not divide them and is left out
    assert [(c[2].strip(), c[3].strip()) for c in rows] == [
        (s, d) for s in ("64", "101") for d in ("1", "2", "4")]
    eff = json.loads((tmp_path / "eff.json").read_text())
    assert sorted(eff["tiny"]) == ["2", "4"] and sorted(eff["tiny"]["2"]) == ["101", "64"]
    assert all(0 < e < 10 for d in eff["tiny"].values() for e in d.values())


def test_share_does_one_dth_of_the_self_attention():
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    sys.path.insert(0, str(REPO))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from bench.sp import block_share
    block = block_share._block("tiny", torch.device("cpu"), torch.float32)

    def sdpa_flops(d, tokens):
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor
        block.attn1.set_processor(block_share.UlyssesShare(d) if d > 1 else WanAttnProcessor())
        x = torch.randn(1, tokens, 64)
        # the math backend: attention as two batched matmuls, which the counter knows
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as c:
            block.attn1(x, None, None, None)
        return sum(v for k, v in c.get_flop_counts()["Global"].items() if "bmm" in str(k))

    full = sdpa_flops(1, 96)
    assert full > 0 and sdpa_flops(2, 48) * 2 == full and sdpa_flops(4, 24) * 4 == full


@pytest.mark.parametrize("args, message", [
    (["--models", "nope"], "--models: 'nope' is not one of"),
    (["--tokens", "4"], "--tokens: 4 is out of range [8, 1048576]"),
    (["--degrees", "1"], "--degrees: 1 is out of range [2, 64]"),
])
def test_bad_options_are_refused(tmp_path, args, message):
    r = _run(args, tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
