"""The one error type of the server's request path, and its JSON body.

``RequestError(status, message, param=None, code=None)``: what a client gets back, as
``{"error": {"message", "type", "param", "code"}}`` (the OpenAI API's error shape) with HTTP
``status``. ``type`` follows the status: 400-499 ``invalid_request_error`` (429:
``rate_limit_error``), 500-599 ``server_error``.
"""

from __future__ import annotations

import json
from typing import Optional


class RequestError(Exception):
    """A request that ends with HTTP ``status`` and a message naming the field ``param``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        if self.status == 429:
            kind = "rate_limit_error"
        elif self.status >= 500:
            kind = "server_error"
        else:
            kind = "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


def shown(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a client's value quoted in a message
    (a body may hold megabytes in one field)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bad(param: str, message: str) -> RequestError:
    """A 400 for the field ``param``: ``"<param>: <message>"``."""
    return RequestError(400, f"{param}: {message}", param=param, code="invalid_value")
