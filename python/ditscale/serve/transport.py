"""Rank 0's HTTP transport: uvicorn (h11) on a socket bound before the pipeline is built.

:func:`bind` listens at once (a taken port fails fast; clients wait in the backlog until
serving starts); :class:`Transport` runs uvicorn on that socket in a thread of its own, so the
main thread keeps the worker loop and the signals. HTTP framing is h11's (a conflicting or
malformed ``Content-Length``: 400 with the server's error body, before the app). A request's
headers and body must arrive within ``--read-timeout`` seconds of its first byte (of the
connection, or of the previous answer on a kept-alive one), else the connection is closed
(:class:`DeadlineProtocol`): a slow client cannot hold a connection; beyond
``--max-connections`` open ones a new connection gets 503 and is closed. docs/serve.md.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import RequestError

BACKLOG = 2048  # bursts of clients wait in the kernel's queue, not refused
KEEP_ALIVE_S = 5.0  # an idle kept-alive connection closes after this long


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, and a deadline (``read_timeout_s``) for each request's headers
    and body: armed when the connection opens and after each answer, disarmed when a
    request's body is complete; when it passes, the connection is closed (a request being
    read sees a disconnect)."""

    read_timeout_s = 30.0
    max_connections = 1024
    _timer: Optional[asyncio.TimerHandle] = None

    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # beyond the limit: 503 and close
            body = RequestError(503, f"too many connections (--max-connections "
                                     f"{self.max_connections})",
                                code="too_many_connections").json_bytes()
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                            b"application/json\r\nConnection: close\r\nRetry-After: 1\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            self._disarm()  # this request is read; the app answers in its own time

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request's framing: the server's error body, then close."""
        body = RequestError(400, "invalid HTTP request: a malformed or conflicting "
                                 "Content-Length, a bad request or header line, or headers "
                                 "above 16 KiB", code="invalid_http").json_bytes()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def on_response_complete(self) -> None:
        self._arm()  # the next request's clock (a pipelined one may disarm it at once)
        super().on_response_complete()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: any free port); OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=BACKLOG)


class Transport:
    """uvicorn serving ``app`` on ``sock`` in a thread (``start`` / ``stop``)."""

    def __init__(self, app, sock: socket.socket, read_timeout_s: float,
                 max_connections: int, drain_s: float):
        protocol = type("Protocol", (DeadlineProtocol,), {"read_timeout_s": read_timeout_s,
                                                          "max_connections": max_connections})
        config = uvicorn.Config(
            app, http=protocol, loop="asyncio", lifespan="off", log_config=None,
            access_log=False, server_header=False, backlog=BACKLOG,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=drain_s, ws="none")
        self.server = uvicorn.Server(config)
        self.sock = sock
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="ditscale-http", daemon=True)
        self.drain_s = drain_s

    @property
    def address(self):
        return self.sock.getsockname()[:2]

    def start(self, timeout_s: float = 60.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    def stop(self) -> bool:
        """No new connections; the answers being written go out (at most ``drain_s``
        seconds); True when every one did."""
        self.server.should_exit = True
        self.thread.join(self.drain_s + 5.0)
        self.sock.close()
        return not self.thread.is_alive()
