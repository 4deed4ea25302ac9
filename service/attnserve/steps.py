"""The batched step, whatever carries it (``POST /v1/batch/attend``, the stream's
``attend_batch``): one layer's attention for many sessions in one request.

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
from collections.abc import Sequence
from typing import Any

import numpy as np

from .codec import Fields, MediaKind, array_out, check_finite, decode_document, encode
from .engine import AttendResult, Engine, StackedResult
from .errors import ApiError, InternalError, InvalidRequest, RequestTimeout
from .store import JobReservations, LayerState, Owner, Reservation, StepReservation
from .runtime import Runtime
from .operations import (
    ATTEND_FIELDS,
    AttendRequest,
    Checked,
    attend_document,
    attend_fields,
    attend_scale,
    check_attend,
    count_rows,
    count_step_rows,
    fused_kv,
    layer_index,
    max_elements,
    reserve_attend,
)

__all__ = [
    "BatchItem",
    "ParsedBatch",
    "QueuedBatch",
    "QueuedStacked",
    "ReservedStep",
    "StackedItems",
    "parse_batch",
    "parse_batch_document",
    "parse_items",
    "as_stacked",
    "parse_stacked",
    "queue_batch",
    "finish_batch",
    "finish_stacked",
    "finish_any",
    "queue_stacked",
    "settled",
    "answer_document",
    "results_document",
    "stacked_document",
    "count_errors",
    "BATCH_ITEM_FIELDS",
    "STACKED_FIELDS",
    "encode_answer",
]

log = logging.getLogger("attnserve")

BATCH_ITEM_FIELDS = ("session_id", "layer", *ATTEND_FIELDS)
STACKED_FIELDS = ("session_ids", "layer", "q", "k", "v", "offsets", "start_pos", "causal", "scale", "return_lse")


@dataclass(frozen=True)
class BatchItem:
    """One parsed item: its target and attend, or the problem that refused it."""

    session_id: str | None = None
    layer: int = 0
    attend: AttendRequest | None = None
    error: ApiError | None = None


@dataclass(frozen=True)
class StackedItems:
    """The stacked form, kept as arrays: item ``i`` is the attend of ``q[i]``
    (``k[i]``, ``v[i]``) on session ``session_ids[i]`` at ``offsets[i]`` and
    ``start_pos[i]`` (None: not given); ``errors`` holds the items the parse
    refused (a bad id, a non-finite row, a bad integer)."""

    session_ids: list[Any]
    layer: int
    q: np.ndarray
    k: np.ndarray | None
    v: np.ndarray | None
    offsets: list[int | None]
    start_pos: list[int | None]
    causal: bool
    scale: float | None
    errors: dict[int, ApiError]
    return_lse: bool = False  # the stacked form's answer holds lse [B, n, H]

    @property
    def out_shape(self) -> tuple[int, ...]:
        """One item's output shape ``(n, H, d)``."""
        return tuple(self.q.shape[1:])


@dataclass(frozen=True)
class ParsedBatch:
    """A batch body: its ``items`` (None: the stacked form, whose answer is stacked
    too), and ``stacked``: the stacked form, or the items as one (:func:`as_stacked`:
    one layer and shape) to run as one job; None: the items run one job each."""

    items: list[BatchItem] | None = None
    stacked: StackedItems | None = None


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
    items = parse_items(Fields(doc, (*head, "items"), what), max_bytes, max_items)
    return ParsedBatch(items, as_stacked(items))


