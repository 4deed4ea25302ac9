"""The frame transport: the stream's operations over a plain TCP connection, with
arrays carried as raw bytes beside a small MessagePack head, so the server reads
each frame into one buffer and hands the operations numpy views of it (no
WebSocket framing, masking or MessagePack ``bin`` copies on the data path).

Served on ``frames_port`` (``ATTNSERVE_FRAMES_PORT``; off when unset) of the same
host, in the same process and event loop as the HTTP server. ``docs/api.md``
("Frame transport") is the contract; in short, every frame either way is::

    "ATF1" | u32 head_len | u32 body_len | head (MessagePack map) | body (bytes)

(little-endian lengths). A request's head is a request document of the stream
(:mod:`attnserve.transport.ops`) whose arrays are references into the body,
``{"dtype": "<f4", "shape": [...], "at": [offset, nbytes]}`` (offset a multiple
of 4); a reply's arrays are references into its body the same way. The first
frame of a connection is ``{"op": "hello", "id", "version": 1, "key"?}``: the API
key when the server has keys. Heads are at most :data:`MAX_HEAD_BYTES`, bodies at
most ``max_body_bytes``.

Flow control is the stream's: at most ``stream_max_in_flight`` operations of a
connection, holding at most ``stream_max_in_flight_bytes`` of request frames, are
in flight, one counting until its reply is flushed (the socket's unsent bytes
back under a quarter of ``stream_max_unsent_bytes``, its write buffer's
high-water mark); past either, or while the unsent bytes are over the high-water
mark (replies that need no GPU, such as problems, hold no slot), the server reads
nothing more from that connection. A frame that stalls for
``BODY_IDLE_TIMEOUT_S`` mid-way, or a connection that sends no hello in that
time, is closed.

The shared-memory transport (``transport/shm.py``) serves the same frames over a
Unix socket: its connections are this module's, with the hooks it overrides
(:meth:`_Connection._prepare`, :meth:`_Connection._outgoing`,
:meth:`_Connection._released`), and its hello is checked by :func:`greet`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import numpy as np
from attnserve_client.framing import (
    CALL_MAGIC,
    MAX_HEAD_BYTES,
    PREFIX,
    VERSION,
    frame_buffers,
    read_prefix,
    resolve_arrays,
)

from .. import __version__
from ..codec import BODY_IDLE_TIMEOUT_S, wire
from ..contract import Fields, StreamHello
from ..instance import instance_name
from ..errors import (
    ApiError,
    InternalError,
    InvalidRequest,
    MalformedBody,
    NotReady,
    PayloadTooLarge,
    Unauthorized,
)
from ..plane import _callframe
from ..runtime import Runtime
from ..step.steps import Call, begin_frame_call, finish_frame_call
from ..store import Owner
from .ops import Pending, Reply, begin, count_reply, error_document, request_id

__all__ = ["ConnectionServer", "FrameServer", "FRAMES_INSTANCE", "greet", "hello_result", "decode_head"]

log = logging.getLogger("attnserve")

#: The ``instance`` of the transport's problems, and its label in the metrics.
FRAMES_INSTANCE = "/v1/frames"


class ConnectionServer:
    """What the connections of a frame server share: the runtime, and the set of
    those open (a connection leaves it once closed with its operations finished)."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.connections: set[_Connection] = set()

    def close_connections(self) -> None:
        """Close every connection (after the drain: what was in flight is answered)."""
        for conn in list(self.connections):
            conn.close()


class FrameServer(ConnectionServer):
    """The listening socket and its connections."""

    def __init__(self, rt: Runtime):
        super().__init__(rt)
        self._server: asyncio.base_events.Server | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("frame transport listening", extra={"host": host, "port": self.port})

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()


