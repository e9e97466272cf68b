"""What every rank runs for one batch: the pipeline call, and its result checked.

:class:`RunSpec` (built by rank 0 from a batch of jobs, sent to every rank): the shape, steps,
guidance, one seed per sample, and the text: prompt strings (the pipeline's encoders), the
requests' prompt embeddings of ``len(seeds)`` rows (CPU tensors; moved to the transformer's
device and dtype on each rank), or one stand-in seed per sample (each rank makes the stand-in
embeddings itself, cached). :func:`execute` calls the pipeline with them and returns the samples as
uint8 [B, H, W, 3] (images) or [B, F, H, W, 3] (videos), or raises :class:`RunFailure` with
the HTTP status and code the jobs fail with.

:class:`StepControl` is the pipeline's ``callback_on_step_end``: after each denoising step
rank 0 decides (all the batch's jobs cancelled or past their deadline, or the server's
shutdown grace spent: stop) and broadcasts the decision over the control group, and every rank
stops at the same step (:class:`Stopped`), so that no rank is left waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from ..diffusers import generation, tiny
from ..diffusers.generation import stand_in_seed
from .group import GroupBroken
from ..diffusers.stage_timer import StageTimer
from .schema import Request

STAND_IN_CACHE = 8
STOP_NONE, STOP_CANCEL, STOP_TIMEOUT, STOP_SHUTDOWN = 0, 1, 2, 3


@dataclass
class RunSpec:
    kind: str
    height: int
    width: int
    frames: int
    steps: int
    guidance: float
    seeds: List[int]
    text: Optional[Dict[str, List[str]]] = None  # the pipeline's encoders: one text per sample
    embeds: Dict[str, torch.Tensor] = field(default_factory=dict)  # the requests' embeddings
    stand_in: List[int] = field(default_factory=list)  # stand-in embeddings: a seed per sample
    stand_in_tokens: int = 0
    requests: int = 1  # how many requests the batch holds (reported in each result)


class Stopped(Exception):
    """Every rank leaves the pipeline at the same step: ``reason`` one of STOP_*."""

    def __init__(self, reason: int):
        super().__init__(f"stopped ({reason})")
        self.reason = reason


class RunFailure(Exception):
    """A batch that failed on a rank: HTTP ``status``, ``code``, message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@functools.lru_cache(maxsize=STAND_IN_CACHE)
def _stand_in(pipe, tokens: int, guided: bool, seed: int) -> Dict[str, torch.Tensor]:
    return tiny.make_prompt_embeds(pipe, tokens, batch=1, negative=guided, seed=seed)


def stand_in_embeds(pipe, seeds: List[int], tokens: int, guided: bool) -> Dict[str, torch.Tensor]:
    """The stand-in embeddings of a batch (see ``schema``), one row per sample's seed
    (``generation.stand_in_seed`` of its texts), on the transformer's device and dtype (masks
    int64). Every rank makes them itself (nothing to send); the last STAND_IN_CACHE prompts'
    are kept, so that a repeated prompt costs nothing."""
    rows = [_stand_in(pipe, tokens, guided, s) for s in seeds]
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}  # a copy: the cache's stay


def build_spec(requests: List[Request], stand_in_tokens: int) -> RunSpec:
    """The batch of ``requests`` (equal ``batch_key``) as one RunSpec: request r's sample i
    has seed ``r.seed + i`` and r's text."""
    first = requests[0]
    seeds = [r.seed + i for r in requests for i in range(r.n)]
    spec = RunSpec(first.kind, first.height, first.width, first.frames, first.steps,
                   first.guidance, seeds, requests=len(requests))
    if first.text_source == "pipeline":
        spec.text = {"prompt": [r.prompt for r in requests for _ in range(r.n)],
                     "negative_prompt": [r.negative_prompt for r in requests for _ in range(r.n)]}
    elif first.text_source == "stand-in":
        spec.stand_in = [stand_in_seed(r.prompt, r.negative_prompt) for r in requests
                         for _ in range(r.n)]
        spec.stand_in_tokens = stand_in_tokens
    else:
        parts: Dict[str, List[torch.Tensor]] = {}
        for r in requests:
            for k, v in r.embeds.items():
                parts.setdefault(k, []).append(v.expand(r.n, *v.shape[1:]))
        spec.embeds = {k: torch.cat(v) for k, v in parts.items()}
    return spec


