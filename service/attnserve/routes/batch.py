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

import numpy as np

from ..codec import Fields, MediaKind, array_out, check_finite, decode_document, encode, read_body, respond
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
    attend_scale,
    check_attend,
    count_rows,
    fused_kv,
    layer_index,
    max_elements,
)
from .schemas import ok, problems, request_body

__all__ = [
    "router",
    "BatchItem",
    "ParsedBatch",
    "QueuedBatch",
    "parse_batch",
    "parse_batch_document",
    "parse_items",
    "parse_stacked",
    "queue_batch",
    "finish_batch",
    "settled",
    "answer_document",
    "results_document",
    "stacked_document",
    "count_errors",
    "BATCH_ITEM_FIELDS",
    "STACKED_FIELDS",
]

log = logging.getLogger("attnserve")

router = APIRouter(prefix="/v1/batch", tags=["kv"])

BATCH_ITEM_FIELDS = ("session_id", "layer", *ATTEND_FIELDS)
STACKED_FIELDS = ("session_ids", "layer", "q", "k", "v", "offsets", "start_pos", "causal", "scale")


@dataclass(frozen=True)
class BatchItem:
    """One parsed item: its target and attend, or the problem that refused it."""

    session_id: str | None = None
    layer: int = 0
    attend: AttendRequest | None = None
    error: ApiError | None = None


@dataclass(frozen=True)
class ParsedBatch:
    """A batch body's items and, for the stacked form, the shape ``(n, H, d)`` of
    one item's output (its answer is stacked too)."""

    items: list[BatchItem]
    out_shape: tuple[int, ...] | None = None


def parse_batch(raw: bytes, kind: MediaKind | None, max_bytes: int, max_items: int) -> ParsedBatch:
    """The items of a batch body, in either form. A body that is malformed as a
    whole (not a map, no ``items`` list or ``session_ids``, too many items, stacked
    arrays of the wrong shape) raises; a malformed item is kept as an item with its
    problem."""
    return parse_batch_document(decode_document(raw, kind, max_bytes), (), "batch", max_bytes, max_items)


def parse_batch_document(doc: Any, head: tuple[str, ...], what: str, max_bytes: int, max_items: int) -> ParsedBatch:
    """:func:`parse_batch` of a decoded document whose members may also include
    ``head`` (a stream frame's ``id`` and ``op``)."""
    if isinstance(doc, dict) and "session_ids" in doc:
        return parse_stacked(Fields(doc, (*head, *STACKED_FIELDS), what), max_bytes, max_items)
    return ParsedBatch(parse_items(Fields(doc, (*head, "items"), what), max_bytes, max_items))


def _check_count(n: int, max_items: int, name: str) -> None:
    if not n:
        raise InvalidRequest(f"{name}: expected a non-empty array")
    if n > max_items:
        raise InvalidRequest(
            f"{name}: {n} items are more than this server takes in one batch ({max_items}); split it",
            max_batch_items=max_items,
        )


def parse_items(f: Fields, max_bytes: int, max_items: int) -> list[BatchItem]:
    items = f.list("items")
    _check_count(len(items), max_items, "items")
    return [parse_item(doc, i, max_bytes) for i, doc in enumerate(items)]


def parse_stacked(f: Fields, max_bytes: int, max_items: int) -> ParsedBatch:
    """The stacked form: ``session_ids`` (B), one ``layer``, ``q [B, n, H, d]``,
    optional ``k``, ``v [B, m, Hkv, d]``, optional per-item ``offsets`` and
    ``start_pos`` (arrays of B integers or nulls), and ``causal``, ``scale`` for all.
    Item ``i`` is the attend of ``q[i]`` (and ``k[i]``, ``v[i]``) on session
    ``session_ids[i]``, checked as an item of the other form."""
    ids = f.list("session_ids")
    _check_count(len(ids), max_items, "session_ids")
    b = len(ids)
    layer = f.int("layer", lo=0)
    me = max_elements(max_bytes)
    q = f.array("q", max_elements=me, ndim=4, finite=False)
    k, v = fused_kv(f, me, ndim=4, finite=False)
    arrays = [(name, a) for name, a in (("q", q), ("k", k), ("v", v)) if a is not None]
    for name, a in arrays:
        if a.shape[0] != b:
            raise InvalidRequest(
                f"{name}: expected {b} stacked items (one per session id) in dimension 0, got shape {list(a.shape)}"
            )
    per_item = {name: _per_item(f, name, b) for name in ("offsets", "start_pos")}
    causal, scale = f.bool("causal", True), attend_scale(f)
    finite = {name: np.isfinite(a.reshape(b, -1)).all(axis=1) for name, a in arrays}
    items: list[BatchItem] = []
    for i, sid in enumerate(ids):
        try:
            if not isinstance(sid, str):
                raise InvalidRequest(f"session_ids[{i}]: expected a string, got {type(sid).__name__}")
            for name, a in arrays:
                if not finite[name][i]:
                    check_finite(a[i], name)
            offset, start_pos = (_item_int(per_item[name], i, name) for name in ("offsets", "start_pos"))
            attend = AttendRequest(
                q[i],
                None if k is None else k[i],
                None if v is None else v[i],
                offset=offset,
                start_pos=start_pos,
                causal=causal,
                scale=scale,
            )
            items.append(BatchItem(sid, layer, attend))
        except ApiError as e:
            items.append(BatchItem(error=e))
    return ParsedBatch(items, tuple(q.shape[1:]))


