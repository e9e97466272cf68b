"""A generation request's JSON body as pydantic models: field names and types (and the answers).

:class:`ImageBody` / :class:`VideoBody` (strict types: no "2" for 2, no 2.0 for an integer,
unknown fields refused, text valid Unicode) are what ``/openapi.json`` publishes and what
:func:`validate_body` checks first; the ranges that depend on the served pipeline (sizes,
steps, ``n``, widths of prompt embeddings) are checked after, by :mod:`.schema`. A pydantic
error becomes the server's one error body: 400 naming the field (:data:`MESSAGES`, one
template per pydantic error type). The answers' models (:class:`GenerationResult`,
:class:`JobView`, :class:`ErrorBody`) document ``/openapi.json``; the tests check real
answers against them. The fields and their ranges: docs/serve.md.
"""

from __future__ import annotations

from typing import Any, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import RequestError, bad, shown

MAX_TEXT_CHARS = 10_000
MAX_USER_CHARS = 256


class EmbedB64(BaseModel):
    """A tensor as little-endian bytes in base64, of ``shape`` and ``dtype``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    shape: List[int] = Field(description="1-4 dimensions, each in [1, 2^20]")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    b64: str


Embed = Union[List[Any], EmbedB64]  # a nested list of numbers, or base64 bytes


class ImageBody(BaseModel):
    """``POST /v1/images/generations`` (OpenAI's ``images.generate`` fields, and more)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    model: Optional[str] = Field(None, description="the served pipeline's name")
    prompt: Optional[str] = Field(None, max_length=MAX_TEXT_CHARS)
    negative_prompt: Optional[str] = Field(None, max_length=MAX_TEXT_CHARS)
    size: Optional[str] = Field(None, description='"<width>x<height>"')
    width: Optional[int] = None
    height: Optional[int] = None
    n: Optional[int] = Field(None, description="samples; seed + i for sample i")
    seed: Optional[int] = None
    steps: Optional[int] = None
    guidance: Optional[float] = None
    response_format: Optional[Literal["b64_json", "url"]] = None
    output_format: Optional[str] = None
    timeout: Optional[float] = Field(None, description="seconds from submission")
    async_: Optional[bool] = Field(None, alias="async")
    user: Optional[str] = Field(None, max_length=MAX_USER_CHARS)
    prompt_embeds: Optional[Embed] = None
    pooled_prompt_embeds: Optional[Embed] = None
    prompt_attention_mask: Optional[Embed] = None
    negative_prompt_embeds: Optional[Embed] = None
    negative_pooled_prompt_embeds: Optional[Embed] = None
    negative_prompt_attention_mask: Optional[Embed] = None


class VideoBody(ImageBody):
    """``POST /v1/videos/generations``: an image request's fields, and frames and fps."""

    frames: Optional[int] = None
    fps: Optional[int] = None


def _kind(v) -> str:
    return "null" if v is None else type(v).__name__


def _number(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**15:
        return f"a {len(str(abs(v)))}-digit integer (too large for a number)"
    return _kind(v)


# pydantic error type -> the message (after "<field>: ") from the error's input and context
MESSAGES = {
    "int_type": lambda e: f"expected an integer, got {_kind(e['input'])}",
    "float_type": lambda e: f"expected a number, got {_number(e['input'])}",
    "finite_number": lambda e: f"{shown(e['input'])} is not a finite number",
    "string_type": lambda e: f"expected a string, got {_kind(e['input'])}",
    "string_unicode": lambda e: "not valid Unicode text (a lone surrogate code point?)",
    "bool_type": lambda e: f"expected true or false, got {_kind(e['input'])}",
    "literal_error": lambda e: f"{shown(e['input'])} is not one of {e['ctx']['expected']}",
    "string_too_long": lambda e: f"{len(e['input'])} characters, at most "
                                 f"{e['ctx']['max_length']}",
    "list_type": lambda e: f"expected a list, got {_kind(e['input'])}",
}


def _param(loc) -> str:
    """``prompt_embeds.shape`` from pydantic's location (union branch names dropped)."""
    parts = [str(p) for p in loc if not str(p).startswith(("list[", "EmbedB64"))]
    return ".".join(parts)


def _first(errors: list) -> dict:
    """The error a client is told about: an unknown field first, then the first field's."""
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return unknown[0]
    field = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
    return max(field, key=lambda e: len(e["loc"]))  # a union's most specific branch


def to_request_error(exc: ValidationError, accepted) -> RequestError:
    e = _first(exc.errors())
    param = _param(e["loc"])
    if not param:
        return RequestError(400, f"body: expected a JSON object, got {_kind(e['input'])}",
                            code="invalid_body")
    if e["type"] == "extra_forbidden":
        names = accepted if "." not in param else EmbedB64.model_fields
        return RequestError(400, f"{param}: unknown field (the accepted fields are "
                                 f"{', '.join(sorted(names))})", param=param,
                            code="unknown_field")
    template = MESSAGES.get(e["type"])
    return bad(param, template(e) if template else e["msg"])


def validate_body(obj, video: bool, accepted) -> dict:
    """``obj`` (parsed JSON) checked against the body model, or a RequestError (400) naming
    the field; returns ``obj`` itself (its values are not copied: an embedding's nested list
    is converted once, by :mod:`.schema`, after its size is checked). ``accepted``: the field
    names of the served pipeline (an unknown one is named first, and these are listed)."""
    if isinstance(obj, dict):
        for name in obj:
            if name not in accepted:
                raise RequestError(400, f"{name}: unknown field (the accepted fields are "
                                        f"{', '.join(sorted(accepted))})", param=name,
                                   code="unknown_field")
    try:
        (VideoBody if video else ImageBody).model_validate(obj)
    except ValidationError as exc:
        raise to_request_error(exc, accepted) from None
    return obj


# ---- answers (published in /openapi.json; the tests validate real answers against them) ----

class ErrorDetail(BaseModel):
    message: str
    type: Literal["invalid_request_error", "rate_limit_error", "server_error"]
    param: Optional[str]
    code: Optional[str]


class ErrorBody(BaseModel):
    """Every error's body (OpenAI's shape); a job's error also gives its ``id``."""

    error: ErrorDetail
    id: Optional[str] = None


class Item(BaseModel):
    b64_json: Optional[str] = Field(None, description="the PNG / MP4 / GIF bytes")
    url: Optional[str] = Field(None, description="response_format url: GET it")


class Timings(BaseModel):
    """Seconds, rank 0's (docs/serve.md)."""

    queued_s: float
    run_s: float
    text_encoding_s: float
    denoising_s: float
    denoising_steps_s: List[float]
    vae_decode_s: float
    output_encoding_s: float
    encode_s: float


class GenerationResult(BaseModel):
    """A succeeded request's answer (and a job's ``result``)."""

    created: int
    id: str
    model: str
    object: Literal["image.generation", "video.generation"]
    data: List[Item]
    seed: int
    size: str
    steps: int
    guidance: float
    text_encoder: Literal["request", "pipeline", "stand-in"]
    batch: dict = Field(description="requests, samples and pipeline calls of its batch")
    timings: Timings
    frames: Optional[int] = None
    fps: Optional[int] = None


class JobView(BaseModel):
    """``GET /v1/jobs/{id}`` (an async request's 202, a cancel's 200, an event's data)."""

    id: str
    object: Literal["job"]
    kind: Literal["image", "video"]
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    created: int
    progress: dict = Field(description='{"step": k, "steps": n}')
    text_encoder: str
    seed: int
    started: Optional[float] = None
    finished: Optional[float] = None
    error: Optional[ErrorDetail] = None
    result: Optional[GenerationResult] = None
