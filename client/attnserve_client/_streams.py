"""The streaming connection: WebSockets to ``/v1/stream`` that carry append, attend
and batched steps as MessagePack frames.

:class:`Stream` (sync, thread-safe) and :class:`AsyncStream` (asyncio) pipeline:
``submit_*`` returns a future at once, concurrent ``await``\\ s share a connection,
and the server applies the operations of one connection in the order sent.

Behind a router of several replicas a stream holds one connection per replica,
opened when first needed with ``X-Attnserve-Route`` naming a session of that
replica: each operation goes to the connection of its session's replica, and a
batched step whose sessions live on several replicas is split, one frame per
replica, its answers merged in item order (as the client's HTTP path does). Where
the sessions live is the client's knowledge (``ReplicaMap``); on a single server
every operation uses the one connection.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from . import framing, tensors, wire
from ._routing import ROUTE_HEADER
from ._steps import (
    AttendItem,
    AttendOptions,
    StackedOptions,
    CallSink,
    StepOptions,
    StepState,
    attend_answer,
    attend_members,
    attend_out,
    batch_body,
    batch_results,
    item_parts,
    item_results,
    merge_items,
    merge_stacked,
    one_replica,
    stacked_body,
    stacked_parts,
    step_open_body,
    track_length,
)
from ._step_handles import AsyncStreamStep, StreamStep
from .errors import APIConnectionError, InvalidInput, InvalidResponse, parse_problem

if TYPE_CHECKING:  # annotations only
    from typing_extensions import Unpack

__all__ = ["Stream", "AsyncStream", "STREAM_PATH", "Groups", "FrameTarget", "STREAM_TRANSPORTS"]

STREAM_PATH = "/v1/stream"
#: What a stream can travel over: ``/v1/stream``, the frame transport, or the
#: shared-memory transport (``_shm.py``).
STREAM_TRANSPORTS = ("websocket", "frames", "shm")

# The client's answer to "where do these sessions live": per replica (None: the
# stream's first connection), the indexes of the ids it holds.
Groups = list[tuple[Any, list[int]]]


def _ws_url(base_url: str) -> str:
    if base_url.startswith("https://"):
        return "wss://" + base_url[len("https://") :] + STREAM_PATH
    if base_url.startswith("http://"):
        return "ws://" + base_url[len("http://") :] + STREAM_PATH
    raise InvalidInput(f"base_url: expected http:// or https://, got {base_url!r}")


def call_reply(seq: int, status: int, body: memoryview | CallSink) -> dict[str, Any]:
    """A call reply as a reply document: its result ``{"call_reply": body}``
    (``StepState.finish`` reads the arrays from it; a :class:`CallSink`: they were
    received into the call's destination)."""
    if status != 200:
        raise InvalidResponse(f"frames: a call reply of status {status} (only 200 comes as one)")
    return {"id": seq, "status": 200, "result": {"call_reply": body}}


def _reply(doc: Any) -> tuple[Any, Any]:
    """``(id, result doc or APIError)`` of one decoded reply."""
    if not isinstance(doc, Mapping) or type(doc.get("status")) is not int:
        raise InvalidResponse(f"stream: expected {{id, status, ...}}, got {doc!r:.200}")
    if doc["status"] != 200:
        return doc.get("id"), parse_problem(doc["status"], doc.get("error") or {})
    return doc.get("id"), doc.get("result")


def _unpack(raw: Any, what: str) -> Any:
    try:
        return wire.unpackb(raw, max_bytes=1 << 31)
    except wire.WireError as exc:
        raise InvalidResponse(f"{what}: undecodable frame ({exc})") from None


def _ws_document(raw: Any) -> Any:
    """The document of one received WebSocket message (a binary MessagePack frame)."""
    if not isinstance(raw, (bytes, bytearray)):
        raise InvalidResponse("stream: expected a binary (MessagePack) frame")
    return _unpack(raw, "stream")


# -- channels: how one connection's documents travel --------------------------


class _WebSocketChannel:
    """``/v1/stream``: one MessagePack document per binary WebSocket message."""

    what = "stream"
    call_frames = False  # a step's layer calls go as documents

    def __init__(self, base_url: str, headers: Mapping[str, str], open_timeout: float | None):
        from websockets.sync.client import connect

        self.sinks: dict[int, CallSink] = {}  # unused: an answer is decoded, then copied to its destination

        try:
            # entered as a context manager: what every websockets release from 13 on accepts
            self._ws = connect(
                _ws_url(base_url),
                additional_headers=dict(headers),
                max_size=None,
                open_timeout=open_timeout,
                compression=None,
            ).__enter__()
        except Exception as exc:
            raise APIConnectionError(f"stream: cannot connect to {base_url}{STREAM_PATH}: {exc}") from exc

    def send(self, doc: dict[str, Any]) -> None:
        self._ws.send(wire.packb(doc))

    def receive(self) -> Any:
        """The next document, or ``None`` once the connection closed cleanly."""
        from websockets.exceptions import ConnectionClosedOK

        try:
            return _ws_document(self._ws.recv())
        except ConnectionClosedOK:
            return None

    def close(self) -> None:
        self._ws.close()

    def release(self) -> None:
        """Nothing left to free once :meth:`close` returned."""


class _FrameChannel:
    """The frame transport: a TCP connection carrying length-prefixed frames whose
    arrays are raw bytes (:mod:`attnserve_client.framing`). Arrays are sent from the
    caller's memory (``sendmsg``) and answers are views of the received frame; a
    step's call reply whose call named ``out=`` is received straight into it (its
    :class:`CallSink`, by the call's seq)."""

    what = "frames"
    #: a step's layer calls go as call frames (framing.CALL_HEAD: no MessagePack),
    #: answered by call replies; the shared-memory channel, a subclass, sends
    #: documents instead (their arrays are in the region already)
    call_frames = True

    def __init__(self, address: tuple[str, int], key: str | None, open_timeout: float | None):
        host, port = address
        self._where = f"{host}:{port}"
        #: by call id, where a call's reply body is to be received (its ``out=``):
        #: set before the call is sent, taken by the reader
        self.sinks: dict[int, CallSink] = {}
        self._head = memoryview(bytearray(framing.REPLY_HEAD.size))  # the reader's: each frame's first bytes
        try:
            self._sock = socket.create_connection((host, port), timeout=open_timeout)
        except OSError as exc:
            raise APIConnectionError(f"frames: cannot connect to {self._where}: {exc}") from exc
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.send(_hello(key))
            _, result = _reply(self.receive())
        except OSError as exc:
            self._sock.close()
            raise APIConnectionError(f"frames: no hello from {self._where}: {exc}") from exc
        except BaseException:
            self._sock.close()
            raise
        if isinstance(result, BaseException):
            self._sock.close()
            raise result
        self._sock.settimeout(None)

    def send(self, doc: dict[str, Any]) -> None:
        _send_all(self._sock, framing.frame_buffers(doc, wire.packb))

    def send_call(self, step: int, layer: int, seq: int, arrays: list[memoryview]) -> None:
        """A call frame: its head, then the arrays' bytes as they are (``sendmsg``)."""
        body_len = sum(a.nbytes for a in arrays)
        _send_all(self._sock, [framing.CALL_HEAD.pack(framing.CALL_MAGIC, step, layer, seq, body_len), *arrays])

    def receive(self) -> Any:
        prefix = self._head
        if not _recv_exactly(self._sock, prefix[: framing.PREFIX.size], eof_ok=True):
            return None
        if prefix[:4] == framing.REPLY_MAGIC:  # a call reply: its arrays' bytes, as the step's call expects them
            _recv_exactly(self._sock, prefix[framing.PREFIX.size :])
            _, seq, status, body_len = framing.REPLY_HEAD.unpack(prefix)
            sink = self.sinks.pop(seq, None)
            if sink is not None and body_len == sink.nbytes:  # straight into the call's destination
                for view in sink.views():
                    _recv_exactly(self._sock, view)
                sink.filled = True
                return call_reply(seq, status, sink)
            body = memoryview(bytearray(body_len))
            _recv_exactly(self._sock, body)
            return call_reply(seq, status, body)
        head_len, body_len = _frame_lengths(bytes(prefix[: framing.PREFIX.size]))
        view = memoryview(bytearray(head_len + body_len))
        _recv_exactly(self._sock, view)
        return _frame_document(view, head_len)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)  # the server answers what it read, then closes
        except OSError:
            pass

    def release(self) -> None:
        self._sock.close()


