"""Decoding one sample into the pixel tensor its latent is encoded from.

``load_clip(item, probe, shape, model_fps)`` decodes the item and keeps ``shape["frames"]``
frames resampled by timestamp: output frame j is the decoded frame nearest to t_0 + j / r
(ties, within 1 ns: the earlier), with r = model_fps when the clip's fps is above it (else the
clip's own fps: no resampling) and t_0 the first frame's time. Each kept frame is resized
(bilinear, antialiased) by s = max(H_b / H, W_b / W), so that it covers the bucket H_b x W_b
with its aspect ratio kept, then center-cropped to the bucket, and scaled to [-1, 1]
(x / 127.5 - 1). Returns float32 [3, frames, H_b, W_b]. A clip that decodes differently from its probe is a
ValueError naming it. See [docs/prepare.md](../../../docs/prepare.md#frames).
"""

from __future__ import annotations

import math
from typing import List

import numpy as np
import torch
import torch.nn.functional as F

from .discover import Item
from .probe import Probe, open_media

_TIE_S = 1e-9   # frames this close to equally near a target time are a tie: the earlier wins


def target_times(probe: Probe, frames: int, t0: float, model_fps: float) -> List[float]:
    rate = model_fps if 0 < model_fps < probe.fps else probe.fps
    return [t0 + j / rate for j in range(frames)] if frames > 1 else [t0]


def resize_crop(rgb: np.ndarray, height: int, width: int) -> torch.Tensor:
    """[h, w, 3] uint8 -> [3, height, width] float32 in [-1, 1] (cover, then center crop)."""
    h, w = rgb.shape[:2]
    s = max(height / h, width / w)
    nh, nw = max(height, round(h * s)), max(width, round(w * s))
    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).unsqueeze(0).float()
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False,
                          antialias=True)
    top, left = (nh - height) // 2, (nw - width) // 2
    x = x[0, :, top:top + height, left:left + width]
    return (x.clamp(0, 255) / 127.5 - 1.0).contiguous()


def _select(frames_iter, targets: List[float], fps: float):
    """The decoded frames nearest to each target time, in order; also the decoded count."""
    chosen, prev, n = [], None, 0
    for frame in frames_iter:
        t = frame.time if frame.time is not None else n / fps
        while len(chosen) < len(targets) and t >= targets[len(chosen)]:
            want = targets[len(chosen)]
            take_prev = prev is not None and want - prev[0] <= t - want + _TIE_S
            chosen.append(prev[1] if take_prev else frame)
        prev = (t, frame)
        n += 1
    while prev is not None and len(chosen) < len(targets):
        chosen.append(prev[1])    # the targets past the last frame's time (rounding)
    return chosen, n


def load_clip(item: Item, probe: Probe, shape: dict, model_fps: float) -> torch.Tensor:
    """[3, frames, height, width] float32 in [-1, 1] (see the module docstring)."""
    frames, height, width = shape["frames"], shape["height"], shape["width"]
    with open_media(item) as container:
        stream = container.streams.video[0]
        decoded = container.decode(stream)
        first = next(decoded, None)
        if first is None:
            raise ValueError(f"{item.path}: no frame decoded (the probe found {probe.num_frames})")
        t0 = first.time if first.time is not None else 0.0
        fps = probe.fps if probe.fps > 0 else 1.0

        def all_frames():
            yield first
            yield from decoded
        chosen, n = _select(all_frames(), target_times(probe, frames, t0, model_fps), fps)
    if n != probe.num_frames or len(chosen) != frames or not math.isfinite(t0):
        raise ValueError(f"{item.path}: decoded {n} frames, the probe found {probe.num_frames}")
    rgb = [resize_crop(f.to_ndarray(format="rgb24"), height, width) for f in chosen]
    return torch.stack(rgb, dim=1)
