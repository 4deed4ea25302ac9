"""Append and attend, whatever carries them: the HTTP routes, the batched step
(``steps.py``) and the WebSocket stream all parse, check and queue through these
functions, so the transports cannot drift apart (and answer bit-identically). It
imports nothing of ``routes/``: the transports call it.

Each operation is checked against the session's *reserved* state (see
:mod:`attnserve.store`) and turned into a GPU job plan plus a reservation:

* :func:`check_attend` / :func:`check_append` raise the request's problem
  (:class:`~attnserve.errors.ApiError`) with nothing changed, or return a
  :class:`Checked` operation;
* the caller commits the reservation and queues the plan, alone
  (:func:`queue_one`) or with others in one GPU submission
  (:meth:`~attnserve.engine.Engine.submit_group`);
* :func:`attend_result` / the append length turn the job's result into the
  answer document.

Everything between a check and its queueing runs without an ``await``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .codec import Fields, MediaKind, array_out, decode_document
from .engine import AttendResult, Engine
from .errors import InvalidRequest, LayerNotFound
from .gpu.device import PlanFn
from .kvcache import SessionConfig, SessionKV
from .store import Reservation, Session
from .runtime import Runtime

__all__ = [
    "AppendRequest",
    "AttendRequest",
    "Checked",
    "APPEND_FIELDS",
    "ATTEND_FIELDS",
    "parse_append",
    "parse_attend",
    "append_fields",
    "attend_fields",
    "fused_kv",
    "attend_scale",
    "max_elements",
    "layer_index",
    "check_append",
    "check_attend",
    "reserve_attend",
    "queue_one",
    "attend_document",
    "count_rows",
    "count_step_rows",
]

APPEND_FIELDS = ("k", "v", "offset")
ATTEND_FIELDS = ("q", "k", "v", "offset", "start_pos", "causal", "scale", "return_lse")
F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class AppendRequest:
    k: np.ndarray
    v: np.ndarray
    offset: int | None


@dataclass(frozen=True)
class AttendRequest:
    q: np.ndarray
    k: np.ndarray | None
    v: np.ndarray | None
    offset: int | None
    start_pos: int | None
    causal: bool
    scale: float | None
    return_lse: bool = False  # answer the rows' log-sum-exp beside out


def max_elements(max_bytes: int) -> int:
    """The most array elements a body of ``max_bytes`` can carry."""
    return max(1, max_bytes // 4)


def append_fields(f: Fields, max_bytes: int) -> AppendRequest:
    me = max_elements(max_bytes)
    k = f.array("k", max_elements=me)
    v = f.array("v", max_elements=me)
    return AppendRequest(k, v, f.int("offset", None, lo=0))


def attend_fields(f: Fields, max_bytes: int) -> AttendRequest:
    me = max_elements(max_bytes)
    q = f.array("q", max_elements=me)
    k, v = fused_kv(f, me)
    return AttendRequest(
        q,
        k,
        v,
        offset=f.int("offset", None, lo=0),
        start_pos=f.int("start_pos", None, lo=0),
        causal=f.bool("causal", True),
        scale=attend_scale(f),
        return_lse=f.bool("return_lse", False),
    )


def fused_kv(f: Fields, elements: int, ndim: int = 3, finite: bool = True) -> tuple[Any, Any]:
    """The optional ``k``, ``v`` of an attend (a fused append): both or neither."""
    k = f.array("k", None, max_elements=elements, ndim=ndim, finite=finite)
    v = f.array("v", None, max_elements=elements, ndim=ndim, finite=finite)
    if (k is None) != (v is None):
        raise InvalidRequest("k, v: a fused append needs both k and v (or neither)")
    return k, v


def attend_scale(f: Fields) -> float | None:
    """The optional ``scale`` of an attend: a finite float32 (the kernels take it so)."""
    scale = f.number("scale", None)
    if scale is not None:
        with np.errstate(over="ignore"):
            if not np.isfinite(np.float32(scale)):
                raise InvalidRequest(f"scale: expected a finite float32 (|scale| <= {F32_MAX:.7g}), got {scale!r}")
    return scale


def parse_append(raw: bytes, kind: MediaKind | None, max_bytes: int) -> AppendRequest:
    return append_fields(Fields(decode_document(raw, kind, max_bytes), APPEND_FIELDS, "append"), max_bytes)


def parse_attend(raw: bytes, kind: MediaKind | None, max_bytes: int) -> AttendRequest:
    return attend_fields(Fields(decode_document(raw, kind, max_bytes), ATTEND_FIELDS, "attend"), max_bytes)


def layer_index(session: Session, layer: int) -> int:
    if not 0 <= layer < session.config.num_layers:
        raise LayerNotFound(
            f"layer {layer} is outside 0..{session.config.num_layers - 1} of session {session.id!r}",
            num_layers=session.config.num_layers,
        )
    return layer


@dataclass(eq=False)
class Checked:
    """One operation that passed every check: its GPU job (not queued yet), its
    reservation (not committed yet), and what its answer and metrics need."""

    plan: PlanFn | None  # None: planned with others (a stacked step's item)
    res: Reservation
    kv_format: str
    rows: int  # appended rows
    queries: int  # query rows (0: an append)
    start_pos: int = 0  # an attend's first query position


def check_append(rt: Runtime, engine: Engine, session: Session, li: int, req: AppendRequest) -> Checked:
    fmt = session.config.layer_formats[li]
    rows = engine.check_kv_rows(session.config, req.k, req.v, fmt)
    res = rt.store.plan_append(session, li, rows, req.offset)
    rt.store.check_budget(res)
    plan = engine.plan_append(session.cache(li), req.k, req.v)
    return Checked(plan, res, fmt, rows, 0)


def check_attend(rt: Runtime, engine: Engine, session: Session, li: int, req: AttendRequest) -> Checked:
    op = reserve_attend(rt, engine, session, li, req.q, req.k, req.v, req.offset, req.start_pos)
    op.plan = engine.plan_attend(
        session.cache(li), req.q, k=req.k, v=req.v, start_pos=op.start_pos, causal=req.causal, scale=req.scale
    )
    return op


def reserve_attend(
    rt: Runtime,
    engine: Engine,
    session: Session,
    li: int,
    q: np.ndarray,
    k: np.ndarray | None,
    v: np.ndarray | None,
    offset: int | None,
    start_pos: int | None,
    values_clear: bool = False,
) -> Checked:
    """Every check of an attend (and its fused append): the reservation, not
    committed, and no plan (:func:`check_attend` adds it; a stacked step plans
    its items together, having checked their values at once: ``values_clear``)."""
    fmt = session.config.layer_formats[li]
    n = engine.check_query_rows(session.config, q, fmt)
    rows = 0
    if k is not None:
        rows = engine.check_kv_rows(session.config, k, v, fmt, values_clear=values_clear)
        res = rt.store.plan_append(session, li, rows, offset)
    else:
        res = rt.store.plan_read(session, li, offset)
    length = res.new_length
    given = start_pos
    start_pos = length - n if given is None else given
    if start_pos < 0 or start_pos + n > length:
        if given is None:
            detail = (
                f"start_pos: q has {n} rows but the layer holds {length} timesteps (the default "
                f"start_pos, length - n, would be {start_pos}); give start_pos or fewer rows"
            )
        else:
            detail = (
                f"start_pos: {n} query rows from start_pos {start_pos} pass the layer's length "
                f"{length} (start_pos + n <= length is required)"
            )
        raise InvalidRequest(detail, length=length)
    rt.store.check_budget(res)
    return Checked(None, res, fmt, rows, n, start_pos)


def queue_one(rt: Runtime, engine: Engine, op: Checked) -> Future:
    """Queue one checked operation on its own: commit, submit, watch."""
    fut = engine.worker.submit_plan(op.plan)
    rt.track(fut, op.res)
    return fut


def count_rows(rt: Runtime, op: Checked) -> None:
    """Metrics of a completed operation."""
    if op.rows:
        rt.metrics.rows.inc("append", op.kv_format, amount=op.rows)
    if op.queries:
        rt.metrics.rows.inc("query", op.kv_format, amount=op.queries)


def count_step_rows(rt: Runtime, per_format: dict[str, int], rows: int, queries: int) -> None:
    """:func:`count_rows` of a stacked step's completed items, ``per_format[fmt]``
    of each kv format, each of ``rows`` appended and ``queries`` query rows: one
    increment per format."""
    for fmt, count in per_format.items():
        if count and rows:
            rt.metrics.rows.inc("append", fmt, amount=rows * count)
        if count and queries:
            rt.metrics.rows.inc("query", fmt, amount=queries * count)


def attend_document(result: AttendResult, kind: MediaKind, return_lse: bool) -> dict[str, Any]:
    """An attend's answer: ``out``, ``length``, and ``lse`` when it was asked for
    (``return_lse``)."""
    doc = {"out": array_out(result.out, kind), "length": result.length}
    if return_lse:
        doc["lse"] = array_out(np.ascontiguousarray(result.lse), kind)
    return doc


def check_kept(rt: Runtime, config: SessionConfig) -> None:
    """A session with exact sinks or a window cannot live on a server that keeps its
    sessions in a snapshot directory (its journals do not hold the exact rows yet):
    a create or a restore of one there is refused (422) before anything is made."""
    if config.windowed and rt.settings.snapshot_dir:
        raise InvalidRequest(
            "sinks, window: this server keeps its sessions across restarts (snapshot_dir), and does not yet keep "
            "a session's exact sinks and window rows there; use a session without them, or a server without a "
            "snapshot directory"
        )


async def place_session(
    rt: Runtime, engine: Engine, kv: SessionKV, fill: Callable[[], Future], hold: tuple[str | None, str]
) -> Session:
    """A new session whose caches ``fill()`` queues the GPU call to fill (a snapshot's
    load, a fork), under the id and bytes ``hold`` took (``Store.hold``): waits for
    it, then adds the session to the store. The hold is given back either way (a full
    queue included); if the request goes away first, what the call loads is released
    when it lands."""
    try:
        filled = fill()  # may raise Overloaded: the hold goes back below
        try:
            await asyncio.shield(asyncio.wrap_future(filled))
        except asyncio.CancelledError:
            filled.add_done_callback(lambda f: f.exception() is None and engine.release(kv))
            raise
    finally:
        rt.store.unhold(hold)
    owner, session_id = hold
    return rt.store.adopt(kv, owner=owner, session_id=session_id)
