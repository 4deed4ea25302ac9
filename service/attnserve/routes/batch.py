"""``POST /v1/batch/attend``: the batched step over HTTP (its parse, checks,
queueing and answer are the ``step`` package's, which every transport shares)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..codec import read_body, respond
from ..step.answer import count_problems, encode_answer
from ..step.parse import parse_batch
from ..step.plan import finish_request, queue_request
from .deps import EngineDep, OwnerDep, RuntimeDep, WireDep, merge_responses
from .schemas import ok, problems, request_body

__all__ = ["router"]

router = APIRouter(prefix="/v1/batch", tags=["kv"])


@router.post(
    "/attend",
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
