"""Distributed training plumbing shared by ``ditscale.shape_bench`` and ``bench/train/policies.py``:
process group set-up, FSDP2 sharding of the DiT, deterministic synthetic flow-matching data and
the timed training step (``StepRunner.step``: gather -> compute -> wait -> sync -> optim, so
that wait_s is exactly a rank's load-imbalance idle time and ranks may run different numbers
of micro-batches per step).

The phases, the synthetic data and the two model implementations: docs/balance.md ("The
training helpers' step"). Training on real data is ``ditscale.train`` (docs/train.md).
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .wan_dit import WanConfig, WanDiT, latent_shape

VOCAB = 256  # rows of the synthetic text-embedding table


# ---------------------------------------------------------------------------------------------
# Process group.


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str = "auto", timeout_s: float = 60.0) -> DistEnv:
    """Initialises the default process group: from torchrun's environment when present, else as
    a single process (world size 1). device: "auto" (cuda:LOCAL_RANK when CUDA is available),
    "cuda" or "cpu" (gloo backend, for tests)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = "0", "1", "0"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        if use_cuda:
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
    return DistEnv(rank, world, local_rank, dev, backend)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Model construction and sharding.


IMPLS = ("ditscale", "diffusers")


def build_model(
    cfg: WanConfig,
    device: torch.device,
    *,
    fused_adaln: bool,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    lr: float = 1e-4,
    impl: str = "ditscale",
    weights: Optional[str] = None,
):
    """The DiT, FSDP2-sharded over the default process group, and its AdamW optimizer.

    Parameters are fp32 (master weights and Adam state on the shards); each block is an FSDP unit
    whose parameters are all-gathered in ``dtype`` with gradients reduced in fp32; the timestep
    MLPs are units of their own kept in fp32 (Wan computes the modulation in fp32). The blocks
    and the root do not cast their forward inputs (cast_forward_inputs=False): the modulation
    e0, the gates and the RoPE tables stay fp32. Every rank initialises the same weights from
    ``seed``.

    impl: "ditscale" (WanDiT) or "diffusers" (WanTransformer3DModel: random weights from
    ``seed``, or the local checkpoint folder ``weights``; see the module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if impl not in IMPLS:
        raise ValueError(f"impl: {impl!r} is not one of {', '.join(IMPLS)}")
    if weights is not None and impl != "diffusers":
        raise ValueError(f"weights: a checkpoint folder ({weights!r}) needs impl 'diffusers'")
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    mp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    if impl == "diffusers":
        from . import diffusers_wan

        model = diffusers_wan.build(cfg, device, seed=seed, weights=weights,
                                    fused_adaln=fused_adaln)
        units32, replicated = diffusers_wan.fp32_split(model)
        ignored = set(replicated)
        for unit in units32:
            fully_shard(unit, mp_policy=mp32, reshard_after_forward=False, ignored_params=ignored)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)
        fully_shard(model, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)
        return model, _adamw(model, lr)
    torch.manual_seed(seed)
    with torch.device(device):
        model = WanDiT(cfg, fused_adaln=fused_adaln)
    fully_shard(model.time_embedding, mp_policy=mp32, reshard_after_forward=False)
    fully_shard(model.time_projection, mp_policy=mp32, reshard_after_forward=False)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    return model, _adamw(model, lr)


def replicated_params(model) -> List[torch.nn.Parameter]:
    """The trainable parameters FSDP does not manage (not DTensors): replicated on every rank."""
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]


def _adamw(model, lr: float):
    """AdamW over the FSDP shards, and the replicated parameters as a group of their own (the
    foreach kernels take one tensor kind per group)."""
    replicated = replicated_params(model)
    ids = {id(p) for p in replicated}
    params = list(model.parameters())
    if replicated:
        params = [{"params": [p for p in params if id(p) not in ids]}, {"params": replicated}]
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0, foreach=True)


# ---------------------------------------------------------------------------------------------
# Synthetic flow-matching data.


def _mix(*xs: int) -> int:
    """A 63-bit hash of integers (splitmix64 steps), for per-sample generator seeds."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
        h = h * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x7FFFFFFFFFFFFFFF


@dataclass
class MicroBatch:
    """One micro-batch on the device: B samples of one latent shape."""

    x_t: torch.Tensor  # [B, C, T, H, W], compute dtype
    t: torch.Tensor  # [B] fp32, in [0, 1000]
    text: torch.Tensor  # [B, text_len, text_dim], compute dtype
    target: torch.Tensor  # [B, C, T, H, W] fp32 velocity
    sample_ids: List[int]
    tokens: int  # B * S


