"""The per-request middleware: request id, access log, metrics, drain, API keys,
request timeouts, last-resort 500."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .codec import problem_response
from .errors import ApiError, InternalError, NotReady, RequestTimeout, Unauthorized
from .runtime import OWNER_KEY, RequestState, Runtime, current_request

__all__ = ["RequestMiddleware", "PROBLEM_KEY"]

log = logging.getLogger("attnserve")
access_log = logging.getLogger("attnserve.access")

#: The scope key under which a request's problem slug is kept (for the log and metrics).
PROBLEM_KEY = "attnserve.problem"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


# ── per-request middleware: access log, metrics, drain, last-resort 500 ─────


class RequestMiddleware:
    """Pure ASGI middleware (no body buffering): times every request, logs one
    structured line, counts it, refuses new /v1 work while draining or warming up, checks the
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
            scope[PROBLEM_KEY] = err.slug
            await problem_response(err, path)(scope, receive, send_wrapper)

        req = RequestState()
        token = current_request.set(req)
        rt.request_started()
        try:
            v1 = path == "/v1" or path.startswith("/v1/")
            # draining, no new /v1 request; warming up, none but /v1/info (which says ready: false),
            # not even a session's read, so a session answers only once it takes every operation
            if v1 and (rt.draining or (rt.warming_up and path != "/v1/info")):
                await answer(NotReady(rt.not_ready_reason() or "not ready"))
            elif rt.keys.enabled and (v1 or (path == "/metrics" and rt.settings.metrics_auth)):
                try:
                    scope[OWNER_KEY] = rt.keys.authenticate(_header(scope, b"authorization"))
                except Unauthorized as e:
                    rt.metrics.auth_failures.labels(getattr(e, "reason", "invalid")).inc()
                    await answer(e)
                else:
                    await self.app(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            if not req.timed_out or state["started"]:
                raise
            # our request timeout cancelled the queued GPU job: nothing was applied
            await answer(
                RequestTimeout(
                    f"the request waited more than {rt.settings.request_timeout_s:g} s for the GPU and was "
                    "dropped; nothing was applied, so it is safe to retry",
                    headers={"Retry-After": "1"},
                )
            )
        except ClientDisconnect:
            if not state["started"]:
                state["status"] = 499
        except Exception:
            log.exception("unhandled error", extra={"request_id": rid, "method": method, "path": path})
            if not state["started"]:
                scope[PROBLEM_KEY] = InternalError.slug
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
            slug = scope.get(PROBLEM_KEY)
            if slug:
                rt.metrics.errors_by[slug].inc()
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
    v: bytes  # an ASGI header value (the scope is typed as a plain mapping)
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


def _request_id(scope: Scope) -> str:
    v: bytes
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
