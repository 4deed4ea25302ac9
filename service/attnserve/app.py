"""The app factory: lifespan (device open, drain, close), routers, one error mapping.

``create_app(settings)`` builds the FastAPI app. Its lifespan opens the GPU
engine on a thread (the event loop keeps running), restores the snapshot
directory's sessions (``snapshot_dir``), marks the server ready and starts the
idle-session expiry; on shutdown it marks the server draining (``/readyz`` 503,
new ``/v1`` requests 503), waits for the requests in flight, writes every
session's snapshot (``snapshot_dir``), and closes the engine after its queue
drains.

Tenants: with API keys configured, the request middleware checks the bearer
token of every ``/v1`` request (and of ``/metrics`` with ``metrics_auth``) before
anything else but the drain check, answers 401 without a valid one, and puts
the key's id in the scope for :func:`~attnserve.routes.deps.get_owner`.

Errors: routes raise :class:`~attnserve.errors.ApiError` subclasses; one handler
turns them (and FastAPI's validation errors, unknown routes, wrong methods) into
``application/problem+json``. Anything else becomes a 500 problem without a
traceback in the answer (the traceback goes to the log).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from attnserve_client.wire import PROBLEM_JSON

from . import __version__
from .codec import problem_response
from .instance import InstanceHeaderMiddleware
from .config import Settings, get_settings
from .engine import Engine
from .errors import (
    ApiError,
    InternalError,
    InvalidRequest,
    LayerNotFound,
    MethodNotAllowed,
    NotReady,
    RequestTimeout,
    RouteNotFound,
    Unauthorized,
)
from .gpu.device import DeviceError
from .kvcache import KV_FORMATS
from .metrics import Gauge
from .persistence import SnapshotDir
from .routes import batch, kv, probes, sessions, snapshots, stream
from .routes.deps import OWNER_KEY, RequestState, Runtime, current_request
from .routes.schemas import COMPONENTS

__all__ = ["create_app", "open_engine"]

log = logging.getLogger("attnserve")
access_log = logging.getLogger("attnserve.access")

_PROBLEM_KEY = "attnserve.problem"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")

DESCRIPTION = """\
Attention served over HTTP: per-session KV caches (float32 or TurboQuant) on a
wgpu device. Every body is MessagePack (`application/vnd.msgpack`) or JSON
(`application/json`); the answer uses the type `Accept` names, else the
request's, else JSON. Arrays are `{"dtype": "<f4", "shape": [..], "data": <bin>}`
in MessagePack and nested lists in JSON. Errors are RFC 9457 problem details
(`application/problem+json`). See docs/api.md.
"""


def open_engine(settings: Settings, **kw: Any) -> Engine:
    """The GPU engine the settings describe (adapter, batch and queue sizes).
    Raises :class:`~attnserve.gpu.device.DeviceError` with the reason."""
    return Engine.open(settings.adapter, max_batch_jobs=settings.max_batch_jobs, max_queue=settings.max_queue, **kw)


def create_app(settings: Settings | None = None, *, engine: Engine | None = None) -> FastAPI:
    """Build the app. ``engine``: an engine opened by the caller (tests), which the
    app uses but does not close; by default the lifespan opens and closes one."""
    settings = settings or get_settings()
    rt = Runtime(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt.loop = asyncio.get_running_loop()
        owned = engine is None
        if owned:
            try:
                eng = await asyncio.to_thread(open_engine, settings, on_batch=rt.metrics.on_batch,
                                              on_job_start=rt.metrics.on_job_start)
            except DeviceError as e:
                log.error("cannot open a GPU device", extra={"error": str(e)})
                raise
            previous_hooks = None
        else:
            eng = engine
            previous_hooks = (eng.worker.on_batch, eng.worker.on_job_start)
            eng.worker.on_batch, eng.worker.on_job_start = rt.metrics.on_batch, rt.metrics.on_job_start
        rt.engine = eng
        expiry: asyncio.Task | None = None
        try:
            if settings.snapshot_dir:
                rt.persistence = SnapshotDir(settings.snapshot_dir, rt)
                rt.persistence.open()
                await rt.persistence.restore_all(eng)
            if settings.session_ttl_seconds > 0:
                expiry = asyncio.create_task(rt.expire_idle(), name="attnserve-expiry")
        except BaseException:
            log.exception("start-up failed")
            if rt.persistence is not None:
                rt.persistence.close()
            if owned:
                await asyncio.to_thread(eng.close)
            raise
        rt.ready = True
        log.info("ready", extra={"adapter": eng.ctx.describe(), "version": __version__,
                                 "api_keys": len(rt.keys), "sessions": len(rt.store)})
        try:
            yield
        finally:
            rt.begin_drain()
            rt.ready = False
            if expiry is not None:
                expiry.cancel()
            if not await rt.wait_idle(settings.drain_timeout_s):
                log.warning("drain timeout: requests still in flight", extra={"in_flight": rt.in_flight})
            if rt.persistence is not None:
                try:
                    await rt.persistence.save_all(eng)
                finally:
                    rt.persistence.close()
            for s in list(rt.store.sessions.values()):
                rt.store.remove(s)
                try:
                    eng.release(s.kv)
                except ApiError:  # pragma: no cover - queue full at shutdown
                    pass
            if owned:
                await asyncio.to_thread(eng.close)
            else:
                eng.worker.on_batch, eng.worker.on_job_start = previous_hooks
            log.info("stopped")

    app = FastAPI(
        title="attnserve",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        # operationIds are the route functions' names: attend, append_kv, create_session, ...
        generate_unique_id_function=lambda route: route.name,
        # a trailing slash (or an id like %2F) is a 404 problem, not a redirect
        redirect_slashes=False,
        openapi_tags=[
            {"name": "sessions", "description": "Sessions: one KV cache per layer of one sequence."},
            {"name": "kv", "description": "Append K/V rows and attend."},
            {"name": "snapshots", "description": "A session as one MessagePack blob, and its restore."},
            {"name": "probes", "description": "Liveness, readiness, metrics and server info."},
        ],
    )
    app.state.runtime = rt
    app.include_router(sessions.router)
    app.include_router(kv.router)
    app.include_router(batch.router)
    app.include_router(stream.router)
    app.include_router(snapshots.router)
    app.include_router(probes.router)
    _install_error_handlers(app)
    _install_gauges(rt)
    app.add_middleware(RequestMiddleware, runtime=rt)
    # outermost: names the replica on every answer, problems included
    app.add_middleware(InstanceHeaderMiddleware, name=settings.instance_name)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                openapi_version=app.openapi_version,
                description=app.description,
                routes=app.routes,
                tags=app.openapi_tags,
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(COMPONENTS)
            if rt.keys.enabled:
                schema["components"]["securitySchemes"] = {
                    "apiKey": {"type": "http", "scheme": "bearer", "description": "An API key as a bearer token."}
                }
                for path, ops in schema.get("paths", {}).items():
                    if path.startswith("/v1") or (path == "/metrics" and settings.metrics_auth):
                        for op in ops.values():
                            op["security"] = [{"apiKey": []}]
                            # a missing or wrong key answers 401 on every protected route
                            op.setdefault("responses", {}).setdefault(
                                "401", {"description": "Problem: unauthorized",
                                        "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


# ── errors ───────────────────────────────────────────────────────────────────


def _problem(request: Request, err: ApiError):
    request.scope[_PROBLEM_KEY] = err.slug
    return problem_response(err, request.url.path)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _problem(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        for e in errors:
            loc = tuple(e.get("loc", ()))
            if loc[:2] == ("path", "layer"):
                return _problem(request, LayerNotFound(f"layer {e.get('input')!r} is not a layer index"))
        parts = []
        for e in errors[:5]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body", "query", "path"))
            parts.append(f"{where or 'request'}: {e.get('msg', 'invalid')}")
        return _problem(request, InvalidRequest("; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err: ApiError = RouteNotFound(f"no route {request.method} {request.url.path}")
        elif exc.status_code == 405:
            allowed = _allowed_methods(request)
            err = MethodNotAllowed(
                f"{request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}",
                headers={"Allow": ", ".join(allowed)},
            )
        else:
            err = ApiError(str(exc.detail), headers=dict(exc.headers or {}))
            err.status = exc.status_code
            err.slug = "http-" + str(exc.status_code)
            err.title = str(exc.detail)
        return _problem(request, err)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route offers on this path (Starlette names only the first)."""
    methods = []
    for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
        scope = {"type": "http", "path": request.url.path, "method": method, "root_path": ""}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.routes):
            methods.append(method)
    return methods


