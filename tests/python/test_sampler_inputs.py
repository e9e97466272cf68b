"""Hostile inputs of ditscale.BalancedBatchSampler and the bound shape functions.

One rule (python/ditscale/_checks.py, ditscale/core/range.h): a number out of its range raises
ValueError("<name>: <value> is out of range [lo, hi]"), a value of the wrong type TypeError naming
the argument; a state dict is checked field by field; an epoch without a step is an error; a
large dropped share warns. No torch needed.
"""

import json
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import ditscale

U64 = "18446744073709551615"
I64 = "9223372036854775807"


def write_images(path, n, size=(256, 256)):
    """n images of one size: every micro-batch has the same shape."""
    rows = ["path,num_frames,height,width,fps"]
    rows += [f"i/{i}.jpg,1,{size[0]},{size[1]}," for i in range(n)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("m") / "images.csv", 64)


def make(manifest, rank=0, world_size=2, **kw):
    kw.setdefault("m_mem_tokens", 4096)
    return ditscale.BalancedBatchSampler(manifest, rank, world_size, **kw)


# ---- constructor arguments ---------------------------------------------------------------

OUT_OF_RANGE = [
    ({"seed": -1}, f"seed: -1 is out of range [0, {U64}]"),
    ({"seed": 2**64}, f"seed: 18446744073709551616 is out of range [0, {U64}]"),
    ({"epoch": -1}, f"epoch: -1 is out of range [0, {I64}]"),
    ({"epoch": 2**63}, f"epoch: 9223372036854775808 is out of range [0, {I64}]"),
    ({"world_size": 0}, "world_size: 0 is out of range [1, 1048576]"),
    ({"world_size": 2**20 + 1}, "world_size: 1048577 is out of range [1, 1048576]"),
    ({"rank": 2}, "rank: 2 is out of range [0, 1]"),
    ({"rank": -1}, "rank: -1 is out of range [0, 1]"),
    ({"mem_safety": -0.5, "m_mem_tokens": None}, "mem_safety: -0.5 is out of range [0, 0.99]"),
    ({"mem_safety": 1.0, "m_mem_tokens": None}, "mem_safety: 1 is out of range [0, 0.99]"),
    ({"gpu_mem_gib": float("nan"), "m_mem_tokens": None},
     "gpu_mem_gib: nan is out of range [0.001, 1.04858e+06]"),
    ({"gpu_mem_gib": 0, "m_mem_tokens": None},
     "gpu_mem_gib: 0 is out of range [0.001, 1.04858e+06]"),
    ({"m_mem_tokens": -1}, "m_mem_tokens: -1 is out of range [1, 1125899906842624]"),
    ({"m_mem_tokens": 0}, "m_mem_tokens: 0 is out of range [1, 1125899906842624]"),
    ({"m_mem_tokens": 2**70},
     "m_mem_tokens: 1180591620717411303424 is out of range [1, 1125899906842624]"),
    ({"m_comp": float("inf")}, "m_comp: inf is out of range [0, 1e+300]"),
    ({"m_comp": -1.0}, "m_comp: -1 is out of range [0, 1e+300]"),
    ({"rank_budget_s": float("inf")}, "rank_budget_s: inf is out of range [0, 1e+09]"),
    ({"rank_budget_s": -5}, "rank_budget_s: -5 is out of range [0, 1e+09]"),
    ({"rank_budget_s": 10**400}, "rank_budget_s: 1" + "0" * 400 + " is out of range [0, 1e+09]"),
]


@pytest.mark.parametrize("kw,message", OUT_OF_RANGE, ids=[m.split(":")[0] + "=" + str(
    list(k.values())[0])[:12] for k, m in OUT_OF_RANGE])
def test_out_of_range_argument_names_itself_value_and_range(manifest, kw, message):
    kw = dict(kw)
    rank = kw.pop("rank", 0)
    world = kw.pop("world_size", 2)
    with pytest.raises(ValueError) as e:
        make(manifest, rank, world, **kw)
    assert str(e.value) == message


