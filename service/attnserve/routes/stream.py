"""The streaming transport: ``/v1/stream``, a WebSocket carrying the data-plane
operations as MessagePack frames, so an engine keeps one connection and
pipelines requests with no HTTP parsing per call.

A request frame is a map ``{"id": <int or string>, "op": <name>, ...members}``:

* ``attend``: ``session_id``, ``layer`` and the members of ``POST .../attend``;
* ``append``: ``session_id``, ``layer`` and the members of ``POST .../kv``;
* ``attend_batch``: ``items``, as ``POST /v1/batch/attend``;
* ``session``: ``session_id``: the session's info; ``ping``: nothing.

Each gets one reply frame ``{"id", "status": 200, "result": {...}}`` (the HTTP
answer's body) or ``{"id", "status": <4xx/5xx>, "error": <problem>}``. Binary
frames are MessagePack (arrays as MessagePack bodies); text frames are JSON and
are answered in JSON. Operations are checked and queued in the order their frames
arrive; replies come as each finishes (match them by ``id``).

Authentication: the bearer key of the handshake (``Authorization`` header); a
missing or wrong key closes the handshake (HTTP 403, close code 1008). At most
``stream_max_in_flight`` operations of one connection are in flight, an operation
counting until its reply is written: past that the server reads no further frame
until one is answered (the socket's flow control pushes back both ways; a peer
that does not read its replies stops being read, and nothing is buffered without
bound). A full GPU queue is a 503
``overloaded`` reply. An operation whose reply was sent is applied; a connection
that drops loses no queued operation (it completes; its reply is lost).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from ..codec import Fields, MediaKind, decode_document, encode
from ..errors import ApiError, InternalError, InvalidRequest, Unauthorized
from ..store import Owner
from ..steps import (
    BATCH_ITEM_FIELDS,
    STACKED_FIELDS,
    answer_document,
    count_errors,
    finish_any,
    parse_batch_document,
    queue_batch,
    settled,
)
from ..runtime import OWNER_KEY, Runtime
from .deps import ready_engine
from ..operations import (
    APPEND_FIELDS,
    ATTEND_FIELDS,
    append_fields,
    attend_document,
    attend_fields,
    check_append,
    check_attend,
    layer_index,
    queue_one,
)

__all__ = ["router", "STREAM_PATH", "OPS"]

log = logging.getLogger("attnserve")

router = APIRouter()
STREAM_PATH = "/v1/stream"
OPS = ("attend", "append", "attend_batch", "session", "ping")
_HEAD = ("id", "op")


class _Reply(Exception):
    """Raised inside a frame's handling to answer it at once."""

    def __init__(self, doc: dict[str, Any]):
        self.doc = doc


@router.websocket(STREAM_PATH)
async def stream(ws: WebSocket) -> None:
    rt: Runtime = ws.app.state.runtime
    owner: Owner = None
    if rt.keys.enabled:
        try:
            owner = rt.keys.authenticate(ws.headers.get("authorization", "").encode() or None)
        except Unauthorized as e:
            rt.metrics.auth_failures.inc(getattr(e, "reason", "invalid"))
            await ws.close(code=1008, reason="unauthorized: a valid bearer key is required")
            return
    if rt.draining or not rt.ready:
        await ws.close(code=1013, reason="not ready: try again later")
        return
    ws.scope[OWNER_KEY] = owner
    await ws.accept()
    conn = _Connection(rt, ws, owner)
    rt.request_started()
    try:
        await conn.serve()
    finally:
        rt.request_finished()


