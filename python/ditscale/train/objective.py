"""Wan's flow-matching objective: timestep sampling and shift, noisy latents, velocity target.

Per sample (seeded by (seed, epoch, sample id), so it does not depend on the rank, the
micro-batch or the world size that trained it):

    u ~ uniform(0, 1)  or  sigmoid(N(logit_mean, logit_std^2))        (timestep_sampling)
    sigma = shift * u / (1 + (shift - 1) * u)       (the shift of FlowMatchEulerDiscreteScheduler)
    noise ~ N(0, I);  x_t = (1 - sigma) * x0 + sigma * noise;  target v = noise - x0
    timestep = 1000 * sigma     (what WanTransformer3DModel takes)
    loss = mean over the latent of (v_pred - v)^2, fp32; the step's loss is the mean over its
    samples on every rank. See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..models.training import MicroBatch, _mix

NUM_TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class Objective:
    seed: int
    shift: float = 5.0
    sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0

    def sigma(self, g: torch.Generator) -> torch.Tensor:
        """One shifted sigma in (0, 1) (fp32 scalar) drawn from the CPU generator ``g``."""
        if self.sampling == "uniform":
            u = torch.rand((), generator=g, dtype=torch.float64)
        else:
            z = torch.randn((), generator=g, dtype=torch.float64)
            u = torch.sigmoid(z * self.logit_std + self.logit_mean)
        s = self.shift
        return (s * u / (1 + (s - 1) * u)).float()

    def noised(self, x0: torch.Tensor, sample_id: int, epoch: int):
        """(x_t, sigma, target) of one clean latent x0 [C, F, H, W] (fp32 math on CPU)."""
        g = torch.Generator(device="cpu").manual_seed(_mix(self.seed, epoch, sample_id, 0x7E5))
        sigma = self.sigma(g)
        noise = torch.randn(x0.shape, generator=g, dtype=torch.float32)
        x0 = x0.float()
        return (1 - sigma) * x0 + sigma * noise, sigma, noise - x0

    def micro_batch(self, latents: torch.Tensor, text: torch.Tensor, ids: Sequence[int],
                    epoch: int, patch: Sequence[int]):
        """The CPU tensors of a training micro-batch: latents [B, C, F, H, W] (clean), text
        [B, L, D] -> a ``MicroBatch`` (x_t fp32, t = 1000 sigma, target fp32) on the CPU; the
        loop moves it to the device in the compute dtype."""
        parts = [self.noised(latents[i], int(s), epoch) for i, s in enumerate(ids)]
        x_t = torch.stack([p[0] for p in parts])
        sigma = torch.stack([p[1] for p in parts])
        target = torch.stack([p[2] for p in parts])
        _, _, f, h, w = latents.shape
        tokens = len(ids) * (f // patch[0]) * (h // patch[1]) * (w // patch[2])
        return MicroBatch(x_t, sigma * NUM_TRAIN_TIMESTEPS, text, target, [int(i) for i in ids],
                          tokens)


def to_device(mb: MicroBatch, device: torch.device, dtype: torch.dtype) -> MicroBatch:
    """``mb`` on ``device``: x_t and text in the compute dtype, t and target fp32."""
    nb = device.type == "cuda"
    return MicroBatch(mb.x_t.to(device, dtype, non_blocking=nb), mb.t.to(device, non_blocking=nb),
                      mb.text.to(device, dtype, non_blocking=nb),
                      mb.target.to(device, non_blocking=nb), mb.sample_ids, mb.tokens)
