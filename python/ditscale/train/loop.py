"""The training loop of ``python -m ditscale.train``: set-up, the steps of each epoch's
segments, logging, validation and checkpoints; SIGTERM saves a checkpoint and stops.

    setup (before the process group): store, model config, store/model check, checkpoint/model
    check -> process group -> layout (sp_degree: the SP groups) -> model (sequence-parallel,
    FSDP2), AdamW, schedule, EMA -> resume -> per segment:
    DataLoader from the segment's step; per step: this rank's micro-batches -> Stepper.step ->
    gathered per-rank stats -> metrics line -> validation -> checkpoint.

Every rank of an SP group trains its data-parallel index's micro-batches; the metrics count
each sample once (the first rank of each SP group reports its group's loss, samples, tokens).
With ``sp_degrees`` (``parallel_mixed``) the plan is over all ranks and each micro-batch runs on
its degree's group; a rank reports the micro-batches whose group it leads.
Exit status: 0 when ``steps`` steps are done, 143 after a SIGTERM (its checkpoint saved).
See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import Error as DitscaleError
from ..latent_store import LatentStore
from ..models.training import MicroBatch, init_distributed
from . import checkpoint, model as model_mod, parallel, parallel_mixed
from .data import StoreDataset, make_loader
from .logs import RunLog
from .objective import Objective, to_device
from .optim import Ema, adamw, scheduler
from .segment import Segment
from .step import Stepper
from .validation import Validator

EXIT_SIGTERM = 143


@dataclass
class Setup:
    """What is checked before the process group starts (every rank alike)."""

    store: LatentStore
    wan: object  # WanConfig
    resume: Optional[str]


def prepare(cfg) -> Setup:
    """The checks that need no process group: store, model, tokens per sample for sp_degree,
    fused AdaLN, the checkpoint."""
    store = LatentStore(cfg.store)
    wan = model_mod.model_config(cfg.model, cfg.num_layers, store.meta.max_text_tokens)
    model_mod.check_store(store, wan)
    if cfg.sp_degrees:  # the largest degree of the list (the check is per degree, conservative)
        parallel.check_tokens(store, max(parallel_mixed.parse_degrees(cfg.sp_degrees)),
                              "sp_degrees (largest)")
    else:
        parallel.check_tokens(store, cfg.sp_degree)
    if cfg.fused_adaln:
        from .. import ops
        from ..models import diffusers_wan

        if not ops.is_available():
            raise ValueError(f"fused_adaln: {ops.load_error()}; set fused_adaln = false "
                             f"(--no-fused-adaln)")
        try:
            diffusers_wan.fused_adaln_function()
        except RuntimeError as e:
            raise ValueError(f"fused_adaln: {e}") from e
    found = checkpoint.latest(cfg.out)
    if cfg.resume == "never" and found:
        raise ValueError(f"resume: 'never' but {cfg.out!r} has checkpoints ({found}); use "
                         f"resume = 'auto' or another out folder")
    folder = found if cfg.resume == "auto" else (None if cfg.resume == "never" else cfg.resume)
    if folder is not None:
        checkpoint.read_meta(folder, model_mod.describe(wan))
    return Setup(store, wan, folder)


def run(cfg, dataset=None) -> int:
    """Trains per ``cfg``. ``dataset`` (Python only, not a config field): a map-style dataset
    read instead of the store, with ``StoreDataset``'s ids and items (the benchmarks' in-memory
    data); the store is still opened, checked and planned."""
    setup = prepare(cfg)
    env = init_distributed(cfg.device, cfg.pg_timeout_s)
    try:
        return Trainer(cfg, setup, env, dataset).train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Trainer:
    def __init__(self, cfg, setup: Setup, env, dataset=None):
        self.cfg, self.setup, self.env = cfg, setup, env
        self.rank, self.world, self.device = env.rank, env.world_size, env.device
        self.degrees = parallel_mixed.parse_degrees(cfg.sp_degrees) if cfg.sp_degrees else None
        if self.degrees:
            self.layout = parallel_mixed.make_layout(self.degrees, cfg.sp_strategy,
                                                     cfg.pg_timeout_s, self.device, setup.wan)
        else:
            self.layout = parallel.make_layout(cfg.sp_degree, cfg.sp_strategy,
                                               cfg.pg_timeout_s, self.device, setup.wan)
        auto = "bf16" if self.device.type == "cuda" else "fp32"
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
            auto if cfg.dtype == "auto" else cfg.dtype]
        self.store, self.wan = setup.store, setup.wan
        if self.rank == 0:
            os.makedirs(cfg.out, exist_ok=True)
            with open(os.path.join(cfg.out, "config.json"), "w") as f:
                json.dump(asdict(cfg), f, indent=1)
        self.model = model_mod.build(self.wan, cfg, self.device, self.dtype, self.layout)
        self.optimizer = adamw(self.model, cfg)
        self.scheduler = scheduler(self.optimizer, cfg)
        self.ema = Ema(self.model, cfg.ema_decay) if cfg.ema_decay > 0 else None
        self.stepper = Stepper(self.model, self.optimizer, self.scheduler, self.ema,
                               self.device, self.wan, self.dtype, cfg.grad_clip,
                               cfg.sp_degree, self.layout if self.degrees else None)
        self.objective = Objective(cfg.seed, cfg.shift, cfg.timestep_sampling, cfg.logit_mean,
                                   cfg.logit_std)
        self.dataset = (StoreDataset(self.store, self.store.meta.max_text_tokens)
                        if dataset is None else dataset)
        self.sampler_kw = dict(
            model=self.store.shape_model, policy=cfg.policy, seed=cfg.seed,
            cost=cfg.cost or None, m_mem_tokens=cfg.m_mem_tokens or None,
            gpu_mem_gib=cfg.gpu_mem_gib, tail=cfg.tail, sp_degrees=self.degrees)
        self.step, self.stop_requested = 0, False

    # ---- segments -----------------------------------------------------------------------
    def segment(self, epoch: int, excluded=None) -> Segment:
        """The plan over the data-parallel ranks (this rank: its SP group's index)."""
        return Segment(self.store.manifest_path, len(self.store), epoch, self.layout.dp_rank,
                       self.layout.dp, excluded, **self.sampler_kw)

    def resume(self) -> Segment:
        """The segment and its step to continue at (``self.seg_step``), from the checkpoint."""
        folder = self.setup.resume
        if folder is None:
            self.seg_step = 0
            return self.segment(0)
        ts = checkpoint.load(folder, self.model, self.optimizer, self.ema)
        self.scheduler.load_state_dict(ts["scheduler"])
        self.step, epoch = int(ts["step"]), int(ts["epoch"])
        if ts["world_size"] == self.layout.dp:
            seg = self.segment(epoch, ts["excluded"].numpy())
            try:
                self.seg_step = seg.load_state_dict(ts["sampler"])
            except (DitscaleError, ValueError) as e:
                raise ValueError(f"checkpoint {folder!r}: its data plan is not this run's "
                                 f"(store, policy, cost, seed, m_mem_tokens, tail or "
                                 f"sp_degrees changed?): {e}") from e
            return seg
        consumed = ts["consumed"].numpy()
        self.seg_step = 0
        self.log.message(f"resume: data-parallel world size {ts['world_size']} -> "
                         f"{self.layout.dp}; epoch "
                         f"{epoch}: {len(consumed)} samples consumed, the other "
                         f"{len(self.store) - len(consumed)} re-planned")
        if len(consumed) >= len(self.store):
            return self.segment(epoch + 1)
        return self.segment(epoch, consumed)

    # ---- the loop -------------------------------------------------------------------------
    def train(self) -> int:
        cfg = self.cfg
        start = 0
        if self.setup.resume is not None:
            with open(os.path.join(self.setup.resume, "meta.json")) as f:
                start = json.load(f)["step"]
        self.log = RunLog(cfg.out, self.rank, cfg.steps, start, cfg.tensorboard, cfg.progress)
        mesh = self.layout.model_mesh
        if mesh is not None:  # rank 0's group (the message is rank 0's)
            self.log.message(f"sequence parallelism: sp_strategy {cfg.sp_strategy} on groups of "
                             f"up to {mesh.size} ranks, rank 0's a mesh of {mesh.machines} x "
                             f"{mesh.gpus_per_machine} (machines x ranks per machine)")
        seg = self.resume()
        self.validator = (Validator(cfg, self.store, self.dataset, self.device, self.dtype,
                                    cfg.out) if cfg.validate_every else None)
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            while self.step < cfg.steps:
                seg, stopped = self.run_segment(seg)
                if stopped:
                    return EXIT_SIGTERM
            return 0
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.log.close()

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True

    def run_segment(self, seg: Segment):
        """Trains ``seg`` from ``self.seg_step`` until its end, ``steps`` or a stop; returns
        (the segment to continue with, stopped)."""
        cfg = self.cfg
        loader = iter(make_loader(self.dataset, seg, self.seg_step, self.objective,
                                  self.wan.patch, cfg, self.device))
        while self.seg_step < seg.num_steps and self.step < cfg.steps:
            k = self.seg_step
            t0 = time.perf_counter()
            mbs = [self._micro_batch(next(loader)) for _ in range(seg.counts[k])]
            t_data = time.perf_counter() - t0
            total = len(seg.step_ids(k))  # each sample once (the plan is over the dp ranks)
            # W / N: FSDP averages over all W ranks (step.py derives it with sp_degree > 1)
            res = self.stepper.step(mbs, self.world / total, self.stop_requested,
                                    seg.my_degrees(k))
            self.step += 1
            self.seg_step += 1
            record = self._record(seg, k, res, t_data, time.perf_counter() - t0)
            if seg.num_steps == self.seg_step:  # the epoch is done: the next one starts
                seg, self.seg_step = self.segment(seg.epoch + 1), 0
            self._after_step(record, seg, res.stop)
            if res.stop:
                return seg, True
            if self.seg_step == 0:
                break
        return seg, False

    def _micro_batch(self, batch: Dict) -> MicroBatch:
        mb = MicroBatch(batch["x_t"], batch["t"], batch["text"], batch["target"],
                        batch["ids"], batch["tokens"])
        return to_device(mb, self.device, self.dtype)

    def _record(self, seg: Segment, k: int, res, t_data: float, step_s: float) -> Dict:
        mine = dict(loss_sum=res.loss_sum, samples=res.samples, tokens=res.tokens,
                    compute_s=res.compute_s, wait_s=res.wait_s, shapes=res.shapes,
                    degrees=res.degrees)
        every = [None] * self.world
        dist.all_gather_object(every, mine)
        groups = every[:: self.layout.sp]  # one rank per SP group: each sample once
        n = sum(r["samples"] for r in groups)
        tokens = sum(r["tokens"] for r in groups)
        return {"step": self.step, "epoch": seg.epoch,
                "loss": sum(r["loss_sum"] for r in groups) / max(n, 1), "lr": res.lr,
                "grad_norm": res.grad_norm, "tokens": tokens,
                "samples": seg.step_ids(k) if self.rank == 0 else [],
                "tokens_per_s": tokens / step_s, "step_time_s": step_s, "data_wait_s": t_data,
                "compute_s": [r["compute_s"] for r in every],
                "wait_s": [r["wait_s"] for r in every],
                "micro_batches": [len(r["shapes"]) for r in groups],
                "shapes": [r["shapes"] for r in groups], "world_size": self.world,
                "sp_degree": self.layout.sp,
                **({"sp_degrees": [r["degrees"] for r in groups]} if self.degrees else {})}

    def _after_step(self, record: Dict, seg: Segment, stop: bool) -> None:
        cfg, step = self.cfg, self.step
        if self.validator is not None and (step % cfg.validate_every == 0 or step == cfg.steps):
            record["validation"] = self.validator.run(self.model, step, self.rank, self.log)
        self.log.step(record)
        due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
        if due or stop or step == cfg.steps:
            path = self.save(seg)
            self.log.message(f"checkpoint: {path}" + (" (SIGTERM: stopping)" if stop else ""))

    def save(self, seg: Segment) -> str:
        train_state = {
            "step": self.step, "epoch": seg.epoch, "world_size": self.layout.dp,  # the plan's
            "excluded": torch.from_numpy(seg.excluded.copy()),
            "sampler": seg.state_dict(self.seg_step),
            "consumed": torch.from_numpy(np.asarray(seg.consumed(self.seg_step), np.int64)),
            "scheduler": self.scheduler.state_dict()}
        meta = {"world_size": self.world, "sp_degree": self.layout.sp,
                "sp_degrees": self.degrees or [], "epoch": seg.epoch,
                "ema": self.ema is not None,
                "model": model_mod.describe(self.wan)}
        return checkpoint.save(self.cfg.out, self.step, self.model, self.optimizer, self.ema,
                               train_state, meta, self.cfg.keep_checkpoints)