class _Connection:
    def __init__(self, rt: Runtime, ws: WebSocket, owner: Owner):
        self.rt = rt
        self.ws = ws
        self.owner = owner
        self.slots = asyncio.Semaphore(rt.settings.stream_max_in_flight)
        self.send_lock = asyncio.Lock()
        self.tasks: set[asyncio.Task] = set()
        self.open = True

    async def serve(self) -> None:
        try:
            while True:
                await self.slots.acquire()  # backpressure: no further frame past the in-flight limit
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    self.slots.release()
                    break
                t0 = time.perf_counter()
                raw = msg.get("bytes")
                kind: MediaKind = "msgpack"
                if raw is None:
                    raw, kind = (msg.get("text") or "").encode(), "json"
                try:
                    waiter = await self.start(raw, kind)
                except _Reply as r:
                    try:
                        await self.send(r.doc, kind, t0)
                    finally:
                        self.slots.release()
                    continue
                task = asyncio.create_task(self.finish(waiter, kind, t0))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        except WebSocketDisconnect:
            pass
        finally:
            self.open = False
            # queued operations complete on the GPU whatever happens to the socket
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)

    async def start(self, raw: bytes, kind: MediaKind):
        """Decode, check and queue one frame (in arrival order); returns a
        coroutine function that awaits its result, or raises :class:`_Reply`."""
        rt = self.rt
        max_bytes = rt.settings.max_body_bytes
        rid: Any = None
        try:
            doc = await rt.offload(decode_document, raw, kind, max_bytes, size=len(raw))
            if isinstance(doc, dict):
                rid = doc.get("id")
                if not isinstance(rid, (int, str)) or isinstance(rid, bool):
                    rid = None
                    raise InvalidRequest("id: expected an integer or a string that names the request")
            op = Fields(doc, (*_HEAD, *BATCH_ITEM_FIELDS, *STACKED_FIELDS, "items"), "frame").str("op", choices=OPS)
            return self.dispatch(op, doc, rid)
        except ApiError as e:
            raise _Reply(_error(rid, e)) from None

    def dispatch(self, op: str, doc: dict[str, Any], rid: Any):
        rt = self.rt
        max_bytes = rt.settings.max_body_bytes
        if op == "ping":
            raise _Reply({"id": rid, "status": 200, "result": {}})
        engine = ready_engine(rt)
        if op == "attend_batch":
            parsed = parse_batch_document(doc, _HEAD, "attend_batch", max_bytes, rt.settings.max_batch_items)
            queued = queue_batch(rt, engine, self.owner, parsed)

            async def batch_result(kind: MediaKind) -> dict[str, Any]:
                outcome = await finish_any(rt, queued)
                count_errors(rt, outcome)
                return answer_document(parsed, outcome, kind, STREAM_PATH)

            return rid, batch_result
        if op == "session":
            f = Fields(doc, (*_HEAD, "session_id"), "session")
            raise _Reply({"id": rid, "status": 200, "result": rt.store.get(f.str("session_id"), self.owner).info()})
        fields = (*_HEAD, "session_id", "layer", *(APPEND_FIELDS if op == "append" else ATTEND_FIELDS))
        f = Fields(doc, fields, op)
        session = rt.store.get(f.str("session_id"), self.owner)
        li = layer_index(session, f.int("layer", lo=0))
        if op == "append":
            checked = check_append(rt, engine, session, li, append_fields(f, max_bytes))
        else:
            checked = check_attend(rt, engine, session, li, attend_fields(f, max_bytes))
        fut = queue_one(rt, engine, checked)

        async def result(kind: MediaKind) -> Any:
            done = await asyncio.gather(asyncio.wrap_future(fut), return_exceptions=True)
            r = settled(rt, fut, checked, done[0])
            if isinstance(r, ApiError):
                return r
            if op == "append":
                return {"length": r}
            out, length = r
            return attend_document(out, length, kind)

        return rid, result

    async def finish(self, waiter, kind: MediaKind, t0: float) -> None:
        """Await one operation's result and write its reply; its in-flight slot is
        held until the reply is written, so a peer that does not read its replies
        stops being read (its unsent replies are bounded by the slots)."""
        rid, result = waiter
        try:
            try:
                r = await result(kind)
                doc = _error(rid, r) if isinstance(r, ApiError) else {"id": rid, "status": 200, "result": r}
            except ApiError as e:
                doc = _error(rid, e)
            except Exception:
                log.exception("stream operation failed", extra={"request_id": rid})
                doc = _error(rid, InternalError("an internal error occurred; it was logged"))
            await self.send(doc, kind, t0)
        finally:
            self.slots.release()

    async def send(self, doc: dict[str, Any], kind: MediaKind, t0: float) -> None:
        rt = self.rt
        status = int(doc["status"])
        rt.metrics.observe_request(STREAM_PATH, "WS", status, time.perf_counter() - t0)
        if "error" in doc:
            rt.metrics.errors.inc(doc["error"]["type"].rsplit("/", 1)[-1])
        if not self.open:
            return
        try:
            body = await self.rt.offload(_encode_frame, doc, kind, size=_size_hint(doc))
            async with self.send_lock:
                if kind == "json":
                    await self.ws.send_text(body.decode())
                else:
                    await self.ws.send_bytes(body)
        except Exception:  # the peer went away: its operations still complete
            self.open = False


def _error(rid: Any, err: ApiError) -> dict[str, Any]:
    return {"id": rid, "status": err.status, "error": err.problem(STREAM_PATH)}


def _encode_frame(doc: dict[str, Any], kind: MediaKind) -> bytes:
    if kind == "json":
        return json.dumps(doc, separators=(",", ":"), default=str).encode()
    return encode(doc, kind)


def _size_hint(doc: dict[str, Any]) -> int:
    out = doc.get("result", {}).get("out") if isinstance(doc.get("result"), dict) else None
    data = out.get("data") if isinstance(out, dict) else None
    return len(data) if isinstance(data, (bytes, bytearray)) else 0