def as_stacked(items: list[BatchItem]) -> StackedItems | None:
    """The items as the stacked form when every item that parsed attends the same
    layer with the same shapes, ``causal`` and ``scale`` (an engine's step of one
    layer sent as items), so they run as one job; else None."""
    good = [it.attend for it in items if it.attend is not None]
    if not good:
        return None
    first, layer = good[0], next(it.layer for it in items if it.attend is not None)
    kv_shape = None if first.k is None else first.k.shape
    for it in items:
        a = it.attend
        if a is None:
            continue
        if (
            it.layer != layer
            or a.q.shape != first.q.shape
            or (None if a.k is None else a.k.shape) != kv_shape
            or a.causal != first.causal
            or a.scale != first.scale
        ):
            return None
    b = len(items)

    def stack(name: str, shape: tuple[int, ...]) -> np.ndarray:
        out = np.zeros((b, *shape), dtype="<f4")  # a refused item's rows stay zero (never read)
        for i, it in enumerate(items):
            if it.attend is not None:
                out[i] = getattr(it.attend, name)
        return out

    q = stack("q", first.q.shape)
    k, v = (None, None) if kv_shape is None else (stack("k", kv_shape), stack("v", kv_shape))
    return StackedItems(
        session_ids=[it.session_id for it in items],
        layer=layer,
        q=q,
        k=k,
        v=v,
        offsets=[None if it.attend is None else it.attend.offset for it in items],
        start_pos=[None if it.attend is None else it.attend.start_pos for it in items],
        causal=first.causal,
        scale=first.scale,
        errors={i: it.error for i, it in enumerate(items) if it.error is not None},
    )


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
    causal, scale, return_lse = f.bool("causal", True), attend_scale(f), f.bool("return_lse", False)
    errors: dict[int, ApiError] = {}
    for name, a in arrays:  # finiteness of every item at once; the first bad value of a bad item named
        for i in np.flatnonzero(~np.isfinite(a.reshape(b, -1)).all(axis=1)).tolist():
            try:
                check_finite(a[i], name)
            except ApiError as e:
                errors.setdefault(i, e)
    for i, sid in enumerate(ids):
        if not isinstance(sid, str):
            errors[i] = InvalidRequest(f"session_ids[{i}]: expected a string, got {type(sid).__name__}")
    ints = {}
    for name in ("offsets", "start_pos"):
        values = per_item[name]
        ints[name] = [None] * b if values is None else values
        if values is None:
            continue
        for i, value in enumerate(values):
            if value is not None and (type(value) is not int or value < 0):
                errors.setdefault(
                    i, InvalidRequest(f"{name}[{i}]: expected an integer >= 0 or null, got {value!r:.40}")
                )
    offsets, start_pos = ints["offsets"], ints["start_pos"]
    return ParsedBatch(stacked=StackedItems(ids, layer, q, k, v, offsets, start_pos, causal, scale, errors, return_lse))


def _per_item(f: Fields, name: str, b: int) -> list[Any] | None:
    values = f.list(name, None)
    if values is not None and len(values) != b:
        raise InvalidRequest(f"{name}: expected {b} values (one per session id, null for none), got {len(values)}")
    return values


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


def queue_batch(rt: Runtime, engine: Engine, owner: Owner, parsed: ParsedBatch) -> "QueuedBatch | QueuedStacked":
    """Check every item in order and queue those that pass: the items form as one
    GPU group of jobs, the stacked form as one job (:func:`queue_stacked`). No
    ``await``: the checks see each other's reservations, and nothing else can come
    between the first check and the queueing."""
    if parsed.stacked is not None:
        return queue_stacked(rt, engine, owner, parsed.stacked)
    assert parsed.items is not None
    items = parsed.items
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
    done = rt.watch_all(futures, [(op.res,) for _, op in checked])
    return QueuedBatch(outcome, futures, checked, done)


@dataclass(eq=False)
class ReservedStep:
    """The items of a stacked step that passed every check, reserved as one job:
    their indices (``items``), layers and first query positions; every item's kv
    format (``formats[i]`` for item ``i``, None for one refused) and how many passed
    per format; ``rows`` and ``queries`` (one value for the step); and the job's
    reservations (``job``: one ``StepReservation`` when the step was checked as
    columns, else one ``Reservation`` per item, committed as each was checked)."""

    items: list[int]
    layers: list[LayerState]
    start_pos: list[int]
    formats: Sequence[str | None]
    per_format: dict[str, int]
    rows: int
    queries: int
    job: JobReservations


@dataclass(eq=False)
class QueuedStacked:
    """A stacked step checked and queued as one job: ``errors`` (item -> the
    problem that refused it), ``reserved`` (the items that passed), the job's
    ``future`` and ``done`` (as :class:`QueuedBatch`'s)."""

    stacked: StackedItems
    errors: dict[int, ApiError]
    reserved: ReservedStep | None
    future: Future | None = None
    done: asyncio.Future | None = None