# ── metrics that describe state (computed when scraped) ─────────────────────


def _install_gauges(rt: Runtime) -> None:
    m = rt.metrics

    def by_format(i: int):
        counts = rt.store.by_format()
        return [((fmt,), counts.get(fmt, (0, 0))[i]) for fmt in KV_FORMATS]

    m.add_gauge(Gauge("attnserve_sessions", "Sessions held, by kv format.", ("kv_format",), lambda: by_format(0)))
    m.add_gauge(Gauge(
        "attnserve_kv_bytes", "GPU bytes the sessions' caches hold, by kv format.", ("kv_format",),
        lambda: by_format(1),
    ))
    m.add_gauge(Gauge(
        "attnserve_memory_used_bytes", "GPU bytes held or reserved by queued work (what the budget counts).",
        fn=lambda: [((), rt.store.used_bytes)],
    ))
    m.add_gauge(Gauge(
        "attnserve_memory_budget_bytes", "The GPU memory budget (0: none).",
        fn=lambda: [((), rt.settings.memory_budget_bytes)],
    ))
    m.add_gauge(Gauge(
        "attnserve_gpu_queue_depth", "Jobs waiting for or running on the GPU thread.",
        fn=lambda: [((), rt.engine.worker.queue_depth if rt.engine is not None else 0)],
    ))
    m.add_gauge(Gauge(
        "attnserve_requests_in_flight", "HTTP requests being handled now.", fn=lambda: [((), rt.in_flight)]
    ))
    m.add_gauge(Gauge(
        "attnserve_ready", "1 when the device is open and the server is not draining.",
        fn=lambda: [((), int(rt.ready and not rt.draining))],
    ))
    s = rt.settings
    m.add_gauge(Gauge(
        "attnserve_gpu_queue_limit", "Most jobs that may wait for the GPU (503 overloaded past it).",
        fn=lambda: [((), rt.engine.worker.max_queue if rt.engine is not None else s.max_queue)],
    ))
    # The configured limits (0: none), one metric per unit.
    m.add_gauge(Gauge(
        "attnserve_limit_sessions", "Configured session limits (0: none), by name.", ("name",),
        fn=lambda: [(("max_sessions",), s.max_sessions),
                    (("quota_sessions_per_key",), s.quota_sessions_per_key)],
    ))
    m.add_gauge(Gauge(
        "attnserve_limit_bytes", "Configured byte limits (0: none), by name.", ("name",),
        fn=lambda: [(("quota_bytes_per_key",), s.quota_bytes_per_key)],
    ))
    m.add_gauge(Gauge(
        "attnserve_limit_seconds", "Configured time limits (0: none), by name.", ("name",),
        fn=lambda: [(("request_timeout",), s.request_timeout_s),
                    (("session_ttl",), s.session_ttl_seconds)],
    ))

    def tenants(i: int):
        return [((owner or "",), v[i]) for owner, v in rt.store.by_tenant().items()]

    m.add_gauge(Gauge(
        "attnserve_tenant_sessions", "Sessions each tenant holds (tenant: its API key id; empty without keys).",
        ("tenant",), lambda: tenants(0),
    ))
    m.add_gauge(Gauge(
        "attnserve_tenant_bytes", "GPU bytes each tenant's sessions hold or have reserved (what its quota counts).",
        ("tenant",), lambda: tenants(1),
    ))

    def info():
        d = rt.engine.ctx.describe() if rt.engine is not None else {}
        return [((__version__, d.get("name", ""), d.get("backend", "")), 1)]

    m.add_gauge(Gauge("attnserve_build_info", "Version and GPU adapter.", ("version", "adapter", "backend"), info))


