"""Small media corpora for CPU tests, written with PyAV (shared by the prepare and train tests).

    from media_util import make_corpus, write_video, write_image
    corpus = make_corpus(tmp_path / "media", videos=24, images=12)   # + bad files by default
    corpus.good    # relative paths of the readable media, sorted
    corpus.bad     # relative path -> what is wrong with it (truncated, empty, not a video)

Every clip is a deterministic pattern (a colored square moving over a gradient; the color and
direction follow from the seed, and the sidecar caption says them), so a model can learn it.
Sizes and fps vary (see SIZES / FPS); codecs follow the extension (mp4/mkv/mov: H.264, webm:
VP9). Images: png, jpg, webp.
"""

from __future__ import annotations

import dataclasses
import os
from fractions import Fraction
from typing import Dict, List, Tuple

import av
import numpy as np

SIZES = [(32, 48), (48, 32), (64, 64), (40, 72), (24, 24), (96, 64), (36, 60), (80, 48)]
FPS = [8, 12, 24, 30, 15]
COLORS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230),
          "yellow": (230, 220, 40)}
CODECS = {".mp4": "libx264", ".mkv": "libx264", ".mov": "libx264", ".webm": "libvpx-vp9"}


def caption_of(seed: int) -> str:
    color = list(COLORS)[seed % len(COLORS)]
    direction = ("right", "down")[(seed // len(COLORS)) % 2]
    return f"a {color} square moving {direction}"


def pattern(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    """[frames, height, width, 3] uint8: a square of the seed's color moving over a gradient."""
    color = np.array(list(COLORS.values())[seed % len(COLORS)], dtype=np.float32)
    down = (seed // len(COLORS)) % 2 == 1
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 60, y / height * 60, np.full_like(x, 30)], -1)
    side = max(4, min(height, width) // 3)
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        img = base.copy()
        step = t * 2
        top = (step if down else (height - side) // 2) % max(1, height - side)
        left = ((width - side) // 2 if down else step) % max(1, width - side)
        img[top:top + side, left:left + side] = color
        out[t] = img.clip(0, 255).astype(np.uint8)
    return out


def write_video(path, frames: int, height: int, width: int, fps: int, seed: int = 0) -> None:
    """A clip of ``frames`` frames at ``fps`` (codec from the extension, yuv420p)."""
    ext = os.path.splitext(str(path))[1]
    with av.open(str(path), "w") as out:
        stream = out.add_stream(CODECS[ext], rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if ext == ".webm":
            stream.options = {"deadline": "realtime", "cpu-used": "8"}
        for img in pattern(seed, frames, height, width):
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def write_image(path, height: int, width: int, seed: int = 0) -> None:
    """One still image (format from the extension: png, jpg, webp)."""
    av_frame = av.VideoFrame.from_ndarray(pattern(seed, 1, height, width)[0], format="rgb24")
    av_frame.to_image().save(str(path))


@dataclasses.dataclass
class Corpus:
    root: str
    good: List[str]                 # relative paths, sorted
    bad: Dict[str, str]             # relative path -> what is wrong
    captions: Dict[str, str]        # relative path -> caption (good and bad)
    shapes: Dict[str, Tuple[int, int, int, float]]   # good path -> (frames, h, w, fps or 0)


def make_corpus(root, videos: int = 24, images: int = 12, bad: bool = True,
                sidecar: bool = True) -> Corpus:
    """Writes ``videos`` clips (mixed containers, sizes, fps, 5-20 frames) and ``images`` images
    under ``root`` (in two subfolders), each with a sidecar ``.txt`` caption when ``sidecar``;
    with ``bad``: a truncated mp4, an empty mp4 and a text file named .mp4 (captioned too)."""
    root = str(root)
    os.makedirs(os.path.join(root, "clips"), exist_ok=True)
    os.makedirs(os.path.join(root, "stills"), exist_ok=True)
    c = Corpus(root, [], {}, {}, {})
    exts = [".mp4", ".webm", ".mkv", ".mov"]
    for i in range(videos):
        h, w = SIZES[i % len(SIZES)]
        fps, frames = FPS[i % len(FPS)], 5 + (i * 7) % 16
        rel = f"clips/v{i:03d}{exts[i % len(exts)]}"
        write_video(os.path.join(root, rel), frames, h, w, fps, seed=i)
        c.good.append(rel)
        c.shapes[rel] = (frames, h, w, float(fps))
        c.captions[rel] = caption_of(i)
    for i in range(images):
        h, w = SIZES[(i + 3) % len(SIZES)]
        rel = f"stills/i{i:03d}{['.png', '.jpg', '.webp'][i % 3]}"
        write_image(os.path.join(root, rel), h, w, seed=100 + i)
        c.good.append(rel)
        c.shapes[rel] = (1, h, w, 0.0)
        c.captions[rel] = caption_of(100 + i)
    if bad:
        _write_bad(c)
    if sidecar:
        for rel, text in c.captions.items():
            with open(os.path.join(root, os.path.splitext(rel)[0] + ".txt"), "w") as f:
                f.write(text + "\n")
    c.good.sort()
    return c


def _write_bad(c: Corpus) -> None:
    full = os.path.join(c.root, "clips", "v000.mp4")
    with open(full, "rb") as f:
        data = f.read()
    cases = {"clips/bad_truncated.mp4": (data[:len(data) // 2], "truncated"),
             "clips/bad_empty.mp4": (b"", "empty"),
             "clips/bad_text.mp4": (b"this is not a video\n" * 4, "not a video")}
    for rel, (payload, why) in cases.items():
        with open(os.path.join(c.root, rel), "wb") as f:
            f.write(payload)
        c.bad[rel] = why
        c.captions[rel] = "a broken file"
