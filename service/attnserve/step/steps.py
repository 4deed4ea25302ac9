"""The explicit step (docs/api.md, "Steps: a batch held open across layers"):
its open, its layer calls and its close, as every transport carries
them (``transport/ops.py``: ``step_open``, ``step_call``, ``step_close``;
``routes/steps.py`` and ``transport/http.py``: ``/v1/steps``).

On today's machinery a layer call *is* a stacked attend: the step's sessions in
order, its fixed options, the call's arrays, checked by ``rules.check_step``
(whose rule of a session in a step lets the step's own call through: ``via``),
queued by ``plan.queue_request`` and answered by ``answer.answer_document``, so
its answers are bit-identical to the stacked form's. What lives between calls
(handles, tenancy, the layers called this token, broken, connections, idle
expiry) is ``step_registry.py``'s; this module checks a call against it, claims
its layer when it is queued and settles it when its jobs are done (on the event
loop, whether or not anyone still awaits the answer).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel

from ..codec import MediaKind, wire
from ..contract import Fields, StepCall, StepCallArrays, StepOpen
from ..engine import Engine
from ..errors import ApiError, InvalidRequest, RequestTimeout, StepBroken, StepLayerCalled, StepNotFound
from ..runtime import Runtime
from ..step_registry import CallFrameError, OpenStep
from ..store import Owner, step_conflict
from .answer import answer_document, count_problems, whole_arrays
from .parse import Parsed, attend_scale, check_count, max_elements, stacked_request
from .plan import Queued, finish_request, queue_request
from .rules import layer_problem

__all__ = [
    "Call", "open_step", "close_step", "get_step", "begin_call", "begin_frame_call", "finish_call",
    "finish_frame_call", "reply_sizes",
]  # fmt: skip

log = logging.getLogger("attnserve")

#: What a call may not carry, because the step fixed it (or the server keeps it).
_FIXED = (
    "the step fixed rows, queries, dtype, causal, scale, return_lse and out_dtype at its open, and keeps the offsets"
)


# ── open, get, close ────────────────────────────────────────────────────────


def open_step(
    rt: Runtime, owner: Owner, doc: Any, *, what: str = "step", head: tuple[str, ...] = (), bound: Hashable | None
) -> OpenStep:
    """Open a step from its request document (``StepOpen``'s members; ``head``: a
    frame's ``id`` and ``op``), bound to the connection ``bound`` (None: over
    HTTP). Checks, in order: the members (422), each session (404), one shape
    (422), the layers (422, 404), each session in no step (409); a refused open
    changes nothing."""
    f = Fields(doc, StepOpen, what, head=head)
    ids = f.list("session_ids")
    check_count(len(ids), rt.settings.max_batch_items, "session_ids")
    first: dict[str, int] = {}
    for i, sid in enumerate(ids):
        if not isinstance(sid, str):
            raise InvalidRequest(f"session_ids[{i}]: expected a string, got {type(sid).__name__}")
        if sid in first:
            raise InvalidRequest(
                f"session_ids[{i}]: {sid!r} repeats session_ids[{first[sid]}]; a step names each session once"
            )
        first[sid] = i
    rows = f.int("rows")
    queries = f.int("queries")
    if queries is None:
        queries = rows or 1
    layers = f.list("layers")
    dtype = f.str("dtype")
    causal, scale, return_lse, out_dtype = f.bool("causal"), attend_scale(f), f.bool("return_lse"), f.str("out_dtype")
    if layers is not None:
        _check_layers(layers)
    sessions = [rt.store.get(sid, owner) for sid in ids]
    c0 = sessions[0].config
    shape = (c0.num_qo_heads, c0.num_kv_heads, c0.head_dim)
    for i, s in enumerate(sessions):
        c = s.config
        if (c.num_qo_heads, c.num_kv_heads, c.head_dim) != shape:
            raise InvalidRequest(
                f"session_ids[{i}]: session {s.id!r} has num_qo_heads, num_kv_heads, head_dim "
                f"{c.num_qo_heads}, {c.num_kv_heads}, {c.head_dim}, not {', '.join(map(str, shape))} as "
                f"session_ids[0] has; a step's sessions share one shape"
            )
    if layers is None:
        counts = {s.config.num_layers for s in sessions}
        if len(counts) > 1:
            raise InvalidRequest(
                f"layers: the sessions have different num_layers ({', '.join(map(str, sorted(counts)))}); "
                "name the layers the step calls"
            )
        layers = list(range(counts.pop()))
    for layer in layers:
        for s in sessions:
            problem = layer_problem(s, layer)
            if problem is not None:
                raise problem
    for s in sessions:
        conflict = step_conflict(s)
        if conflict is not None:
            raise conflict
    itemsize = wire.DTYPES[dtype].itemsize
    q_bytes = len(sessions) * queries * c0.num_qo_heads * c0.head_dim * itemsize
    kv_bytes = len(sessions) * rows * c0.num_kv_heads * c0.head_dim * itemsize
    step = rt.steps.open(
        owner, sessions, (q_bytes, kv_bytes, kv_bytes), bound=bound, layers=layers, rows=rows, queries=queries,
        dtype=dtype, causal=causal, scale=scale, return_lse=return_lse, out_dtype=out_dtype,
    )  # fmt: skip
    rt.metrics.steps_opened.inc()
    return step


def _check_layers(layers: list[Any]) -> None:
    seen: set[int] = set()
    if not layers:
        raise InvalidRequest("layers: expected a non-empty array (or none: every layer)")
    for i, layer in enumerate(layers):
        if type(layer) is not int or layer < 0:
            raise InvalidRequest(f"layers[{i}]: expected an integer >= 0, got {layer!r:.40}")
        if layer in seen:
            raise InvalidRequest(f"layers[{i}]: layer {layer} is named twice; a step calls each layer once a token")
        seen.add(layer)


def get_step(rt: Runtime, owner: Owner, handle: int) -> OpenStep:
    """The owner's open step (404 step-not-found)."""
    return rt.steps.get(handle, owner)