WRONG_TYPE = [
    ({"seed": 1.5}, "seed: expected an integer, got float 1.5"),
    ({"seed": "7"}, "seed: expected an integer, got str '7'"),
    ({"epoch": 1.0}, "epoch: expected an integer, got float 1.0"),
    ({"rank": True}, "rank: expected an integer, got bool True"),
    ({"world_size": None}, "world_size: expected an integer, got NoneType None"),
    ({"m_mem_tokens": 4096.0}, "m_mem_tokens: expected an integer, got float 4096.0"),
    ({"mem_safety": "0.1", "m_mem_tokens": None}, "mem_safety: expected a number, got str '0.1'"),
    ({"rank_budget_s": True}, "rank_budget_s: expected a number, got bool True"),
]


@pytest.mark.parametrize("kw,message", WRONG_TYPE, ids=[m.split(":")[0] for _, m in WRONG_TYPE])
def test_wrong_type_argument_names_itself(manifest, kw, message):
    kw = dict(kw)
    rank = kw.pop("rank", 0)
    world = kw.pop("world_size", 2)
    with pytest.raises(TypeError) as e:
        make(manifest, rank, world, **kw)
    assert str(e.value) == message


def test_numpy_integers_and_the_range_ends_are_accepted(manifest):
    a = make(manifest, np.int64(1), np.int32(2), seed=np.uint64(2**64 - 1), mem_safety=0.99,
             gpu_mem_gib=np.float32(1048576.0), m_mem_tokens=np.int64(4096))
    b = make(manifest, 1, 2, seed=2**64 - 1, mem_safety=0, gpu_mem_gib=0.001)
    assert a.state_dict() == b.state_dict()
    assert a.state_dict()["seed"] == 2**64 - 1
    c = make(manifest, 0, 1, epoch=2**63 - 1)
    assert c.epoch == 2**63 - 1


def test_set_epoch_and_cell_check_their_arguments(manifest):
    s = make(manifest)
    with pytest.raises(ValueError, match=rf"^epoch: -1 is out of range \[0, {I64}\]$"):
        s.set_epoch(-1)
    with pytest.raises(TypeError, match="^epoch: expected an integer, got float 2.0$"):
        s.set_epoch(2.0)
    with pytest.raises(ValueError, match=rf"^step: -1 is out of range \[0, {s.num_steps - 1}\]$"):
        s.cell(-1, 0)
    with pytest.raises(ValueError, match=r"^rank: 2 is out of range \[0, 1\]$"):
        s.cell(0, 2)
    with pytest.raises(ValueError, match=rf"^consumed_steps: -1 is out of range \[0, "):
        s.state_dict(consumed_steps=-1)
    with pytest.raises(TypeError, match="^consumed_micro_batches: expected an integer"):
        s.state_dict(consumed_micro_batches=1.5)
    assert s.epoch == 0


def test_seq_len_and_train_shape_check_their_arguments():
    assert ditscale.seq_len(np.int64(81), 480, 832, np.float32(16.0)) == 21 * 30 * 52
    cases = [
        ((0, 480, 832), ValueError, "num_frames: 0 is out of range [1, 2147483647]"),
        ((2**40, 480, 832), ValueError,
         "num_frames: 1099511627776 is out of range [1, 2147483647]"),
        ((81, -480, 832), ValueError, "height: -480 is out of range [1, 2147483647]"),
        ((81, 480, 2**31), ValueError, "width: 2147483648 is out of range [1, 2147483647]"),
        ((81, 480, 832, float("inf")), ValueError, "fps: inf is out of range [0, 1e+06]"),
        ((81, 480, 832, -1.0), ValueError, "fps: -1 is out of range [0, 1e+06]"),
        ((81.5, 480, 832), TypeError, "num_frames: expected an integer, got float 81.5"),
        ((81, "480", 832), TypeError, "height: expected an integer, got str '480'"),
    ]
    for fn in (ditscale.seq_len, ditscale.train_shape):
        for args, exc, message in cases:
            with pytest.raises(exc) as e:
                fn(*args)
            assert str(e.value) == message, (fn.__name__, args)


# ---- state dicts ---------------------------------------------------------------------------


