"""The HTTP API of rank 0 as a FastAPI app over the :class:`~.server.Server` (the core).

Routes (the API, its fields and errors: docs/serve.md; ``/openapi.json`` and ``/docs``):
``POST /v1/images/generations`` and ``/v1/videos/generations`` (a job: answered when it ends,
or 202 at once with ``"async": true``; a client that disconnects cancels its synchronous
job), ``GET /v1/jobs/{id}`` and ``/v1/jobs/{id}/events`` (server-sent events: ``progress``,
then the final status), ``DELETE /v1/jobs/{id}`` / ``POST /v1/jobs/{id}/cancel``,
``GET /v1/files/{name}``, ``GET /v1/models``, ``/health``, ``/metrics``. Every error is
``{"error": {"message", "type", "param", "code"}}`` (:class:`~.errors.RequestError`), 404 and
405 included. The handlers wait on jobs without blocking the event loop: the job store wakes
them (:meth:`~.jobs.JobStore.watch`) through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import re
import time

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from .body import ErrorBody, GenerationResult, ImageBody, JobView, VideoBody
from .errors import RequestError
from .metrics import CONTENT_TYPE
from .reading import ClientGone, parse_json, read_body
from .schema import Request as GenerationRequest
from .schema import parse_request
from .waiting import events, wait_finished

CONTENT_TYPES = {"png": "image/png", "mp4": "video/mp4", "gif": "image/gif"}
DECODE_SLOTS = 2  # bodies decoded at once (JSON and embeddings: their memory is bounded)
JOB_ID = r"gen-[0-9a-f]{16}"  # jobs.JobStore.submit's ids
FILE = JOB_ID + r"-[0-9]{1,2}\.(png|mp4|gif)"  # Server._item's file names
ROUTES = [re.compile(p) for p in (
    r"^/health$", r"^/metrics$", r"^/v1/models$", r"^/v1/(images|videos)/generations$",
    rf"^/v1/jobs/{JOB_ID}(/events|/cancel)?$", rf"^/v1/files/{FILE}$", r"^/openapi.json$",
    r"^/docs$")]
FILE_NAME, JOB_NAME = re.compile(FILE), re.compile(JOB_ID)


def route_label(path: str) -> str:
    """The metrics' endpoint label of a path: ids as {id}, files as {name}; a path of no
    route is "other" (a bounded set of labels)."""
    if not any(r.match(path) for r in ROUTES):
        return "other"
    return JOB_NAME.sub("{id}", FILE_NAME.sub("{name}", path))


def error_response(err: RequestError, job_id: str = None) -> JSONResponse:
    body = err.body()
    if job_id is not None:
        body["id"] = job_id
    headers = {"Retry-After": "1"} if err.status in (429, 503) else {}
    if err.status in (411, 413):  # the body left unread ends the connection
        headers["Connection"] = "close"
    return JSONResponse(body, err.status, headers=headers)


class Observe:
    """ASGI middleware: each answered request counted in ``requests_total{endpoint, status}``
    and logged (but /health and /metrics); 499: the client left before its answer."""

    def __init__(self, app, core):
        self.app, self.core = app, core

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        begin, status = time.perf_counter(), [499]

        async def observed_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        except Exception:  # answered by the outermost error handler (500)
            status[0] = 500
            raise
        finally:
            path, method = scope["path"], scope["method"]
            label = route_label(path)
            self.core.metrics.requests.labels(endpoint=f"{method} {label}",
                                              status=str(status[0])).inc()
            if label not in ("/health", "/metrics"):
                client = (scope.get("client") or ("-",))[0]
                self.core.log_request(f"{client} {method} {path[:200]} {status[0]} "
                                      f"{time.perf_counter() - begin:.3f} s")


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, with the generation bodies (read by the handlers themselves, to
    keep the error body and the size checks before reading) under components."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description=app.description)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (ImageBody, VideoBody):
            js = model.model_json_schema(by_alias=True,
                                         ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


def _body_doc(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


ERRORS = {status: {"model": ErrorBody} for status in (400, 404, 409, 411, 413, 415, 429, 500,
                                                     503, 504)}
GENERATION = {200: {"model": GenerationResult}, 202: {"model": JobView}, **ERRORS}
JOB = {200: {"model": JobView}, 404: {"model": ErrorBody}}


def make_app(core) -> FastAPI:
    """The app of ``core`` (a ``server.Server``)."""
    app = FastAPI(title="ditscale.serve", version="1",
                  description="Generation over a sequence-parallel diffusers pipeline group")
    app.openapi = lambda: _openapi(app)
    app.add_middleware(Observe, core=core)
    _errors(app, core)
    _service_routes(app, core)
    _generation_routes(app, core)
    _job_routes(app, core)
    return app


def _errors(app: FastAPI, core) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError):
        return error_response(err)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, err: ClientGone):
        return Response(status_code=499)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        path = request.url.path[:200]
        if err.status_code == 405:
            what, code = "method not allowed", "method_not_allowed"
        else:
            what, code = "no such route", "not_found"
        return error_response(RequestError(err.status_code, f"{request.method} {path}: {what}",
                                           code=code))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):  # a bug of ours
        return error_response(RequestError(500, f"internal error: {type(err).__name__}",
                                           code="internal_error"))


def _service_routes(app: FastAPI, core) -> None:
    store = core.store

    @app.get("/health")
    def health():
        ok = not core.stopping.is_set()
        return JSONResponse({
            "status": "ok" if ok else ("failed" if core.broken else "shutting_down"),
            "pipeline": core.opts.pipeline, "world_size": core.group.world,
            "ranks": core.ranks, "queue": store.depth(),
            "running": [j.id for j in store.running]}, 200 if ok else 503)

    @app.get("/metrics")
    def metrics():
        core.metrics.queue_depth.set(store.depth())
        return Response(core.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [model_card(core)]}


def _generation_routes(app: FastAPI, core) -> None:
    store = core.store

    slots = asyncio.Semaphore(DECODE_SLOTS)

    async def generate(request: Request, kind: str):
        raw = await read_body(request, core.opts.max_body_mib << 20)
        async with slots:  # off the event loop, at most DECODE_SLOTS at once
            req = await run_in_threadpool(decode, raw, kind, core.limits)
        job = store.submit(req)
        if req.async_:
            return JSONResponse(job.view(), 202, headers={"Location": f"/v1/jobs/{job.id}"})
        await wait_finished(store, job, request)
        if job.status == "succeeded":
            return JSONResponse(job.result, headers={"X-Job-Id": job.id})
        return error_response(job.error, job.id)

    @app.post("/v1/images/generations", openapi_extra=_body_doc(ImageBody),
              responses=GENERATION)
    async def images(request: Request):
        return await generate(request, "image")

    @app.post("/v1/videos/generations", openapi_extra=_body_doc(VideoBody),
              responses=GENERATION)
    async def videos(request: Request):
        return await generate(request, "video")


def _job_routes(app: FastAPI, core) -> None:
    store = core.store

    @app.get("/v1/jobs/{job_id}", responses=JOB)
    def job_view(job_id: str):
        return store.get(job_id).view()

    @app.get("/v1/jobs/{job_id}/events")
    def job_events(job_id: str):
        return StreamingResponse(events(store, store.get(job_id)), headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "Connection": "close"})

    @app.delete("/v1/jobs/{job_id}", responses=JOB)
    @app.post("/v1/jobs/{job_id}/cancel", responses=JOB)
    def cancel(job_id: str):
        view = store.cancel(job_id).view()
        view.pop("result", None)
        return view

    @app.get("/v1/files/{name}")
    def file(name: str):
        m = FILE_NAME.fullmatch(name)
        path = core.file_path(name) if m else None
        try:
            if path is None:
                raise FileNotFoundError(name)
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # never written, or removed (--keep-files), even just now
            raise RequestError(404, f"no file {name[:100]!r} (unknown, or removed: "
                                    f"--keep-files)", code="not_found") from None
        return Response(data, media_type=CONTENT_TYPES[m.group(1)])


def decode(raw: bytes, kind: str, limits) -> GenerationRequest:
    """A body's bytes as a validated request (JSON, then :func:`~.schema.parse_request`)."""
    return parse_request(parse_json(raw), kind, limits)


def model_card(core) -> dict:
    """The served model as ``GET /v1/models`` lists it."""
    lim = core.limits
    return {"id": core.opts.pipeline, "object": "model", "owned_by": "ditscale",
            "kind": "video" if lim.video else "image",
            "limits": {"pixel_multiple": lim.pixel_multiple, "max_size": lim.max_size,
                       "frame_step": lim.frame_step, "max_frames": lim.max_frames,
                       "max_steps": lim.max_steps, "max_n": lim.max_n,
                       "max_batch": lim.max_batch, "max_timeout": lim.max_timeout_s},
            "defaults": {"size": f"{lim.default_size[1]}x{lim.default_size[0]}",
                         "frames": lim.default_size[2], "steps": lim.default_steps,
                         "guidance": lim.default_guidance},
            "text_encoders": lim.has_encoders}