def close_step(rt: Runtime, owner: Owner, handle: int) -> None:
    """Close the owner's step (404 step-not-found): its sessions are free at once;
    its calls in flight complete and are answered."""
    rt.steps.close(rt.steps.get(handle, owner), "closed")


# ── a layer call ────────────────────────────────────────────────────────────


def _call_fields(doc: Any, model: type[BaseModel], what: str, head: tuple[str, ...]) -> Fields:
    """A call document's members (``model``'s: the arrays, and a frame's ``step``
    and ``layer``); any other member is refused naming what the step fixed."""
    try:
        return Fields(doc, model, what, head=head)
    except InvalidRequest as e:
        if "fields" not in e.extra:
            raise
        raise InvalidRequest(f"{e.detail} ({_FIXED})", **e.extra) from None


@dataclass(eq=False)
class Call:
    """A layer call checked and queued: its step, layer and token, the stacked
    request it is, and that request queued."""

    step: OpenStep
    layer: int
    token: int
    parsed: Parsed
    queued: Queued


def begin_call(
    rt: Runtime,
    engine: Engine,
    owner: Owner,
    doc: Any,
    *,
    what: str,
    head: tuple[str, ...] = (),
    target: tuple[int, int] | None = None,
) -> Call:
    """Check a layer call (its document's members; the step, broken, the layer,
    called this token, the arrays: in that order, raising the first problem,
    changing nothing) and queue it as the stacked attend it is, its layer claimed
    (no ``await`` inside). ``target``: the step's handle and the layer (a route's
    path), else the document's ``step`` and ``layer`` (a frame's)."""
    try:
        f = _call_fields(doc, StepCall if target is None else StepCallArrays, what, head)
        handle, layer = (f.int("step"), f.int("layer")) if target is None else target
        step = rt.steps.get(handle, owner)
    except ApiError:
        rt.metrics.step_calls_by["refused"].inc()
        raise
    return _begin(rt, engine, owner, step, layer, lambda: _request(rt, step, layer, f))