def _hello(key: str | None) -> dict[str, Any]:
    """The first frame of a frame-transport connection."""
    hello: dict[str, Any] = {"id": 0, "op": "hello", "version": framing.VERSION}
    if key is not None:
        hello["key"] = key
    return hello


def _frame_lengths(prefix: bytes | bytearray) -> tuple[int, int]:
    try:
        return framing.read_prefix(prefix)
    except wire.WireError as exc:
        raise InvalidResponse(str(exc)) from None


def _frame_document(frame: memoryview, head_len: int) -> Any:
    """A received frame's head, its array references resolved into its body."""
    doc = _unpack(frame[:head_len], "frames")
    try:
        framing.resolve_arrays(doc, frame[head_len:])
    except wire.WireError as exc:
        raise InvalidResponse(f"frames: {exc}") from None
    return doc


def _send_all(sock: socket.socket, buffers: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views[:512])  # below every platform's IOV_MAX
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        while views and not views[0].nbytes:
            views.pop(0)


def _recv_exactly(sock: socket.socket, view: memoryview, eof_ok: bool = False) -> bool:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if not n:
            if eof_ok and not got:
                return False
            raise ConnectionError("the connection closed mid-frame")
        got += n
    return True


def _append_members(session: Any, layer: int, k: Any, v: Any, offset: int | None) -> dict[str, Any]:
    item = AttendItem(session, layer, q=np.zeros((1, 1, 1), np.float32), k=k, v=v, offset=offset)
    doc = attend_members(item)
    if "k" not in doc:
        raise InvalidInput("k, v: an append needs both")
    del doc["q"], doc["causal"]
    return doc


