"""One generation call of a diffusers pipeline: its arguments, its output as bytes.

Shared by ``examples/generate.py`` and ``ditscale.serve``, so that the example, the server and
a test calling the pipeline directly build the same call and get the same bits.

- :func:`shape_rule` / :func:`shape_error`: the pixel multiple and frame rule of a pipeline
  (height and width multiples of the VAE's spatial factor times the transformer's patch, SD3's
  at most its position embedding's side, Wan's sides and frames within its rotary table;
  video frames ``1 + k * t`` with ``t`` the VAE's temporal factor, twice it for CogVideoX 1.0),
  checked instead of the pipelines' own silent rounding or late failure.
- :func:`call_kwargs`: the keyword arguments of ``pipe(...)`` for a batch of samples: shape,
  steps, guidance by the pipeline's own switch, one ``torch.Generator`` per sample (seed
  ``seeds[i]``), prompt text or prompt embeddings, ``output_type="np"``.
- :func:`to_uint8`: the pipeline's float output in [0, 1] as uint8 arrays [B, H, W, 3] (images)
  or [B, F, H, W, 3] (videos), ``round(clip(x, 0, 1) * 255)`` (the rounding of diffusers'
  ``numpy_to_pil``); :func:`nonfinite` counts NaN / inf values first.
- :func:`encode_png`, :func:`encode_video`: one sample as PNG / MP4 / GIF bytes.
- :func:`timed_call`: the call timed per stage (``stage_timer.StageTimer``: text encoding,
  denoising and each step, VAE decode; the caller adds output encoding).
- :func:`has_text_encoders`, :func:`stand_in_seed`: a checkpoint saved without text encoders
  gets stand-in embeddings seeded by the prompt texts; :func:`check_output_dir`: an output
  folder checked at startup.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .stage_timer import StageTimer
from .tiny import VIDEO_PIPELINES

# The classifier-free guidance scale each pipeline uses by default (Flux and HunyuanVideo:
# true_cfg_scale, off; their distilled guidance stays on).
DEFAULT_GUIDANCE = {"flux": 1.0, "hunyuan-video": 1.0, "wan": 5.0, "wan2.2": 4.0, "sd3": 7.0,
                    "cogvideox": 6.0}

# Pipelines whose CFG switch is ``true_cfg_scale`` (the others: ``guidance_scale``).
TRUE_CFG = ("flux", "hunyuan-video")


@dataclass(frozen=True)
class ShapeRule:
    """``pixel_multiple``: height and width must be multiples of it; ``frame_step``: video
    frame counts are ``1 + k * frame_step`` (0 for an image pipeline: 1 frame);
    ``max_side``: the largest height or width the model's position table covers (0: no such
    limit); ``max_frames``: the largest frame count it covers (0: none); ``limit``: what sets
    those two (named in :func:`shape_error`'s message)."""

    pixel_multiple: int
    frame_step: int
    max_side: int = 0
    max_frames: int = 0
    limit: str = "the model's position embedding"


def _wan_rule(pipe, multiple: int, temporal: int) -> ShapeRule:
    """Wan's rotary table (``WanRotaryPosEmbed``) has ``rope_max_seq_len`` rows per axis, indexed
    by the patched latent's frames, rows and columns: ``(h / multiple) <= M`` and
    ``latent_frames // p_t <= M`` with ``latent_frames = 1 + (frames - 1) / temporal``; the
    smaller table of Wan 2.2's two transformers counts."""
    models = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
    rows = min(int(m.config.rope_max_seq_len) for m in models)
    p_t = int(pipe.transformer.config.patch_size[0])
    latent_frames = (rows + 1) * p_t - 1
    return ShapeRule(multiple, temporal, rows * multiple, 1 + (latent_frames - 1) * temporal,
                     f"Wan's rotary table, rope_max_seq_len {rows} patches per axis")


def shape_rule(name: str, pipe) -> ShapeRule:
    """The shape rule of the pipeline ``name`` (see :data:`tiny.PIPELINES`) built as ``pipe``."""
    patch = pipe.transformer.config.patch_size
    if name == "flux":
        return ShapeRule(pipe.vae_scale_factor * 2, 0)
    if name == "sd3":  # a learned position embedding of pos_embed_max_size^2 patches
        multiple = pipe.vae_scale_factor * patch
        return ShapeRule(multiple, 0, pipe.transformer.config.pos_embed_max_size * multiple)
    spatial = patch[1] if isinstance(patch, (tuple, list)) else patch
    temporal = pipe.vae_scale_factor_temporal
    multiple = pipe.vae_scale_factor_spatial * spatial
    if name in ("wan", "wan2.2"):
        return _wan_rule(pipe, multiple, temporal)
    if name == "cogvideox" and pipe.transformer.config.patch_size_t is None:
        # CogVideoX 1.0's decoder doubles the frames of each latent pair after the first of an
        # odd count: an even latent count (frames 1 + 4 * odd) comes back with extra frames
        temporal *= 2
    return ShapeRule(multiple, temporal)


def shape_error(rule: ShapeRule, height: int, width: int, frames: int) -> Optional[str]:
    """Why (height, width, frames) breaks ``rule`` (a message naming the field, its value and
    the allowed range), or None."""
    for field, value in (("height", height), ("width", width)):
        if value % rule.pixel_multiple:
            return (f"{field} {value} is not a multiple of {rule.pixel_multiple} (the VAE's "
                    f"spatial factor times the transformer's patch size)")
    for field, value in (("height", height), ("width", width)):
        if rule.max_side and value > rule.max_side:
            return (f"{field} {value} is above {rule.max_side}: out of range "
                    f"[{rule.pixel_multiple}, {rule.max_side}] (the largest side covered by "
                    f"{rule.limit})")
    if rule.frame_step == 0 and frames != 1:
        return f"frames {frames}: an image pipeline makes 1 frame"
    if rule.frame_step and (frames - 1) % rule.frame_step:
        return (f"frames {frames} is not 1 + a multiple of {rule.frame_step} (the VAE's "
                f"temporal factor; CogVideoX 1.0: twice it)")
    if rule.max_frames and frames > rule.max_frames:
        return (f"frames {frames} is above {rule.max_frames}: out of range "
                f"[1, {rule.max_frames}] (the most frames covered by {rule.limit})")
    return None


def guidance_kwarg(name: str) -> str:
    """The pipeline argument carrying the CFG scale of ``name``."""
    return "true_cfg_scale" if name in TRUE_CFG else "guidance_scale"


def generators(seeds: Sequence[int], device: torch.device) -> List[torch.Generator]:
    """One generator per sample, seeded ``seeds[i]`` (on ``device``: the latents' RNG)."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def call_kwargs(name: str, *, height: int, width: int, frames: int, steps: int,
                guidance: float, seeds: Sequence[int], device: torch.device,
                text: Optional[Dict[str, List[str]]] = None,
                embeds: Optional[Dict[str, torch.Tensor]] = None) -> dict:
    """The keyword arguments of ``pipe(...)`` for ``len(seeds)`` samples.

    ``text``: ``{"prompt": [...], "negative_prompt": [...]}`` (one string per sample; the
    pipeline's encoders run), or ``embeds``: the pipeline's ``*prompt_embeds`` arguments with
    ``len(seeds)`` rows each. A single sample gets a single generator (as a plain pipeline call
    with ``generator=torch.Generator().manual_seed(seed)``: the same latents either way)."""
    gens = generators(seeds, device)
    kw = dict(height=height, width=width, num_inference_steps=steps, output_type="np",
              generator=gens[0] if len(gens) == 1 else gens)
    if name in VIDEO_PIPELINES:
        kw["num_frames"] = frames
    kw[guidance_kwarg(name)] = guidance
    if text is not None:
        kw["prompt"] = text["prompt"]
        if guidance > 1 and "negative_prompt" in text:
            kw["negative_prompt"] = text["negative_prompt"]
    if embeds is not None:
        kw.update(embeds)
    return kw


def timed_call(pipe, kwargs: dict, device, on_step=None) -> Tuple[object, StageTimer]:
    """``pipe(**kwargs)`` timed per stage: (its output, the :class:`StageTimer`). ``on_step``:
    the caller's ``callback_on_step_end`` (called after each step is timed). The caller adds
    its own stages (``with timer.stage("output_encoding"): ...``); ``timer.as_dict()`` then
    gives seconds per stage: ``text_encoding``, ``denoising`` (and ``steps``: a list, one per
    step), ``vae_decode``, ``other`` (latents, timesteps, post-processing), ``pipeline`` (the
    whole call), ``output_encoding`` (see ``stage_timer.KEYS``)."""
    timer = StageTimer(device)
    with timer.attach(pipe):
        out = pipe(**kwargs, callback_on_step_end=timer.step_callback(on_step))
    return out, timer


def has_text_encoders(pipe, where: str) -> bool:
    """True when every text encoder and tokenizer of ``pipe`` is loaded, False when none is
    (prompts then get stand-in embeddings: :func:`stand_in_seed`); a checkpoint with some but
    not all of them (e.g. CLIP without T5) is a ValueError naming ``where`` and the missing
    ones, since every prompt would fail inside the pipeline."""
    parts = {k: v is not None for k, v in pipe.components.items()
             if k.startswith(("text_encoder", "tokenizer"))}
    if parts and all(parts.values()):
        return True
    if any(parts.values()):
        missing = sorted(k for k, present in parts.items() if not present)
        raise ValueError(f"{where}: the checkpoint has some of the pipeline's text encoders / "
                         f"tokenizers but not {', '.join(missing)}: give all of them, or none "
                         f"(prompts then get stand-in embeddings)")
    return False


def stand_in_seed(prompt: str, negative: str) -> int:
    """The seed of a prompt's stand-in embeddings (``tiny.make_prompt_embeds``) when the
    pipeline has no text encoders: 63 bits of SHA-256 of the two texts (UTF-8), so that the
    same texts give the same output in the example and the server."""
    digest = hashlib.sha256(prompt.encode() + b"\0" + negative.encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def check_output_dir(name: str, path: str) -> str:
    """``path`` as an absolute folder that exists (created if missing) and takes new files (a
    temporary file is created and removed there), else a ValueError naming the option
    ``name``, the path and why (a file in the way, a read-only or virtual file system such
    as /proc, no permission)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"{name}: {path!r} is not a folder path")
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ditscale-write-check-"):
            pass
    except OSError as e:
        why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) \
            else (e.strerror or str(e))
        raise ValueError(f"{name}: {path!r} is not a folder where files can be written "
                         f"({why})") from e
    return path