def _device_embeds(pipe, embeds: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    device, dtype = pipe.transformer.device, pipe.transformer.dtype
    return {k: v.to(device=device, dtype=v.dtype if v.dtype == torch.int64 else dtype)
            for k, v in embeds.items()}


def spec_embeds(pipe, spec: RunSpec) -> Optional[Dict[str, torch.Tensor]]:
    """The prompt embeddings of ``spec`` on the pipeline's device (None: the pipeline encodes
    ``spec.text``)."""
    if spec.stand_in:
        return stand_in_embeds(pipe, spec.stand_in, spec.stand_in_tokens, spec.guidance > 1)
    if spec.embeds:
        return _device_embeds(pipe, spec.embeds)
    return None


def _data_plane_failure(e: Exception) -> bool:
    """True for a collective of the pipeline's own group that failed (a peer gone, its
    timeout): the group is broken, not this batch alone."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(w in text for w in (
        "gloo", "Gloo", "Timed out", "timed out", "Connection reset", "Connection closed"))


def execute(pipe, name: str, spec: RunSpec, control: Callable,
            timer: Optional[StageTimer] = None) -> np.ndarray:
    """Runs ``spec`` on this rank's ``pipe`` (the pipeline ``name``); returns the uint8
    samples. Raises Stopped (from ``control``), GroupBroken (a collective of the pipeline
    failed: noticed within one group timeout) or RunFailure. ``timer``: times the stages
    (:func:`stage_seconds`)."""
    device = pipe.transformer.device
    timer = timer or StageTimer(device)
    try:
        kw = generation.call_kwargs(
            name, height=spec.height, width=spec.width, frames=spec.frames, steps=spec.steps,
            guidance=spec.guidance, seeds=spec.seeds, device=device, text=spec.text,
            embeds=spec_embeds(pipe, spec))
        with timer.attach(pipe):
            out = pipe(**kw, callback_on_step_end=timer.step_callback(control))
    except (Stopped, GroupBroken):  # every rank stops at this step / the group is gone
        raise
    except torch.OutOfMemoryError as e:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise RunFailure(500, "out_of_memory", f"out of memory on the device: "
                                               f"{str(e).splitlines()[0]}") from None
    except Exception as e:  # the pipeline's own failure: this batch fails, the group serves on
        if _data_plane_failure(e):
            raise GroupBroken(f"a collective of the pipeline failed: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''} (a rank died or "
                              f"stopped answering)") from e
        raise RunFailure(500, "generation_failed",
                         f"the pipeline failed: {type(e).__name__}: {e}") from None
    array = generation.output_array(out, spec.kind == "video")
    bad = generation.nonfinite(array)
    if bad:
        raise RunFailure(500, "nonfinite", f"the output has {bad} NaN or infinite values of "
                                           f"{array.size} (numerical overflow in the model)")
    return generation.to_uint8(array)


def stage_seconds(timer: StageTimer) -> dict:
    """A call's stages as the response's ``timings`` name them (seconds; docs/serve.md)."""
    d = timer.as_dict()
    return {"text_encoding_s": round(d.get("text_encoding", 0.0), 6),
            "denoising_s": round(d.get("denoising", 0.0), 6),
            "denoising_steps_s": [round(s, 6) for s in d.get("steps", [])],
            "vae_decode_s": round(d.get("vae_decode", 0.0), 6)}


def split_spec(spec: RunSpec, max_samples: int) -> List[RunSpec]:
    """``spec`` as pipeline calls of at most ``max_samples`` samples each (a request's ``n``
    above ``--max-batch`` runs as several calls, its seeds in order)."""
    if len(spec.seeds) <= max_samples:
        return [spec]
    parts = []
    for lo in range(0, len(spec.seeds), max_samples):
        rows = slice(lo, lo + max_samples)
        parts.append(dataclasses.replace(
            spec, seeds=spec.seeds[rows],
            text=None if spec.text is None else {k: v[rows] for k, v in spec.text.items()},
            embeds={k: v[rows] for k, v in spec.embeds.items()},
            stand_in=spec.stand_in[rows]))
    return parts


def digest(array: np.ndarray) -> str:
    """SHA-256 of the samples' bytes (the ranks compare it: every rank's output is rank 0's)."""
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