class SyntheticData:
    """Deterministic synthetic samples for a model config (see the module docstring)."""

    def __init__(self, cfg: WanConfig, device: torch.device, dtype: torch.dtype, seed: int = 0):
        self.cfg, self.device, self.dtype, self.seed = cfg, device, dtype, int(seed)
        g = torch.Generator(device="cpu").manual_seed(_mix(seed, 0xC0FFEE))
        self.text_table = torch.randn(VOCAB, cfg.text_dim, generator=g).to(device, dtype)
        self.channel_bias = (0.5 * torch.randn(VOCAB, cfg.in_channels, generator=g)).to(device)

    def sample(self, sample_id: int, epoch: int, latent: Sequence[int]):
        """(x0, noise, t, text) of one sample: x0, noise, t fp32 and text in the compute dtype,
        on the device. The scalars and token ids come from a CPU generator (no device sync),
        the large tensors from a device generator, both seeded by (seed, epoch, sample_id)."""
        c, (lt, lh, lw) = self.cfg.in_channels, latent
        key = _mix(self.seed, epoch, sample_id)
        g_cpu = torch.Generator(device="cpu").manual_seed(key)
        g_dev = torch.Generator(device=self.device).manual_seed(_mix(key, 1))
        t = torch.sigmoid(torch.randn((), generator=g_cpu))
        ids = torch.randint(0, VOCAB, (self.cfg.text_len,), generator=g_cpu)
        length = int(torch.randint(1, self.cfg.text_len + 1, (), generator=g_cpu))
        coarse = (c, max(1, (lt + 1) // 2), max(1, lh // 4), max(1, lw // 4))
        low = torch.randn(coarse, generator=g_dev, device=self.device)
        x0 = F.interpolate(low[None], size=(lt, lh, lw), mode="trilinear", align_corners=False)[0]
        x0 = x0 / x0.std().clamp_min(1e-6)
        noise = torch.randn((c, lt, lh, lw), generator=g_dev, device=self.device)
        ids = ids.to(self.device)
        text = self.text_table[ids]
        text[length:] = 0
        x0 = x0 + self.channel_bias[ids[0]][:, None, None, None]
        return x0, noise, t.to(self.device), text

    def micro_batch(self, sample_ids: Sequence[int], latent: Sequence[int], epoch: int = 0):
        """A micro-batch of samples that share one latent shape (t, h, w)."""
        parts = [self.sample(i, epoch, latent) for i in sample_ids]
        x0 = torch.stack([p[0] for p in parts])
        noise = torch.stack([p[1] for p in parts])
        t = torch.stack([p[2] for p in parts])
        text = torch.stack([p[3] for p in parts])
        tb = t.view(-1, 1, 1, 1, 1)
        x_t = ((1 - tb) * x0 + tb * noise).to(self.dtype)
        pt, ph, pw = self.cfg.patch
        s = (latent[0] // pt) * (latent[1] // ph) * (latent[2] // pw)
        return MicroBatch(x_t, t * 1000.0, text, noise - x0, list(sample_ids),
                          len(sample_ids) * s)

    def for_pixels(self, sample_ids, frames: int, height: int, width: int, epoch: int = 0):
        return self.micro_batch(sample_ids, latent_shape(frames, height, width), epoch)


def predict(model, mb: MicroBatch) -> torch.Tensor:
    """The model's velocity for ``mb`` [B, C, T, H, W]: ditscale's WanDiT is called as
    ``model(x_t, t, text)``, any other model through ``diffusers_wan.forward``."""
    if isinstance(model, WanDiT):
        return model(mb.x_t, mb.t, mb.text)
    from .diffusers_wan import forward

    return forward(model, mb.x_t, mb.t, mb.text)


def per_sample_loss(model, mb: MicroBatch) -> torch.Tensor:
    """Flow-matching MSE per sample [B] (fp32): mean over the latent of (v_pred - v)^2."""
    pred = predict(model, mb)
    return (pred.float() - mb.target).pow(2).mean(dim=(1, 2, 3, 4))


# ---------------------------------------------------------------------------------------------
# The timed step.


@dataclass
class StepTiming:
    gather_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    optim_s: float = 0.0
    step_s: float = 0.0
    loss_sum: float = 0.0  # sum of this rank's per-sample losses
    samples: int = 0
    tokens: int = 0
    micro_batches: int = 0
    oom: bool = False  # some rank ran out of memory: the step was abandoned on every rank


class StepRunner:
    """Runs training steps of an FSDP2 model (see the module docstring)."""

    def __init__(self, model, optimizer, device: torch.device, sync_mode: str = "timed",
                 cfg: Optional[WanConfig] = None, dtype: torch.dtype = torch.float32,
                 sync_tokens: int = 1):
        """cfg: the model's config (default ``model.cfg``; a diffusers model has none); dtype:
        the compute dtype of the inputs (that of the gradient-sync pass's batch); sync_tokens:
        the tokens of that batch (a sequence-parallel model needs one per rank of its group)."""
        from torch.distributed.fsdp import FSDPModule

        if sync_mode not in ("timed", "native"):
            raise ValueError(f"sync_mode must be 'timed' or 'native', got {sync_mode!r}")
        self.model, self.optimizer, self.device = model, optimizer, device
        self.sync_mode = sync_mode
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.replicated = replicated_params(model)
        self._dummy = None
        self._cfg = cfg if cfg is not None else getattr(model, "cfg", None)
        if self._cfg is None:
            raise ValueError(f"StepRunner: cfg is required for a {type(model).__name__} "
                             f"(it has no .cfg)")
        self._dtype = dtype
        self._sync_tokens = int(sync_tokens)

    def _dummy_batch(self) -> MicroBatch:
        """A ``sync_tokens``-token input for the gradient-sync pass (one row of patches)."""
        if self._dummy is None:
            cfg, dev, dt = self._cfg, self.device, self._dtype
            lt, lh, lw = cfg.patch
            lw *= self._sync_tokens
            self._dummy = MicroBatch(
                torch.zeros(1, cfg.in_channels, lt, lh, lw, device=dev, dtype=dt),
                torch.full((1,), 500.0, device=dev),
                torch.zeros(1, cfg.text_len, cfg.text_dim, device=dev, dtype=dt),
                torch.zeros(1, cfg.out_channels, lt, lh, lw, device=dev), [], 0)
        return self._dummy

    def _average_replicated_grads(self) -> None:
        """Gradients of the replicated parameters averaged over the ranks (as FSDP averages the
        sharded ones): one all_reduce of their concatenation. A missing gradient counts as 0."""
        if not self.replicated:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.replicated]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for p, g in zip(self.replicated, flat.split([q.numel() for q in self.replicated])):
            p.grad = g.view_as(p).to(p.dtype)

    def _set_sync(self, on: bool) -> None:
        self.model.set_requires_gradient_sync(on)
        self.model.set_reshard_after_backward(on)

    def step(self, micro_batches: Sequence[MicroBatch], loss_scale: float,
             fail_above_tokens: Optional[int] = None) -> StepTiming:
        """One optimizer step over this rank's micro-batches; gradients are the sum of
        ``loss_scale * per-sample loss`` over the micro-batches, averaged over ranks by FSDP.

        fail_above_tokens: testing hook; a micro-batch of more tokens raises an out-of-memory
        error as a real OOM would (the CPU tests use it to exercise the OOM path)."""
        dev, st = self.device, StepTiming()
        st.micro_batches = len(micro_batches)
        st.samples = sum(len(m.sample_ids) for m in micro_batches)
        st.tokens = sum(m.tokens for m in micro_batches)
        native = self.sync_mode == "native"
        synchronize(dev)
        t0 = time.perf_counter()
        handles = [unit.unshard(async_op=True) for unit in self.units]
        for h in handles:
            if h is not None:
                h.wait()
        synchronize(dev)
        t1 = time.perf_counter()
        loss_sum = torch.zeros((), device=dev)
        oom = False
        try:
            for i, mb in enumerate(micro_batches):
                if fail_above_tokens is not None and mb.tokens > fail_above_tokens:
                    raise torch.cuda.OutOfMemoryError(
                        f"simulated: {mb.tokens} tokens > fail_above_tokens {fail_above_tokens}")
                self._set_sync(native and i + 1 == len(micro_batches))
                losses = per_sample_loss(self.model, mb)
                (losses.sum() * loss_scale).backward()
                loss_sum += losses.detach().sum()
                del losses
        except torch.cuda.OutOfMemoryError:
            oom = True
        except RuntimeError as e:  # cuBLAS / attention workspaces report OOM as RuntimeError
            if "out of memory" not in str(e).lower():
                raise
            oom = True
        if oom:
            gc.collect()
        synchronize(dev)
        t2 = time.perf_counter()
        flag = torch.tensor([1.0 if oom else 0.0], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        synchronize(dev)
        t3 = time.perf_counter()
        st.gather_s, st.compute_s = t1 - t0, t2 - t1
        st.wait_s = math.nan if native else t3 - t2
        if flag.item() > 0:
            st.oom = True
            return st
        if not native or not micro_batches:
            self._set_sync(True)
            dummy = self._dummy_batch()
            (per_sample_loss(self.model, dummy).sum() * 0.0).backward()
        self._average_replicated_grads()
        synchronize(dev)
        t4 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(dev)
        t5 = time.perf_counter()
        st.sync_s, st.optim_s, st.step_s = t4 - t3, t5 - t4, t5 - t0
        if native:
            st.compute_s = t4 - t1  # forward + backward including the overlapped sync
        st.loss_sum = float(loss_sum)
        return st


def peak_memory_bytes(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
