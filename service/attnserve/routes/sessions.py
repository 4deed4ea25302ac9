"""Sessions: create (POST, or PUT with the client's id), get, list, fork, delete."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from fastapi import APIRouter, Request, Response

from ..codec import MediaKind, decode_document, read_body, respond
from ..errors import InvalidRequest
from ..kv.config import SessionConfig
from ..session_spec import CreateRequest, parse_create
from ..store import check_session_id, step_conflict
from ..transport.deps import EngineDep, OwnerDep, RuntimeDep, SessionDep, SessionIdPath, WireDep, merge_responses
from ..lifecycle import check_kept, place_session
from ..contract import ok, problems, request_body

__all__ = ["router"]

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


def _decode_create(raw: bytes, kind: MediaKind | None, max_bytes: int) -> CreateRequest:
    return parse_create(decode_document(raw, kind, max_bytes))


async def _create(
    request: Request, rt: RuntimeDep, wire: WireDep, engine: EngineDep, owner: str | None, session_id: str | None
) -> Response:
    if session_id is not None:
        check_session_id(session_id)
    rt.store.check_room(session_id, owner)  # early 409 / 507, before reading the body
    raw = await read_body(request, rt.settings.max_body_bytes)
    req = await rt.offload(_decode_create, raw, wire.request, rt.settings.max_body_bytes, size=len(raw))
    windowed = bool(req.sinks or req.window)
    # a window's rows are held in float32 pages beside the codes: their binding limit counts too
    formats = (*req.layer_formats, "f32") if windowed else req.layer_formats
    limit = engine.max_tokens_limit(formats, req.num_kv_heads, req.head_dim)
    if req.max_tokens is None:
        max_tokens = min(rt.settings.default_max_tokens, limit)
    elif req.max_tokens > limit:
        names = " and ".join(dict.fromkeys(formats))
        raise InvalidRequest(
            f"max_tokens: this adapter can bind at most {limit} timesteps per layer for "
            f"{names} with num_kv_heads {req.num_kv_heads} and head_dim {req.head_dim}, "
            f"got {req.max_tokens}",
            max_tokens_limit=limit,
        )
    else:
        max_tokens = req.max_tokens
    seed = req.seed if req.seed is not None else secrets.randbits(53)
    config = SessionConfig(
        req.num_layers, req.num_qo_heads, req.num_kv_heads, req.head_dim, req.kv_format, max_tokens, seed,
        req.sinks, req.window,
    )  # fmt: skip
    check_kept(rt, config)
    session = rt.store.create(engine.session_kv(config), owner=owner, session_id=session_id)  # checks the room again
    return respond(session.info(), wire, 201, headers={"Location": f"/v1/sessions/{session.id}"})


_CREATE_DOC: dict[str, Any] = dict(
    status_code=201,
    response_class=Response,
    openapi_extra=request_body("CreateSession"),
)


@router.post(
    "",
    summary="Create a session",
    description="Creates a session: a KV cache for every layer of one sequence, with a random id.",
    responses=merge_responses(
        ok(201, "The session's info", "SessionInfo"),
        problems(400, 408, 413, 415, 422, 503, 507, slugs={408: "body-timeout"}),
    ),
    **_CREATE_DOC,
)
async def create_session(
    request: Request, rt: RuntimeDep, wire: WireDep, engine: EngineDep, owner: OwnerDep
) -> Response:
    return await _create(request, rt, wire, engine, owner, None)


@router.put(
    "/{session_id}",
    summary="Create a session with a chosen id",
    description="Creates a session under the id in the path (`[A-Za-z0-9_-]{1,64}`); 409 session-exists "
    "if the caller already has a session with that id (ids are per API key: another key's sessions never "
    "collide). A router in front of several replicas can hash the id, so a session lives on one replica.",
    responses=merge_responses(
        ok(201, "The session's info", "SessionInfo"),
        problems(400, 408, 409, 413, 415, 422, 503, 507, slugs={408: "body-timeout", 409: "session-exists"}),
    ),
    **_CREATE_DOC,
)
async def put_session(
    session_id: SessionIdPath, request: Request, rt: RuntimeDep, wire: WireDep, engine: EngineDep, owner: OwnerDep
) -> Response:
    return await _create(request, rt, wire, engine, owner, session_id)


@router.get(
    "",
    summary="List the caller's sessions",
    response_class=Response,
    responses=merge_responses(ok(200, "The sessions' info", "SessionList"), problems(503)),
)
async def list_sessions(rt: RuntimeDep, wire: WireDep, owner: OwnerDep) -> Response:
    return respond({"sessions": [s.info() for s in rt.store.list(owner)]}, wire)


@router.get(
    "/{session_id}",
    summary="Get a session's info",
    response_class=Response,
    responses=merge_responses(
        ok(200, "The session's info", "SessionInfo"), problems(404, 503, slugs={404: "session-not-found"})
    ),
)
async def get_session_info(session: SessionDep, wire: WireDep) -> Response:
    return respond(session.info(), wire)


def _decode_fork(raw: bytes, kind: MediaKind | None, max_bytes: int) -> tuple[str | None, int | None]:
    doc = decode_document(raw, kind, max_bytes)
    if not isinstance(doc, dict):
        raise InvalidRequest(f"expected an object, got {type(doc).__name__}")
    extra = sorted(set(doc) - {"session_id", "length"})
    if extra:
        raise InvalidRequest(f"unknown field(s) {extra}; a fork takes session_id and length")
    sid, length = doc.get("session_id"), doc.get("length")
    if sid is not None:
        check_session_id(sid)
    if length is not None and (type(length) is not int or length < 0):
        raise InvalidRequest(f"length: expected an integer >= 0, got {length!r}")
    return sid, length


@router.post(
    "/{session_id}/fork",
    summary="Fork a session",
    description="Creates a session that starts as this one's first `length` timesteps of every layer "
    "(default: each layer's current length), owned by the same API key, and answers 201 with its info. "
    "The two share the GPU pages that are full (rows are append-only, so a shared page is never written); "
    "a partly filled last page is copied, so a fork of a session whose lengths are whole pages costs no "
    "copy and at most one new page per layer. A shared page is charged once (budget, quotas, `bytes`): to "
    "the session that took it, and when that one is deleted, to a session still holding it. Deleting "
    "either side frees only the pages nobody else holds; a snapshot of a fork is self-contained.",
    status_code=201,
    response_class=Response,
    openapi_extra=request_body("ForkSession", required=False),
    responses=merge_responses(
        ok(201, "The new session's info", "SessionInfo"),
        problems(400, 404, 408, 409, 413, 415, 422, 503, 507, slugs={404: "session-not-found", 409: "session-exists"}),
    ),
)
async def fork_session(
    session: SessionDep, request: Request, rt: RuntimeDep, wire: WireDep, engine: EngineDep, owner: OwnerDep
) -> Response:
    raw = await read_body(request, rt.settings.max_body_bytes)
    new_id, length = await rt.offload(
        _decode_fork, raw, wire.request if raw else None, rt.settings.max_body_bytes, size=len(raw)
    )
    store = rt.store
    # the source as it is now the body is read: it may have been deleted meanwhile (404)
    session = store.get(session.id, owner)
    store.check_room(new_id, owner)
    new_id = store.unused_id(owner) if new_id is None else new_id
    # From here to the queueing: no await, so the checks below hold.
    lengths = [ls.length for ls in session.layers]  # after every job queued on the source
    if length is not None:
        short = [i for i, n in enumerate(lengths) if n < length]
        if short:
            raise InvalidRequest(
                f"length: {length} passes layer {short[0]}'s length {lengths[short[0]]}; a fork takes at most "
                "each layer's length",
                lengths=lengths,
            )
        lengths = [length] * len(lengths)
    kv = engine.session_kv(session.config)
    # charged for what it does not share (LayerCache.fork_bytes)
    need = sum(c.fork_bytes(n) for c, n in zip(kv.layers, lengths))
    hold = store.hold(new_id, need, owner, what=f"the fork {new_id!r} of session {session.id!r}")  # 409 / 507
    # the fork runs after the jobs queued on its source
    forked = await place_session(rt, engine, kv, lambda: engine.fork(session.kv, kv, lengths), hold)
    store.join(session, forked)
    return respond(forked.info(), wire, 201, headers={"Location": f"/v1/sessions/{forked.id}"})


@router.delete(
    "/{session_id}",
    summary="Delete a session",
    description="Frees the session's GPU memory (after any of its work already queued) and answers 204. A "
    "session in an open step is 409 session-in-step: close the step first.",
    status_code=204,
    response_class=Response,
    responses=merge_responses(
        {204: {"description": "Deleted."}},
        problems(404, 409, 503, slugs={404: "session-not-found", 409: "session-in-step"}),
    ),
)
async def delete_session(session: SessionDep, rt: RuntimeDep, engine: EngineDep) -> Response:
    conflict = step_conflict(session)  # a session in an open step: close the step first (409)
    if conflict is not None:
        raise conflict
    fut = rt.drop_session(session, engine)  # queued after the session's jobs; may raise Overloaded
    await asyncio.shield(asyncio.wrap_future(fut))
    return Response(status_code=204)