def _attend_result(item: AttendItem, sent: Mapping[str, Any], doc: Any) -> Any:
    """The answer ``doc`` to the attend ``item`` whose members were ``sent``."""
    out, length = attend_out(doc, sent, "attend")
    track_length(item, length)
    return attend_answer(doc, out, item.q, sent, "attend")


def _append_result(item: AttendItem, doc: Any) -> int:
    length = doc.get("length") if isinstance(doc, Mapping) else None
    if type(length) is not int:
        raise InvalidResponse(f"append: expected {{length}}, got {doc!r:.200}")
    track_length(item, length)
    return length


def _settle(fut: Any, finish: Any, result: Any) -> None:
    """Resolve a call's future (concurrent or asyncio) from its reply: the problem
    it raised, or ``finish(result)`` (the decoded answer)."""
    if isinstance(result, BaseException):
        fut.set_exception(result)
        return
    try:
        fut.set_result(finish(result))
    except Exception as exc:
        fut.set_exception(exc)


@dataclass(frozen=True)
class FrameTarget:
    """Where a stream over the frame transport connects: ``(host, port)``, and the
    API key its hello sends (``None``: none)."""

    address: tuple[str, int]
    key: str | None = field(default=None, repr=False)


def _one_place(ids: list[str]) -> Groups:
    return [(None, list(range(len(ids))))]


# -- sync ---------------------------------------------------------------------


