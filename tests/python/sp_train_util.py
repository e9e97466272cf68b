"""Gradients of a parallelized diffusers transformer against the single-process ones (the
sequence-parallel training checks of test_diffusers_sp_train.py and of every family's harness,
diffusers_sp_harness.py).

Loss = output.square().mean() on every rank (the same gathered output), backward. Convention
(docs/diffusers.md, "Training"): each rank's gradients are partials whose sum over the group
(all_reduce SUM) is the single-process gradient, for the parameters and the input latent alike.
A key projection's bias has a zero gradient in exact arithmetic (softmax is invariant to adding
q.b to every score of a row): compared against the largest gradient, not its own.
"""

from __future__ import annotations

import copy
from typing import Dict, Tuple

import torch

ZERO_GRADIENT = ("to_k.bias", "add_k_proj.bias")


def gradients(model, inputs, call=None
              ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """(output, latent gradient, {parameter name: gradient}) of loss = output.square().mean();
    ``call`` runs the model (e.g. its torch.compile wrapper; default: the model)."""
    latent = inputs["hidden_states"].clone().requires_grad_(True)
    out = (model if call is None else call)(**dict(inputs, hidden_states=latent))[0]
    out.square().mean().backward()
    return out.detach(), latent.grad, {n: p.grad for n, p in model.named_parameters()}


def summed(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    torch.distributed.all_reduce(grad)
    return grad


def relative_error(got: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    return float((got - ref).abs().max() / max(float(ref.abs().max()), scale, 1e-12))


def training_errors(model, inputs, parallelize, label: str,
                    compile_backend=None) -> Dict[Tuple[str, str], float]:
    """{(label, what): relative error} of ``parallelize(model)``'s gradients (summed over the
    ranks; under ``torch.compile(backend=compile_backend)`` when given) against the
    single-process ones; ``what``: "output", "latent", "latent, rank alone" (large: a rank holds
    a partial) and every parameter's name."""
    ref_out, ref_latent, ref_params = gradients(copy.deepcopy(model), inputs)
    parallelize(model)
    call = torch.compile(model, backend=compile_backend) if compile_backend else None
    out, latent, params = gradients(model, inputs, call)
    errors = {(label, "output"): relative_error(out, ref_out),
              (label, "latent, rank alone"): relative_error(latent, ref_latent),
              (label, "latent"): relative_error(summed(latent), ref_latent)}
    assert params.keys() == ref_params.keys()
    largest = max(float(g.abs().max()) for g in ref_params.values())
    for name, grad in params.items():
        assert grad is not None, (label, name)
        scale = largest if name.endswith(ZERO_GRADIENT) else 0.0
        errors[(label, name)] = relative_error(summed(grad), ref_params[name], scale)
    return errors


def check_training_errors(errors: Dict[Tuple[str, str], float], tolerance: float) -> None:
    """Every error within tolerance, but a rank's own latent gradient (a partial: far off)."""
    for (label, what), error in errors.items():
        if what == "latent, rank alone":
            assert error > 1e-2, (label, error)
        else:
            assert error <= tolerance, (label, what, error)