def test_state_dict_carries_every_field(manifest):
    s = make(manifest, 1, 2, seed=5)
    st = s.state_dict()
    assert set(st) == {"epoch", "step", "micro_batch", "seed", "world_size", "rank",
                       "plan_fingerprint"}
    assert (st["rank"], st["world_size"], st["seed"], st["epoch"]) == (1, 2, 5, 0)
    assert st["plan_fingerprint"] != 0
    assert st["plan_fingerprint"] == make(manifest, 0, 2, seed=5).state_dict()["plan_fingerprint"]


@pytest.mark.parametrize("field", ["epoch", "step", "micro_batch", "seed", "world_size", "rank",
                                   "plan_fingerprint"])
def test_state_dict_missing_field_is_refused(manifest, field):
    s = make(manifest)
    st = s.state_dict()
    del st[field]
    with pytest.raises(ValueError, match=f"^state dict: missing field '{field}'$"):
        s.load_state_dict(st)
    # The binding refuses it too, with the same words (not pybind's cast error).
    with pytest.raises(ValueError, match=f"^state dict: missing field '{field}'$"):
        s._impl.load_state(st)


BAD_STATE_VALUES = [
    ("epoch", -1, ValueError, f"state.epoch: -1 is out of range [0, {I64}]"),
    ("epoch", "0", TypeError, "state.epoch: expected an integer, got str '0'"),
    ("step", -1, ValueError, f"state.step: -1 is out of range [0, {I64}]"),
    ("step", 2.0, TypeError, "state.step: expected an integer, got float 2.0"),
    ("micro_batch", None, TypeError, "state.micro_batch: expected an integer, got NoneType None"),
    ("seed", -1, ValueError, f"state.seed: -1 is out of range [0, {U64}]"),
    ("seed", 2**64, ValueError, f"state.seed: 18446744073709551616 is out of range [0, {U64}]"),
    ("world_size", 0, ValueError, "state.world_size: 0 is out of range [1, 1048576]"),
    ("rank", 2, ValueError, "state.rank: 2 is out of range [0, 1]"),
    ("rank", True, TypeError, "state.rank: expected an integer, got bool True"),
    ("plan_fingerprint", 0, ValueError, f"state.plan_fingerprint: 0 is out of range [1, {U64}]"),
    ("plan_fingerprint", [1], TypeError, "state.plan_fingerprint: expected an integer, got list [1]"),
]


@pytest.mark.parametrize("field,value,exc,message", BAD_STATE_VALUES,
                         ids=[f"{f}={v!r}" for f, v, _, _ in BAD_STATE_VALUES])
def test_state_dict_bad_value_is_refused_naming_field_value_and_range(manifest, field, value,
                                                                      exc, message):
    s = make(manifest)
    st = s.state_dict()
    st[field] = value
    with pytest.raises(exc) as e:
        s.load_state_dict(st)
    assert str(e.value) == message
    with pytest.raises(exc) as e:  # the binding on its own: the same words
        s._impl.load_state(st)
    assert str(e.value) == message


def test_state_dict_unknown_field_and_non_mapping_are_refused(manifest):
    s = make(manifest)
    st = s.state_dict()
    st["cursor"] = 3
    with pytest.raises(ValueError, match="^state dict: unknown field.s. cursor; expected epoch"):
        s.load_state_dict(st)
    with pytest.raises(TypeError, match="^state dict: expected a mapping, got list$"):
        s.load_state_dict([1, 2])


def test_state_dict_with_numpy_and_tensor_like_scalars_loads(manifest):
    s = make(manifest)
    next(iter(s))
    st = {k: np.uint64(v) for k, v in s.state_dict().items()}
    t = make(manifest)
    t.load_state_dict(st)
    assert t.state_dict() == s.state_dict()


def test_another_ranks_mid_step_state_is_refused_its_step_boundary_state_loads(manifest):
    r0, r1 = make(manifest, 0, 2), make(manifest, 1, 2)
    st = r1.state_dict()
    st["micro_batch"] = 1  # mid-step on rank 1
    with pytest.raises(ditscale.Error, match="state.rank: the state was saved on rank 1 in the "
                                             "middle of step 0 .*this sampler is rank 0"):
        r0.load_state_dict(st)
    boundary = r1.state_dict(consumed_steps=2)
    r0.load_state_dict(boundary)  # a step boundary means the same on every rank
    assert r0.state_dict()["step"] == 2 and r0.state_dict()["rank"] == 0


