"""Snapshots over HTTP: ``GET`` a session as one blob, ``PUT`` a blob to restore it
(the format: :mod:`attnserve.snapshot_format`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from ..codec import read_body, respond, wire
from ..errors import UnsupportedMediaType
from ..snapshot_format import build_blob, load, parse_blob, read_layers, restore_bytes
from ..store import check_session_id
from ..transport.deps import EngineDep, OwnerDep, RuntimeDep, SessionDep, SessionIdPath, WireDep, merge_responses
from ..lifecycle import check_kept, place_session
from ..contract import ok, problems

__all__ = ["router"]

router = APIRouter(prefix="/v1/sessions/{session_id}", tags=["snapshots"])


@router.get(
    "/snapshot",
    summary="Snapshot a session",
    description="The session as one self-describing MessagePack blob: format name and version, the "
    "configuration with its seed, each layer's length and cache exactly as held on the GPU, and a checksum. "
    "Taken after every request already accepted for the session (with exact `sinks` or a `window`, "
    "their rows too).",
    response_class=Response,
    responses=merge_responses(
        {
            200: {
                "description": "The snapshot blob.",
                "content": {wire.MSGPACK: {"schema": {"type": "string", "format": "binary"}}},
            }
        },
        problems(404, 503, slugs={404: "session-not-found"}),
    ),
)
async def get_snapshot(session: SessionDep, rt: RuntimeDep, engine: EngineDep) -> Response:
    layers = await asyncio.shield(asyncio.wrap_future(engine.call(read_layers(session.kv))))
    size = sum(len(kb) + len(vb) for _, _, kb, vb in layers)
    blob = await rt.offload(build_blob, session.config, layers, size=size)
    return Response(
        blob, media_type=wire.MSGPACK, headers={"Content-Disposition": f'attachment; filename="{session.id}.attnsnap"'}
    )


@router.put(
    "/snapshot",
    summary="Restore a snapshot",
    description="Restores a snapshot blob under the id in the path (409 session-exists if taken; 422 "
    "invalid-snapshot for a truncated, corrupted, wrong-version or oversized blob, and nothing is created). "
    "Attends on the restored session give bit-identical results.",
    status_code=201,
    response_class=Response,
    openapi_extra={
        "requestBody": {"required": True, "content": {wire.MSGPACK: {"schema": {"type": "string", "format": "binary"}}}}
    },
    responses=merge_responses(
        ok(201, "The restored session's info", "SessionInfo"),
        problems(
            408,
            409,
            413,
            415,
            422,
            503,
            507,
            slugs={408: "body-timeout", 409: "session-exists", 422: "invalid-snapshot"},
        ),
    ),
)
async def put_snapshot(
    session_id: SessionIdPath, request: Request, rt: RuntimeDep, wire_: WireDep, engine: EngineDep, owner: OwnerDep
) -> Response:
    if wire_.request == "json":
        raise UnsupportedMediaType("a snapshot is a MessagePack blob: send Content-Type application/vnd.msgpack")
    check_session_id(session_id)
    store = rt.store
    store.check_room(session_id, owner)  # the restored session is the caller's (ids are per tenant)
    raw = await read_body(request, rt.settings.max_body_bytes)
    config, layers = await rt.offload(
        parse_blob, raw, rt.settings.max_body_bytes, engine.max_tokens_limit, size=len(raw)
    )
    check_kept(rt, config)  # a windowed session where this server cannot keep it: 422, nothing made
    # From here to the queueing: no await, so the id and budget checks hold.
    kv = engine.session_kv(config)
    # 409 / 507 now; the id and bytes stay taken while restoring
    hold = store.hold(session_id, restore_bytes(kv, layers), owner)
    session = await place_session(rt, engine, kv, lambda: engine.call(lambda ctx: load(ctx, kv, layers)), hold)
    return respond(session.info(), wire_, 201, headers={"Location": f"/v1/sessions/{session.id}"})
