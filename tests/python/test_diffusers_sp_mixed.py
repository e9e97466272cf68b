"""A training step with a sequence-parallel degree per micro-batch, on 4 gloo processes:
FSDP2 shards a small random-weight WanTransformer3DModel over all 4 ranks; sample A trains on
ranks {0, 1} together (degree 2, their group), samples B and C on ranks 2 and 3 alone (degree 1),
each through ``ditscale.diffusers.sequence_group`` on a model parallelized once over its pair.
With each rank's loss scaled by W / N (W ranks, N samples; FSDP averages over W, the ranks of a
group hold partial gradients that sum to the sample's), the parameter gradients equal the
single-process gradient of the mean loss over A, B and C (fp32). Also refused: sequence_group
on a module parallelized on one rank or not parallelized. See docs/diffusers.md ("Training").
"""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
import test_diffusers_sp_wan  # noqa: E402

TOLERANCE = 1e-4  # relative to the largest reference gradient of the parameter, fp32
# rank -> the samples it trains; the group of ranks training each sample
PLACEMENT = {0: ["A"], 1: ["A"], 2: ["B"], 3: ["C"]}
GROUPS = {"A": (0, 1), "B": (2,), "C": (3,)}


def _sample(name: str) -> dict:
    """Sample ``name``: the test's Wan inputs (batch 1, an odd token count), seeded per name."""
    inputs = test_diffusers_sp_wan.TestWan().make_inputs("wan2.1", (1, 4, 3, 6, 10))
    g = torch.Generator().manual_seed(ord(name))
    inputs["hidden_states"] = torch.randn(inputs["hidden_states"].shape, generator=g)
    inputs["timestep"] = torch.tensor([100 * ord(name) % 1000])
    return inputs


def _loss(model, inputs) -> torch.Tensor:
    return model(**inputs)[0].square().mean()


def _dense(model) -> dict:
    """{name: gradient} of the mean loss over every sample, one process."""
    model = copy.deepcopy(model)
    loss = sum(_loss(model, _sample(n)) for n in GROUPS) / len(GROUPS)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _step(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ditscale import sp
    model = test_diffusers_sp_wan.TestWan().make_model("wan2.1").train()
    ref = _dense(model)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    meshes = {2: sp.Mesh(1, 2, pairs[rank // 2]), 1: sp.Mesh(1, 1, singles[rank])}
    dd.parallelize(model, mesh=meshes[2], strategy="ring")  # once, on the largest group
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    scale = world / len(GROUPS)  # FSDP averages over the W ranks
    for name in PLACEMENT[rank]:
        with dd.sequence_group(model, meshes[len(GROUPS[name])]):
            (_loss(model, _sample(name)) * scale).backward()
    errors = {}
    for n, p in model.named_parameters():
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errors[n] = float((got - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12))
    return errors


def test_mixed_degrees_give_the_dense_gradient_of_the_mean_loss():
    gloo_util = pytest.importorskip("gloo_util")
    for errors in gloo_util.run_gloo(_step, 4, timeout_s=300):
        bad = {n: e for n, e in errors.items() if not e <= TOLERANCE}
        assert not bad, bad
        assert len(errors) > 20


def test_sequence_group_needs_a_multi_rank_parallelized_module():
    from ditscale import sp
    model = test_diffusers_sp_wan.TestWan().make_model("wan2.1")
    with pytest.raises(ValueError, match="is not parallelized"):
        with dd.sequence_group(model, sp.Mesh(1, 1)):
            pass
    dd.parallelize(model, mesh=sp.Mesh(1, 1))
    with pytest.raises(ValueError, match="was parallelized on one rank"):
        with dd.sequence_group(model, sp.Mesh(1, 1)):
            pass