class _Link:
    """One connection (a channel) and its reader thread."""

    def __init__(self, channel: _WebSocketChannel | _FrameChannel):
        self._channel = channel
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Future[Any], Any]] = {}
        self._lock = threading.Lock()
        self._closed: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name=f"attnserve-{channel.what}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while (doc := self._channel.receive()) is not None:
                rid, result = _reply(doc)
                with self._lock:
                    fut, finish = self._pending.pop(rid, (None, None))
                    if self._channel.sinks:  # a reply not read into its call's destination
                        self._channel.sinks.pop(rid, None)
                if fut is not None:
                    _settle(fut, finish, result)
        except Exception as exc:
            self._fail(exc)
        else:
            self._fail(None)

    def _fail(self, exc: BaseException | None) -> None:
        err = APIConnectionError(
            f"{self._channel.what}: the connection closed{f' ({exc})' if exc else ''}; operations whose "
            "reply did not arrive may or may not have been applied"
        )
        with self._lock:
            self._closed = self._closed or err
            pending, self._pending = self._pending, {}
            self._channel.sinks.clear()
        for fut, _ in pending.values():
            fut.set_exception(err)

    def submit(self, op: str, members: Mapping[str, Any], finish: Any, sink: CallSink | None = None) -> Future[Any]:
        """Send an operation; ``sink``: where its reply's arrays go (a step's layer
        call with ``out=``), where the channel reads them straight there."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed is not None:
                raise self._closed
            rid = next(self._ids)
            self._pending[rid] = (fut, finish)
            if sink is not None:
                self._channel.sinks[rid] = sink
            try:
                self._channel.send({"id": rid, "op": op, **members})
            except Exception as exc:
                self._pending.pop(rid, None)
                self._channel.sinks.pop(rid, None)
                raise APIConnectionError(f"{self._channel.what}: send failed: {exc}") from exc
        return fut

    def submit_call(
        self, step: int, layer: int, arrays: list[memoryview], finish: Any, sink: CallSink | None = None
    ) -> Future[Any]:
        """Send a step's layer call as a call frame (its channel has ``call_frames``);
        ``sink``: where its call reply's body is received (``out=``)."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed is not None:
                raise self._closed
            seq = next(self._ids)
            self._pending[seq] = (fut, finish)
            if sink is not None:
                self._channel.sinks[seq] = sink
            try:
                self._channel.send_call(step, layer, seq, arrays)  # type: ignore[union-attr]  # a frame channel
            except Exception as exc:
                self._pending.pop(seq, None)
                self._channel.sinks.pop(seq, None)
                raise APIConnectionError(f"{self._channel.what}: send failed: {exc}") from exc
        return fut

    @property
    def call_frames(self) -> bool:
        """Whether a step's layer calls go as call frames on this connection."""
        return bool(self._channel.call_frames)

    def close(self) -> None:
        """Close the connection (after the replies of what is in flight)."""
        with self._lock:
            pending = [f for f, _ in self._pending.values()]
        for f in pending:
            try:
                f.exception()
            except BaseException:
                pass
        self._channel.close()
        self._reader.join(timeout=10)
        self._channel.release()


def _joined(parts: list[Future[Any]], merge: Callable[[list[Any]], Any]) -> Future[Any]:
    """A future of ``merge([each part's result or exception])`` once every part is done."""
    out: Future[Any] = Future()
    remaining = [len(parts)]
    lock = threading.Lock()

    def done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            out.set_result(merge([f.exception() or f.result() for f in parts]))
        except BaseException as exc:
            out.set_exception(exc)

    for f in parts:
        f.add_done_callback(done)
    return out


