"""A request body's framing and JSON, checked before and while it is read.

:func:`read_body`: ``Transfer-Encoding: chunked`` or no ``Content-Length`` -> 411; a length
above ``--max-body-mib`` -> 413 before a byte of the body is read (the connection then closes);
a ``Content-Type`` other than JSON -> 415; fewer bytes than announced -> 400. :func:`parse_json`:
invalid JSON, NaN or Infinity -> 400. h11 has already refused a malformed or conflicting
``Content-Length`` (400). A client gone while its body is read raises :class:`ClientGone`.
The error bodies: docs/serve.md.
"""

from __future__ import annotations

import json

from starlette.requests import ClientDisconnect, Request

from .errors import RequestError


class ClientGone(Exception):
    """The client closed the connection (or its read deadline passed) before its request
    was answered."""


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _length(request: Request, limit: int) -> int:
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        raise RequestError(411, "chunked bodies are not accepted: send Content-Length",
                           code="length_required")
    length = request.headers.get("content-length")
    if length is None or not (length.isascii() and length.isdigit()):
        raise RequestError(411, "Content-Length is required", code="length_required")
    if int(length) > limit:
        raise RequestError(413, f"body: {int(length)} bytes, at most {limit} "
                                f"(--max-body-mib {limit >> 20})", code="body_too_large")
    return int(length)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body of ``request`` (at most ``limit`` bytes; see the module)."""
    length = _length(request, limit)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientGone() from None
    if ctype != "application/json":
        raise RequestError(415, f"Content-Type: {ctype or '(none)'!r}, expected "
                                f"application/json", code="unsupported_media_type")
    if len(raw) != length:
        raise RequestError(400, f"body: {len(raw)} bytes, Content-Length said {length}",
                           code="invalid_body")
    return raw


def parse_json(raw: bytes):
    """``raw`` as JSON (no NaN or Infinity), or a 400."""
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"body: invalid JSON at line {e.lineno} column {e.colno}: "
                                f"{e.msg}", code="invalid_json") from None
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise RequestError(400, f"body: invalid JSON: {e}", code="invalid_json") from None