class _Connection(asyncio.BufferedProtocol):
    """One client's connection: reads frames into buffers of their own size, checks
    and queues each, writes the replies as they finish."""

    #: the ``instance`` of its problems, and the route and method of its metrics
    INSTANCE = FRAMES_INSTANCE
    METHOD = "TCP"

    def __init__(self, server: ConnectionServer):
        self.server = server
        self.rt = server.rt
        self.transport: asyncio.Transport | None = None
        self.owner: Owner = None
        self.greeted = False
        self.open = True
        self.in_flight = 0
        self.in_flight_bytes = 0  # of the request frames in flight
        self.reading = True
        self.writable = asyncio.Event()
        self.writable.set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.prefix = bytearray(_callframe.HEAD_BYTES)  # a frame's prefix, or a call frame's whole head
        self.frame: np.ndarray | None = None
        self.view = memoryview(self.prefix)[: PREFIX.size]
        self.filled = 0
        self.head_len = 0
        # a call frame's (step, layer, seq, body_len) while its head is whole (None: an ordinary frame)
        self.call: tuple[int, int, int, int] | None = None
        self.head_rest = False  # reading the rest of a call frame's head
        self.last_byte = time.monotonic()
        self.started = time.monotonic()
        self.watchdog: asyncio.TimerHandle | None = None

    # ── asyncio callbacks ───────────────────────────────────────────────────

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._connected(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if len(self.server.connections) >= self.rt.settings.frames_max_connections:
            self.refuse(None, NotReady("too many frame connections; try again later"))
            return
        self.server.connections.add(self)
        self._arm_watchdog()

    def _connected(self, transport: asyncio.BaseTransport) -> None:
        """Take the transport, its write buffer limited to ``stream_max_unsent_bytes``."""
        self.transport = transport  # type: ignore[assignment]  # a TCP or Unix transport (uvloop's are no subclass)
        transport.set_write_buffer_limits(high=self.rt.settings.stream_max_unsent_bytes)  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        self.last_byte = time.monotonic()
        if self.filled < len(self.view):
            return
        if self.head_rest:
            self._call_head_done()
        elif self.frame is None:
            self._prefix_done()
        elif self.call is not None:
            self._call_done()
        else:
            self._frame_done()

    def pause_writing(self) -> None:
        self.writable.clear()
        self._set_reading()

    def resume_writing(self) -> None:
        self.writable.set()
        self._set_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self.rt.steps.close_bound(self)  # its steps close with it (their calls in flight complete)
        self.writable.set()  # replies still being produced are dropped, their slots freed
        if self.watchdog is not None:
            self.watchdog.cancel()
        if not self.tasks:
            self._released()

    def _released(self) -> None:
        """The connection is closed and its operations are finished."""
        self.server.connections.discard(self)

    # ── frames in ───────────────────────────────────────────────────────────

    def _prefix_done(self) -> None:
        if self.greeted and self.prefix[:4] == CALL_MAGIC:  # a call frame: its head is longer
            self.head_rest = True
            self.view = memoryview(self.prefix)
            return
        try:
            head_len, body_len = read_prefix(self.prefix[: PREFIX.size])
        except wire.WireError as e:
            self.refuse(None, MalformedBody(str(e)))
            return
        if head_len > MAX_HEAD_BYTES:
            self.refuse(None, PayloadTooLarge(f"frame head: expected at most {MAX_HEAD_BYTES} bytes, got {head_len}"))
            return
        max_body = self.rt.settings.max_body_bytes
        if body_len > max_body:
            self.refuse(None, PayloadTooLarge(f"frame body: expected at most {max_body} bytes, got {body_len}"))
            return
        self.head_len = head_len
        self._read_frame(head_len + body_len)
        if not len(self.view):
            self._frame_done()

    def _read_frame(self, nbytes: int) -> None:
        self.frame = np.empty(nbytes, np.uint8)
        self.view = self.frame.data.cast("B")  # ndarray.data: memoryview(frame) (typed on Python < 3.12 too)
        self.filled = 0

    def _next_frame(self) -> memoryview:
        """The frame just read (its buffer's view); the connection reads the next one's prefix."""
        view = self.view
        self.frame, self.view, self.filled, self.call = None, memoryview(self.prefix)[: PREFIX.size], 0, None
        return view

    def _call_head_done(self) -> None:
        """A call frame's head is whole: parsed by the step table's parser (its
        body's length bounded as a frame's), then its body is read."""
        self.head_rest = False
        try:
            self.call = _callframe.parse_head(self.prefix, self.rt.settings.max_body_bytes)
        except _callframe.CallFrameError as e:
            max_body = self.rt.settings.max_body_bytes
            self.refuse(
                None,
                PayloadTooLarge(f"call frame body: expected at most {max_body} bytes")
                if e.status == "TOO_LARGE"
                else MalformedBody(f"call frame: {e}"),
            )
            return
        self._read_frame(self.call[3])
        if not len(self.view):
            self._call_done()

    def _call_done(self) -> None:
        """A call frame is read: checked and queued as its step's layer call
        (``steps.begin_frame_call``); a refused one is answered with its problem
        in an ordinary reply frame (``id``: its seq), as every reply that is not
        a call reply."""
        assert self.call is not None
        t0 = time.perf_counter()
        head = self.call
        view = self._next_frame()
        seq = head[2]
        try:
            call = begin_frame_call(self.rt, self.rt.ready_engine(), self.owner, head, view)
        except ApiError as e:
            self.send(error_document(seq, e, self.INSTANCE), t0)
            return
        nbytes = len(view) + _callframe.HEAD_BYTES
        self._hold_slot(nbytes)
        task = asyncio.get_running_loop().create_task(self._finish_call(call, seq, t0, nbytes))
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _frame_done(self) -> None:
        assert self.frame is not None
        t0 = time.perf_counter()
        head_len = self.head_len
        view = self._next_frame()
        if not self.greeted:
            self._hello(view[:head_len], t0)
            return
        rid: Any = None
        try:
            doc = decode_head(view[:head_len])
            rid = request_id(doc)
            reply_to = self._prepare(doc, view[head_len:])
            pending = begin(self.rt, self.owner, doc, self.INSTANCE, bound=self)
        except Reply as r:
            self.send(r.doc, t0)
            return
        except ApiError as e:
            self.send(error_document(rid, e, self.INSTANCE), t0)
            return
        nbytes = len(view)
        self._hold_slot(nbytes)
        task = asyncio.get_running_loop().create_task(self._finish(pending, t0, reply_to, nbytes))
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _prepare(self, doc: Any, body: memoryview) -> Any:
        """Make a received request document ready for :func:`begin`: its array
        references resolved into ``body``. Returns what :meth:`_outgoing` needs to
        send its reply (nothing, here).

        Raises:
            ApiError: the frame's problem.
        """
        _resolve_arrays(doc, body)
        return None

    def _outgoing(self, doc: dict[str, Any], reply_to: Any) -> dict[str, Any]:
        """The reply document as sent (here: as it is; its arrays go in the body)."""
        return doc

    def _hello(self, head: memoryview, t0: float) -> None:
        """The first frame: the version and the key; any failure closes the connection."""
        rid: Any = None
        try:
            doc = decode_head(head)
            rid = request_id(doc)
            self.owner, _ = greet(self.rt, doc)
        except ApiError as e:
            self.refuse(rid, e, t0)
            return
        self.greeted = True
        self.send({"id": rid, "status": 200, "result": hello_result(self.rt)}, t0)

    # ── flow control ────────────────────────────────────────────────────────

    def _hold_slot(self, nbytes: int) -> None:
        self.in_flight += 1
        self.in_flight_bytes += nbytes
        self.rt.request_started()
        self._set_reading()

    def _release_slot(self, nbytes: int) -> None:
        self.in_flight -= 1
        self.in_flight_bytes -= nbytes
        self.rt.request_finished()
        self._set_reading()

    def _set_reading(self) -> None:
        """Read the connection while it has a free slot, its frames in flight are
        under their byte limit and its unsent bytes under the high-water mark; else
        pause reading (the peer's sends back up)."""
        transport = self.transport
        if not self.open or transport is None or transport.is_closing():
            return
        settings = self.rt.settings
        want = (
            self.in_flight < settings.stream_max_in_flight
            and self.in_flight_bytes < settings.stream_max_in_flight_bytes
            and self.writable.is_set()
        )
        if want != self.reading:
            self.reading = want
            if want:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not self.open and not self.tasks:
            self._released()

    async def _finish(self, pending: Pending, t0: float, reply_to: Any, nbytes: int) -> None:
        """Await one operation and write its reply; the slot is held until the reply
        is flushed (a peer that reads nothing stops being read)."""
        try:
            doc = await pending.reply("msgpack")
            self.send(self._outgoing(doc, reply_to) if self.open else doc, t0)
            if not self.writable.is_set():
                await self.writable.wait()
        finally:
            self._release_slot(nbytes)

    async def _finish_call(self, call: Call, seq: int, t0: float, nbytes: int) -> None:
        """Await a call frame's call and write its reply: a call reply of ``out``
        (and ``lse``) when every item applied, else the answer document (or the
        problem) in an ordinary reply frame; the slot is held until it is flushed."""
        try:
            doc: dict[str, Any] | None = None
            try:
                r = await finish_frame_call(self.rt, call, self.INSTANCE)
                if isinstance(r, tuple):
                    self.send_call_reply(seq, r[0], r[1], t0)
                else:
                    doc = {"id": seq, "status": 200, "result": r}
            except ApiError as e:
                doc = error_document(seq, e, self.INSTANCE)
            except Exception:
                log.exception("call frame failed", extra={"request_id": seq})
                doc = error_document(seq, InternalError("an internal error occurred; it was logged"), self.INSTANCE)
            if doc is not None:
                self.send(doc, t0)
            if not self.writable.is_set():
                await self.writable.wait()
        finally:
            self._release_slot(nbytes)

    def _arm_watchdog(self) -> None:
        self.watchdog = asyncio.get_running_loop().call_later(BODY_IDLE_TIMEOUT_S / 4, self._watch)

    def _watch(self) -> None:
        """Close a connection with no hello, or a frame stalled mid-way, after
        ``BODY_IDLE_TIMEOUT_S``."""
        if not self.open:
            return
        now = time.monotonic()
        if not self.greeted and now - self.started > BODY_IDLE_TIMEOUT_S:
            log.info("frame connection closed: no hello", extra={"seconds": BODY_IDLE_TIMEOUT_S})
            self.close()
            return
        if self.filled and now - self.last_byte > BODY_IDLE_TIMEOUT_S:
            log.info("frame connection closed: a frame stalled", extra={"seconds": BODY_IDLE_TIMEOUT_S})
            self.close()
            return
        self._arm_watchdog()

    # ── frames out ──────────────────────────────────────────────────────────

    def send(self, doc: dict[str, Any], t0: float) -> None:
        count_reply(self.rt, doc, self.INSTANCE, self.METHOD, time.perf_counter() - t0)
        if not self.open or self.transport is None or self.transport.is_closing():
            return
        self.transport.writelines(frame_buffers(doc, wire.packb))

    def send_call_reply(self, seq: int, out: np.ndarray, lse: np.ndarray | None, t0: float) -> None:
        """A call reply: its head, then the bytes of ``out`` and ``lse`` as they are."""
        self.rt.metrics.observe_request(self.INSTANCE, self.METHOD, 200, time.perf_counter() - t0)
        if not self.open or self.transport is None or self.transport.is_closing():
            return
        parts = [np.ascontiguousarray(out).data.cast("B")]
        if lse is not None:
            parts.append(np.ascontiguousarray(lse).data.cast("B"))
        body_len = sum(p.nbytes for p in parts)
        self.transport.writelines([_callframe.reply_head(seq, 200, body_len), *parts])

    def refuse(self, rid: Any, err: ApiError, t0: float | None = None) -> None:
        """Answer ``err`` and close the connection (the frames after it cannot be read)."""
        self.send(error_document(rid, err, self.INSTANCE), time.perf_counter() if t0 is None else t0)
        self.close()

    def close(self) -> None:
        self.open = False
        self.filled = 0
        if self.transport is not None:
            self.transport.close()  # after what is buffered is written


def decode_head(head: memoryview) -> Any:
    """A frame's head (a MessagePack document).

    Raises:
        MalformedBody: it is none.
    """
    try:
        return wire.unpackb(head, max_bytes=MAX_HEAD_BYTES)
    except wire.WireError as e:
        raise MalformedBody(f"frame head: {e}") from None


def _resolve_arrays(doc: Any, body: memoryview, region: memoryview | None = None) -> None:
    try:
        resolve_arrays(doc, body.toreadonly(), region=region)
    except wire.WireError as e:
        raise InvalidRequest(str(e)) from None


def greet(rt: Runtime, doc: Any, model: type[StreamHello] = StreamHello) -> tuple[Owner, Fields]:
    """Check the hello of a connection (a document of ``model``): the version and,
    when the server has API keys, the key; and that the server takes work. Returns
    the key's owner and the hello's members (``model``'s others are the caller's).

    Raises:
        ApiError: the problem that refuses the connection (the key is never logged).
    """
    if not isinstance(doc, dict) or doc.get("op") != "hello":
        raise InvalidRequest("frame: the first frame of a connection must be {op: hello, version: 1}")
    f = Fields(doc, model, "hello")
    f.int("version", lo=VERSION, hi=VERSION)
    key = f.str("key", "")
    owner: Owner = None
    if rt.keys.enabled:
        try:
            owner = rt.keys.authenticate(b"Bearer " + key.encode() if key else None)
        except Unauthorized as e:
            rt.metrics.auth_failures.labels(getattr(e, "reason", "invalid")).inc()
            raise
    rt.ready_engine()
    return owner, f


def hello_result(rt: Runtime) -> dict[str, Any]:
    """The ``result`` of a hello's reply: the protocol's version, the server's and its limits."""
    return {
        "version": VERSION,
        "server": __version__,
        "instance": instance_name(rt.settings.instance_name),
        "max_head_bytes": MAX_HEAD_BYTES,
        "max_body_bytes": rt.settings.max_body_bytes,
        "max_in_flight": rt.settings.stream_max_in_flight,
    }
