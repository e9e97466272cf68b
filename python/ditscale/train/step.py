"""One optimizer step of a rank: its micro-batches with gradient accumulation, the timed
barrier (the imbalance), the gradient sync, clipping, AdamW, the schedule and the EMA.

The phases are those of ``ditscale.models.training.StepRunner`` (its docstring): unshard every
FSDP unit; forward + backward of each micro-batch with gradient sync off (ranks may run
different numbers of micro-batches: the balanced plan's accumulation); a barrier that is an
all_reduce(MAX) of this rank's stop request (SIGTERM), so that every rank learns it in the same
step and ``wait_s`` is the time this rank idled for the slowest one; the sync pass (a 1-token
forward/backward, loss * 0, reduce-scatters the accumulated gradients) and the average of the
replicated parameters' gradients; then ``optim.clip_grad_norm``, AdamW, the scheduler, the EMA.
The gradient is that of the mean per-sample loss over every rank's samples of the step:
``loss_scale = world_size / samples_in_step`` (FSDP averages over the ranks).

Sequence parallelism (W ranks, SP groups of sp ranks, dp = W / sp; N samples in the step, each
trained by one SP group): every rank of group g computes the same loss L_g (the sum of its
per-sample losses, on the gathered output) and holds a partial gradient P_{g,i}, with
sum_i P_{g,i} = grad L_g (docs/sp.md, "Gradients"). FSDP's reduce-scatter (and the replicated
parameters' all_reduce) average over all W ranks, so with the loss scaled by s:
    (1 / W) sum_g sum_i s P_{g,i} = (s / W) sum_g grad L_g,
which is the data-parallel gradient (1 / N) sum_g grad L_g for s = W / N = sp * (dp / N): the
same ``loss_scale = world_size / samples_in_step`` with N counting each sample once (the plan is
over the dp ranks); i.e. dp's scale dp / N times sp_degree.

A degree per micro-batch (``sp_degrees``, ``parallel_mixed``; the plan over all W ranks): micro-
batch m of degree d_m is trained by its group G_m of d_m ranks, each computing the same loss
L_m and a partial gradient P_{m,i} (i in G_m), sum_{i in G_m} P_{m,i} = grad L_m (d_m = 1: the
one rank's full gradient). Rank i accumulates s * sum_{m: i in G_m} P_{m,i}; the average over
the W ranks is
    (1 / W) sum_i s sum_{m: i in G_m} P_{m,i} = (s / W) sum_m grad L_m,
the gradient (1 / N) sum_m grad L_m of the mean loss over the step's N distinct samples for
s = W / N again: ``loss_scale = world_size / samples_in_step``, N counting each micro-batch's
samples once (not once per rank of its group). Each micro-batch runs, forward and backward,
inside ``sequence_group`` on its group; the sync pass on the 1-rank group. The result reports
a micro-batch only on the first rank of its group, so that the metrics count it once.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..models.training import MicroBatch, StepRunner, per_sample_loss, synchronize
from .optim import clip_grad_norm


@dataclass
class StepResult:
    loss_sum: float = 0.0  # sum of this rank's per-sample losses
    samples: int = 0
    tokens: int = 0
    shapes: List[List[int]] = field(default_factory=list)  # [B, C, F', H', W'] per micro-batch
    degrees: List[int] = field(default_factory=list)  # sequence-parallel degree per micro-batch
    compute_s: float = 0.0
    wait_s: float = 0.0
    step_s: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    stop: bool = False  # some rank asked to stop (SIGTERM)


class Stepper:
    """``sp_degree``: the fixed degree (the sync pass's tokens); ``mixed``: a
    ``parallel_mixed.MixedLayout`` when each micro-batch has its own degree (``sp_degree`` 1)."""

    def __init__(self, model, optimizer, scheduler, ema, device, wan_cfg, dtype, grad_clip,
                 sp_degree: int = 1, mixed=None):
        self.runner = StepRunner(model, optimizer, device, cfg=wan_cfg, dtype=dtype,
                                 sync_tokens=sp_degree)
        self.model, self.optimizer, self.scheduler, self.ema = model, optimizer, scheduler, ema
        self.device, self.grad_clip, self.mixed = device, grad_clip, mixed

    def _on(self, degree: int):
        if self.mixed is None:
            return contextlib.nullcontext()
        return self.mixed.on_group(self.model, degree)

    def step(self, mbs: Sequence[MicroBatch], loss_scale: float, stop: bool,
             degrees: Optional[Sequence[int]] = None) -> StepResult:
        """``degrees``: each micro-batch's degree (with ``mixed``; None: all 1)."""
        r, run, dev = StepResult(), self.runner, self.device
        degrees = [1] * len(mbs) if degrees is None else list(degrees)
        r.lr = float(self.optimizer.param_groups[0]["lr"])
        t0 = time.perf_counter()
        for h in [u.unshard(async_op=True) for u in run.units]:
            if h is not None:
                h.wait()
        loss_sum = torch.zeros((), device=dev, dtype=torch.float64)
        for mb, d in zip(mbs, degrees, strict=True):
            run._set_sync(False)
            with self._on(d):
                losses = per_sample_loss(self.model, mb)
                (losses.sum() * loss_scale).backward()
            if self.mixed is not None and not self.mixed.leads(d):
                continue  # the group's first rank reports it
            loss_sum += losses.detach().double().sum()
            r.samples += len(mb.sample_ids)
            r.tokens += mb.tokens
            r.shapes.append(list(mb.x_t.shape))
            r.degrees.append(d)
        synchronize(dev)
        t1 = time.perf_counter()
        flag = torch.tensor([1.0 if stop else 0.0], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        synchronize(dev)
        t2 = time.perf_counter()
        run._set_sync(True)
        with self._on(1):
            (per_sample_loss(self.model, run._dummy_batch()).sum() * 0.0).backward()
        run._average_replicated_grads()
        r.grad_norm = clip_grad_norm(self.model, self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.model)
        synchronize(dev)
        r.compute_s, r.wait_s, r.step_s = t1 - t0, t2 - t1, time.perf_counter() - t0
        r.loss_sum, r.stop = float(loss_sum), bool(flag.item() > 0)
        return r