# ── per-request middleware: access log, metrics, drain, last-resort 500 ─────


class RequestMiddleware:
    """Pure ASGI middleware (no body buffering): times every request, logs one
    structured line, counts it, refuses new /v1 work while draining, checks the
    API key, answers a request whose GPU job timed out in the queue with 503
    timeout, and turns an unexpected exception into a 500 problem."""

    def __init__(self, app: ASGIApp, runtime: Runtime):
        self.app = app
        self.rt = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rt = self.rt
        t0 = time.perf_counter()
        path: str = scope.get("path", "")
        method: str = scope.get("method", "")
        rid = _request_id(scope)
        state = {"status": 0, "started": False, "bytes": 0}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                state["started"] = True
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            elif message["type"] == "http.response.body":
                state["bytes"] += len(message.get("body", b""))
            await send(message)

        async def answer(err: ApiError) -> None:
            scope[_PROBLEM_KEY] = err.slug
            await problem_response(err, path)(scope, receive, send_wrapper)

        req = RequestState()
        token = current_request.set(req)
        rt.request_started()
        try:
            v1 = path == "/v1" or path.startswith("/v1/")
            if rt.draining and v1:
                await answer(NotReady("the server is draining", headers={"Retry-After": "1"}))
            elif rt.keys.enabled and (v1 or (path == "/metrics" and rt.settings.metrics_auth)):
                try:
                    scope[OWNER_KEY] = rt.keys.authenticate(_header(scope, b"authorization"))
                except Unauthorized as e:
                    rt.metrics.auth_failures.inc(getattr(e, "reason", "invalid"))
                    await answer(e)
                else:
                    await self.app(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            if not req.timed_out or state["started"]:
                raise
            # our request timeout cancelled the queued GPU job: nothing was applied
            await answer(RequestTimeout(
                f"the request waited more than {rt.settings.request_timeout_s:g} s for the GPU and was "
                "dropped; nothing was applied, so it is safe to retry",
                headers={"Retry-After": "1"},
            ))
        except ClientDisconnect:
            if not state["started"]:
                state["status"] = 499
        except Exception:
            log.exception("unhandled error", extra={"request_id": rid, "method": method, "path": path})
            if not state["started"]:
                scope[_PROBLEM_KEY] = InternalError.slug
                resp = problem_response(
                    InternalError(f"an internal error occurred (request id {rid}); it was logged"), path
                )
                await resp(scope, receive, send_wrapper)
        finally:
            current_request.reset(token)
            rt.request_finished()
            dt = time.perf_counter() - t0
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            status = state["status"] or 500
            rt.metrics.observe_request(template, method, status, dt)
            slug = scope.get(_PROBLEM_KEY)
            if slug:
                rt.metrics.errors.inc(slug)
            params = scope.get("path_params") or {}
            fields: dict[str, Any] = {
                "method": method,
                "route": template,
                "path": path,
                "status": status,
                "latency_ms": round(dt * 1000, 3),
                "request_id": rid,
                "bytes_out": state["bytes"],
            }
            if "session_id" in params:
                fields["session_id"] = params["session_id"]
            if "layer" in params:
                fields["layer"] = params["layer"]
            if scope.get(OWNER_KEY):
                fields["tenant"] = scope[OWNER_KEY]
            if slug:
                fields["problem"] = slug
            access_log.info("request", extra=fields)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


def _request_id(scope: Scope) -> str:
    for k, v in scope.get("headers", ()):
        if k == b"x-request-id":
            try:
                s = v.decode("ascii")
            except UnicodeDecodeError:
                break
            if _REQUEST_ID.fullmatch(s):
                return s
            break
    return uuid.uuid4().hex[:16]
