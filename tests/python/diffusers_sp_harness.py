"""The one test harness of ``ditscale.diffusers.parallelize`` for every model family.

A family's test file defines ``class TestX(SpFamilyTests)`` giving its small configurations
(``KINDS``, ``make_model``, ``make_inputs``) and, where it differs, how an output is compared;
the mixin supplies the cases: one rank bit-identical to the stock module (state_dict and
parameters kept), unparallelize giving the stock module back bit for bit, parallelizing twice
and undoing what was not done refused, a look-alike class refused, inputs on another device and
custom processors refused, training on one rank allowed, torch.compile(fullgraph=True) at one
rank; and ONE gloo spawn of 4 ranks that runs every strategy on the 4 ranks and on two groups
of 2 against the single-process module, training with strategy "ring" (gradients summed over the
ranks against the single-process ones: sp_train_util.py), unparallelize after a multi-rank run,
fewer tokens than ranks, and the family's own multi-rank checks (``multi_rank_checks``).
See docs/diffusers.md.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import ditscale.diffusers as dd
from ditscale import sp
from ditscale.diffusers import _sp_plan
from sp_train_util import training_errors

WORLD = 4


def strategy_cases(world: int):
    """(label, machines or None = the group's own mesh, strategy, options) on ``world`` ranks."""
    return [("ulysses", None, "ulysses", {}), ("ulysses-overlap", None, "ulysses-overlap", {}),
            ("ring", None, "ring", {}), ("usp", 2, "usp", {}),
            ("swiftfusion-tas", 2, "swiftfusion-tas", {}), ("torus-1", 2, "torus", {"chunks": 1}),
            ("torus-2", 2, "torus", {"chunks": 2}), ("auto", None, "auto", {})]


ALL_STRATEGIES = tuple(c[0] for c in strategy_cases(WORLD))
# Schedules of each kind (all-to-all, ring, torus): for configurations that differ from the
# first one before and after the attention only.
SOME_STRATEGIES = ("ulysses", "ring", "torus-2")


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def processors(model) -> dict:
    """{module name: processor object} of every attention module."""
    return {name: m.processor for name, m in model.named_modules() if hasattr(m, "processor")}


def state_copy(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(model, state: dict) -> bool:
    now = model.state_dict()
    return list(now) == list(state) and all(torch.equal(now[k], state[k]) for k in now)


class SpFamilyTests:
    """Mixin of every family's parallelize tests (see the module docstring). A subclass sets
    ``KINDS`` and defines ``make_model(kind)`` (a fresh, seeded, eval-mode module) and
    ``make_inputs(kind)``; it may override the class attributes and the methods below."""

    KINDS = ("default",)
    TOLERANCE = 1e-4           # relative error of a multi-rank output, fp32
    ERROR_FLOOR = 1.0          # the error is max|out - ref| / max(ERROR_FLOOR, max|ref|)
    ALL_STRATEGY_KINDS = None  # kinds that run every strategy (None: the first kind)
    DEVICE_INPUT = "encoder_hidden_states"  # an input moved to "meta" to test the device check

    # ---- what a family may override ----------------------------------------------------------

    def make_model(self, kind):
        raise NotImplementedError

    def make_inputs(self, kind, **shape):
        raise NotImplementedError

    def too_few_tokens(self, kind, world: int) -> dict:
        """Inputs with fewer image/video tokens than ``world`` ranks."""
        raise NotImplementedError

    def run(self, model, inputs):
        """The compared result of one forward pass (no grad)."""
        with torch.no_grad():
            out = model(**inputs)
        return out[0] if isinstance(out, tuple) else out.sample

    def error(self, got, ref, kind) -> float:
        scale = max(self.ERROR_FLOOR, float(ref.abs().max()))
        return float((got - ref).abs().max()) / scale

    def same(self, got, ref) -> bool:
        return torch.equal(got, ref)

    def multi_rank_checks(self, rank: int, world: int) -> dict:
        """A family's own checks on ``world`` gloo ranks: {label: relative error}."""
        return {}

    # ---- one rank ------------------------------------------------------------------------------

    def test_one_rank_is_bit_identical_and_keeps_the_state_dict(self):
        for kind in self.KINDS:
            model, inputs = self.make_model(kind), self.make_inputs(kind)
            ref, state = self.run(model, inputs), state_copy(model)
            params = [id(p) for p in model.parameters()]
            assert dd.parallelize(model, strategy="ulysses") is model
            assert same_state(model, state) and [id(p) for p in model.parameters()] == params
            assert self.same(self.run(model, inputs), ref), kind

    def test_unparallelize_gives_the_stock_module_back(self):
        kind = self.KINDS[0]
        model, inputs = self.make_model(kind), self.make_inputs(kind)
        ref, state = self.run(model, inputs), state_copy(model)
        stock, hooks = processors(model), hook_count(model)
        dd.parallelize(model)
        assert hook_count(model) > hooks
        assert any(p is not stock[n] for n, p in processors(model).items())
        assert dd.unparallelize(model) is model
        assert hook_count(model) == hooks == 0
        assert all(p is stock[n] for n, p in processors(model).items())
        assert _sp_plan.ATTR not in model.__dict__ and same_state(model, state)
        assert self.same(self.run(model, inputs), ref)
        dd.parallelize(model)  # and again: a round trip leaves nothing behind
        assert self.same(self.run(model, inputs), ref)

    def test_twice_and_undoing_what_was_not_done_are_refused(self):
        model = self.make_model(self.KINDS[0])
        with pytest.raises(ValueError, match="is not parallelized"):
            dd.unparallelize(model)
        dd.parallelize(model)
        with pytest.raises(ValueError, match="already parallelized"):
            dd.parallelize(model)
        dd.unparallelize(model)
        with pytest.raises(ValueError, match="is not parallelized"):
            dd.unparallelize(model)

    def test_a_look_alike_class_is_refused(self):
        real = type(self.make_model(self.KINDS[0]))
        look_alike = type(real.__name__, (torch.nn.Linear,), {})(2, 2)
        subclass = object.__new__(type(real.__name__, (real,), {}))
        for call in (dd.parallelize, dd.apply_fused_adaln, dd.unparallelize):
            for obj in (look_alike, subclass):
                with pytest.raises(ValueError, match=f"class '{real.__name__}' of module "
                                                     f"'{__name__}' is not diffusers'"):
                    call(obj)
        with pytest.raises(ValueError, match="class 'Linear' is not supported"):
            dd.parallelize(torch.nn.Linear(2, 2))

    def test_a_bad_mesh_and_inputs_on_another_device_are_refused(self):
        model = self.make_model(self.KINDS[0])
        with pytest.raises(TypeError, match="mesh must be a ditscale.sp.Mesh"):
            dd.parallelize(model, mesh=2)
        dd.parallelize(model)
        inputs = self.make_inputs(self.KINDS[0])
        value = inputs[self.DEVICE_INPUT]
        inputs[self.DEVICE_INPUT] = (tuple(t.to("meta") for t in value)
                                     if isinstance(value, tuple) else value.to("meta"))
        with pytest.raises(ValueError, match=f"{self.DEVICE_INPUT} is on meta"):
            self.run(model, inputs)

    def test_other_processors_and_diffusers_parallelism_are_refused(self):
        plan = _family_plan(self.make_model(self.KINDS[0]))
        for rule in plan.processors:
            model = self.make_model(self.KINDS[0])
            name, attn = next((n, a) for n, a in _sp_plan._expand(model, rule.pattern)
                              if a is not None)
            attn.set_processor(type("Custom", (type(attn.processor),), {})())
            with pytest.raises(ValueError, match=re.escape(f"{name}'s attention processor is "
                                                           f"Custom")):
                dd.parallelize(model)
            assert hook_count(model) == 0  # refused before any change
        model = self.make_model(self.KINDS[0])
        model._parallel_config = object()  # what diffusers' enable_parallelism leaves
        with pytest.raises(ValueError, match="enable_parallelism"):
            dd.parallelize(model)

    def test_one_rank_training_is_the_stock_module(self):
        kind = self.KINDS[0]
        model, inputs = self.make_model(kind).train(), self.make_inputs(kind)
        dd.parallelize(model)
        out = model(**inputs)
        (out[0] if isinstance(out, tuple) else out.sample).sum().backward()
        assert any(p.grad is not None and bool(p.grad.abs().sum()) for p in model.parameters())

    def test_compiles_without_graph_breaks_at_one_rank(self):
        kind = self.KINDS[0]
        model, inputs = self.make_model(kind), self.make_inputs(kind)
        ref = self.run(model, inputs)
        dd.parallelize(model)
        torch._dynamo.reset()
        assert self.error(self.run(torch.compile(model, backend="aot_eager", fullgraph=True),
                                   inputs), ref, kind) <= 1e-6

    # ---- several processes: one spawn ---------------------------------------------------------

    def test_every_strategy_and_the_multi_rank_checks_under_gloo(self):
        gloo_util = pytest.importorskip("gloo_util")  # tests/python/gloo_util.py
        results = gloo_util.run_gloo(gloo_checks, WORLD, type(self), timeout_s=500)
        for rank, errors in enumerate(results):
            bad = {key: err for key, err in errors.items() if not err <= self.TOLERANCE}
            assert not bad, f"rank {rank}: errors above {self.TOLERANCE}: {bad}"
            expect = 2 * sum(len(self.strategies(kind)) for kind in self.KINDS)
            assert len([k for k in errors if k[0] == "strategy"]) == expect

    def strategies(self, kind):
        all_kinds = self.ALL_STRATEGY_KINDS or self.KINDS[:1]
        return ALL_STRATEGIES if kind in all_kinds else SOME_STRATEGIES


def _family_plan(model):
    from ditscale.diffusers import _classes

    family = _classes.SUPPORTED_TRANSFORMERS[type(model).__name__]
    return dd._family_module("sp", family).PLAN


def gloo_checks(rank: int, world: int, family_class) -> dict:
    """On every rank: every strategy on all ``world`` ranks, then on two groups of 2; the
    multi-rank refusals, unparallelize and the family's own checks. {key: relative error}."""
    import torch.distributed as dist

    fam = family_class()
    errors = _strategy_errors(fam, None, world)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    errors.update(_strategy_errors(fam, pairs[rank // 2], 2))
    _check_multi_rank_refusals_and_undo(fam, world)
    errors.update({("family", k): v for k, v in fam.multi_rank_checks(rank, world).items()})
    errors.update(_training_errors(fam))
    return errors


def _training_errors(fam: SpFamilyTests) -> dict:
    """Training through the plan with strategy "ring" on every rank: {("training", what):
    relative error} of the gradients summed over the ranks against the single-process ones."""
    kind = fam.KINDS[0]
    model, inputs = fam.make_model(kind).train(), fam.make_inputs(kind)
    errors = training_errors(model, inputs, lambda m: dd.parallelize(m, strategy="ring"), kind)
    alone = errors.pop((kind, "latent, rank alone"))
    assert alone > 1e-2, alone  # a rank holds a partial gradient
    return {("training", what): err for (_, what), err in errors.items()}


def _strategy_errors(fam: SpFamilyTests, group, world: int) -> dict:
    errors = {}
    for kind in fam.KINDS:
        model, inputs = fam.make_model(kind), fam.make_inputs(kind)
        ref, state = fam.run(model, inputs), state_copy(model)
        for label, machines, strategy, options in strategy_cases(world):
            if label not in fam.strategies(kind):
                continue
            copied = copy.deepcopy(model)
            mesh = (sp.Mesh(machines, world // machines, group=group) if machines
                    else sp.Mesh.from_process_group(group))
            dd.parallelize(copied, mesh=mesh, strategy=strategy, **options)
            assert same_state(copied, state), (kind, label)
            errors[("strategy", world, kind, label)] = fam.error(fam.run(copied, inputs), ref,
                                                                 kind)
    return errors


def _check_multi_rank_refusals_and_undo(fam: SpFamilyTests, world: int) -> None:
    kind = fam.KINDS[0]
    model, inputs = fam.make_model(kind), fam.make_inputs(kind)
    ref, stock = fam.run(model, inputs), processors(model)
    dd.parallelize(model, strategy="ulysses")
    with pytest.raises(ValueError, match=f"cannot be split over {world} ranks"):
        fam.run(model, fam.too_few_tokens(kind, world))
    assert fam.error(fam.run(model, inputs), ref, kind) <= fam.TOLERANCE
    dd.unparallelize(model)  # every hook of a multi-rank plan removed: the stock module again
    assert hook_count(model) == 0
    assert all(p is stock[n] for n, p in processors(model).items())
    assert fam.same(fam.run(model, inputs), ref)