class Stream:
    """A synchronous streaming connection (``Client.stream()``). Thread-safe: calls
    from several threads pipeline on the connection.

    ``attend``/``append``/``attend_batch``/``attend_stacked`` send and wait;
    ``submit_*`` send and return a ``concurrent.futures.Future`` at once, so many
    operations are in flight together (the server applies those of one connection
    in the order sent; every operation of a session uses the same connection)."""

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str],
        open_timeout: float | None,
        groups: Callable[[list[str]], Groups] = _one_place,
        *,
        frames: FrameTarget | None = None,
    ):
        self._base_url, self._headers, self._open_timeout = base_url, dict(headers), open_timeout
        self._frames = frames
        self._groups = groups if frames is None else _one_place  # frames: one server, no router
        self._lock = threading.Lock()
        self._closed = False
        self._links: dict[Any, _Link] = {None: self._open(self._headers)}

    def _open(self, headers: Mapping[str, str]) -> _Link:
        if self._frames is not None:
            return _Link(_FrameChannel(self._frames.address, self._frames.key, self._open_timeout))
        return _Link(_WebSocketChannel(self._base_url, headers, self._open_timeout))

    def _link(self, place: Any, route: str) -> _Link:
        with self._lock:
            if self._closed:
                raise APIConnectionError("stream: closed")
            link = self._links.get(place)
            if link is None:
                link = self._open({**self._headers, ROUTE_HEADER: route})
                self._links[place] = link
            return link

    def _one(self, session_id: str, op: str, members: Mapping[str, Any], finish: Any) -> Future[Any]:
        place, _ = self._groups([session_id])[0]
        return self._link(place, session_id).submit(op, members, finish)

    def submit_attend(self, session: Any, layer: int, q: Any, **options: Unpack[AttendOptions]) -> Future[Any]:
        """Send an attend (the options of ``Session.attend``, and ``offset``); its
        future gives the output."""
        item = AttendItem(session, layer, q, **options)
        members = attend_members(item)
        return self._one(item.session_id, "attend", members, lambda doc: _attend_result(item, members, doc))

    def attend(self, session: Any, layer: int, q: Any, **kw: Any) -> np.ndarray:
        """As ``Session.attend``, for ``session`` (a session or its id)."""
        out: np.ndarray = self.submit_attend(session, layer, q, **kw).result()
        return out

    def submit_append(self, session: Any, layer: int, k: Any, v: Any, *, offset: int | None = None) -> Future[Any]:
        item = AttendItem(session, layer, None)
        members = _append_members(session, layer, k, v, offset)
        return self._one(item.session_id, "append", members, lambda doc: _append_result(item, doc))

    def append(self, session: Any, layer: int, k: Any, v: Any, *, offset: int | None = None) -> int:
        length: int = self.submit_append(session, layer, k, v, offset=offset).result()
        return length

    def submit_attend_batch(self, items: Sequence[Any]) -> Future[Any]:
        checked, body = batch_body(items)
        ids = [item.session_id for item in checked]
        groups = self._groups(ids)
        if len(groups) == 1:
            return self._link(groups[0][0], ids[0]).submit(
                "attend_batch", body, lambda d: batch_results(checked, body, d)
            )
        parts = [
            self._link(place, sub[0].session_id).submit(
                "attend_batch", sub_body, lambda d, s=sub, b=sub_body: item_results(s, b, d)
            )
            for (place, _), (sub, sub_body, _) in zip(groups, item_parts(checked, body, [g for _, g in groups]))
        ]
        return _joined(parts, lambda got: merge_items(len(checked), [g for _, g in groups], got))

    def attend_batch(self, items: Sequence[Any]) -> list[np.ndarray]:
        """As ``Client.attend_batch``, over the stream."""
        outs: list[np.ndarray] = self.submit_attend_batch(items).result()
        return outs

    def submit_attend_stacked(
        self, sessions: Sequence[Any], layer: int, q: Any, k: Any = None, v: Any = None, **kw: Unpack[StackedOptions]
    ) -> Future[Any]:
        step, body, _ = stacked_body(sessions, layer, q, k, v, **kw)
        ids = body["session_ids"]
        groups = self._groups(ids)
        if len(groups) == 1:
            return self._link(groups[0][0], ids[0]).submit("attend_batch", body, step.result)
        parts = [
            self._link(place, sub_body["session_ids"][0]).submit("attend_batch", sub_body, sub_step.outcome)
            for (place, _), (sub_step, sub_body, _) in zip(
                groups, stacked_parts(step, body, kw, [g for _, g in groups])
            )
        ]
        return _joined(parts, lambda got: merge_stacked(step, [g for _, g in groups], got))

    def attend_stacked(
        self, sessions: Sequence[Any], layer: int, q: Any, k: Any = None, v: Any = None, **kw: Unpack[StackedOptions]
    ) -> np.ndarray:
        """As ``Client.attend_stacked``, over the stream."""
        out: np.ndarray = self.submit_attend_stacked(sessions, layer, q, k, v, **kw).result()
        return out

    def open_step(self, sessions: Sequence[Any], **options: Unpack[StepOptions]) -> StreamStep:
        """As ``Client.open_step``, on the stream's connection (of the sessions'
        replica): a :class:`StreamStep`, closed with the connection at the latest."""
        sessions, body = step_open_body(sessions, **options)
        ids = body["session_ids"]
        groups = self._groups(ids)
        if len(groups) > 1:
            raise one_replica(len(groups))
        link = self._link(groups[0][0], ids[0])
        state: StepState = link.submit("step_open", body, lambda doc: StepState(sessions, body, doc)).result()
        return StreamStep(link, state)

    def ping(self) -> None:
        """A round trip on every connection of the stream."""
        with self._lock:
            links = list(self._links.values())
        for f in [link.submit("ping", {}, lambda doc: None) for link in links]:
            f.result()

    def close(self) -> None:
        """Close the connections (after the replies of what is in flight)."""
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- asyncio ------------------------------------------------------------------


