"""A generation request's JSON body, checked against the served pipeline, into a :class:`Request`.

:func:`parse_request` checks the names and types first (the pydantic models of :mod:`.body`),
then what depends on the pipeline (:class:`Limits`): sizes on its pixel multiple and within
``--max-size``, frames on its frame rule, ``n`` / ``steps`` / ``timeout`` within the options,
prompt embeddings of its text widths (a nested list's size bounded before it is converted, a
base64 one's from its shape), every value finite. Any error is a RequestError (400) whose
message starts with the field's name. Without text encoders a ``prompt`` gets stand-in
embeddings (``generation.stand_in_seed``: a hash of the texts; the same text, the same image, but no
encoding of it). The fields, ranges and text sources: docs/serve.md.
"""

from __future__ import annotations

import base64
import binascii
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Dict, Tuple

import numpy as np
import torch

from .body import MAX_TEXT_CHARS, validate_body
from .errors import RequestError, bad, shown

MAX_TEXT_TOKENS = 4096
MAX_SEED = 2**63 - 1
TEXT_SOURCES = ("request", "pipeline", "stand-in")
EMBED_DTYPES = {"float32": (np.float32, torch.float32), "float16": (np.float16, torch.float16),
                "bfloat16": (None, torch.bfloat16)}

IMAGE_FIELDS = {"model", "prompt", "negative_prompt", "size", "width", "height", "n", "seed",
                "steps", "guidance", "response_format", "output_format", "timeout", "async",
                "user"}
VIDEO_FIELDS = IMAGE_FIELDS | {"frames", "fps"}
EMBED_FIELDS = ("prompt_embeds", "pooled_prompt_embeds", "prompt_attention_mask")


@dataclass(frozen=True)
class Limits:
    """What the server accepts (its options) and what the pipeline needs."""

    pipeline: str  # the served pipeline's name
    video: bool
    pixel_multiple: int
    frame_step: int  # 0: images
    text_width: int  # C_text
    pooled_width: int  # C_pool, 0: none
    has_mask: bool  # prompt_attention_mask (HunyuanVideo)
    has_encoders: bool  # the pipeline's own text encoders are loaded
    default_size: Tuple[int, int, int]  # (height, width, frames)
    default_steps: int
    default_guidance: float
    max_size: int
    max_frames: int
    max_steps: int
    max_batch: int  # samples per pipeline call
    max_n: int  # samples of one request
    max_timeout_s: float
    stand_in_tokens: int  # T of stand-in embeddings


@dataclass
class Request:
    """A validated request. ``embeds``: CPU tensors [1, ...] (float32 or the sent dtype; masks
    int64); empty when ``text_source == "pipeline"`` (the pipeline encodes ``prompt``)."""

    kind: str  # "image" or "video"
    height: int
    width: int
    frames: int
    steps: int
    guidance: float
    n: int
    seed: int
    fps: int
    response_format: str
    output_format: str
    timeout_s: float
    async_: bool
    text_source: str
    prompt: str = ""
    negative_prompt: str = ""
    embeds: Dict[str, torch.Tensor] = field(default_factory=dict)
    user: str = ""

    @property
    def guided(self) -> bool:
        return self.guidance > 1

    def batch_key(self) -> tuple:
        """Requests with equal keys can run as one batch (same shape, steps, guidance and
        text length)."""
        emb = self.embeds.get("prompt_embeds")
        return (self.kind, self.height, self.width, self.frames, self.steps, self.guidance,
                self.text_source, None if emb is None else tuple(emb.shape[1:]),
                tuple(sorted(self.embeds)))


# ---- scalars ------------------------------------------------------------------------------

def _int(body: dict, name: str, lo: int, hi: int, default=None) -> int:
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise bad(name, f"expected an integer, got {_kind(v)}")
    if v < lo or v > hi:
        raise bad(name, f"{shown(v)} is out of range [{lo}, {hi}]")
    return int(v)


