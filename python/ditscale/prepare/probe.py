"""Probing a media item with PyAV: frames, height, width, fps, or the reason it is unusable.

Every frame is decoded (the count is the decoded one, not the container's claim, so a file that
probes good decodes again the same way when it is encoded). A bad file is a ``str`` reason, never
an exception: empty, unreadable, no video stream, a decode error, zero frames, too large.
``open_media`` opens an item (a file, or a byte range of a WebDataset tar) for PyAV.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Union

import av

from .discover import Item

MAX_PIXELS = 1 << 26            # height * width of one frame (8192 x 8192)
MAX_MEMBER_BYTES = 4 << 30      # a tar member read into memory
MIN_VIDEO_FPS = 1e-3            # the manifest's video fps range [1e-3, 1e6]
MAX_VIDEO_FPS = 1e6


@dataclasses.dataclass(frozen=True)
class Probe:
    num_frames: int     # decoded frames (1: an image)
    height: int         # pixels
    width: int
    fps: float          # frames per second; 0 for an image (or a one-frame video)


def open_media(item: Item):
    """av.open of the item (a path, or the tar member's bytes, bounded by MAX_MEMBER_BYTES)."""
    if item.offset is None:
        return av.open(item.file)
    if item.size > MAX_MEMBER_BYTES:
        raise ValueError(f"tar member of {item.size} bytes is over {MAX_MEMBER_BYTES}")
    with open(item.file, "rb") as f:
        f.seek(item.offset)
        data = f.read(item.size)
    return av.open(io.BytesIO(data))


def _error(e: Exception) -> str:
    if isinstance(e, av.FFmpegError):   # strerror: the message without the file's path
        return e.strerror or type(e).__name__
    return f"{type(e).__name__}: {e}"


def _size(item: Item) -> int:
    return item.size if item.offset is not None else os.path.getsize(item.file)


def _video_fps(stream) -> float:
    rate = stream.average_rate or stream.guessed_rate
    return float(rate) if rate else 0.0


def _count(container, stream) -> Union[int, str]:
    n = 0
    for frame in container.decode(stream):
        if frame.width != stream.codec_context.width or frame.height != stream.codec_context.height:
            return f"frame {n} is {frame.height}x{frame.width}, the stream's first " \
                   f"{stream.codec_context.height}x{stream.codec_context.width}"
        n += 1
    return n


def probe(item: Item) -> Union[Probe, str]:
    """The item's Probe, or the reason it cannot be used."""
    if not os.path.isfile(item.file):
        return "no such file"
    try:
        if _size(item) == 0:
            return "empty file"
        with open_media(item) as container:
            if not container.streams.video:
                return "no video stream"
            stream = container.streams.video[0]
            h, w = stream.codec_context.height, stream.codec_context.width
            if h < 1 or w < 1 or h * w > MAX_PIXELS:
                return f"frame size {h}x{w} is out of range (1 to {MAX_PIXELS} pixels)"
            n = _count(container, stream)
    except Exception as e:  # noqa: BLE001 (whatever a file makes the decoder raise: a bad file)
        return f"unreadable: {_error(e)}"
    if isinstance(n, str):
        return n
    if n == 0:
        return "no decodable frame"
    if item.is_image or n == 1:
        return Probe(1 if item.is_image else n, h, w, 0.0) if n == 1 else \
            f"an image file with {n} frames"
    fps = _video_fps(stream)
    if not MIN_VIDEO_FPS <= fps <= MAX_VIDEO_FPS:
        return f"fps {fps:.6g} is out of range [{MIN_VIDEO_FPS:g}, {MAX_VIDEO_FPS:g}]"
    return Probe(n, h, w, fps)
