"""The data plane over HTTP: append K/V to a layer, attend (with an optional fused
append), the batched step (``POST /v1/batch/attend``) and a layer call of an open
step (``POST /v1/steps/{step}/layers/{layer}``), as one router.

Each request goes: negotiate (415, declared 413) -> session and layer (404; the
batched step's items: each in its own result) -> read the body (streamed 413) ->
decode (400) and check fields (422), off the event loop when large -> a step
(``step/``; a single append or attend is a step of one): its rules against the
session's reserved state (422, 409, 507) -> queue its GPU job -> await it -> the
answer.
Everything up to the queueing runs without an ``await`` after the body is decoded,
so a request is either refused with every cache untouched, or queued in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request, Response

from ..codec import MediaKind, Wire, decode_document, encode, read_body, respond
from ..engine import Engine
from ..runtime import Runtime
from ..step.answer import answer_document, count_problems, encode_answer
from ..step.parse import Parsed, one_append, one_attend, parse_append, parse_attend, parse_batch
from ..step.plan import Outcome, finish_request, queue_request
from ..step.rules import layer_problem
from ..step.steps import begin_call, finish_call, get_step
from ..store import Session
from .deps import EngineDep, LayerPath, OwnerDep, RuntimeDep, SessionDep, StepPath, WireDep, merge_responses
from ..contract import ok, problems, request_body
from ..errors import ApiError

__all__ = ["router"]

# The statuses an append or attend can answer with.
_STATUSES = (400, 404, 408, 409, 413, 415, 422, 500, 503, 507)

router = APIRouter(tags=["kv"])

#: The path of a session's layer, under which its append and attend live.
LAYER_PATH = "/v1/sessions/{session_id}/layers/{layer}"

_Body = TypeVar("_Body")  # what a route's parse gives (an AppendRequest, an AttendRequest)


def _layer(session: Session, layer_path: str) -> int:
    layer = int(layer_path)  # the path pattern allows 1 to 10 digits only
    problem = layer_problem(session, layer)
    if problem is not None:
        raise problem
    return layer


async def _read(
    request: Request,
    rt: Runtime,
    wire: Wire,
    session: Session,
    layer: str,
    parse: Callable[[bytes, MediaKind | None, int], _Body],
    one: Callable[[str, int, _Body], Parsed],
) -> Parsed:
    """Read and parse the body (``parse(raw, kind, max_bytes)``, off the event loop
    when large) into a step of one (``one(session_id, layer, parsed)``). A layer out
    of range is a 404 before any of the body is read."""
    li = _layer(session, layer)
    max_bytes = rt.settings.max_body_bytes
    raw = await read_body(request, max_bytes)
    req: _Body = await rt.offload(parse, raw, wire.request, max_bytes, size=len(raw))
    return one(session.id, li, req)


async def _run(rt: Runtime, engine: Engine, owner: str | None, parsed: Parsed) -> Outcome:
    """Check and queue a route's step of one, and await it: its outcome (a refusal
    raises its problem). Its checks see the store as it is after the body's awaits
    (the session may have been deleted, or deleted and created anew, meanwhile). A
    job the request timeout drops answers through the middleware (503)."""
    queued = queue_request(rt, engine, owner, parsed)
    if 0 in queued.problems:
        raise queued.problems[0]
    outcome = await finish_request(rt, queued, what="request")
    problem = outcome.problems.get(0)
    if problem is not None:
        if queued.futures and queued.futures[0].cancelled():
            raise asyncio.CancelledError  # the request timeout dropped it: the middleware answers 503
        raise problem
    return outcome


@router.post(
    f"{LAYER_PATH}/kv",
    summary="Append K/V rows to a layer",
    description="Appends n >= 1 timesteps to the layer and answers its new length. With `offset`, the "
    "append happens only if the layer's length is `offset` (409 offset-mismatch with `length` otherwise): "
    "a retried append is safe.",
    response_class=Response,
    openapi_extra=request_body("AppendJson", "AppendMsgpack"),
    responses=merge_responses(
        ok(200, "The layer's new length", "AppendResult"),
        problems(
            *_STATUSES,
            slugs={408: "body-timeout", 409: "offset-mismatch, capacity-exceeded, session-in-step"},
        ),
    ),
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
    parsed = await _read(request, rt, wire, session, layer, parse_append, one_append)
    outcome = await _run(rt, engine, owner, parsed)
    return respond(answer_document(outcome, wire.response, request.scope["path"]), wire)


@router.post(
    f"{LAYER_PATH}/attend",
    summary="Attend (with an optional fused append)",
    description="Appends `k`, `v` first when given (checked with `offset` before), then attends the query rows "
    "`q`: row i sits at position start_pos + i and, with `causal`, attends to timesteps 0..start_pos + i. "
    "A decode step is one call with one row of q, k and v. With `return_lse` the answer also holds `lse` "
    "[n, num_qo_heads]: each row's log-sum-exp (natural log) of its scaled scores, to merge partial attention.",
    response_class=Response,
    openapi_extra=request_body("AttendJson", "AttendMsgpack"),
    responses=merge_responses(
        ok(200, "The attention output and the layer's length", "AttendResultJson", "AttendResultMsgpack"),
        problems(
            *_STATUSES,
            slugs={408: "body-timeout", 409: "offset-mismatch, capacity-exceeded (fused append), session-in-step"},
        ),
    ),
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
    parsed = await _read(request, rt, wire, session, layer, parse_attend, one_attend)
    outcome = await _run(rt, engine, owner, parsed)
    q = parsed.steps[0].q
    assert q is not None
    size = q.nbytes * (1 if wire.response == "msgpack" else 6)  # JSON text is ~6x the float32 bytes
    body = await rt.offload(encode_answer, outcome, wire.response, request.scope["path"], size=size)
    return respond(None, wire, body=body)


@router.post(
    "/v1/batch/attend",
    summary="Batched step: attend (with optional fused appends) for many sessions at once",
    description="One layer's work for many sessions: `items` is an array of attends, each with `session_id` "
    "and `layer` and the members of `POST /v1/sessions/{id}/layers/{layer}/attend`. The items that pass "
    "their checks run in one GPU submission; items of one session and layer apply in item order. The answer "
    "has one result per item, in order: `{out, length}`, or `{error}` holding the item's problem (the item "
    "changed nothing). A body malformed as a whole is one problem, as on the other routes. At most "
    "`limits.max_batch_items` items (`/v1/info`).",
    response_class=Response,
    openapi_extra=request_body("BatchAttendJson", "BatchAttendMsgpack"),
    responses=merge_responses(
        ok(200, "One result per item", "BatchAttendResultJson", "BatchAttendResultMsgpack"),
        problems(400, 408, 413, 415, 422, 500, 503, slugs={408: "body-timeout"}),
    ),
)
async def batch_attend(request: Request, rt: RuntimeDep, wire: WireDep, engine: EngineDep, owner: OwnerDep) -> Response:
    max_bytes = rt.settings.max_body_bytes
    raw = await read_body(request, max_bytes)
    parsed = await rt.offload(parse_batch, raw, wire.request, max_bytes, rt.settings.max_batch_items, size=len(raw))
    outcome = await finish_request(rt, queue_request(rt, engine, owner, parsed))
    count_problems(rt, outcome)
    size = len(raw) * (1 if wire.response == "msgpack" else 6)
    body = await rt.offload(encode_answer, outcome, wire.response, request.url.path, size=size)
    return respond(None, wire, body=body)


@router.post(
    "/v1/steps/{step}/layers/{layer}",
    summary="Call a layer of an open step",
    description="One layer call of a step (`POST /v1/steps`): only the arrays, `q` [B, queries, num_qo_heads, "
    "head_dim] and, when the step's rows > 0, `k`, `v` [B, rows, num_kv_heads, head_dim], in the step's dtype "
    "(without the rows axis when queries or rows is 1). It runs as the stacked form of `POST /v1/batch/attend` "
    "over the step's sessions with the step's options, and answers the same document (bit-identical) with "
    "`token`, the token the call belonged to. Each layer is called once a token, in any order; once every "
    "layer of the step has been called, the token advances. A call whose items all fail changes nothing and "
    "may be retried; one that applies to some sessions and fails for others breaks the step (409 step-broken "
    "from then on).",
    response_class=Response,
    openapi_extra=request_body("StepCallArraysJson", "StepCallArraysMsgpack"),
    responses=merge_responses(
        ok(200, "The stacked answer and the call's token", "StepCallResultJson", "StepCallResultMsgpack"),
        problems(
            400,
            404,
            408,
            409,
            413,
            415,
            422,
            500,
            503,
            slugs={404: "step-not-found", 408: "body-timeout", 409: "step-layer-called, step-broken"},
        ),  # fmt: skip
    ),
)
async def call_step(
    request: Request, step: StepPath, layer: LayerPath, rt: RuntimeDep, wire: WireDep, engine: EngineDep,
    owner: OwnerDep,
) -> Response:  # fmt: skip
    handle = int(step)  # the path pattern allows digits only
    try:
        get_step(rt, owner, handle)  # 404 before any of the body is read
    except ApiError:
        rt.metrics.step_calls_by["refused"].inc()
        raise
    max_bytes = rt.settings.max_body_bytes
    raw = await read_body(request, max_bytes)
    doc = await rt.offload(decode_document, raw, wire.request, max_bytes, size=len(raw))
    call = begin_call(rt, engine, owner, doc, what="step call", target=(handle, int(layer)))
    answer = await finish_call(rt, call, wire.response, request.url.path)
    size = len(raw) * (1 if wire.response == "msgpack" else 6)
    body = await rt.offload(encode, answer, wire.response, size=size)
    return respond(None, wire, body=body)