class _AsyncWebSocketChannel:
    """:class:`_WebSocketChannel` for asyncio."""

    what = "stream"
    call_frames = False

    def __init__(self, ws: Any):
        self._ws = ws
        self.sinks: dict[int, CallSink] = {}  # unused (_WebSocketChannel's)

    @classmethod
    async def open(
        cls, base_url: str, headers: Mapping[str, str], open_timeout: float | None
    ) -> _AsyncWebSocketChannel:
        from websockets.asyncio.client import connect

        try:
            ws = await connect(
                _ws_url(base_url),
                additional_headers=dict(headers),
                max_size=None,
                open_timeout=open_timeout,
                compression=None,
            )
        except Exception as exc:
            raise APIConnectionError(f"stream: cannot connect to {base_url}{STREAM_PATH}: {exc}") from exc
        return cls(ws)

    async def send(self, doc: dict[str, Any]) -> None:
        await self._ws.send(wire.packb(doc))

    async def receive(self) -> Any:
        from websockets.exceptions import ConnectionClosedOK

        try:
            return _ws_document(await self._ws.recv())
        except ConnectionClosedOK:
            return None

    async def close(self) -> None:
        await self._ws.close()

    async def release(self) -> None:
        """Nothing left to free once :meth:`close` returned."""


class _AsyncFrameChannel:
    """:class:`_FrameChannel` for asyncio."""

    what = "frames"
    call_frames = True  # as _FrameChannel's

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self.sinks: dict[int, CallSink] = {}  # as _FrameChannel's (a call reply is copied into its sink)

    @classmethod
    async def open(cls, target: FrameTarget, open_timeout: float | None) -> _AsyncFrameChannel:
        host, port = target.address
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), open_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise APIConnectionError(f"frames: cannot connect to {host}:{port}: {exc!r}") from exc
        self = cls(reader, writer)
        try:
            await self.send(_hello(target.key))
            _, result = _reply(await asyncio.wait_for(self.receive(), open_timeout))
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            writer.close()
            raise APIConnectionError(f"frames: no hello from {host}:{port}: {exc!r}") from exc
        except BaseException:
            writer.close()
            raise
        if isinstance(result, BaseException):
            writer.close()
            raise result
        return self

    async def send(self, doc: dict[str, Any]) -> None:
        self._writer.writelines(framing.frame_buffers(doc, wire.packb))
        await self._writer.drain()

    async def send_call(self, step: int, layer: int, seq: int, arrays: list[memoryview]) -> None:
        """A call frame (:meth:`_FrameChannel.send_call`)."""
        body_len = sum(a.nbytes for a in arrays)
        self._writer.writelines([framing.CALL_HEAD.pack(framing.CALL_MAGIC, step, layer, seq, body_len), *arrays])
        await self._writer.drain()

    async def receive(self) -> Any:
        try:
            prefix = await self._reader.readexactly(framing.PREFIX.size)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise
        if prefix[:4] == framing.REPLY_MAGIC:  # a call reply (_FrameChannel.receive)
            prefix += await self._reader.readexactly(framing.REPLY_HEAD.size - framing.PREFIX.size)
            _, seq, status, body_len = framing.REPLY_HEAD.unpack(prefix)
            body = memoryview(await self._reader.readexactly(body_len))
            sink = self.sinks.pop(seq, None)
            if sink is not None and body_len == sink.nbytes:  # copied into the call's destination
                at = 0
                for view in sink.views():
                    view[:] = body[at : at + view.nbytes]
                    at += view.nbytes
                sink.filled = True
                return call_reply(seq, status, sink)
            return call_reply(seq, status, body)
        head_len, body_len = _frame_lengths(prefix)
        return _frame_document(memoryview(await self._reader.readexactly(head_len + body_len)), head_len)

    async def close(self) -> None:
        if self._writer.can_write_eof():
            self._writer.write_eof()  # the server answers what it read, then closes

    async def release(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:  # the server closed first
            pass


class _AsyncLink:
    """One connection (a channel) and its reader task."""

    def __init__(self, channel: _AsyncWebSocketChannel | _AsyncFrameChannel):
        self._channel = channel
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Any], Any]] = {}
        self._closed: BaseException | None = None
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        err: BaseException | None = None
        try:
            while (doc := await self._channel.receive()) is not None:
                rid, result = _reply(doc)
                fut, finish = self._pending.pop(rid, (None, None))
                if self._channel.sinks:  # a reply not read into its call's destination
                    self._channel.sinks.pop(rid, None)
                if fut is not None and not fut.done():
                    _settle(fut, finish, result)
        except Exception as exc:
            err = exc
        self._closed = APIConnectionError(
            f"{self._channel.what}: the connection closed{f' ({err})' if err else ''}; operations whose reply "
            "did not arrive may or may not have been applied"
        )
        pending, self._pending = self._pending, {}
        self._channel.sinks.clear()
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(self._closed)

    async def call_frame(
        self, step: int, layer: int, arrays: list[memoryview], finish: Any, sink: CallSink | None = None
    ) -> Any:
        """A step's layer call as a call frame (its channel has ``call_frames``);
        ``sink``: where its call reply's body goes (``out=``)."""
        if self._closed is not None:
            raise self._closed
        seq = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[seq] = (fut, finish)
        if sink is not None:
            self._channel.sinks[seq] = sink
        try:
            await self._channel.send_call(step, layer, seq, arrays)  # type: ignore[union-attr]  # a frame channel
        except Exception as exc:
            self._pending.pop(seq, None)
            self._channel.sinks.pop(seq, None)
            raise APIConnectionError(f"{self._channel.what}: send failed: {exc}") from exc
        return await fut

    @property
    def call_frames(self) -> bool:
        """Whether a step's layer calls go as call frames on this connection."""
        return bool(self._channel.call_frames)

    async def call(self, op: str, members: Mapping[str, Any], finish: Any, sink: CallSink | None = None) -> Any:
        if self._closed is not None:
            raise self._closed
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, finish)
        if sink is not None:
            self._channel.sinks[rid] = sink
        try:
            await self._channel.send({"id": rid, "op": op, **members})
        except Exception as exc:
            self._pending.pop(rid, None)
            self._channel.sinks.pop(rid, None)
            raise APIConnectionError(f"{self._channel.what}: send failed: {exc}") from exc
        return await fut

    async def close(self) -> None:
        if self._pending:
            await asyncio.gather(*(f for f, _ in self._pending.values()), return_exceptions=True)
        await self._channel.close()
        await self._reader
        await self._channel.release()