def queue_stacked(rt: Runtime, engine: Engine, owner: Owner, st: StackedItems) -> QueuedStacked:
    """Check each item of a stacked step as :func:`queue_batch` does (in order,
    each against the reservations of those before it), then queue every item that
    passed as one job (``Engine.plan_stacked``): one future for the step. The common
    case is checked, reserved and committed as columns (:func:`_reserve_columns`)."""
    errors = dict(st.errors)
    b = len(st.session_ids)
    reserved = _reserve_columns(rt, engine, owner, st)
    if reserved is None:
        reserved = _reserve_items(rt, engine, owner, st, errors)
    else:
        assert isinstance(reserved.job, StepReservation)
        rt.store.commit_step(reserved.job)
    queued = QueuedStacked(st, errors, reserved)
    if not reserved.items:
        queued.reserved = None
        return queued
    if len(reserved.items) == b:
        layers: list[Any] = [ls.cache for ls in reserved.layers]
        start_pos: list[int | None] = list(reserved.start_pos)
    else:
        layers, start_pos = [None] * b, [None] * b
        for i, ls, sp in zip(reserved.items, reserved.layers, reserved.start_pos):
            layers[i], start_pos[i] = ls.cache, sp
    try:
        plan = engine.plan_stacked(layers, st.q, k=st.k, v=st.v, start_pos=start_pos, causal=st.causal, scale=st.scale)
        queued.future = engine.worker.submit_plan(plan, weight=len(reserved.items))  # counts as its items
    except Exception as e:  # Overloaded (or a bug): nothing was queued; give every reservation back
        if not isinstance(e, ApiError):
            log.exception("stacked step failed to queue")
        err = e if isinstance(e, ApiError) else InternalError("an internal error occurred; it was logged")
        rt.store.finish_job(reserved.job, [e] * len(reserved.items))
        for i in reserved.items:
            errors[i] = err
        queued.reserved = None
        return queued
    items = reserved.items

    def item_errors(result: StackedResult) -> list[BaseException | None] | None:
        return [result.errors.get(i) for i in items] if result.errors else None

    queued.done = rt.watch_all([queued.future], [reserved.job], item_errors)
    return queued


def _reserve_items(
    rt: Runtime, engine: Engine, owner: Owner, st: StackedItems, errors: dict[int, ApiError]
) -> ReservedStep:
    """Check each item of a stacked step in order, each against the reservations of
    those before it (committed as it passes); a refused item's problem goes in
    ``errors``. Returns the items that passed."""
    k, v = st.k, st.v
    b = len(st.session_ids)
    reserved = ReservedStep([], [], [], [None] * b, {}, 0 if k is None else k.shape[1], st.q.shape[1], ())
    job: list[Reservation] = []
    clear: dict[str, np.ndarray] = {}  # per kv format: the items whose k, v values pass at once
    for i, sid in enumerate(st.session_ids):
        if i in errors:
            continue
        try:
            session = rt.store.get(sid, owner)
            li = layer_index(session, st.layer)
            fmt = session.config.layer_formats[li]
            if k is not None and fmt not in clear:
                clear[fmt] = engine.kv_values_clear(k, v, fmt)
            op = reserve_attend(
                rt, engine, session, li, st.q[i], None if k is None else k[i], None if v is None else v[i],
                st.offsets[i], st.start_pos[i], values_clear=k is not None and bool(clear[fmt][i]),
            )  # fmt: skip
        except ApiError as e:
            errors[i] = e
            continue
        rt.store.commit(op.res)
        job.append(op.res)
        reserved.items.append(i)
        reserved.layers.append(op.res.layer)
        reserved.start_pos.append(op.start_pos)
        reserved.formats[i] = fmt
        reserved.per_format[fmt] = reserved.per_format.get(fmt, 0) + 1
    reserved.job = tuple(job)
    return reserved