def output_array(out, video: bool) -> np.ndarray:
    """The pipeline's output (``output_type="np"``) as one float array [B, H, W, 3] or
    [B, F, H, W, 3]."""
    arr = out.frames if video else out.images
    if isinstance(arr, torch.Tensor):
        arr = arr.float().cpu().numpy()
    return np.asarray(arr)


def nonfinite(array: np.ndarray) -> int:
    """How many values of ``array`` are NaN or infinite."""
    return int(array.size - np.count_nonzero(np.isfinite(array)))


def to_uint8(array: np.ndarray) -> np.ndarray:
    """Float output in [0, 1] as uint8: ``round(clip(x, 0, 1) * 255)``."""
    return (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_png(image: np.ndarray, level: int = 1) -> bytes:
    """An image [H, W, 3] uint8 as PNG bytes (zlib ``level`` 0-9: 1 is fast, 9 small)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=level)
    return buf.getvalue()


def encode_video(frames: np.ndarray, fps: int, fmt: str) -> bytes:
    """A video [F, H, W, 3] uint8 as ``fmt`` ("mp4": H.264 through imageio-ffmpeg, or "gif")
    bytes. MP4 without imageio-ffmpeg is an ImportError naming the package."""
    import imageio

    if fmt == "gif":
        buf = io.BytesIO()
        imageio.mimwrite(buf, list(frames), format="GIF", duration=1000.0 / fps, loop=0)
        return buf.getvalue()
    if fmt != "mp4":
        raise ValueError(f"encode_video: format {fmt!r} is not mp4 or gif")
    try:
        import imageio_ffmpeg  # noqa: F401  (the MP4 writer's backend)
    except ImportError as e:
        raise ImportError("encode_video: MP4 needs the imageio-ffmpeg package "
                          "(pip install imageio-ffmpeg), or ask for gif") from e
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        imageio.mimwrite(path, list(frames), fps=fps, codec="libx264", macro_block_size=1)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def init_distributed(device: str, timeout_s: float = 600.0) -> torch.device:
    """One process per rank under torchrun (NCCL on "cuda", gloo on "cpu"; collectives wait at
    most ``timeout_s`` seconds), a single process otherwise. Returns this rank's device."""
    import datetime

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available (use --device cpu)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if device == "cuda":
            dist.init_process_group("nccl", device_id=dev, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return dev
