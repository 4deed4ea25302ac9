"""The batched step: one layer's attention for many sessions in one request.

``POST /v1/batch/attend`` carries ``{"items": [item, ...]}``; an item is an attend
(the members of ``POST .../attend``) plus ``session_id`` and ``layer``. Every item
is checked as the single attend checks it, in item order against the state the
items before it leave (so items of one session and layer apply in order); an
item that fails gets its own problem in its slot and changes nothing. The items
that pass go to the GPU together: one submission, one readback. The answer,
``{"results": [...]}`` in item order, holds ``{"out", "length"}`` or
``{"error": <problem>}`` per item.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response

from ..codec import Fields, MediaKind, decode_document, encode, read_body, respond
from ..engine import Engine
from ..errors import ApiError, InternalError, InvalidRequest, RequestTimeout
from ..store import Owner
from .deps import EngineDep, OwnerDep, Runtime, RuntimeDep, WireDep
from .operations import (
    ATTEND_FIELDS,
    AttendRequest,
    Checked,
    attend_document,
    attend_fields,
    check_attend,
    count_rows,
    layer_index,
)
from .schemas import ok, problems, request_body

__all__ = [
    "router",
    "BatchItem",
    "QueuedBatch",
    "parse_batch",
    "parse_items",
    "queue_batch",
    "finish_batch",
    "settled",
    "results_document",
    "count_errors",
    "BATCH_ITEM_FIELDS",
]

log = logging.getLogger("attnserve")

router = APIRouter(prefix="/v1/batch", tags=["kv"])

BATCH_ITEM_FIELDS = ("session_id", "layer", *ATTEND_FIELDS)


@dataclass(frozen=True)
class BatchItem:
    """One parsed item: its target and attend, or the problem that refused it."""

    session_id: str | None = None
    layer: int = 0
    attend: AttendRequest | None = None
    error: ApiError | None = None


def parse_batch(raw: bytes, kind: MediaKind | None, max_bytes: int, max_items: int) -> list[BatchItem]:
    """The items of a batch body. A body that is malformed as a whole (not a map,
    no ``items`` list, too many items) raises; a malformed item is kept as an
    item with its problem."""
    return parse_items(Fields(decode_document(raw, kind, max_bytes), ("items",), "batch"), max_bytes, max_items)


def parse_items(f: Fields, max_bytes: int, max_items: int) -> list[BatchItem]:
    items = f.list("items")
    if not items:
        raise InvalidRequest("items: expected a non-empty array of attend items")
    if len(items) > max_items:
        raise InvalidRequest(
            f"items: {len(items)} items are more than this server takes in one batch ({max_items}); split it",
            max_batch_items=max_items,
        )
    return [parse_item(doc, i, max_bytes) for i, doc in enumerate(items)]


def parse_item(doc: Any, i: int, max_bytes: int) -> BatchItem:
    try:
        f = Fields(doc, BATCH_ITEM_FIELDS, f"items[{i}]")
        session_id = f.str("session_id")
        layer = f.int("layer", lo=0)
        return BatchItem(session_id, layer, attend_fields(f, max_bytes))
    except ApiError as e:
        return BatchItem(error=e)


def _check(rt: Runtime, engine: Engine, owner: Owner, item: BatchItem) -> Checked:
    if item.error is not None:
        raise item.error
    assert item.session_id is not None and item.attend is not None
    session = rt.store.get(item.session_id, owner)
    return check_attend(rt, engine, session, layer_index(session, item.layer), item.attend)


@dataclass(eq=False)
class QueuedBatch:
    """A batch whose items are checked and queued: per item the :class:`ApiError`
    that refused it, or its slot in ``futures``/``ops``."""

    outcome: list[Any]
    futures: list[Future]
    ops: list[tuple[int, Checked]]


def queue_batch(rt: Runtime, engine: Engine, owner: Owner, items: list[BatchItem]) -> QueuedBatch:
    """Check every item in order and queue those that pass as one GPU group. No
    ``await``: the checks see each other's reservations, and nothing else can come
    between the first check and the queueing."""
    outcome: list[Any] = [None] * len(items)
    checked: list[tuple[int, Checked]] = []
    for i, item in enumerate(items):
        try:
            op = _check(rt, engine, owner, item)
        except ApiError as e:
            outcome[i] = e
            continue
        rt.store.commit(op.res)
        checked.append((i, op))
    if not checked:
        return QueuedBatch(outcome, [], [])
    try:
        futures = engine.submit_group([op.plan for _, op in checked])
    except ApiError as e:  # Overloaded: nothing was queued; give every reservation back
        for i, op in checked:
            rt.store.finish(op.res, e)
            outcome[i] = e
        return QueuedBatch(outcome, [], [])
    for fut, (_, op) in zip(futures, checked):
        rt.watch(fut, op.res)
    return QueuedBatch(outcome, futures, checked)


async def finish_batch(rt: Runtime, queued: QueuedBatch) -> list[Any]:
    """Await a queued batch. Returns per item ``AttendResult`` or the
    :class:`ApiError` that failed it."""
    outcome = queued.outcome
    if queued.futures:
        done = await asyncio.shield(
            asyncio.gather(*(asyncio.wrap_future(f) for f in queued.futures), return_exceptions=True)
        )
        for fut, (i, op), result in zip(queued.futures, queued.ops, done):
            outcome[i] = settled(rt, fut, op, result)
    return outcome


def settled(rt: Runtime, fut: Future, op: Checked, result: Any) -> Any:
    if fut.cancelled():  # the request timeout dropped it from the queue: nothing applied
        return RequestTimeout(
            f"the item waited more than {rt.settings.request_timeout_s:g} s for the GPU and was dropped; "
            "nothing was applied, so it is safe to retry",
            headers={"Retry-After": "1"},
        )
    if isinstance(result, ApiError):
        return result
    if isinstance(result, BaseException):
        log.error("batch item failed", exc_info=result)
        return InternalError("an internal error occurred in this item; it was logged")
    count_rows(rt, op)
    return result


def results_document(outcome: list[Any], kind: MediaKind, instance: str) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    for i, r in enumerate(outcome):
        if isinstance(r, ApiError):
            results.append({"error": r.problem(instance) | {"item": i}})
        else:
            out, length = r
            results.append(attend_document(out, length, kind))
    return {"results": results}


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
    responses={
        **ok(200, "One result per item", "BatchAttendResultJson", "BatchAttendResultMsgpack"),
        **problems(400, 408, 413, 415, 422, 500, 503, slugs={408: "body-timeout"}),
    },
)
async def batch_attend(request: Request, rt: RuntimeDep, wire: WireDep, engine: EngineDep, owner: OwnerDep) -> Response:
    max_bytes = rt.settings.max_body_bytes
    raw = await read_body(request, max_bytes)
    items = await rt.offload(parse_batch, raw, wire.request, max_bytes, rt.settings.max_batch_items, size=len(raw))
    outcome = await finish_batch(rt, queue_batch(rt, engine, owner, items))
    count_errors(rt, outcome)
    size = len(raw) * (1 if wire.response == "msgpack" else 6)
    body = await rt.offload(_encode_results, outcome, wire.response, request.url.path, size=size)
    return respond(None, wire, body=body)


def count_errors(rt: Runtime, outcome: list[Any]) -> None:
    for r in outcome:
        if isinstance(r, ApiError):
            rt.metrics.errors.inc(r.slug)


def _encode_results(outcome: list[Any], kind: MediaKind, instance: str) -> bytes:
    return encode(results_document(outcome, kind, instance), kind)
