"""AdamW, the warm-up + cosine schedule, gradient clipping and the EMA of the weights.

    lr(step) = lr * step / warmup_steps                                 step < warmup_steps
             = lr * (m + (1 - m) * (1 + cos(pi * p)) / 2),  p = (step - warmup) / (steps - warmup)
    (m = min_lr_ratio; ``step`` counts the optimizer steps already taken, so the first step
    trains at lr / warmup_steps)

Clipping: the global L2 norm of the gradients (FSDP shards: the squares of the local shards
summed over the ranks; replicated parameters: counted once) is computed every step (logged as
grad_norm); above ``grad_clip`` every gradient is scaled by grad_clip / norm.
EMA: ``ema = decay * ema + (1 - decay) * param`` after each step, on the shards (DTensors, so
a checkpoint reshards it like the model). See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch
import torch.distributed as dist

from ..models.training import replicated_params


def adamw(model, cfg) -> torch.optim.AdamW:
    """AdamW over the FSDP shards, and the replicated parameters as a group of their own (the
    foreach kernels take one tensor kind per group)."""
    replicated = replicated_params(model)
    ids = {id(p) for p in replicated}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) not in ids]}]
    if replicated:
        groups.append({"params": replicated})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay, foreach=True)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """The schedule's multiplier of ``lr`` for the step after ``step`` steps (module docs)."""
    if step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def scheduler(optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def clip_grad_norm(model, max_norm: float) -> float:
    """The global gradient norm before clipping; scales the gradients to ``max_norm`` when it
    is larger and ``max_norm > 0`` (module docs). One all_reduce."""
    replicated = {id(p) for p in replicated_params(model)}
    grads = [(p.grad, id(p) in replicated) for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    sq = torch.zeros((), device=_local(grads[0][0]).device, dtype=torch.float64)
    sharded = [_local(g) for g, rep in grads if not rep]
    rep = [g for g, r in grads if r]
    for g in sharded:
        sq += g.detach().double().pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(sq)
    for g in rep:
        sq += g.detach().double().pow(2).sum()
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


class Ema:
    """Exponential moving average of the trainable parameters (fp32, same sharding)."""

    def __init__(self, model, decay: float):
        self.decay = decay
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        with torch.no_grad():
            self.shadow: Dict[str, torch.Tensor] = {
                n: p.detach().clone().float() for n, p in model.named_parameters()
                if p.requires_grad}

    @torch.no_grad()
    def update(self, model) -> None:
        params = dict(model.named_parameters())
        for n in self.names:
            self.shadow[n].lerp_(params[n].detach().float(), 1.0 - self.decay)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self.shadow

    def names_list(self) -> List[str]:
        return list(self.names)