def begin_frame_call(
    rt: Runtime, engine: Engine, owner: Owner, head: tuple[int, int, int, int], body: memoryview
) -> Call:
    """Check a binary layer call (a call frame's head ``(step, layer, seq,
    body_len)`` and its body, q | k | v in the step's dtype and shapes) and queue
    it as :func:`begin_call` does a document's: the same checks in the same order,
    made by the step table (``StepTable.check``: the step, broken, the layer,
    called this token, the body's length), then the same stacked request over
    views of the body (its values checked item by item, as a document's are)."""
    handle, layer, _, _ = head
    try:
        step = rt.steps.get(handle, owner)
        try:
            offsets = rt.steps.table.check(rt.steps.owner_id(owner), head, body)
        except CallFrameError as e:
            raise _frame_problem(step, layer, e, len(body)) from None
    except ApiError:
        rt.metrics.step_calls_by["refused"].inc()
        raise
    return _begin(rt, engine, owner, step, layer, lambda: _frame_request(step, layer, body.toreadonly(), offsets))


def _begin(
    rt: Runtime, engine: Engine, owner: Owner, step: OpenStep, layer: int, request: Callable[[], Parsed]
) -> Call:
    """Claim ``layer`` of ``step``, make the call's stacked ``request`` (its claim
    given back when that is refused) and queue it; the layer is settled when its
    jobs are done."""
    try:
        try:
            token = step.claim(layer)
        except CallFrameError as e:
            raise _claim_problem(step, layer, e) from None
        try:
            parsed = request()
        except BaseException:
            step.release(layer)
            raise
    except ApiError:
        rt.metrics.step_calls_by["refused"].inc()
        raise
    step.in_flight += 1
    step.last_used = time.monotonic()
    try:
        queued = queue_request(rt, engine, owner, parsed)
    except BaseException:  # a bug: nothing was queued
        _settle(rt, step, layer, token, 0, {})
        raise
    call = Call(step, layer, token, parsed, queued)
    if queued.done is None:  # every item refused before queueing: nothing applied
        _settle(rt, step, layer, token, 0, queued.problems)
    else:
        queued.done.add_done_callback(lambda _: _settle_done(rt, call))
    return call


async def finish_call(rt: Runtime, call: Call, kind: MediaKind, instance: str) -> dict[str, Any]:
    """Await a queued call: the stacked form's answer document and its ``token``
    (the layer is settled by then: :func:`_settle_done` runs first)."""
    outcome = await finish_request(rt, call.queued)
    count_problems(rt, outcome)
    doc = answer_document(outcome, kind, instance)
    doc["token"] = call.token
    return doc


async def finish_frame_call(
    rt: Runtime, call: Call, instance: str
) -> tuple[np.ndarray, np.ndarray | None] | dict[str, Any]:
    """Await a queued binary call: ``(out, lse)`` as the GPU gave them back when
    every item applied (a call frame's reply carries their bytes), else the
    answer document :func:`finish_call` gives (sent as a frame's reply)."""
    outcome = await finish_request(rt, call.queued)
    arrays = whole_arrays(outcome)
    if arrays is not None:
        out, lse = arrays
        return out, lse if call.step.return_lse else None
    count_problems(rt, outcome)
    doc = answer_document(outcome, "msgpack", instance)
    doc["token"] = call.token
    return doc


