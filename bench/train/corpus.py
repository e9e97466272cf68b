"""A generated media corpus at scale for the training benchmark: 480p and 720p clips and images.

The media and captions are those of the prepare / train tests (``tests/python/media_util.py``:
a colored square moving over a gradient, caption saying its color and direction, H.264 / VP9
by extension), imported from there rather than copied; only the sizes and counts differ. Sizes
per scale (``SCALES``): ``full`` the real 480p / 720p resolutions (Wan 2.1's 832x480 and
1280x720), ``small`` the same mix at a few dozen pixels for CPU dry runs. Files are written by
``jobs`` processes; the result is the same for any ``jobs``. See bench/README.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import multiprocessing
import os
import sys
from typing import Dict, List, Tuple

from bench.common import REPO
from ditscale._checks import check_int

# scale -> kind -> (height, width); images take the 480p size and its portrait.
SCALES: Dict[str, Dict[str, Tuple[int, int]]] = {
    "full": {"480p": (480, 832), "720p": (720, 1280), "image": (480, 832),
             "image-portrait": (832, 480)},
    "small": {"480p": (24, 40), "720p": (36, 64), "image": (24, 40), "image-portrait": (40, 24)},
}
FPS = (16, 24, 30)              # clip i: FPS[i % 3]
EXTS = (".mp4", ".mp4", ".webm", ".mkv")
MAX_FILES = 100_000
MAX_FRAMES = 1025


def media_util():
    """tests/python/media_util.py as a module (the tests' corpus writer), loaded once."""
    mod = sys.modules.get("media_util")
    if mod is None:
        path = REPO / "tests" / "python" / "media_util.py"
        spec = importlib.util.spec_from_file_location("media_util", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["media_util"] = mod
        spec.loader.exec_module(mod)
    return mod


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """How many of each kind, frames per clip, the size scale."""

    videos_480p: int
    videos_720p: int
    images: int
    frames: int
    scale: str = "full"

    def __post_init__(self):
        check_int("--videos-480p", self.videos_480p, 0, MAX_FILES)
        check_int("--videos-720p", self.videos_720p, 0, MAX_FILES)
        check_int("--images", self.images, 0, MAX_FILES)
        check_int("--frames", self.frames, 2, MAX_FRAMES)
        if self.videos_480p + self.videos_720p + self.images < 1:
            raise ValueError("corpus: --videos-480p + --videos-720p + --images is 0; at least 1")
        if self.scale not in SCALES:
            raise ValueError(f"--scale: {self.scale!r} is not one of {', '.join(SCALES)}")

    def jobs(self) -> List[tuple]:
        """(relative path, kind, frames, height, width, fps, seed) of every file."""
        sizes, out = SCALES[self.scale], []
        for i in range(self.videos_480p + self.videos_720p):
            kind = "480p" if i < self.videos_480p else "720p"
            h, w = sizes[kind]
            out.append((f"clips/{kind}-{i:05d}{EXTS[i % len(EXTS)]}", kind, self.frames, h, w,
                        FPS[i % len(FPS)], i))
        for i in range(self.images):
            kind = "image" if i % 4 else "image-portrait"
            h, w = sizes[kind]
            out.append((f"stills/i{i:05d}{('.png', '.jpg', '.webp')[i % 3]}", kind, 1, h, w, 0,
                        100_000 + i))
        return out


def _write(root: str, job: tuple) -> str:
    rel, kind, frames, h, w, fps, seed = job
    mu = media_util()
    path = os.path.join(root, rel)
    if kind.startswith("image"):
        mu.write_image(path, h, w, seed=seed)
    else:
        mu.write_video(path, frames, h, w, fps, seed=seed)
    with open(os.path.splitext(path)[0] + ".txt", "w") as f:
        f.write(mu.caption_of(seed) + "\n")
    return kind


def write_corpus(root: str, spec: CorpusSpec, jobs: int = 1) -> Dict[str, int]:
    """Writes the corpus under ``root`` (clips/, stills/, a sidecar .txt each) with ``jobs``
    processes; returns the count per kind."""
    check_int("--jobs", jobs, 1, 1024)
    for sub in ("clips", "stills"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    todo = spec.jobs()
    if jobs == 1:
        kinds = [_write(root, j) for j in todo]
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            kinds = pool.starmap(_write, [(root, j) for j in todo], chunksize=1)
    counts: Dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    return counts
