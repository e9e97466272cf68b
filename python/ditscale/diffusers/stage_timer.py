"""Seconds per stage of one diffusers pipeline call, for the example's table and the server's
``timings``.

:class:`StageTimer` measures, around ``pipe(...)`` (``with timer.attach(pipe):``), the text
encoding (inside ``pipe.encode_prompt``), the denoising loop (from the first transformer
forward to the last step callback) and each step, the VAE decode (inside ``pipe.vae.decode``),
and around the caller's own work (``with timer.stage("output_encoding"):``). On CUDA every
boundary synchronizes the device first, so a stage's seconds are its kernels' too. The keys of
:meth:`StageTimer.as_dict` are :data:`KEYS`; see docs/diffusers/pipelines.md (per-stage timings).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, List, Optional

import torch

# as_dict()'s keys: seconds per stage, "steps" a list of seconds per denoising step.
KEYS = ("text_encoding", "denoising", "steps", "vae_decode", "other", "pipeline",
        "output_encoding")


class StageTimer:
    """Seconds per stage of pipeline calls on ``device`` (see the module)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.seconds: Dict[str, float] = {}
        self.steps: List[float] = []
        self._denoise_start: Optional[float] = None
        self._last: Optional[float] = None

    def now(self) -> float:
        """``time.perf_counter()`` after the device's queued work is done."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def stage(self, name: str):
        """Adds the seconds the ``with`` block takes to stage ``name``."""
        begin = self.now()
        try:
            yield self
        finally:
            self._add(name, self.now() - begin)

    def _timed(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            with self.stage(name):
                return fn(*args, **kwargs)
        return timed

    def _denoise_begins(self, module, args) -> None:
        if self._denoise_start is None:
            self._denoise_start = self._last = self.now()

    @contextlib.contextmanager
    def attach(self, pipe):
        """Times the pipeline calls made inside the ``with`` block (``pipeline``: the block's
        seconds); ``pipe`` gets its own methods and hooks back at the end. Pass
        :meth:`step_callback` as the call's ``callback_on_step_end`` for the steps."""
        patched = [(pipe, "encode_prompt", "text_encoding"), (pipe.vae, "decode", "vae_decode")]
        saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in patched]
        models = [getattr(pipe, k, None) for k in ("transformer", "transformer_2")]
        hooks = [m.register_forward_pre_hook(self._denoise_begins)
                 for m in models if isinstance(m, torch.nn.Module)]
        for obj, attr, name in patched:
            object.__setattr__(obj, attr, self._timed(name, getattr(obj, attr)))
        begin = self.now()
        try:
            yield self
        finally:
            self._add("pipeline", self.now() - begin)
            for hook in hooks:
                hook.remove()
            for obj, attr, old in saved:
                if old is None:
                    object.__delattr__(obj, attr)
                else:
                    object.__setattr__(obj, attr, old)

    def step_callback(self, inner: Optional[Callable] = None) -> Callable:
        """A ``callback_on_step_end`` recording each step's seconds (the first from the first
        transformer forward), then calling ``inner(pipe, step, timestep, callback_kwargs)``
        (whose return value it returns; ``inner``'s own time counts as denoising, not as a
        step)."""
        def callback(pipe, step: int, timestep, callback_kwargs):
            now = self.now()
            if self._last is not None:
                self.steps.append(now - self._last)
            out = callback_kwargs if inner is None else inner(pipe, step, timestep,
                                                              callback_kwargs)
            self._last = now if inner is None else self.now()
            if self._denoise_start is not None:
                self.seconds["denoising"] = self._last - self._denoise_start
            return out
        return callback

    def as_dict(self) -> dict:
        """The timings so far: ``text_encoding``, ``denoising`` (the loop: its steps and the
        step callbacks), ``vae_decode``, ``output_encoding`` (what the caller timed as such),
        ``pipeline`` (the whole call), ``other`` (the call's rest: latents, timesteps,
        post-processing to arrays), in seconds, and ``steps`` (seconds per denoising step).
        Stages that did not run are absent."""
        out = dict(self.seconds)
        if "pipeline" in out:
            inside = sum(out.get(k, 0.0) for k in ("text_encoding", "denoising", "vae_decode"))
            out["other"] = max(0.0, out["pipeline"] - inside)
        if self.steps:
            out["steps"] = list(self.steps)
        return {k: out[k] for k in KEYS if k in out}
