"""Probes, metrics and server info: /livez, /readyz (and /health, its alias),
/metrics, /v1/info.

None of them touches the GPU thread, so a slow GPU never stalls them.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Response

from .. import __version__
from ..codec import respond
from ..errors import NotReady
from .. import formats
from ..metrics import CONTENT_TYPE
from ..contract import MAX_LAYERS, MAX_QO_HEADS
from ..transport.deps import OwnerDep, Runtime, RuntimeDep, WireDep, merge_responses
from ..contract import ok, problems

__all__ = ["router", "API_VERSION"]

router = APIRouter(tags=["probes"])
API_VERSION = 1


@router.get(
    "/livez",
    summary="Liveness: the process is up",
    response_class=Response,
    responses=merge_responses(ok(200, "Alive", "Status")),
)
async def livez(wire: WireDep) -> Response:
    return respond({"status": "ok"}, wire)


_READINESS = merge_responses(ok(200, "Ready", "Status"), problems(503, slugs={503: "not-ready"}))


async def readiness(rt: RuntimeDep, wire: WireDep) -> Response:
    """200 ``{"status": "ready"}`` when the server takes work, else 503 not-ready saying why."""
    reason = rt.not_ready_reason()
    if reason is None and rt.engine is not None and not rt.engine.worker.alive:
        reason = "the GPU thread has stopped"
    if reason is not None:
        raise NotReady(reason)
    return respond({"status": "ready"}, wire)


# one answer under two names: /readyz (Kubernetes' habit) and /health (vLLM's, TGI's, llama.cpp's)
for _path, _name, _summary in (
    ("/readyz", "readyz", "Readiness: the device is open, the kernels are warm and the server is not draining"),
    ("/health", "health", "Health, where vLLM, TGI and llama.cpp have it: the answer of /readyz"),
):
    router.add_api_route(
        _path, readiness, methods=["GET"], name=_name, summary=_summary, response_class=Response, responses=_READINESS
    )


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition format 0.0.4.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
async def metrics(rt: RuntimeDep) -> Response:
    return Response(rt.metrics.render(), media_type=CONTENT_TYPE)


def server_info(rt: Runtime, owner: str | None = None) -> dict[str, Any]:
    s = rt.settings
    eng = rt.engine
    adapter = eng.describe() if eng is not None else None
    return {
        "name": "attnserve",
        "version": __version__,
        "api_version": API_VERSION,
        "adapter": adapter,
        "backend": adapter["backend"] if adapter else None,
        **formats.catalog(),
        "limits": {
            "max_body_bytes": s.max_body_bytes,
            "memory_budget_bytes": s.memory_budget_bytes,
            "memory_used_bytes": rt.store.used_bytes,
            "max_sessions": s.max_sessions,
            "default_max_tokens": s.default_max_tokens,
            "max_layers": MAX_LAYERS,
            "max_qo_heads": MAX_QO_HEADS,
            "max_binding_bytes": eng.max_binding if eng is not None else None,
            "max_queue": s.max_queue,
            "max_batch_jobs": s.max_batch_jobs,
            "max_batch_items": s.max_batch_items,
            "quota_sessions_per_key": s.quota_sessions_per_key,
            "quota_bytes_per_key": s.quota_bytes_per_key,
            "request_timeout_s": s.request_timeout_s,
            "session_ttl_seconds": s.session_ttl_seconds,
        },
        # with API keys, a tenant sees its own sessions and bytes only
        "sessions": len(rt.store.list(owner)) if rt.keys.enabled else len(rt.store),
        "tenant_bytes": rt.store.tenant_bytes(owner),
        "auth": rt.keys.enabled,
        "persistence": rt.persistence is not None,
        "pool": eng.pools.describe() if eng is not None else None,
        "arenas": {"bytes": eng.worker.arenas.held_bytes} if eng is not None else None,
        "pipelines": {"compiled": len(eng.worker.ctx.pipelines)} if eng is not None else None,
        "journal": rt.persistence.journal_info() if rt.persistence is not None else None,
        "ready": bool(rt.ready and not rt.draining),
        "frames": {"port": rt.frames_port} if rt.frames_port is not None else None,
        "shm": (
            {"socket": rt.shm_socket, "max_region_bytes": s.shm_max_region_bytes, "uid": os.getuid()}
            if rt.shm_socket is not None
            else None
        ),
    }


@router.get(
    "/v1/info",
    summary="Server info: adapter, limits, kv formats, version",
    response_class=Response,
    responses=merge_responses(ok(200, "Server info", "ServerInfo")),
)
async def info(rt: RuntimeDep, wire: WireDep, owner: OwnerDep) -> Response:
    return respond(server_info(rt, owner), wire)
