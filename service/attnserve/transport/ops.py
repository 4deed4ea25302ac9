"""The operations of a pipelined connection, whatever carries its frames: the
WebSocket stream (``transport/websocket.py``) and the TCP frame transport
(``transport/frames.py``) turn each received frame into a request document, and
this module checks and queues it (through ``step/``) and turns its outcome into
the reply document.

A request document is a map ``{"id": <int or string>, "op": <name>, ...members}``:

* ``attend``: ``session_id``, ``layer`` and the members of ``POST .../attend``;
* ``append``: ``session_id``, ``layer`` and the members of ``POST .../kv``;
* ``attend_batch``: ``items``, or the stacked form, as ``POST /v1/batch/attend``;
* ``session``: ``session_id``: the session's info; ``ping``: nothing;
* ``step_open``, ``step_call``, ``step_close``: a step held open across layers
  (``step/steps.py``): the members of ``POST /v1/steps``, of a layer call with
  its ``step`` and ``layer``, and ``step``. A step opened on a connection is
  bound to it (its transport closes it when the connection ends:
  ``StepRegistry.close_bound``).

Its reply is ``{"id", "status": 200, "result": {...}}`` (the HTTP answer's body) or
``{"id", "status": <4xx/5xx>, "error": <problem>}``. :func:`begin` checks and
queues a document (in arrival order, with no ``await``) and returns a
:class:`Pending` whose :meth:`Pending.reply` awaits the outcome, or raises
:class:`Reply` with an answer that needs no GPU (a problem, ``ping``, ``session``).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any, Awaitable, Callable

from ..codec import MediaKind
from ..engine import Engine
from ..contract import AppendItem, BatchItem, BatchItems, Fields, StackedBatch, StepOpen, members
from ..errors import ApiError, InternalError, InvalidRequest
from ..runtime import Runtime
from ..step.answer import answer_document, count_problems
from ..step.parse import (
    append_fields,
    attend_fields,
    one_append,
    one_attend,
    parse_batch_document,
)
from ..step.plan import finish_request, queue_request
from ..step.rules import layer_problem
from ..step.steps import begin_call, close_step, finish_call, open_step
from ..store import Owner

__all__ = ["OPS", "HEAD", "Reply", "Pending", "request_id", "begin", "error_document", "count_reply"]

log = logging.getLogger("attnserve")

OPS = ("attend", "append", "attend_batch", "session", "ping", "step_open", "step_call", "step_close")
HEAD = ("id", "op")
# what a frame of any op may name (each op's own members are checked after)
_ANY_OP = tuple(
    dict.fromkeys((*members(BatchItem), *members(StackedBatch), *members(BatchItems), *members(StepOpen), "step"))
)


class Reply(Exception):
    """Raised by :func:`begin` to answer a frame at once (``doc`` is the reply)."""

    def __init__(self, doc: dict[str, Any]):
        self.doc = doc


class Pending:
    """An operation checked and queued; :meth:`reply` awaits it and gives its reply
    document (a problem document if it failed)."""

    __slots__ = ("rid", "instance", "_result")

    def __init__(self, rid: Any, instance: str, result: Callable[[MediaKind], Awaitable[Any]]):
        self.rid, self.instance, self._result = rid, instance, result

    async def reply(self, kind: MediaKind) -> dict[str, Any]:
        try:
            r = await self._result(kind)
        except ApiError as e:
            r = e
        except Exception:
            log.exception("stream operation failed", extra={"request_id": self.rid})
            r = InternalError("an internal error occurred; it was logged")
        if isinstance(r, ApiError):
            return error_document(self.rid, r, self.instance)
        return {"id": self.rid, "status": 200, "result": r}


def error_document(rid: Any, err: ApiError, instance: str) -> dict[str, Any]:
    return {"id": rid, "status": err.status, "error": err.problem(instance)}


def count_reply(rt: Runtime, doc: dict[str, Any], route: str, method: str, seconds: float) -> None:
    """The metrics of one reply document: its request, latency and problem type."""
    rt.metrics.observe_request(route, method, int(doc["status"]), seconds)
    if "error" in doc:
        rt.metrics.errors_by[doc["error"]["type"].rsplit("/", 1)[-1]].inc()


def request_id(doc: Any) -> Any:
    """The ``id`` of a request document (``None`` where it has none usable).

    Raises:
        InvalidRequest: the id is neither an integer nor a string.
    """
    if not isinstance(doc, dict):
        return None
    rid = doc.get("id")
    if not isinstance(rid, (int, str)) or isinstance(rid, bool):
        raise InvalidRequest("id: expected an integer or a string that names the request")
    return rid


def begin(rt: Runtime, owner: Owner, doc: Any, instance: str, bound: Hashable | None = None) -> Pending:
    """Check and queue one request document (no ``await`` inside); ``bound``: the
    connection it came on (the steps it opens are bound to it).

    Raises:
        Reply: the answer is ready now (a problem, ``ping``, ``session``, a
        step's open or close).
    """
    rid: Any = None
    try:
        rid = request_id(doc)
        op = Fields(doc, _ANY_OP, "frame", head=HEAD).str("op", choices=OPS)
        return _dispatch(rt, owner, op, doc, rid, instance, bound)
    except ApiError as e:
        raise Reply(error_document(rid, e, instance)) from None


def _dispatch(
    rt: Runtime, owner: Owner, op: str, doc: dict[str, Any], rid: Any, instance: str, bound: Hashable | None
) -> Pending:
    max_bytes = rt.settings.max_body_bytes
    if op == "ping":
        raise Reply({"id": rid, "status": 200, "result": {}})
    engine = rt.ready_engine()
    if op.startswith("step_"):
        return _step_op(rt, engine, owner, op, doc, rid, instance, bound)
    if op == "attend_batch":
        parsed = parse_batch_document(doc, HEAD, "attend_batch", max_bytes, rt.settings.max_batch_items)
    elif op == "session":
        f = Fields(doc, (*HEAD, "session_id"), "session")
        raise Reply({"id": rid, "status": 200, "result": rt.store.get(f.str("session_id"), owner).info()})
    else:
        f = Fields(doc, AppendItem if op == "append" else BatchItem, op, head=HEAD)
        session = rt.store.get(f.str("session_id"), owner)
        layer = f.int("layer")
        problem = layer_problem(session, layer)
        if problem is not None:
            raise problem
        if op == "append":
            parsed = one_append(session.id, layer, append_fields(f, max_bytes))
        else:
            parsed = one_attend(session.id, layer, attend_fields(f, max_bytes))
    queued = queue_request(rt, engine, owner, parsed)
    if parsed.form == "one" and 0 in queued.problems:
        raise queued.problems[0]

    async def result(kind: MediaKind) -> Any:
        outcome = await finish_request(rt, queued)
        if parsed.form != "one":
            count_problems(rt, outcome)
        return answer_document(outcome, kind, instance)

    return Pending(rid, instance, result)


def _step_op(
    rt: Runtime, engine: Engine, owner: Owner, op: str, doc: dict[str, Any], rid: Any, instance: str,
    bound: Hashable | None,
) -> Pending:  # fmt: skip
    """``step_open``, ``step_close`` (answered at once) and ``step_call``."""
    if op == "step_open":
        step = open_step(rt, owner, doc, what=op, head=HEAD, bound=bound)
        raise Reply({"id": rid, "status": 200, "result": step.document()})
    if op == "step_close":
        close_step(rt, owner, Fields(doc, (*HEAD, "step"), op).int("step", lo=1))
        raise Reply({"id": rid, "status": 200, "result": {}})
    call = begin_call(rt, engine, owner, doc, what=op, head=HEAD)

    async def result(kind: MediaKind) -> Any:
        return await finish_call(rt, call, kind, instance)

    return Pending(rid, instance, result)
