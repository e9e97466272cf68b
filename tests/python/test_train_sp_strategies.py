"""Every ``sp_strategy`` of ``python -m ditscale.train`` on the group meshes it can run on: 4 CPU
ranks (gloo) on 2 emulated machines of 2 (train_util.run_train_machines: a torchrun agent per
machine, each its own NCCL_HOSTID) with sp_degree 4 and strategy usp (a 2 x 2 mesh: Ulysses 2 x
ring 2, usp's own backward) against one rank without sequence parallelism on the same toy store
and seed: the same samples per step, losses, gradient norms and weights after the steps within
fp32 tolerance. The refusals at start-up, on every rank: usp on one machine of 4 ranks (Ulysses
degree 4 above the tiny model's 3 heads), and which strategy runs on which mesh.
See docs/train.md ("Sequence parallelism").
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from ditscale import sp  # noqa: E402
from ditscale.sp.grad import GRAD_STRATEGIES  # noqa: E402
from ditscale.train import config, model, parallel  # noqa: E402
from test_train_sp import PARAM_TOLERANCE, TOLERANCE, _args, _close, _params  # noqa: E402
from train_util import (check_ok, make_toy_store, metrics_lines, run_train,  # noqa: E402
                        run_train_machines)

STEPS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_sp_strategies")
    store = make_toy_store(root / "store", n=24)
    one, usp = str(root / "one"), str(root / "usp")
    check_ok(run_train(1, _args(store, one, steps=STEPS, **{"checkpoint-every": 0})))
    proc = run_train_machines(2, 2, _args(store, usp, steps=STEPS, **{
        "checkpoint-every": 0, "sp-degree": 4, "sp-strategy": "usp"}))
    check_ok(proc)
    return {"root": root, "store": store, "one": one, "usp": usp, "log": proc.stdout}


def test_usp_on_two_machines_gives_the_one_rank_result(runs):
    assert ("sequence parallelism: sp_strategy usp on groups of up to 4 ranks, rank 0's a mesh "
            "of 2 x 2") in runs["log"]
    got, want = metrics_lines(runs["usp"]), metrics_lines(runs["one"])
    assert [x["step"] for x in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert (a["world_size"], a["sp_degree"], b["sp_degree"]) == (4, 4, 1)
        assert a["samples"] == b["samples"] and a["shapes"] == b["shapes"], a["step"]
        assert _close(a["loss"], b["loss"]), (a["step"], a["loss"], b["loss"])
        assert _close(a["grad_norm"], b["grad_norm"]), (a["step"], a["grad_norm"],
                                                        b["grad_norm"])
    got, want = _params(runs["usp"], STEPS), _params(runs["one"], STEPS)
    assert got.keys() == want.keys() and len(got) > 20
    for k in want:
        err = float((got[k] - want[k]).abs().max())
        assert err <= PARAM_TOLERANCE, (k, err)


def test_usp_on_one_machine_of_four_is_refused_on_every_rank(runs, tmp_path):
    proc = run_train(4, _args(runs["store"], str(tmp_path / "out"), **{
        "sp-degree": 4, "sp-strategy": "usp"}))
    assert proc.returncode != 0
    line = ("ditscale.train: error: sp_strategy: 'usp' cannot run on the sequence-parallel "
            "group of 4 ranks: usp on a 1 x 4 mesh: column 'ulysses_degree': ulysses_degree 4 "
            "exceeds the 3 kv heads (each Ulysses rank needs at least one) (a mesh of machines x "
            "ranks per machine; the model has 3 attention heads; strategies that run there: "
            "ring, swiftfusion-tas, torus, auto)")
    assert proc.stderr.count(line) == 4, proc.stderr[-5000:]


def test_strategies_per_mesh():
    """On one machine usp is Ulysses over the group, swiftfusion-tas and torus a ring (Ulysses
    across machines): which strategies build for the tiny model's 3 heads."""
    wan = model.model_config("tiny", 2, 8)
    runs_on = {(m, g): [s for s in GRAD_STRATEGIES
                        if not parallel.strategy_error(s, sp.Mesh(m, g), wan)]
               for m, g in ((1, 2), (1, 4), (2, 2), (4, 1))}
    assert runs_on[1, 2] == list(GRAD_STRATEGIES)
    assert runs_on[1, 4] == ["ring", "swiftfusion-tas", "torus", "auto"]
    assert runs_on[2, 2] == ["ring", "usp", "swiftfusion-tas", "torus", "auto"]
    assert runs_on[4, 1] == ["ring", "usp", "auto"]
    assert config.BY_NAME["sp_strategy"].choices is GRAD_STRATEGIES
    text = config.BY_NAME["sp_strategy"].help
    assert all(f"{s}: " in text for s in GRAD_STRATEGIES)
