"""The HTTP side of the server (rank 0): routes, body limits, JSON in and out.

Routes:

- ``POST /v1/images/generations``, ``POST /v1/videos/generations``: a generation request
  (``schema``); answers when the job finishes: 200 with ``{"created", "id", "data": [{"b64_json"}
  | {"url"}], "seed", "text_encoder", "timings", ...}``, or the job's error; with
  ``"async": true`` at once: 202 with the job (``Location: /v1/jobs/{id}``)
- ``GET /v1/jobs/{id}``: the job (status, progress ``{"step", "steps"}``, error or result)
- ``GET /v1/jobs/{id}/events``: server-sent events: ``progress`` at each step, then one of
  ``succeeded`` / ``failed`` / ``cancelled`` with the job (without its result data)
- ``DELETE /v1/jobs/{id}`` or ``POST /v1/jobs/{id}/cancel``: cancel (a running job stops at its
  next denoising step; 200 with the job as it is then)
- ``GET /v1/files/{name}``: a ``response_format="url"`` output
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text)

Errors are ``{"error": {"message", "type", "param", "code"}}``: 400 bad field, 404, 405, 411
(no Content-Length), 413 (body above ``--max-body-mib``, refused before it is read), 415 (not
JSON), 429 (queue full; ``Retry-After``), 503 (shutting down, too many connections), 504
(timeout), 409 (cancelled), 500 (the generation failed).
"""

from __future__ import annotations

import json
import re
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional, Tuple

from .errors import RequestError
from .jobs import Job
from .schema import parse_request

