"""Training through ditscale.diffusers.parallelize on 2 gloo processes (one spawn): a small
random-weight WanTransformer3DModel (test_diffusers_sp_wan's configurations: 45 video tokens,
uneven heads) in train mode, loss = output.square().mean() on every rank, backward. The input
latent's gradient and every parameter's gradient, summed over the ranks (all_reduce SUM), equal
the single-process ones (fp32: max abs error <= 1e-4 of the largest reference gradient): Wan
2.1 (one timestep per sample), Wan 2.2 TI2V (one timestep per video token), Wan 2.1 I2V with
strategy "ulysses", and Wan 2.1 with "ring" (the ring's own backward, ring_backward.py),
eagerly and under torch.compile (backend aot_eager); the
other families' gradients are checked in their harness spawn (diffusers_sp_harness.py). The
refusal kept: tensors on another device than the CPU. See docs/diffusers.md ("Training").
"""

import pytest
import torch

pytest.importorskip("diffusers")

import ditscale.diffusers as dd  # noqa: E402
import test_diffusers_sp_wan  # noqa: E402
from sp_train_util import check_training_errors, training_errors  # noqa: E402

# (kind, strategy, torch.compile backend or None)
RUNS = (("wan2.1", "ulysses", None), ("wan2.2-ti2v", "ulysses", None),
        ("wan2.1-i2v", "ulysses", None), ("wan2.1", "ring", None), ("wan2.1", "ring", "aot_eager"))
TOLERANCE = 1e-4


def _train_checks(rank, world):
    """{(label, what): relative error} of the parallelized gradients against the dense ones."""
    wan, errors = test_diffusers_sp_wan.TestWan(), {}
    for kind, strategy, backend in RUNS:
        model, inputs = wan.make_model(kind).train(), wan.make_inputs(kind)
        errors.update(training_errors(model, inputs,
                                      lambda m: dd.parallelize(m, strategy=strategy),
                                      f"{kind} {strategy} {backend or 'eager'}", backend))
    _check_refusal(world)
    return errors


def _check_refusal(world):
    """No backward on another device than the CPU: refused at the module's input, naming it
    (meta tensors take the path CUDA tensors take)."""
    wan = test_diffusers_sp_wan.TestWan()
    model = dd.parallelize(wan.make_model("wan2.1").to("meta").train(), strategy="ulysses")
    inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
              for k, v in wan.make_inputs("wan2.1").items()}
    with pytest.raises(ValueError, match=f"not supported yet for WanTransformer3DModel with "
                                         f"strategy 'ulysses' on meta tensors on {world} ranks "
                                         f"\\(supported: every family with any strategy on "
                                         f"CPU tensors"):
        model(**inputs)


def test_parallelized_wan_gradients_equal_the_dense_ones_on_2_ranks():
    gloo_util = pytest.importorskip("gloo_util")  # tests/python/gloo_util.py
    results = gloo_util.run_gloo(_train_checks, 2, timeout_s=300)
    for errors in results:
        check_training_errors(errors, TOLERANCE)
    assert len(results[0]) > 3 * 20  # every parameter of every kind was compared