def _frame_problem(step: OpenStep, layer: int, e: CallFrameError, body_len: int) -> ApiError:
    """The problem of a call frame the step table refused (``e.status``)."""
    if e.status == "BODY_LEN":
        info = step.table.info(step.handle)
        want = info["q_bytes"] + info["k_bytes"] + info["v_bytes"]
        return InvalidRequest(
            f"call frame: body of {body_len} bytes, expected {want} (this step's q | k | v: "
            f"{info['q_bytes']}, {info['k_bytes']}, {info['v_bytes']} bytes in {step.dtype})"
        )
    return _claim_problem(step, layer, e)


def _claim_problem(step: OpenStep, layer: int, e: CallFrameError) -> ApiError:
    """The problem of a layer the step table would not claim (``e.status``)."""
    if e.status == "BROKEN":
        return _broken(step)
    if e.status == "LAYER_NOT_IN_STEP":
        return InvalidRequest(f"layer {layer} is not one of this step's layers {step.layers}", layers=step.layers)
    assert e.status == "LAYER_CALLED", e.status
    token = step.token
    return StepLayerCalled(
        f"layer {layer} was already called for token {token}"
        + (" (a call of it is in flight)" if layer in step.in_flight_layers() else "")
        + "; call the step's other layers first",
        token=token,
    )


def _broken(step: OpenStep) -> StepBroken:
    f = step.failure
    assert f is not None
    return StepBroken(
        f"step {step.handle} is broken: its call of layer {f['layer']} for token {f['token']} applied to some "
        f"sessions but failed for item {f['item']} (session {step.sessions[f['item']].id!r}: {f['type']}: "
        f"{f['detail']}); close it and open a new step",
        failure=f,
    )


def _request(rt: Runtime, step: OpenStep, layer: int, f: Fields) -> Parsed:
    """The stacked request a call is: its arrays checked against the step."""
    me = max_elements(rt.settings.max_body_bytes)
    b = len(step.sessions)
    c = step.sessions[0].config
    q, squeeze = _array(f, "q", me, step, (b, step.queries, c.num_qo_heads, c.head_dim), "queries")
    k = v = None
    if step.rows:
        shape = (b, step.rows, c.num_kv_heads, c.head_dim)
        k, _ = _array(f, "k", me, step, shape, "rows")
        v, _ = _array(f, "v", me, step, shape, "rows")
    else:
        for name in ("k", "v"):
            if f.doc.get(name) is not None:
                raise InvalidRequest(f"{name}: this step appends no rows (rows 0 at its open); send q only")
    out_dtype = None if step.out_dtype is None else wire.DTYPES[step.out_dtype]
    parsed = stacked_request(
        step.session_ids, layer, q, k, v, {"offsets": None, "start_pos": None}, step.causal, step.scale,
        step.return_lse, out_dtype, via=step.handle,
    )  # fmt: skip
    parsed.squeeze = squeeze
    return parsed


def _frame_request(step: OpenStep, layer: int, body: memoryview, offsets: tuple[int, int, int]) -> Parsed:
    """The stacked request of a binary call: views of its body (its length checked
    against the step's shapes by the step table)."""
    dt = wire.DTYPES[step.dtype]
    b, c = len(step.sessions), step.sessions[0].config
    q_off, k_off, v_off = offsets
    q_shape = (b, step.queries, c.num_qo_heads, c.head_dim)
    q = np.frombuffer(body, dt, int(np.prod(q_shape)), q_off).reshape(q_shape)
    k = v = None
    if step.rows:
        kv_shape = (b, step.rows, c.num_kv_heads, c.head_dim)
        count = int(np.prod(kv_shape))
        k = np.frombuffer(body, dt, count, k_off).reshape(kv_shape)
        v = np.frombuffer(body, dt, count, v_off).reshape(kv_shape)
    out_dtype = None if step.out_dtype is None else wire.DTYPES[step.out_dtype]
    return stacked_request(
        step.session_ids, layer, q, k, v, {"offsets": None, "start_pos": None}, step.causal, step.scale,
        step.return_lse, out_dtype, via=step.handle,
    )  # fmt: skip