class AsyncStreamOpening:
    """What :meth:`AsyncClient.stream` returns: the opening of an :class:`AsyncStream`,
    both awaitable (``stream = await client.stream()``, closed by the caller) and an
    async context manager (``async with client.stream() as stream:``, closed on exit)."""

    def __init__(self, open_stream: Callable[[], Awaitable[AsyncStream]]):
        self._open_stream = open_stream
        self._stream: AsyncStream | None = None

    def __await__(self) -> Generator[Any, None, AsyncStream]:
        return self._open_stream().__await__()

    async def __aenter__(self) -> AsyncStream:
        self._stream = await self._open_stream()
        return self._stream

    async def __aexit__(self, *exc: Any) -> None:
        if self._stream is not None:
            await self._stream.close()


class AsyncStream:
    """The asyncio streaming connection (``AsyncClient.stream()``): concurrent
    awaits of its methods pipeline on the connection (one per replica behind a
    router, as :class:`Stream`)."""

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str],
        open_timeout: float | None,
        groups: Callable[[list[str]], Awaitable[Groups]] | None = None,
        *,
        frames: FrameTarget | None = None,
    ):
        self._base_url, self._headers, self._open_timeout = base_url, dict(headers), open_timeout
        self._frames = frames
        self._groups = groups if frames is None else None  # frames: one server, no router
        self._closed = False
        self._links: dict[Any, asyncio.Future[_AsyncLink]] = {}

    @classmethod
    async def open(
        cls,
        base_url: str,
        headers: Mapping[str, str],
        open_timeout: float | None,
        groups: Callable[[list[str]], Awaitable[Groups]] | None = None,
        *,
        frames: FrameTarget | None = None,
    ) -> AsyncStream:
        self = cls(base_url, headers, open_timeout, groups, frames=frames)
        await self._link(None, None)
        return self

    async def _open(self, headers: Mapping[str, str]) -> _AsyncLink:
        if self._frames is not None:
            return _AsyncLink(await _AsyncFrameChannel.open(self._frames, self._open_timeout))
        return _AsyncLink(await _AsyncWebSocketChannel.open(self._base_url, headers, self._open_timeout))

    async def _link(self, place: Any, route: str | None) -> _AsyncLink:
        if self._closed:
            raise APIConnectionError("stream: closed")
        fut = self._links.get(place)
        if fut is None:  # opened once: concurrent callers wait for the same connection
            fut = self._links[place] = asyncio.get_running_loop().create_future()
            headers = self._headers if route is None else {**self._headers, ROUTE_HEADER: route}
            try:
                fut.set_result(await self._open(headers))
            except BaseException as exc:
                del self._links[place]
                fut.set_exception(exc)
                fut.exception()  # retrieved: raised here (and to concurrent waiters), not logged as lost
                raise
        return await asyncio.shield(fut)

    async def _where(self, ids: list[str]) -> Groups:
        return _one_place(ids) if self._groups is None else await self._groups(ids)

    async def _one(self, session_id: str, op: str, members: Mapping[str, Any], finish: Any) -> Any:
        place, _ = (await self._where([session_id]))[0]
        return await (await self._link(place, session_id)).call(op, members, finish)

    async def attend(self, session: Any, layer: int, q: Any, **options: Unpack[AttendOptions]) -> np.ndarray:
        """As ``Session.attend``, for ``session`` (a session or its id), with ``offset``."""
        item = AttendItem(session, layer, q, **options)
        members = attend_members(item)
        out: np.ndarray = await self._one(
            item.session_id, "attend", members, lambda doc: _attend_result(item, members, doc)
        )
        return out

    async def append(self, session: Any, layer: int, k: Any, v: Any, *, offset: int | None = None) -> int:
        item = AttendItem(session, layer, None)
        members = _append_members(session, layer, k, v, offset)
        length: int = await self._one(item.session_id, "append", members, lambda doc: _append_result(item, doc))
        return length

    async def _split(self, ids: list[str], calls: list[tuple[Any, str, Mapping[str, Any], Any]]) -> list[Any]:
        async def one(place: Any, route: str, body: Mapping[str, Any], finish: Any) -> Any:
            return await (await self._link(place, route)).call("attend_batch", body, finish)

        return list(await asyncio.gather(*(one(*c) for c in calls), return_exceptions=True))

    async def attend_batch(self, items: Sequence[Any]) -> list[np.ndarray]:
        checked, body = batch_body(items)
        ids = [item.session_id for item in checked]
        groups = await self._where(ids)
        if len(groups) == 1:
            link = await self._link(groups[0][0], ids[0])
            outs: list[np.ndarray] = await link.call("attend_batch", body, lambda d: batch_results(checked, body, d))
            return outs
        parts = item_parts(checked, body, [g for _, g in groups])
        got = await self._split(
            ids,
            [
                (place, sub[0].session_id, sub_body, lambda d, s=sub, b=sub_body: item_results(s, b, d))
                for (place, _), (sub, sub_body, _) in zip(groups, parts)
            ],
        )
        return merge_items(len(checked), [g for _, g in groups], got)

    async def attend_stacked(
        self, sessions: Sequence[Any], layer: int, q: Any, k: Any = None, v: Any = None, **kw: Unpack[StackedOptions]
    ) -> tensors.Answer:
        """As ``Client.attend_stacked``, over the stream."""
        step, body, _ = stacked_body(sessions, layer, q, k, v, **kw)
        ids = body["session_ids"]
        groups = await self._where(ids)
        if len(groups) == 1:
            out: np.ndarray = await (await self._link(groups[0][0], ids[0])).call("attend_batch", body, step.result)
            return out
        parts = stacked_parts(step, body, kw, [g for _, g in groups])
        got = await self._split(
            ids,
            [
                (place, sub_body["session_ids"][0], sub_body, sub_step.outcome)
                for (place, _), (sub_step, sub_body, _) in zip(groups, parts)
            ],
        )
        return merge_stacked(step, [g for _, g in groups], got)

    async def open_step(self, sessions: Sequence[Any], **options: Unpack[StepOptions]) -> AsyncStreamStep:
        """As :meth:`Stream.open_step`: an :class:`AsyncStreamStep`."""
        sessions, body = step_open_body(sessions, **options)
        ids = body["session_ids"]
        groups = await self._where(ids)
        if len(groups) > 1:
            raise one_replica(len(groups))
        link = await self._link(groups[0][0], ids[0])
        state: StepState = await link.call("step_open", body, lambda doc: StepState(sessions, body, doc))
        return AsyncStreamStep(link, state)

    async def ping(self) -> None:
        """A round trip on every connection of the stream."""
        links = [await f for f in list(self._links.values())]
        await asyncio.gather(*(link.call("ping", {}, lambda doc: None) for link in links))

    async def close(self) -> None:
        self._closed = True
        links = [await f for f in list(self._links.values())]
        self._links = {}
        for link in links:
            await link.close()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