def _real(body: dict, name: str, lo: float, hi: float, default=None, open_lo=False) -> float:
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise bad(name, f"expected a number, got {_kind(v)}")
    v = float(v)
    if not math.isfinite(v) or v < lo or v > hi or (open_lo and v == lo):
        left = "(" if open_lo else "["
        raise bad(name, f"{v:g} is out of range {left}{lo:g}, {hi:g}]")
    return v


def _text(body: dict, name: str, limit: int) -> str:
    v = body.get(name, "")
    if not isinstance(v, str):
        raise bad(name, f"expected a string, got {_kind(v)}")
    if len(v) > limit:
        raise bad(name, f"{len(v)} characters, at most {limit}")
    return v


def _choice(body: dict, name: str, choices: Tuple[str, ...]) -> str:
    v = body.get(name, choices[0])
    if v not in choices:
        raise bad(name, f"{shown(v)} is not one of {', '.join(map(repr, choices))}")
    return v


def _kind(v) -> str:
    return "null" if v is None else type(v).__name__


def _size(body: dict, lim: Limits) -> Tuple[int, int]:
    """(height, width) from ``size`` "WxH" or ``width`` / ``height``; an error names the field
    the client gave."""
    if "size" in body and ("width" in body or "height" in body):
        raise bad("size", "give size or width and height, not both")
    dh, dw, _ = lim.default_size
    m = lim.pixel_multiple
    if "size" in body:
        s = body["size"]
        parts = s.lower().split("x") if isinstance(s, str) else []
        if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 6
                                      for p in parts):
            raise bad("size", f"{shown(s)} is not \"<width>x<height>\" (e.g. \"1024x768\")")
        w, h = int(parts[0]), int(parts[1])
        named = (("size", "height", h), ("size", "width", w))
    else:
        named = (("height", "height", _int(body, "height", m, lim.max_size, dh)),
                 ("width", "width", _int(body, "width", m, lim.max_size, dw)))
    for name, what, v in named:
        if not m <= v <= lim.max_size:
            raise bad(name, f"{what} {v} is out of range [{m}, {lim.max_size}]")
        if v % m:
            raise bad(name, f"{what} {v} is not a multiple of {m} (the pipeline's VAE factor "
                            f"times its patch size)")
    return named[0][2], named[1][2]


def _frames(body: dict, lim: Limits) -> int:
    if not lim.video:
        return 1
    f = _int(body, "frames", 1, lim.max_frames, lim.default_size[2])
    if (f - 1) % lim.frame_step:
        raise bad("frames", f"{f} is not 1 + a multiple of {lim.frame_step} (the VAE's "
                            f"temporal factor; CogVideoX: twice it)")
    return f


# ---- tensors ------------------------------------------------------------------------------

def decode_tensor(name: str, value, max_numel: int) -> torch.Tensor:
    """A tensor from a nested list or ``{"shape", "dtype", "b64"}`` (see the module), on the
    CPU; at most ``max_numel`` values, every one finite."""
    if isinstance(value, dict):
        t = _decode_b64(name, value, max_numel)
    elif isinstance(value, list):
        numel = _nested_numel(name, value, max_numel)
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError) as e:
            raise bad(name, f"not a rectangular nested list of numbers ({e})") from None
        if arr.dtype.kind not in "iuf" or arr.size != numel:
            raise bad(name, f"not a rectangular nested list of numbers (found {arr.dtype})")
        with np.errstate(over="ignore"):  # beyond float32: inf, refused below
            t = torch.from_numpy(arr.astype(np.float32))
    else:
        raise bad(name, f"expected a nested list or an object with shape, dtype and b64, "
                        f"got {_kind(value)}")
    if not bool(torch.isfinite(t).all()):
        raise bad(name, "has NaN or infinite values")
    return t


def _nested_numel(name: str, value: list, max_numel: int) -> int:
    """The values of a nested list, from the lengths along its first elements (what
    ``np.asarray`` would allocate), refused above ``max_numel`` before anything is
    converted; a ragged list is found by the conversion."""
    numel, level = 1, value
    for _ in range(5):
        if not isinstance(level, list):
            break
        numel *= len(level)
        if numel > max_numel:
            raise bad(name, f"more than {max_numel} values (at most {max_numel})")
        if not level:
            break
        level = level[0]
    else:
        raise bad(name, "not a nested list of 1-4 dimensions")
    return numel