def _reserve_columns(rt: Runtime, engine: Engine, owner: Owner, st: StackedItems) -> ReservedStep | None:
    """Every item of a stacked step checked at once, as :func:`reserve_attend` checks
    each (shapes once per kv format, values per format over the whole step, offsets,
    capacities and the budget as columns): one ``StepReservation`` for the step, not
    committed, and no object per item. None when the step is not the common case (an
    item refused by the parse, a session named twice or not found, a layer out of
    range, sessions of other shapes, or anything that would refuse an item): then
    :func:`queue_stacked` checks item by item, and each problem is the one a single
    attend gets."""
    if st.errors:
        return None
    store = rt.store
    group = store.step_group(st.session_ids, owner)  # resolved once for every layer and step
    if group is None:
        return None
    sessions, memo = group.sessions, group.memo
    config = sessions[0].config
    if "same_shape" not in memo:
        shape = (config.num_layers, config.num_qo_heads, config.num_kv_heads, config.head_dim)
        memo["same_shape"] = all(
            s.config is config or (s.config.num_layers, s.config.num_qo_heads, s.config.num_kv_heads,
                                   s.config.head_dim) == shape
            for s in sessions
        )  # fmt: skip
    li = st.layer
    if not memo["same_shape"] or li >= config.num_layers:
        return None
    by_format = memo.get(("formats", li))
    if by_format is None:  # the layer's formats, per format the items of it, and how many
        formats = [s.layers[li].cache.kv_format for s in sessions]
        masks = {fmt: np.fromiter((f == fmt for f in formats), bool, len(formats)) for fmt in set(formats)}
        by_format = memo["formats", li] = (formats, masks, {fmt: int(m.sum()) for fmt, m in masks.items()})
    formats, masks, per_format = by_format
    k, v, q = st.k, st.v, st.q
    try:
        for fmt, mine in masks.items():
            engine.check_query_rows(config, q[0], fmt)
            if k is not None:
                engine.check_kv_rows(config, k[0], v[0], fmt, values_clear=True)
                if not engine.kv_values_clear(
                    k if len(masks) == 1 else k[mine], v if len(masks) == 1 else v[mine], fmt
                ).all():
                    return None
    except ApiError:
        return None
    rows = 0 if k is None else k.shape[1]
    step = store.plan_step(sessions, li, rows, st.offsets)
    if step is None:
        return None
    n = q.shape[1]
    new_length = np.asarray(step.new_length, np.int64)
    if any(p is not None for p in st.start_pos):
        given = np.fromiter((-1 if p is None else p for p in st.start_pos), np.int64, len(sessions))
        start_pos = np.where(given < 0, new_length - n, given)
    else:
        start_pos = new_length - n
    if (start_pos < 0).any() or (start_pos + n > new_length).any():
        return None
    return ReservedStep(
        list(range(len(sessions))), step.layers, start_pos.tolist(), formats, per_format, rows, n, step
    )  # fmt: skip


async def finish_stacked(rt: Runtime, queued: QueuedStacked) -> tuple[StackedResult | None, dict[int, ApiError]]:
    """Await a queued stacked step. Returns the job's :class:`StackedResult` (None
    if no item was queued or the job failed as a whole) and every failed item's
    problem."""
    errors, fut, reserved = queued.errors, queued.future, queued.reserved
    if queued.done is None or fut is None or reserved is None:
        return None, errors
    await asyncio.shield(queued.done)
    failed = None if fut.cancelled() else fut.exception()
    result = None if fut.cancelled() or failed is not None else fut.result()
    if result is None:
        problem = failure(rt, fut, failed)
        for i in reserved.items:
            errors[i] = problem
        return result, errors
    per_format = reserved.per_format
    if result.errors:
        per_format = dict(per_format)
        for i, e in result.errors.items():
            errors[i] = failure(rt, fut, e)
            fmt = reserved.formats[i]
            assert fmt is not None
            per_format[fmt] -= 1
    count_step_rows(rt, per_format, reserved.rows, reserved.queries)
    return result, errors


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
    """An item's outcome: its result (its rows counted), or the problem that failed it."""
    if fut.cancelled() or isinstance(result, BaseException):
        return failure(rt, fut, result)
    count_rows(rt, op)
    return result


