"""Append K/V to a layer, and attend (with an optional fused append).

Each request goes: negotiate (415, declared 413) -> session and layer (404) ->
read the body (streamed 413) -> decode (400) and check fields (422), off the
event loop when large -> check against the session's reserved state (422, 409,
507) -> queue one GPU job -> await it. Everything up to the queueing runs
without an ``await`` after the body is decoded, so a request is either refused
with every cache untouched, or queued in order.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response

from ..codec import MediaKind, Wire, encode, read_body, respond
from ..engine import AttendResult
from ..store import Session
from .deps import EngineDep, LayerPath, OwnerDep, Runtime, RuntimeDep, SessionDep, WireDep
from ..operations import (
    attend_document,
    check_append,
    check_attend,
    count_rows,
    layer_index,
    parse_append,
    parse_attend,
    queue_one,
)
from .schemas import ok, problems, request_body

__all__ = ["router"]

# The statuses an append or attend can answer with.
_STATUSES = (400, 404, 408, 409, 413, 415, 422, 500, 503, 507)

router = APIRouter(prefix="/v1/sessions/{session_id}/layers/{layer}", tags=["kv"])


def _layer(session: Session, layer_path: str) -> int:
    return layer_index(session, int(layer_path))  # the path pattern allows 1 to 10 digits only


async def _read(
    request: Request, rt: Runtime, wire: Wire, session: Session, owner: str | None, layer: str, parse: Any
) -> tuple[Session, int, Any]:
    """Read and parse the body (``parse(raw, kind, max_bytes)``, off the event loop
    when large); return the session looked up again after those awaits (it may have
    been deleted, or even deleted and created anew under the same id, meanwhile),
    the layer index, and the parsed request. A layer out of range is a 404 before
    any of the body is read."""
    _layer(session, layer)
    max_bytes = rt.settings.max_body_bytes
    raw = await read_body(request, max_bytes)
    req = await rt.offload(parse, raw, wire.request, max_bytes, size=len(raw))
    session = rt.store.get(session.id, owner)
    return session, _layer(session, layer), req


@router.post(
    "/kv",
    summary="Append K/V rows to a layer",
    description="Appends n >= 1 timesteps to the layer and answers its new length. With `offset`, the "
    "append happens only if the layer's length is `offset` (409 offset-mismatch with `length` otherwise): "
    "a retried append is safe.",
    response_class=Response,
    openapi_extra=request_body("AppendJson", "AppendMsgpack"),
    responses={
        **ok(200, "The layer's new length", "AppendResult"),
        **problems(
            *_STATUSES,
            slugs={408: "body-timeout", 409: "offset-mismatch, capacity-exceeded"},
        ),
    },
)
async def append_kv(
    request: Request,
    layer: LayerPath,
    rt: RuntimeDep,
    wire: WireDep,
    engine: EngineDep,
    session: SessionDep,
    owner: OwnerDep,
) -> Response:
    session, li, req = await _read(request, rt, wire, session, owner, layer, parse_append)
    # From here to the queueing: no await, so the check and the queue order agree.
    op = check_append(rt, engine, session, li, req)
    length = await asyncio.shield(asyncio.wrap_future(queue_one(rt, engine, op)))
    count_rows(rt, op)
    return respond({"length": length}, wire)


def _attend_body(result: AttendResult, kind: MediaKind, return_lse: bool) -> bytes:
    return encode(attend_document(result, kind, return_lse), kind)


@router.post(
    "/attend",
    summary="Attend (with an optional fused append)",
    description="Appends `k`, `v` first when given (checked with `offset` before), then attends the query rows "
    "`q`: row i sits at position start_pos + i and, with `causal`, attends to timesteps 0..start_pos + i. "
    "A decode step is one call with one row of q, k and v. With `return_lse` the answer also holds `lse` "
    "[n, num_qo_heads]: each row's log-sum-exp (natural log) of its scaled scores, to merge partial attention.",
    response_class=Response,
    openapi_extra=request_body("AttendJson", "AttendMsgpack"),
    responses={
        **ok(200, "The attention output and the layer's length", "AttendResultJson", "AttendResultMsgpack"),
        **problems(
            *_STATUSES,
            slugs={408: "body-timeout", 409: "offset-mismatch, capacity-exceeded (fused append)"},
        ),
    },
)
async def attend(
    request: Request,
    layer: LayerPath,
    rt: RuntimeDep,
    wire: WireDep,
    engine: EngineDep,
    session: SessionDep,
    owner: OwnerDep,
) -> Response:
    session, li, req = await _read(request, rt, wire, session, owner, layer, parse_attend)
    op = check_attend(rt, engine, session, li, req)
    result = await asyncio.shield(asyncio.wrap_future(queue_one(rt, engine, op)))
    count_rows(rt, op)
    size = result.out.nbytes * (1 if wire.response == "msgpack" else 6)  # JSON text is ~6x the float32 bytes
    body = await rt.offload(_attend_body, result, wire.response, req.return_lse, size=size)
    return respond(None, wire, body=body)
