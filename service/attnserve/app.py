"""The app factory: lifespan (device open, drain, close), routers, one error mapping.

``create_app(settings)`` builds the FastAPI app. Its lifespan opens the GPU
engine on a thread (the event loop keeps running), restores the snapshot
directory's sessions (``snapshot_dir``) and starts the idle-session expiry; then,
while the server already answers (``/readyz`` 503), it warms the kernels
(``warmup``: warmup.py) and marks the server ready. On shutdown it marks the
server draining (``/readyz`` 503, new ``/v1`` requests 503), waits for the
requests in flight, writes every session's snapshot (``snapshot_dir``), and
closes the engine after its queue drains.

Tenants: with API keys configured, the request middleware checks the bearer
token of every ``/v1`` request (and of ``/metrics`` with ``metrics_auth``) before
anything else but the drain check, answers 401 without a valid one, and puts
the key's id in the scope for :func:`~attnserve.transport.deps.get_owner`.

Errors: routes raise :class:`~attnserve.errors.ApiError` subclasses; one handler
turns them (and FastAPI's validation errors, unknown routes, wrong methods) into
``application/problem+json``. Anything else becomes a 500 problem without a
traceback in the answer (the traceback goes to the log).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from attnserve_client.wire import PROBLEM_JSON

from . import __version__
from .codec import problem_response
from .instance import InstanceHeaderMiddleware
from .config import Settings, get_settings
from .engine import Engine
from .errors import (
    ApiError,
    InvalidRequest,
    LayerNotFound,
    MethodNotAllowed,
    RouteNotFound,
    StepNotFound,
)
from .gpu.device import DeviceError
from .gpu.kernels import KernelPolicy
from .persistence import SnapshotDir
from .routes import problem_pages, probes, sessions, snapshots, steps
from .transport import http, websocket
from .transport.frames import FrameServer
from .transport.shm import ShmServer
from .middleware import PROBLEM_KEY, RequestMiddleware
from .runtime import Runtime, install_gauges
from .warmup import warm_up
from .contract import components

__all__ = ["create_app", "open_engine", "DOCS_ASSETS"]

#: where the API pages' (/docs, /redoc) scripts, styles and icon are served
DOCS_ASSETS = "/docs-assets"

log = logging.getLogger("attnserve")


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
    policy = KernelPolicy(
        force=None if settings.kernels == "auto" else settings.kernels,
        target_workgroups=settings.split_target_workgroups,
    )
    return Engine.open(
        settings.adapter,
        settings.cuda_context,
        max_batch_jobs=settings.max_batch_jobs,
        max_queue=settings.max_queue,
        batch_arena_bytes=settings.batch_arena_bytes,
        policy=policy,
        page_tokens=settings.page_tokens,
        pool_slab_bytes=settings.pool_slab_bytes,
        **kw,
    )


def create_app(settings: Settings | None = None, *, engine: Engine | None = None) -> FastAPI:
    """Build the app. ``engine``: an engine opened by the caller (tests), which the
    app uses but does not close; by default the lifespan opens and closes one."""
    settings = settings or get_settings()
    rt = Runtime(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt.loop = asyncio.get_running_loop()
        owned = engine is None
        if engine is None:
            try:
                eng = await asyncio.to_thread(
                    open_engine, settings, on_batch=rt.metrics.on_batch, on_job_start=rt.metrics.on_job_start
                )
            except DeviceError as e:
                log.error("cannot open a GPU device", extra={"error": str(e)})
                raise
            previous_hooks = None
        else:
            eng = engine
            previous_hooks = (eng.worker.on_batch, eng.worker.on_job_start)
            eng.worker.on_batch, eng.worker.on_job_start = rt.metrics.on_batch, rt.metrics.on_job_start
        rt.engine = eng
        expiry: asyncio.Task[None] | None = None
        frames: FrameServer | None = None
        shm: ShmServer | None = None
        try:
            if settings.snapshot_dir:
                rt.persistence = SnapshotDir(settings.snapshot_dir, rt, settings.sync_interval_s)
                rt.persistence.open()
                await rt.persistence.restore_all(eng)
                rt.persistence.start_sync(eng)
            if settings.frames_port is not None:
                frames = FrameServer(rt)
                await frames.start(settings.host, settings.frames_port)
                rt.frames_port = frames.port
            if settings.shm_socket is not None:
                shm = ShmServer(rt)
                await shm.start(settings.shm_socket)
                rt.shm_socket = shm.path
            expiry = asyncio.create_task(rt.expire_idle(), name="attnserve-expiry")  # steps always; sessions by TTL
        except BaseException:
            log.exception("start-up failed")
            if frames is not None:
                frames.stop_listening()
            if shm is not None:
                shm.stop_listening()  # its socket file goes
            if rt.persistence is not None:
                await rt.persistence.stop_sync()
                rt.persistence.close()
            if owned:
                await asyncio.to_thread(eng.close)
            elif previous_hooks is not None:  # the caller's engine keeps its hooks
                eng.worker.on_batch, eng.worker.on_job_start = previous_hooks
            raise
        warmup: asyncio.Task[None] | None = None
        if settings.warmup_formats():  # the server answers (/readyz 503) while the kernels compile
            rt.warming_up = True
            warmup = asyncio.create_task(_warm_up_then_ready(rt, eng), name="attnserve-warmup")
        else:
            rt.mark_ready()
        try:
            yield
        finally:
            rt.begin_drain()
            rt.ready = False
            if warmup is not None:
                warmup.cancel()
                await asyncio.gather(warmup, return_exceptions=True)
            if expiry is not None:
                expiry.cancel()
            if frames is not None:
                frames.stop_listening()
            if shm is not None:
                shm.stop_listening()
            if not await rt.wait_idle(settings.drain_timeout_s):
                log.warning("drain timeout: requests still in flight", extra={"in_flight": rt.in_flight})
            if frames is not None:
                frames.close_connections()
            if shm is not None:
                shm.close_connections()
                await shm.wait_closed(1.0)  # each region unmapped as its connection goes
            if rt.persistence is not None:
                try:
                    await rt.persistence.stop_sync()
                    await rt.persistence.save_all(eng)
                finally:
                    rt.persistence.close()
            rt.steps.close_all()
            for s in list(rt.store.sessions.values()):
                rt.store.remove(s)
                try:
                    eng.release(s.kv)
                except ApiError:  # pragma: no cover - queue full at shutdown
                    pass
            if owned:
                await asyncio.to_thread(eng.close)
            else:
                assert previous_hooks is not None  # set wherever the engine is not owned
                eng.worker.on_batch, eng.worker.on_job_start = previous_hooks
            log.info("stopped")

    # /docs (Swagger UI) and /redoc with their scripts, styles and icon served from
    # the fastapi-offline package under DOCS_ASSETS, not from a CDN: the pages work
    # on a host with no internet access
    app = FastAPIOffline(
        static_url=DOCS_ASSETS,
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
            {"name": "steps", "description": "A batch of sessions held open across layers, called once a layer."},
            {"name": "probes", "description": "Liveness, readiness, metrics and server info."},
        ],
    )
    app.state.runtime = rt
    app.include_router(sessions.router)
    app.include_router(http.router)
    app.include_router(websocket.router)
    app.include_router(snapshots.router)
    app.include_router(steps.router)
    app.include_router(probes.router)
    app.include_router(problem_pages.router)
    _install_error_handlers(app)
    install_gauges(rt)
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
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components())
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
                                "401",
                                {
                                    "description": "Problem: unauthorized",
                                    "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
                                },
                            )
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def _warm_up_then_ready(rt: Runtime, engine: Engine) -> None:
    """Warm the kernels the settings name (warmup.py), then mark the server ready. A
    failed warm-up is logged and the server serves all the same: the kernels then
    compile on first use, and /readyz still says whether the GPU thread runs."""
    s = rt.settings
    try:
        await warm_up(engine, s.warmup_formats(), s.warmup_shape_list())
    except Exception as e:
        log.exception(
            "kernel warm-up failed; serving without it (kernels compile on first use)", extra={"error": str(e)}
        )
    finally:
        rt.warming_up = False
    if not rt.draining:
        rt.mark_ready()


# ── errors ───────────────────────────────────────────────────────────────────


def _problem(request: Request, err: ApiError) -> Response:
    request.scope[PROBLEM_KEY] = err.slug
    return problem_response(err, request.url.path)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _problem(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        for e in errors:
            loc = tuple(e.get("loc", ()))
            if loc[:2] == ("path", "layer"):
                return _problem(request, LayerNotFound(f"layer {e.get('input')!r} is not a layer index"))
            if loc[:2] == ("path", "step"):
                return _problem(request, StepNotFound(f"no open step {e.get('input')!r}"))
        parts = []
        for e in errors[:5]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body", "query", "path"))
            parts.append(f"{where or 'request'}: {e.get('msg', 'invalid')}")
        return _problem(request, InvalidRequest("; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
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