def _array(
    f: Fields, name: str, max_elements: int, step: OpenStep, shape: tuple[int, int, int, int], axis: str
) -> tuple[np.ndarray, bool]:
    """A call's array ``name`` in the step's dtype and ``shape`` (``[B, n, H, d]``,
    or ``[B, H, d]`` when ``n`` is 1: then returned with its rows axis and True)."""
    value = f.doc.get(name)
    if value is None:
        raise InvalidRequest(f"{name}: required")
    try:
        a = wire.decode_array(value, name=name, finite=False, max_elements=max_elements)
    except wire.WireError as e:
        raise InvalidRequest(str(e)) from None
    if wire.dtype_name(a) != step.dtype:
        raise InvalidRequest(
            f"{name}: this step's arrays are {step.dtype} (its dtype, fixed at its open), got {wire.dtype_name(a)}"
        )
    b, n, heads, d = shape
    if a.shape == shape:
        return a, False
    if n == 1 and a.shape == (b, heads, d):
        return a[:, None], True
    want = f"[{b}, {n}, {heads}, {d}]" + (f" or [{b}, {heads}, {d}]" if n == 1 else "")
    raise InvalidRequest(
        f"{name}: expected shape {want} (this step's {len(step.sessions)} sessions, {axis} {n}, heads, head_dim), "
        f"got {list(a.shape)}"
    )


def _settle_done(rt: Runtime, call: Call) -> None:
    """Settle a queued call once its jobs are done (their reservations settled):
    each item applied or not, from the jobs' results."""
    queued = call.queued
    problems: dict[int, BaseException] = dict(call.queued.problems)
    applied = 0
    for c, fut in zip(queued.checked, queued.futures):
        items = c.step.items
        failed = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or failed is not None:
            error = failed or RequestTimeout("dropped by the request timeout; nothing was applied")
            for i in c.passed:
                problems[items[i]] = error
            continue
        errors = fut.result().errors
        applied += len(c.passed) - len(errors)
        for i, e in errors.items():
            problems[items[i]] = e
    _settle(rt, call.step, call.layer, call.token, applied, problems)


def _settle(
    rt: Runtime, step: OpenStep, layer: int, token: int, applied: int, problems: Mapping[int, BaseException]
) -> None:
    """A call of ``layer`` (claimed at ``token``) is done: ``applied`` items applied,
    ``problems`` those that were not (by item)."""
    failed = len(step.sessions) - applied
    outcome = step.settle(layer, applied, failed)
    step.in_flight -= 1
    step.last_used = time.monotonic()
    rt.metrics.step_calls_by[outcome].inc()
    if outcome == "partial":
        item = min(problems) if problems else 0
        e = problems.get(item)
        slug, detail = (
            (e.slug, e.detail) if isinstance(e, ApiError) else ("internal-error", "an internal error; it was logged")
        )
        step.break_at(layer, token, item, slug, detail)
        log.warning(
            "step broken: a call applied to some sessions and failed for others",
            extra={"step": step.handle, "layer": layer, "token": token, "item": item, "type": slug},
        )


# ── shared memory: where a call's reply goes ────────────────────────────────


def reply_sizes(rt: Runtime, owner: Owner, doc: Any) -> list[int] | None:
    """The bytes of the arrays of the reply to the layer call ``doc`` (a frame's:
    ``step`` names the step), or None when ``doc`` names no open step of the
    owner's (the call itself answers its problem)."""
    handle = doc.get("step") if isinstance(doc, dict) else None
    if type(handle) is not int:
        return None
    try:
        step = rt.steps.get(handle, owner)
    except StepNotFound:
        return None
    c = step.sessions[0].config
    rows = len(step.sessions) * step.queries * c.num_qo_heads
    itemsize = wire.DTYPES[step.out_dtype or step.dtype].itemsize
    return [rows * c.head_dim * itemsize] + ([rows * 4] if step.return_lse else [])