def _per_item(f: Fields, name: str, b: int) -> list[Any] | None:
    values = f.list(name, None)
    if values is not None and len(values) != b:
        raise InvalidRequest(f"{name}: expected {b} values (one per session id, null for none), got {len(values)}")
    return values


def _item_int(values: list[Any] | None, i: int, name: str) -> int | None:
    value = None if values is None else values[i]
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise InvalidRequest(f"{name}[{i}]: expected an integer >= 0 or null, got {value!r:.40}")
    return value


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
    that refused it, or its slot in ``futures``/``ops``; ``done`` is the event-loop
    future that is done when every queued item is done and settled."""

    outcome: list[Any]
    futures: list[Future]
    ops: list[tuple[int, Checked]]
    done: asyncio.Future | None = None


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
    done = rt.watch_all(futures, [op.res for _, op in checked])
    return QueuedBatch(outcome, futures, checked, done)


async def finish_batch(rt: Runtime, queued: QueuedBatch) -> list[Any]:
    """Await a queued batch. Returns per item ``AttendResult`` or the
    :class:`ApiError` that failed it."""
    outcome = queued.outcome
    if queued.done is not None:
        await asyncio.shield(queued.done)
        for fut, (i, op) in zip(queued.futures, queued.ops):
            result = None if fut.cancelled() else (fut.exception() or fut.result())
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


def answer_document(parsed: ParsedBatch, outcome: list[Any], kind: MediaKind, instance: str) -> dict[str, Any]:
    """The answer to a batch, in the form of its body: ``{"results": [...]}`` for
    items, stacked ``{"out", "lengths", "errors"}`` for the stacked form."""
    if parsed.out_shape is None:
        return results_document(outcome, kind, instance)
    return stacked_document(outcome, parsed.out_shape, kind, instance)


def _problem(err: ApiError, i: int, instance: str) -> dict[str, Any]:
    return err.problem(instance) | {"item": i}


def results_document(outcome: list[Any], kind: MediaKind, instance: str) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    for i, r in enumerate(outcome):
        if isinstance(r, ApiError):
            results.append({"error": _problem(r, i, instance)})
        else:
            out, length = r
            results.append(attend_document(out, length, kind))
    return {"results": results}


def stacked_document(outcome: list[Any], out_shape: tuple[int, ...], kind: MediaKind, instance: str) -> dict[str, Any]:
    """``out [B, n, H, d]`` (zeros in the rows of a failed item), ``lengths`` (null
    for a failed item) and ``errors`` (the failed items' problems, with ``item``)."""
    out = np.zeros((len(outcome), *out_shape), dtype="<f4")
    lengths: list[int | None] = []
    errors: list[dict[str, Any]] = []
    for i, r in enumerate(outcome):
        if isinstance(r, ApiError):
            errors.append(_problem(r, i, instance))
            lengths.append(None)
        else:
            out[i], length = r
            lengths.append(length)
    return {"out": array_out(out, kind), "lengths": lengths, "errors": errors}


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
    parsed = await rt.offload(parse_batch, raw, wire.request, max_bytes, rt.settings.max_batch_items, size=len(raw))
    outcome = await finish_batch(rt, queue_batch(rt, engine, owner, parsed.items))
    count_errors(rt, outcome)
    size = len(raw) * (1 if wire.response == "msgpack" else 6)
    body = await rt.offload(_encode_answer, parsed, outcome, wire.response, request.url.path, size=size)
    return respond(None, wire, body=body)


def count_errors(rt: Runtime, outcome: list[Any]) -> None:
    for r in outcome:
        if isinstance(r, ApiError):
            rt.metrics.errors.inc(r.slug)


def _encode_answer(parsed: ParsedBatch, outcome: list[Any], kind: MediaKind, instance: str) -> bytes:
    return encode(answer_document(parsed, outcome, kind, instance), kind)
