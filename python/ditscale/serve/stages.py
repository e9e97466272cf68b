"""Seconds per stage of one pipeline call on this rank: text encoding, each denoising step,
the VAE decode (the server adds output encoding, :mod:`.server`).

:class:`StageTimer` wraps the pipeline's ``encode_prompt`` and ``vae.decode`` for the call
(instance attributes, restored after: the classes are not touched), opens a step at the
transformer's first forward after the previous step's end and closes it at the step callback.
On CUDA every boundary synchronizes the device (the seconds are the GPU's, not the launch's).
``timings()``: ``{"text_encoding_s", "denoising_s", "denoising_steps_s": [...],
"vae_decode_s"}``. The response's ``timings`` and the histograms: docs/serve.md.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import List, Optional

import torch


class StageTimer:
    def __init__(self, pipe):
        self.pipe = pipe
        self.cuda = pipe.transformer.device.type == "cuda"
        self.text_s, self.decode_s = 0.0, 0.0
        self.steps: List[float] = []
        self._step_begin: Optional[float] = None

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _timed(self, fn, attr: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            begin = self._now()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, attr, getattr(self, attr) + self._now() - begin)
        return wrapper

    def _forward_pre(self, module, args, kwargs):
        if self._step_begin is None:
            self._step_begin = self._now()

    def step_end(self) -> None:
        """The step callback's mark: the step opened by the transformer's forward ends."""
        if self._step_begin is not None:
            self.steps.append(self._now() - self._step_begin)
            self._step_begin = None

    @contextlib.contextmanager
    def measure(self):
        """Times the stages of the pipeline calls made inside."""
        patches = [(self.pipe, "encode_prompt", "text_s"), (self.pipe.vae, "decode", "decode_s")]
        saved = []
        for obj, name, attr in patches:
            if not hasattr(obj, name):  # a pipeline without the stage: 0 s
                continue
            own = obj.__dict__.get(name)  # an instance's own wrapper stays under ours
            saved.append((obj, name, own))
            obj.__dict__[name] = self._timed(getattr(obj, name), attr)
        hook = self.pipe.transformer.register_forward_pre_hook(self._forward_pre,
                                                               with_kwargs=True)
        try:
            yield self
        finally:
            hook.remove()
            for obj, name, own in saved:
                if own is None:
                    del obj.__dict__[name]
                else:
                    obj.__dict__[name] = own

    def timings(self) -> dict:
        return {"text_encoding_s": round(self.text_s, 6),
                "denoising_s": round(sum(self.steps), 6),
                "denoising_steps_s": [round(s, 6) for s in self.steps],
                "vae_decode_s": round(self.decode_s, 6)}
