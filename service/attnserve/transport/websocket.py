"""The WebSocket transport: ``/v1/stream``, a WebSocket carrying the data-plane
operations as MessagePack frames, so an engine keeps one connection and
pipelines requests with no HTTP parsing per call; and the uvicorn protocol it
runs on (:class:`StreamWebSocketProtocol`, below), which ``cli.py`` hands the
server.

A request frame is a map ``{"id": <int or string>, "op": <name>, ...members}``:

* ``attend``: ``session_id``, ``layer`` and the members of ``POST .../attend``;
* ``append``: ``session_id``, ``layer`` and the members of ``POST .../kv``;
* ``attend_batch``: ``items``, as ``POST /v1/batch/attend``;
* ``session``: ``session_id``: the session's info; ``ping``: nothing;
* ``step_open``, ``step_call``, ``step_close``: a step held open across layers,
  bound to the connection (closed when it ends).

Each gets one reply frame ``{"id", "status": 200, "result": {...}}`` (the HTTP
answer's body) or ``{"id", "status": <4xx/5xx>, "error": <problem>}``. Binary
frames are MessagePack (arrays as MessagePack bodies); text frames are JSON and
are answered in JSON. Operations are checked and queued in the order their frames
arrive; replies come as each finishes (match them by ``id``).

Authentication: the bearer key of the handshake (``Authorization`` header); a
missing or wrong key closes the handshake (HTTP 403, close code 1008). At most
``stream_max_in_flight`` operations of one connection, holding at most
``stream_max_in_flight_bytes`` of request frames, are in flight, an operation
counting until its reply is flushed: written, and the socket's unsent bytes back
under a quarter of ``stream_max_unsent_bytes`` (:class:`StreamWebSocketProtocol`
sets the write buffer's limits and tells the connection when it drains). Past
that the server reads no further frame until one is answered, so a peer that
does not read its replies stops being read, and what a connection holds is
bounded by the two settings. The keepalive's pong deadline runs only while the
server reads the connection, and a peer that reads no reply for
``stream_send_timeout_s`` is dropped. A full GPU queue is a 503
``overloaded`` reply. An operation whose reply was sent is applied; a connection
that drops loses no queued operation (it completes; its reply is lost).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, cast

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from ..codec import MediaKind, decode_document, encode
from ..errors import ApiError, Unauthorized
from ..runtime import OWNER_KEY, Runtime
from ..store import Owner
from .ops import Pending, Reply, begin, count_reply, error_document

__all__ = ["router", "STREAM_PATH", "StreamWebSocketProtocol", "stream_websocket_protocol"]

log = logging.getLogger("attnserve")

router = APIRouter()
STREAM_PATH = "/v1/stream"
#: The scope extension through which :class:`StreamWebSocketProtocol` hands a
#: connection the event that is set while its socket's unsent bytes are under the
#: low-water mark (an asyncio.Event).
FLUSHED_EXTENSION = "attnserve.flushed"
_warned_unflushed = False


@router.websocket(STREAM_PATH)
async def stream(ws: WebSocket) -> None:
    rt: Runtime = ws.app.state.runtime
    owner: Owner = None
    if rt.keys.enabled:
        try:
            owner = rt.keys.authenticate(ws.headers.get("authorization", "").encode() or None)
        except Unauthorized as e:
            rt.metrics.auth_failures.labels(getattr(e, "reason", "invalid")).inc()
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
        self.in_flight_bytes = 0  # of the request frames in flight
        self.room = asyncio.Event()  # set while in_flight_bytes is under its limit
        self.room.set()
        self.send_lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()
        self.open = True
        self.flushed: asyncio.Event | None = ws.scope.get("extensions", {}).get(FLUSHED_EXTENSION)
        if self.flushed is None:
            _warn_unflushed()

    async def serve(self) -> None:
        try:
            while True:
                await self.slots.acquire()  # backpressure: no further frame past the in-flight limits
                await self.room.wait()
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    self.slots.release()
                    break
                t0 = time.perf_counter()
                raw = msg.get("bytes")
                kind: MediaKind = "msgpack"
                if raw is None:
                    raw, kind = (msg.get("text") or "").encode(), "json"
                nbytes = len(raw)
                self.hold(nbytes)
                try:
                    pending = await self.start(raw, kind)
                except Reply as r:
                    try:
                        await self.send(r.doc, kind, t0)
                        await self.drained()
                    finally:
                        self.release(nbytes)
                    continue
                del raw, msg  # the operation holds what it needs of the frame
                task = asyncio.create_task(self.finish(pending, kind, t0, nbytes))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        except WebSocketDisconnect:
            pass
        finally:
            self.open = False
            self.rt.steps.close_bound(self)  # its steps close with it (their calls in flight complete)
            # queued operations complete on the GPU whatever happens to the socket
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)

    async def start(self, raw: bytes, kind: MediaKind) -> Pending:
        """Decode, check and queue one frame (in arrival order), or raise :class:`Reply`."""
        rt = self.rt
        try:
            doc = await rt.offload(decode_document, raw, kind, rt.settings.max_body_bytes, size=len(raw))
        except ApiError as e:
            raise Reply(error_document(None, e, STREAM_PATH)) from None
        return begin(rt, self.owner, doc, STREAM_PATH, bound=self)

    def hold(self, nbytes: int) -> None:
        self.in_flight_bytes += nbytes
        if self.in_flight_bytes >= self.rt.settings.stream_max_in_flight_bytes:
            self.room.clear()

    def release(self, nbytes: int) -> None:
        """Let an operation's slot and its frame's bytes go."""
        self.in_flight_bytes -= nbytes
        if self.in_flight_bytes < self.rt.settings.stream_max_in_flight_bytes:
            self.room.set()
        self.slots.release()

    async def finish(self, pending: Pending, kind: MediaKind, t0: float, nbytes: int) -> None:
        """Await one operation's result and write its reply; its in-flight slot is
        held until the reply is flushed (:meth:`drained`), so a peer that does not
        read its replies stops being read."""
        try:
            await self.send(await pending.reply(kind), kind, t0)
            await self.drained()
        finally:
            self.release(nbytes)

    async def drained(self) -> None:
        """Return once the socket's unsent bytes are under the low-water mark (at
        once when they are, or the connection is gone)."""
        if self.flushed is not None and not self.flushed.is_set():
            await self.flushed.wait()

    async def send(self, doc: dict[str, Any], kind: MediaKind, t0: float) -> None:
        count_reply(self.rt, doc, STREAM_PATH, "WS", time.perf_counter() - t0)
        if not self.open:
            return
        try:
            body = await self.rt.offload(_encode_frame, doc, kind, size=_size_hint(doc))
            async with self.send_lock:
                if kind == "json":
                    await self.ws.send_text(bytes(body).decode())
                else:
                    await self.ws.send_bytes(body)  # (a view of the packer's buffer: sent as bytes are)
        except Exception:  # the peer went away: its operations still complete
            self.open = False


def _warn_unflushed() -> None:
    global _warned_unflushed
    if not _warned_unflushed:
        _warned_unflushed = True
        log.warning(
            "/v1/stream runs on a WebSocket protocol other than attnserve's (not started by `attnserve serve`): "
            "a reply's slot is released once it is written, not once it is flushed, so stream_max_unsent_bytes "
            "does not bound what an unread connection buffers"
        )


def _encode_frame(doc: dict[str, Any], kind: MediaKind) -> bytes | memoryview:
    if kind == "json":
        return json.dumps(doc, separators=(",", ":"), default=str).encode()
    return encode(doc, kind)


def _size_hint(doc: dict[str, Any]) -> int:
    out = doc.get("result", {}).get("out") if isinstance(doc.get("result"), dict) else None
    data = out.get("data") if isinstance(out, dict) else None
    return len(data) if isinstance(data, (bytes, bytearray)) else 0


# ── the protocol under it ────────────────────────────────────────────────────


class StreamWebSocketProtocol(WebSocketsSansIOProtocol):
    """The WebSocket protocol ``/v1/stream`` runs on: uvicorn's (websockets' sans-I/O
    protocol) with a keepalive that never drops a live peer the server itself holds
    back, and a send timeout (:data:`send_timeout_s` seconds without progress; 0:
    none) that drops a peer that reads nothing.

    uvicorn pings every ``ws_ping_interval`` and closes the connection (1011
    keepalive ping timeout) when no pong comes within ``ws_ping_timeout``. But a pong
    is a frame like any other: it arrives behind the data frames the peer sent before
    it, and the stream stops reading data frames while its in-flight operations are
    running (backpressure). With GPU work in flight for longer than the timeout, a
    peer that reads every reply and answers every ping was dropped with all its
    queued replies. Here the pong's deadline does not run out while the server is not
    reading (the app has not taken the last data frame): it is moved on, and judged
    again once the server reads, so only a peer that is read and still does not
    answer is dropped.

    The write buffer's high-water mark is :data:`max_unsent_bytes` (its low-water
    mark a quarter of it), and the connection's operations wait for it to drain
    through the event handed to the app in the scope's extensions
    (:data:`FLUSHED_EXTENSION`): set while the buffer is under the low-water mark.

    A peer that died while the server was not reading is found either way: once its
    operations finish, the server reads again (the pong deadline runs), or, if its
    replies cannot be written, by the send timeout: while the socket's write buffer
    is full (the peer reads nothing), the connection is aborted when the buffer has
    not shrunk for ``send_timeout_s`` (nginx's ``send_timeout``). Its operations
    still complete; only their replies are lost.
    """

    send_timeout_s: float = 60.0
    max_unsent_bytes: int = 1 << 20

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # the write buffer's size when the send timer was last set
        self.flushed = asyncio.Event()
        self.flushed.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.transport.set_write_buffer_limits(high=self.max_unsent_bytes)

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if self.response.status_code == 101:  # the app runs: hand it the flush event
            extensions = cast(dict[str, Any], self.scope["extensions"])
            extensions[FLUSHED_EXTENSION] = self.flushed

    # -- keepalive ---------------------------------------------------------------

    def keepalive_timeout(self) -> None:
        if self.read_paused and not self.transport.is_closing():
            # The server is not reading (the app has not taken the last data frame):
            # the pong may be queued behind frames not read yet. Judge it once the
            # server reads again.
            assert self.ping_timeout is not None
            self.pong_timer = self.loop.call_later(self.ping_timeout, self.keepalive_timeout)
            return
        super().keepalive_timeout()

    # -- send timeout ------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        self.flushed.clear()
        if self.send_timeout_s > 0 and self._send_timer is None:
            self._arm_send_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        self.flushed.set()
        self._cancel_send_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_send_timer()
        self.flushed.set()  # nothing will drain now: the waiting operations let their slots go
        super().connection_lost(exc)

    def _arm_send_timer(self) -> None:
        self._unsent = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_timed_out)

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size() < self._unsent:  # the peer read some: it lives
            self._arm_send_timer()
            return
        log.warning(
            f"a /v1/stream peer read nothing for {self.send_timeout_s:g} s: its connection is closed "
            "(its operations complete; their replies are lost)",
            extra={"client": "%s:%d" % self.client if self.client else None, "unsent_bytes": self._unsent},
        )
        self.transport.abort()


def stream_websocket_protocol(send_timeout_s: float, max_unsent_bytes: int) -> type[StreamWebSocketProtocol]:
    """The protocol class for uvicorn's ``ws`` option with this send timeout and write buffer limit."""
    return type(
        StreamWebSocketProtocol.__name__,
        (StreamWebSocketProtocol,),
        {"send_timeout_s": send_timeout_s, "max_unsent_bytes": max_unsent_bytes},
    )