CONTENT_TYPES = {"png": "image/png", "mp4": "video/mp4", "gif": "image/gif"}
SSE_KEEPALIVE_S = 15.0
IDLE_TIMEOUT_S = 60.0


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "ditscale-serve"
    core = None  # the Server, set by make_http_server
    disable_nagle_algorithm = True  # headers and body leave at once (no delayed-ACK stall)
    timeout = IDLE_TIMEOUT_S  # a connection silent this long (idle, or a stalled body) closes

    # -- plumbing ---------------------------------------------------------------------------

    def log_message(self, fmt, *args):  # the request log is ours (_done)
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json",
              headers: Optional[dict] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._status = status

    def _json(self, status: int, obj, headers: Optional[dict] = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers=headers)

    def _error(self, err: RequestError, job: Optional[Job] = None) -> None:
        body = err.body()
        if job is not None:
            body["id"] = job.id
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        unread = not self._body_read and self.headers.get("Content-Length", "0") != "0"
        if err.status in (411, 413) or unread:  # the body left unread ends the connection
            self.close_connection = True
            headers = {**(headers or {}), "Connection": "close"}
        self._json(err.status, body, headers)

    def _dispatch(self, table: dict) -> None:
        self._status, self._body_read, self._label = 0, False, "other"
        begin = time.perf_counter()
        path = self.path.split("?", 1)[0]
        self.server.enter()
        try:
            for pattern, fn in table.items():
                m = re.match(pattern, path)
                if m:
                    self._label = route_label(path)
                    fn(*m.groups())
                    break
            else:
                known = any(re.match(p, path) for t in (GET_ROUTES, POST_ROUTES, DELETE_ROUTES)
                            for p in t)
                raise RequestError(405 if known else 404,
                                   f"{self.command} {path[:200]}: " + (
                                       "method not allowed" if known else "no such route"),
                                   code="method_not_allowed" if known else "not_found")
        except RequestError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
            self._status = 499
        except Exception as e:  # a bug of ours: the client still gets an answer, the log says
            self.core.log_request(f"internal error on {self.command} {path[:200]}: "
                                  f"{traceback.format_exc()}")
            try:
                self._error(RequestError(500, f"internal error: {type(e).__name__}: {e}",
                                         code="internal_error"))
            except OSError:
                self.close_connection = True
        finally:
            self.server.leave()
            self._done(begin)

    def _done(self, begin: float) -> None:
        route = self._label
        self.core.metrics.inc("requests_total", endpoint=f"{self.command} {route}",
                              status=str(self._status))
        if route not in ("/health", "/metrics"):
            log_line = (f"{self.client_address[0]} {self.command} {self.path[:200]} "
                        f"{self._status} {time.perf_counter() - begin:.3f} s")
            self.core.log_request(log_line)

    def _body(self):
        """The JSON body (size-checked before it is read)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise RequestError(411, "chunked bodies are not accepted: send Content-Length",
                               code="length_required")
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError(411, "Content-Length is required", code="length_required")
        limit = self.core.opts.max_body_mib << 20
        if int(length) > limit:
            raise RequestError(413, f"body: {int(length)} bytes, at most {limit} "
                                    f"(--max-body-mib {self.core.opts.max_body_mib})",
                               code="body_too_large")
        ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            self.rfile.read(int(length))
            self._body_read = True
            raise RequestError(415, f"Content-Type: {ctype or '(none)'!r}, expected "
                                    f"application/json", code="unsupported_media_type")
        raw = self.rfile.read(int(length))
        self._body_read = True
        if len(raw) != int(length):
            raise RequestError(400, f"body: {len(raw)} bytes, Content-Length said {length}",
                               code="invalid_body")
        try:
            return json.loads(raw, parse_constant=_reject_constant)
        except json.JSONDecodeError as e:
            raise RequestError(400, f"body: invalid JSON at line {e.lineno} column {e.colno}: "
                                    f"{e.msg}", code="invalid_json") from None
        except (ValueError, RecursionError, UnicodeDecodeError) as e:
            raise RequestError(400, f"body: invalid JSON: {e}", code="invalid_json") from None

    # -- verbs ------------------------------------------------------------------------------

    def do_GET(self):
        self._dispatch({p: getattr(self, n) for p, n in GET_ROUTES.items()})

    def do_POST(self):
        self._dispatch({p: getattr(self, n) for p, n in POST_ROUTES.items()})

    def do_DELETE(self):
        self._dispatch({p: getattr(self, n) for p, n in DELETE_ROUTES.items()})

    # -- routes -----------------------------------------------------------------------------

    def health(self):
        core = self.core
        ok = not core.stopping.is_set()
        self._json(200 if ok else 503, {
            "status": "ok" if ok else ("failed" if core.broken else "shutting_down"),
            "pipeline": core.opts.pipeline, "world_size": core.group.world,
            "ranks": core.ranks, "queue": core.store.depth(),
            "running": [j.id for j in core.store.running]})

    def metrics(self):
        self.core.metrics.set("queue_depth", self.core.store.depth())
        self._send(200, self.core.metrics.render().encode(),
                   "text/plain; version=0.0.4; charset=utf-8")

    def models(self):
        lim = self.core.limits
        self._json(200, {"object": "list", "data": [
            {"id": self.core.opts.pipeline, "object": "model", "owned_by": "ditscale",
             "kind": "video" if lim.video else "image",
             "limits": {"pixel_multiple": lim.pixel_multiple, "max_size": lim.max_size,
                        "frame_step": lim.frame_step, "max_frames": lim.max_frames,
                        "max_steps": lim.max_steps, "max_n": lim.max_batch,
                        "max_timeout": lim.max_timeout_s},
             "defaults": {"size": f"{lim.default_size[1]}x{lim.default_size[0]}",
                          "frames": lim.default_size[2], "steps": lim.default_steps,
                          "guidance": lim.default_guidance},
             "text_encoders": lim.has_encoders}]})

    def images(self):
        self._generate("image")

    def videos(self):
        self._generate("video")

    def _generate(self, kind: str):
        request = parse_request(self._body(), kind, self.core.limits)
        job = self.core.store.submit(request)
        if request.async_:
            self._json(202, job.view(), {"Location": f"/v1/jobs/{job.id}"})
            return
        while not self.core.store.wait_done(job, timeout=1.0):
            pass
        self._answer(job)

    def _answer(self, job: Job):
        if job.status == "succeeded":
            self._json(200, job.result, {"X-Job-Id": job.id})
        else:
            self._error(job.error, job)

    def job(self, job_id: str, suffix: Optional[str] = None):
        job = self.core.store.get(job_id)
        if suffix == "/events":
            self._events(job)
        else:
            self._json(200, job.view())

    def cancel(self, job_id: str, suffix: Optional[str] = None):
        if self.command == "POST" and suffix != "/cancel":
            raise RequestError(405, f"POST {self.path}: method not allowed",
                               code="method_not_allowed")
        job = self.core.store.cancel(job_id)
        view = job.view()
        view.pop("result", None)
        self._json(200, view)

    def file(self, name: str, ext: str):
        path = self.core.file_path(name)
        try:
            if path is None:
                raise FileNotFoundError(name)
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # never written, or removed (--keep-files), even just now
            raise RequestError(404, f"no file {name!r} (unknown, or removed: --keep-files)",
                               code="not_found") from None
        self._send(200, data, CONTENT_TYPES[ext])

    def _events(self, job: Job):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection, self._status = True, 200
        version, last = -1, time.monotonic()
        while True:
            if job.version != version:
                version = job.version
                view = job.view()
                view.pop("result", None)
                event = job.status if job.done else "progress"
                self.wfile.write(f"event: {event}\ndata: {json.dumps(view)}\n\n".encode())
                self.wfile.flush()
                last = time.monotonic()
                if job.done:
                    return
            elif time.monotonic() - last > SSE_KEEPALIVE_S:
                self.wfile.write(b": keep-alive\n\n")
                self.wfile.flush()
                last = time.monotonic()
            self.core.store.wait(job, version, timeout=1.0)


JOB_ID = r"gen-[0-9a-f]{16}"  # jobs.JobStore.submit's ids
FILE = JOB_ID + r"-[0-9]{1,2}\.(png|mp4|gif)"  # Server._item's file names
GET_ROUTES = {r"^/health$": "health", r"^/metrics$": "metrics", r"^/v1/models$": "models",
              rf"^/v1/jobs/({JOB_ID})(/events)?$": "job", rf"^/v1/files/({FILE})$": "file"}
POST_ROUTES = {r"^/v1/images/generations$": "images", r"^/v1/videos/generations$": "videos",
               rf"^/v1/jobs/({JOB_ID})(/cancel)$": "cancel"}
DELETE_ROUTES = {rf"^/v1/jobs/({JOB_ID})()$": "cancel"}
FILE_NAME = re.compile(FILE)
JOB_NAME = re.compile(JOB_ID)


def route_label(path: str) -> str:
    """The metrics' endpoint label of a routed path: ids as {id}, files as {name} (a bounded
    set of labels; unrouted paths are "other")."""
    return JOB_NAME.sub("{id}", FILE_NAME.sub("{name}", path))


class HttpServer(ThreadingHTTPServer):
    """A thread per connection, at most ``limit`` at once (beyond: 503 and close). Requests
    being answered are counted (``enter`` / ``leave``), so that a shutdown can let their
    answers out first (``drain``)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the listen backlog: bursts of clients are not refused

    def __init__(self, address: Tuple[str, int], handler, limit: int):
        self.limit, self.active, self.lock = limit, 0, threading.Lock()
        self.inflight, self.idle = 0, threading.Condition(self.lock)
        super().__init__(address, handler)

    def attach(self, core) -> None:
        """Routes requests to ``core`` (a ``server.Server``) from now on."""
        self.RequestHandlerClass.core = core
        self.limit = core.opts.max_connections

    def enter(self) -> None:
        with self.lock:
            self.inflight += 1

    def leave(self) -> None:
        with self.lock:
            self.inflight -= 1
            self.idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Waits until no request is being answered, at most ``timeout`` seconds; True when
        none is."""
        with self.lock:
            return self.idle.wait_for(lambda: self.inflight == 0, timeout=timeout)

    def process_request(self, request, client_address):
        with self.lock:
            full = self.active >= self.limit
            if not full:
                self.active += 1
        if full:
            body = RequestError(503, f"too many connections (--max-connections {self.limit})",
                                code="too_many_connections").json_bytes()
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                                b"application/json\r\nConnection: close\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.active -= 1


def make_http_server(core, host: str, port: int, max_connections: int = 256) -> HttpServer:
    """An HTTP server bound to ``host``:``port`` (listening: connections wait in the backlog
    until ``serve_forever``) for ``core`` (a ``server.Server``; None: ``attach`` it later)."""
    handler = type("BoundHandler", (Handler,), {"core": None})
    httpd = HttpServer((host, port), handler, max_connections)
    if core is not None:
        httpd.attach(core)
    return httpd