def _decode_b64(name: str, value: dict, max_numel: int) -> torch.Tensor:
    extra = set(value) - {"shape", "dtype", "b64"}
    if extra:
        raise bad(f"{name}.{sorted(extra)[0]}", "unknown field (shape, dtype, b64)")
    shape = value.get("shape")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= 4
            or not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 1 << 20
                       for d in shape)):
        raise bad(f"{name}.shape", f"{shown(shape)} is not a list of 1-4 integers in [1, 2^20]")
    numel = math.prod(shape)
    if numel > max_numel:
        raise bad(f"{name}.shape", f"{shape} has {numel} values, at most {max_numel}")
    dtype = value.get("dtype", "float32")
    if dtype not in EMBED_DTYPES:
        raise bad(f"{name}.dtype", f"{shown(dtype)} is not one of {', '.join(EMBED_DTYPES)}")
    data = value.get("b64")
    if not isinstance(data, str):
        raise bad(f"{name}.b64", f"expected a base64 string, got {_kind(data)}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad(f"{name}.b64", f"not base64 ({e})") from None
    np_dtype, torch_dtype = EMBED_DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    if len(raw) != numel * itemsize:
        raise bad(f"{name}.b64", f"{len(raw)} bytes; shape {shape} of {dtype} is "
                                 f"{numel * itemsize}")
    if np_dtype is None:  # bfloat16: the upper halves of float32 values
        halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        arr = halves.view(np.float32)
    else:
        arr = np.frombuffer(raw, dtype=np.dtype(np_dtype).newbyteorder("<")).astype(np.float32)
    return torch.from_numpy(arr.reshape(shape).copy())


def _embeds(body: dict, lim: Limits, guided: bool) -> Dict[str, torch.Tensor]:
    """The request's prompt embeddings, checked against the model's widths."""
    prefixes = ("", "negative_") if guided else ("",)
    max_numel = MAX_TEXT_TOKENS * max(lim.text_width, 1)
    out: Dict[str, torch.Tensor] = {}
    for prefix in ("", "negative_"):
        for base in EMBED_FIELDS:
            name = prefix + base
            if name not in body:
                continue
            if prefix not in prefixes:
                raise bad(name, "given without guidance (guidance <= 1 uses no negative prompt)")
            out[name] = decode_tensor(name, body[name], max_numel)
    for prefix in prefixes:
        _check_embed_shapes(out, prefix, lim)
    return out


def _check_embed_shapes(out: Dict[str, torch.Tensor], prefix: str, lim: Limits) -> None:
    name = prefix + "prompt_embeds"
    if name not in out:
        raise bad(name, "required (the request gives prompt embeddings, and guidance > 1 "
                        "needs the negative prompt's too)" if prefix else "required")
    e = out[name]
    if e.dim() != 3 or e.shape[0] != 1 or e.shape[2] != lim.text_width:
        raise bad(name, f"shape {list(e.shape)}, expected [1, T, {lim.text_width}]")
    if not 1 <= e.shape[1] <= MAX_TEXT_TOKENS:
        raise bad(name, f"{e.shape[1]} tokens, expected [1, {MAX_TEXT_TOKENS}]")
    if prefix and e.shape[1] != out["prompt_embeds"].shape[1]:
        raise bad(name, f"{e.shape[1]} tokens; prompt_embeds has {out['prompt_embeds'].shape[1]} "
                        f"(the two must have the same length)")
    pooled = prefix + "pooled_prompt_embeds"
    if lim.pooled_width:
        p = out.get(pooled)
        if p is None:
            raise bad(pooled, f"required by {lim.pipeline} with {name}")
        if list(p.shape) != [1, lim.pooled_width]:
            raise bad(pooled, f"shape {list(p.shape)}, expected [1, {lim.pooled_width}]")
    elif pooled in out:
        raise bad(pooled, f"{lim.pipeline} takes no pooled embeddings")
    mask = prefix + "prompt_attention_mask"
    if lim.has_mask:
        m = out.get(mask)
        if m is None:
            m = torch.ones(1, e.shape[1])
        if list(m.shape) != [1, e.shape[1]] or not bool(((m == 0) | (m == 1)).all()):
            raise bad(mask, f"expected [1, {e.shape[1]}] of 0 and 1")
        if not bool(m.any()):
            raise bad(mask, "has no 1 (no valid text token)")
        out[mask] = m.to(torch.int64)
    elif mask in out:
        raise bad(mask, f"{lim.pipeline} takes no attention mask")


def embed_fields(lim: Limits) -> Tuple[str, ...]:
    """The prompt-embedding fields the served pipeline takes."""
    bases = ["prompt_embeds"] + (["pooled_prompt_embeds"] if lim.pooled_width else []) + (
        ["prompt_attention_mask"] if lim.has_mask else [])
    return tuple(p + b for p in ("", "negative_") for b in bases)


# ---- the request ----------------------------------------------------------------------------

def parse_request(body, kind: str, lim: Limits) -> Request:
    """``body`` (the parsed JSON) of a ``kind`` ("image" / "video") request as a Request, or a
    RequestError (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(400, f"body: expected a JSON object, got {_kind(body)}",
                           code="invalid_body")
    endpoint = "videos" if lim.video else "images"
    if (kind == "video") != lim.video:
        raise RequestError(400, f"this server runs {lim.pipeline}, "
                                f"{'a video' if lim.video else 'an image'} pipeline: use "
                                f"POST /v1/{endpoint}/generations", code="wrong_endpoint")
    allowed = (VIDEO_FIELDS if lim.video else IMAGE_FIELDS) | set(embed_fields(lim))
    validate_body(body, lim.video, allowed)  # names and types; the ranges below
    if "model" in body and body["model"] != lim.pipeline:
        raise bad("model", f"{shown(body['model'])}: this server runs {lim.pipeline!r}")
    height, width = _size(body, lim)
    frames = _frames(body, lim)
    n = _int(body, "n", 1, lim.max_n, 1)
    seed = (_int(body, "seed", 0, MAX_SEED - n + 1) if "seed" in body
            else int.from_bytes(os.urandom(8), "big") >> 2)
    steps = _int(body, "steps", 1, lim.max_steps, lim.default_steps)
    guidance = _real(body, "guidance", 0.0, 100.0, lim.default_guidance)
    fps = _int(body, "fps", 1, 120, 16) if lim.video else 0
    response_format = _choice(body, "response_format", ("b64_json", "url"))
    output_format = _choice(body, "output_format", ("mp4", "gif") if lim.video else ("png",))
    timeout = _real(body, "timeout", 0.0, lim.max_timeout_s, lim.max_timeout_s, open_lo=True)
    async_ = body.get("async", False)
    if not isinstance(async_, bool):
        raise bad("async", f"expected true or false, got {_kind(async_)}")
    prompt = _text(body, "prompt", MAX_TEXT_CHARS)
    negative = _text(body, "negative_prompt", MAX_TEXT_CHARS)
    user = _text(body, "user", 256)
    req = Request(kind, height, width, frames, steps, guidance, n, seed, fps, response_format,
                  output_format, timeout, async_, "request", prompt, negative, user=user)
    _text_source(body, req, lim)
    return req


def _text_source(body: dict, req: Request, lim: Limits) -> None:
    """Fills ``req.embeds`` / ``req.text_source`` (see the module)."""
    has_embeds = any(p + b in body for p in ("", "negative_") for b in EMBED_FIELDS)
    if has_embeds:
        if "prompt" in body or "negative_prompt" in body:
            raise bad("prompt", "give prompt text or prompt_embeds, not both")
        req.embeds = _embeds(body, lim, req.guided)
        return
    if "prompt" not in body:
        raise bad("prompt", "required (or prompt_embeds)")
    if "negative_prompt" in body and not req.guided:
        raise bad("negative_prompt", "given without guidance (guidance <= 1)")
    req.text_source = "pipeline" if lim.has_encoders else "stand-in"