def test_refused_state_leaves_the_sampler_as_it_was(manifest):
    s = make(manifest, seed=3)
    it = iter(s)
    first = next(it)
    before = s.state_dict()
    other_epoch = make(manifest, seed=3, epoch=4).state_dict()
    other_epoch["plan_fingerprint"] ^= 1
    with pytest.raises(ditscale.Error, match="state.plan_fingerprint: .* differs"):
        s.load_state_dict(other_epoch)
    assert s.state_dict() == before and s.epoch == 0
    other_seed = make(manifest, seed=4).state_dict()
    with pytest.raises(ditscale.Error, match="state.seed: 4 differs"):
        s.load_state_dict(other_seed)
    assert s.state_dict() == before
    fresh = make(manifest, seed=3)
    assert next(iter(fresh)) == first


# ---- empty and mostly dropped epochs -------------------------------------------------------


def test_plan_without_a_step_raises(tmp_path):
    # 6 small images fill one micro-batch: nothing for a step on 4 ranks under tail="drop".
    path = write_images(tmp_path / "six.csv", 6)
    with pytest.raises(ditscale.Error, match="step") as e:
        ditscale.BalancedBatchSampler(path, 0, 4, m_mem_tokens=4096, policy="equal-token")
    assert re.search(r"world.size 4", str(e.value)), str(e.value)  # the cause: 4 ranks


def test_large_dropped_share_warns_with_fraction_and_cause(tmp_path):
    # 10 images of 256 tokens, one per micro-batch, on 4 ranks: 2 full steps, 2 samples dropped.
    path = write_images(tmp_path / "ten.csv", 10)
    tokens = ditscale.seq_len(1, 256, 256)
    with pytest.warns(UserWarning, match=r"drops 2 of 10 samples \(20.0%, more than 10%\): "
                                         r"tail='drop'.*4 ranks") as w:
        s = ditscale.BalancedBatchSampler(path, 0, 4, m_mem_tokens=tokens,
                                          policy="equal-token")
    assert s.dropped_samples == 2 and len(w) == 1
    with pytest.warns(UserWarning, match="epoch 1 drops 2 of 10"):
        s.set_epoch(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.set_epoch(1)  # the same epoch: nothing re-planned, no second warning
        kept = ditscale.BalancedBatchSampler(path, 0, 4, m_mem_tokens=tokens,
                                             policy="equal-token", tail="keep")
        assert kept.dropped_samples == 0
        # 1 of 41 dropped (2.4%) stays below the threshold.
        few = ditscale.BalancedBatchSampler(write_images(tmp_path / "41.csv", 41), 0, 4,
                                            m_mem_tokens=tokens, policy="equal-token")
        assert few.dropped_samples == 1


# ---- a model file whose shape arithmetic overflows -----------------------------------------

OVERFLOW_MODEL = {"base": "wan2.1-1.3b", "vae_stride_hw": 65536, "patch_h": 65536}

CHILD = r"""
import sys, ditscale
manifest, model = sys.argv[1], sys.argv[2]
for call in (lambda: ditscale.seq_len(81, 480, 832, 16.0, model=model),
             lambda: ditscale.BalancedBatchSampler(manifest, 0, 1, model=model)):
    try:
        call()
    except (ditscale.Error, ValueError) as e:
        print("refused:", e)
    else:
        print("accepted")
"""


def test_overflowing_model_file_raises_and_does_not_kill_the_interpreter(tmp_path):
    model = tmp_path / "overflow.json"
    model.write_text(json.dumps(OVERFLOW_MODEL))
    path = write_images(tmp_path / "m.csv", 8)
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(model)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"the interpreter died (rc {r.returncode}): {r.stderr[-2000:]}"
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("refused: ") for line in lines), r.stdout
    assert all("overflow.json" in line for line in lines), r.stdout