def failure(rt: Runtime, fut: Future, error: BaseException | None) -> ApiError:
    """The problem of an item whose job was dropped by the request timeout, or
    that failed with ``error``."""
    if fut.cancelled():  # the request timeout dropped it from the queue: nothing applied
        return RequestTimeout(
            f"the item waited more than {rt.settings.request_timeout_s:g} s for the GPU and was dropped; "
            "nothing was applied, so it is safe to retry",
            headers={"Retry-After": "1"},
        )
    if isinstance(error, ApiError):
        return error
    log.error("batch item failed", exc_info=error)
    return InternalError("an internal error occurred in this item; it was logged")


async def finish_any(rt: Runtime, queued: "QueuedBatch | QueuedStacked") -> Any:
    """:func:`finish_batch` or :func:`finish_stacked`, as the batch was queued;
    what it gives is what :func:`answer_document` answers from."""
    if isinstance(queued, QueuedStacked):
        return await finish_stacked(rt, queued)
    return await finish_batch(rt, queued)


def answer_document(parsed: ParsedBatch, outcome: Any, kind: MediaKind, instance: str) -> dict[str, Any]:
    """The answer to a batch, in the form of its body: ``{"results": [...]}`` for
    items, stacked ``{"out", "lengths", "errors"}`` for the stacked form."""
    if parsed.items is None:
        result, errors = outcome
        return stacked_document(parsed.stacked, result, errors, kind, instance)
    if isinstance(outcome, tuple):  # the items ran as one stacked job
        result, errors = outcome
        outcome = [
            errors[i] if i in errors else AttendResult(result.out[i], int(result.lengths[i]), result.lse[i])
            for i in range(len(parsed.items))
        ]
    want_lse = [it.attend is not None and it.attend.return_lse for it in parsed.items]
    return results_document(outcome, kind, instance, want_lse)


def _problem(err: ApiError, i: int, instance: str) -> dict[str, Any]:
    return err.problem(instance) | {"item": i}


def results_document(
    outcome: list[Any], kind: MediaKind, instance: str, want_lse: Sequence[bool] = ()
) -> dict[str, Any]:
    """``{"results": [...]}``: each item's answer (``lse`` beside ``out`` where
    ``want_lse[i]``) or its problem."""
    results: list[dict[str, Any]] = []
    for i, r in enumerate(outcome):
        if isinstance(r, ApiError):
            results.append({"error": _problem(r, i, instance)})
        else:
            results.append(attend_document(r, kind, i < len(want_lse) and want_lse[i]))
    return {"results": results}


def stacked_document(
    st: StackedItems, result: StackedResult | None, errors: dict[int, ApiError], kind: MediaKind, instance: str
) -> dict[str, Any]:
    """``out [B, n, H, d]`` (zeros in the rows of a failed item), ``lengths`` (null
    for a failed item) and ``errors`` (the failed items' problems, with ``item``)."""
    b = len(st.session_ids)
    if result is None:
        out = np.zeros((b, *st.out_shape), dtype="<f4")
        lse = np.zeros((b, *st.out_shape[:2]), dtype="<f4")
        lengths: list[int | None] = [None] * b
    else:
        out, lse = result.out, result.lse  # zero in the rows of every item that failed (its length is -1)
        lengths = [None if i in errors else length for i, length in enumerate(result.lengths.tolist())]
    problems = [_problem(errors[i], i, instance) for i in sorted(errors)]
    doc = {"out": array_out(np.ascontiguousarray(out), kind), "lengths": lengths, "errors": problems}
    if st.return_lse:
        doc["lse"] = array_out(np.ascontiguousarray(lse), kind)
    return doc


def count_errors(rt: Runtime, outcome: Any) -> None:
    """Count the failed items of a finished batch (either form) by problem."""
    failed = outcome[1].values() if isinstance(outcome, tuple) else outcome
    for r in failed:
        if isinstance(r, ApiError):
            rt.metrics.errors.inc(r.slug)


def encode_answer(parsed: ParsedBatch, outcome: list[Any], kind: MediaKind, instance: str) -> bytes:
    return encode(answer_document(parsed, outcome, kind, instance), kind)
