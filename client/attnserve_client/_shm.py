"""Streams over the shared-memory transport: ``client.stream(transport="shm")``.

A stream of this transport is a frame-transport stream (``_streams.py``: the same
operations, futures, pipelining and errors) whose connection is a Unix socket to a
server on this host, and whose arrays travel through a region both map
(:mod:`attnserve_client.shm`): each operation takes one range of the region for
its arrays and its reply's, the arrays are copied in once (or referred to where
they are, for the arrays :meth:`ShmStream.array` lends), the server reads them in
place and writes the reply's arrays into the range, and the range is free again
once the reply has been read (by default the outputs are copied out first).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import framing, wire
from ._steps import CallSink
from ._streams import (
    AsyncStream,
    Stream,
    _AsyncFrameChannel,
    _AsyncLink,
    _FrameChannel,
    _frame_lengths,
    _hello,
    _Link,
    _one_place,
    _recv_exactly,
    _reply,
    _send_all,
    _unpack,
)
from .errors import APIConnectionError, InvalidInput, InvalidResponse
from .shm import ALIGN, Ranges, create_region, peer_uid, place_arrays, reply_bytes, request_bytes

__all__ = ["ShmTarget", "ShmStream", "AsyncShmStream", "DEFAULT_REGION_BYTES", "shm_target"]

#: The region a stream shares when ``region_bytes`` is not given (at most the server's largest).
DEFAULT_REGION_BYTES = 64 << 20
_ARRAY = frozenset({"dtype", "shape", "data"})


@dataclass(frozen=True)
class ShmTarget:
    """Where a stream over the shared-memory transport connects (the socket's path),
    the bytes of the region it shares, whether it copies outputs out of the region,
    and the API key its hello sends (``None``: none)."""

    path: str
    region_bytes: int
    copy_outputs: bool = True
    key: str | None = field(default=None, repr=False)
    #: the user the server said it runs as (``GET /v1/info``), trusted beside this
    #: process's user and root (None: not asked)
    server_uid: int | None = None


def shm_target(
    transport: str,
    shm_socket: str | None,
    region_bytes: int | None,
    copy_outputs: bool,
    key: str | None,
    info: Callable[[], Generator[Any, Any, dict[str, Any]]],
) -> Generator[Any, Any, ShmTarget | None]:
    """A client's flow: where a stream over the shared-memory transport connects
    (``None``: another transport), from the arguments of ``stream()`` and, where they
    leave it open, the server's ``GET /v1/info`` (``info``)."""
    if transport != "shm":
        given = [
            name
            for name, unset in (
                ("shm_socket", shm_socket is None),
                ("region_bytes", region_bytes is None),
                ("copy_outputs", copy_outputs is True),
            )
            if not unset
        ]
        if given:
            raise InvalidInput(f"{', '.join(given)}: only with transport='shm'")
        return None
    if region_bytes is not None and (type(region_bytes) is not int or region_bytes < ALIGN):
        raise InvalidInput(f"region_bytes: expected an int >= {ALIGN}, got {region_bytes!r}")
    if not isinstance(copy_outputs, bool):
        raise InvalidInput(f"copy_outputs: expected True or False, got {copy_outputs!r}")
    most: int | None = None
    server_uid: int | None = None
    if shm_socket is None or region_bytes is None:
        served = (yield from info()).get("shm")
        if isinstance(served, dict) and isinstance(served.get("socket"), str):
            shm_socket = served["socket"] if shm_socket is None else shm_socket
            most = served.get("max_region_bytes") if type(served.get("max_region_bytes")) is int else None
            server_uid = served.get("uid") if type(served.get("uid")) is int else None
        elif shm_socket is None:
            raise InvalidInput(
                "transport='shm': the server does not serve the shared-memory transport "
                "(start it with --shm-socket or ATTNSERVE_SHM_SOCKET)"
            )
    if region_bytes is None:
        region_bytes = DEFAULT_REGION_BYTES if most is None else min(DEFAULT_REGION_BYTES, most)
    return ShmTarget(os.fspath(shm_socket), region_bytes, copy_outputs, key, server_uid)


# -- the client's side of a region ------------------------------------------------


def _wire_dtype(dtype: Any) -> np.dtype[Any]:
    if isinstance(dtype, str) and dtype in wire.DTYPES:
        return wire.DTYPES[dtype]
    try:
        dt: np.dtype[Any] | None = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt not in wire.DTYPES.values():
        raise InvalidInput(f"dtype: expected one of {sorted(wire.DTYPES)}, got {dtype!r}")
    return dt


def _into_sink(doc: Any, sink: CallSink) -> None:
    """A layer call's reply ``doc`` (resolved) with its ``out`` (and ``lse``) copied
    from the region into ``sink`` (the call's ``out=``; a view of its bytes in their
    place), where the reply is an answer of that size; otherwise left as it is
    (the call's answer is then copied to its destination once decoded)."""
    result = doc.get("result") if isinstance(doc, dict) and doc.get("status") == 200 else None
    if not isinstance(result, dict):
        return
    for name, view in zip(("out", "lse"), sink.views()):
        arr = result.get(name)
        if not isinstance(arr, dict) or arr.keys() != _ARRAY:
            return
        data = arr["data"]
        if not isinstance(data, memoryview) or data.nbytes != view.nbytes:
            return
        view[:] = data
        arr["data"] = view
    sink.filled = True


class _Region:
    """The region of one connection: its mapping, its free ranges, the range each
    operation holds until its reply is read, and the arrays lent to the caller."""

    def __init__(self, nbytes: int, copy_outputs: bool):
        try:
            self.fd, self._map = create_region(nbytes)
        except OSError as exc:
            raise APIConnectionError(f"shm: cannot make a region of {nbytes} bytes: {exc}") from exc
        self.size = nbytes
        self.copy_outputs = copy_outputs
        self.view = memoryview(self._map)
        self.base = int(np.frombuffer(self._map, np.uint8).ctypes.data)
        self.ranges = Ranges(nbytes)
        self.cond = threading.Condition()
        self.held: dict[Any, int] = {}  # request id -> the start of its range
        self.busy = 0  # ranges taken by operations (sent or being sent)
        self.lent: dict[int, int] = {}  # start -> bytes of an array lent (ShmStream.array)
        self.ended: BaseException | None = None
        self.freed: asyncio.Event | None = None  # an async stream's wake-up when a range is freed

    def offset_of(self, data: memoryview) -> int | None:
        """Where in the region ``data`` lies, when it does (at a multiple of 4)."""
        if not data.nbytes:
            return None
        return self._offset(int(np.frombuffer(data, np.uint8).ctypes.data), data.nbytes)

    def _offset(self, address: int, nbytes: int) -> int | None:
        offset = address - self.base
        if 0 <= offset and offset + nbytes <= self.size and not offset % 4:
            return offset
        return None

    # ── an operation's range ─────────────────────────────────────────────────

    def needs(self, doc: Mapping[str, Any]) -> tuple[int, int]:
        """The bytes of ``doc``'s arrays to copy in, and of its reply's.

        Raises:
            InvalidInput: together they are more than the region could ever hold.
        """
        req, rep = request_bytes(doc, self.offset_of), reply_bytes(doc)
        if req + rep > self.ranges.size:
            raise InvalidInput(
                f"shm: the operation needs {req + rep} bytes of the shared region (its arrays, {req}, and its "
                f"reply's, {rep}, each rounded up to {ALIGN}), which holds {self.ranges.size}; open the stream "
                "with a larger region_bytes"
            )
        return req, rep

    def take(self, need: int) -> int | None:
        """A range of ``need`` bytes (call with :attr:`cond` held), or None while
        the operations in flight hold too much of the region.

        Raises:
            APIConnectionError: the connection is gone.
            InvalidInput: nothing is in flight, and the arrays lent leave too little.
        """
        if self.ended is not None:
            raise self.ended
        start = self.ranges.take(need)
        if start is None:
            if not self.busy:
                lent = sum(self.lent.values())
                raise InvalidInput(
                    f"shm: the operation needs {need} bytes of the shared region, which the arrays lent by "
                    f"stream.array() ({lent} bytes) leave no room for; free some, or use a larger region_bytes"
                )
            return None
        self.busy += 1
        return start

    def fill(self, doc: Mapping[str, Any], start: int | None, req: int, rep: int) -> dict[str, Any]:
        """``doc`` with its arrays in the range at ``start`` (or where they are) and
        its ``reply_at``; the range is given back if that fails."""
        try:
            at = 0 if start is None else start
            placed, _ = place_arrays(dict(doc), self.view, at, at + req, self.offset_of)
        except BaseException:
            self.give(start)
            raise
        if rep:
            placed["reply_at"] = [at + req, rep]
        sent: dict[str, Any] = placed
        return sent

    def give(self, start: int | None) -> None:
        """Give back a range taken by an operation (None: it took none)."""
        if start is None:
            return
        with self.cond:
            self.ranges.give(start)
            self.busy -= 1
            self.cond.notify_all()
        if self.freed is not None:
            self.freed.set()

    def hold(self, rid: Any, start: int | None) -> None:
        if start is not None:
            with self.cond:
                self.held[rid] = start

    def end(self, what: str, exc: BaseException | None) -> None:
        """The connection is gone: operations waiting for a range fail."""
        with self.cond:
            if self.ended is None:
                self.ended = APIConnectionError(f"{what}: the connection closed{f' ({exc})' if exc else ''}")
            self.cond.notify_all()
        if self.freed is not None:
            self.freed.set()

    # ── a reply ──────────────────────────────────────────────────────────────

    def document(self, frame: memoryview, head_len: int, sinks: dict[int, CallSink] | None = None) -> Any:
        """A received frame's head, its references resolved (into its body, into the
        region: copied out unless the stream was opened with ``copy_outputs=False``;
        a layer call's ``out`` and ``lse`` into its :class:`CallSink` in ``sinks``,
        when it has one), and its operation's range freed."""
        doc = _unpack(frame[:head_len], "shm")
        rid = doc.get("id") if isinstance(doc, dict) else None
        try:
            framing.resolve_arrays(doc, frame[head_len:], region=self.view)
            sink = sinks.pop(rid, None) if sinks and type(rid) is int else None
            if sink is not None:
                _into_sink(doc, sink)
            if self.copy_outputs:
                self._copy_out(doc, 0)
        except wire.WireError as exc:
            raise InvalidResponse(f"shm: {exc}") from None
        finally:
            with self.cond:
                start = self.held.pop(rid, None)
            self.give(start)
        return doc

    def _copy_out(self, obj: Any, depth: int) -> None:
        members = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for name, value in list(members):
            if isinstance(value, dict) and value.keys() == _ARRAY:
                data = value["data"]
                if isinstance(data, memoryview) and data.obj is self._map:
                    value["data"] = bytearray(data)
            elif isinstance(value, (dict, list)) and depth < framing._DEPTH:
                self._copy_out(value, depth + 1)

    # ── arrays lent ──────────────────────────────────────────────────────────

    def lend(self, shape: Any, dtype: Any) -> np.ndarray:
        dt = _wire_dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise InvalidInput(f"shape: expected sizes >= 0, got {shape}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        with self.cond:
            if self.ended is not None:
                raise self.ended
            start = self.ranges.take(nbytes)
            if start is None:
                raise InvalidInput(
                    f"shm: no free range of {nbytes} bytes in the shared region now ({self.ranges.size} bytes, "
                    f"{sum(self.lent.values())} of them lent); free arrays lent, or use a larger region_bytes"
                )
            self.lent[start] = nbytes
        return np.frombuffer(self.view[start : start + nbytes], dt).reshape(shape)

    def free(self, arr: np.ndarray) -> None:
        offset = self._offset(int(arr.ctypes.data), 0) if isinstance(arr, np.ndarray) else None
        with self.cond:
            start = None if offset is None else self.ranges.owner(offset)
            if start is None or start not in self.lent:
                raise InvalidInput("array: expected an array that stream.array() lent, not freed yet")
            del self.lent[start]
            self.ranges.give(start)
            self.cond.notify_all()
        if self.freed is not None:
            self.freed.set()

    def close(self) -> None:
        """Unmap the region, unless arrays still view it (then it goes with the last of them)."""
        try:
            self.view.release()
            self._map.close()
        except BufferError:
            pass


def _trusted_server(uid: int, reported: int | None) -> bool:
    """Whether a server of user ``uid`` gets the region and the API key: this
    process's user's, root's, or the user the server said it runs as (``reported``,
    from ``GET /v1/info``: a server of another user that serves this root client)."""
    return uid in (os.getuid(), 0) or uid == reported


def _connect(target: ShmTarget, region: _Region, timeout: float | None) -> socket.socket:
    """A connection to ``target`` whose hello, sent with the region's descriptor,
    was answered (blocking; the descriptor is closed). Nothing is sent to a server
    of another user than this process's, root or the one the server reported
    (``SO_PEERCRED``): a socket at the path that another user made gets neither the
    region nor the key.

    Raises:
        APIConnectionError: no connection, a server of another user, or no answer.
        APIError: the server refused the hello (its problem).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(target.path)
        except OSError as exc:
            raise APIConnectionError(f"shm: cannot connect to {target.path}: {exc}") from exc
        uid = peer_uid(sock)
        if not _trusted_server(uid, target.server_uid):
            said = "" if target.server_uid is None else f", nor the server's (uid {target.server_uid}, GET /v1/info)"
            raise APIConnectionError(
                f"shm: the process at {target.path} runs as uid {uid}, neither this process's user "
                f"(uid {os.getuid()}) nor root{said}: the region and the API key were not sent to it"
            )
        hello = {**_hello(target.key), "region": region.size}
        frame_bytes = b"".join(framing.frame_buffers(hello, wire.packb))
        sent: OSError | None = None
        try:
            n = socket.send_fds(sock, [frame_bytes], [region.fd])
            if n < len(frame_bytes):
                sock.sendall(frame_bytes[n:])
        except OSError as exc:  # refused before the hello was read: its problem may be there to read
            sent = exc
        try:
            prefix = bytearray(framing.PREFIX.size)
            if not _recv_exactly(sock, memoryview(prefix), eof_ok=True):
                raise ConnectionError(str(sent or "the server closed the connection"))
            head_len, body_len = _frame_lengths(prefix)
            frame = memoryview(bytearray(head_len + body_len))
            _recv_exactly(sock, frame)
        except OSError as exc:  # ConnectionError, socket.timeout
            raise APIConnectionError(f"shm: no hello from {target.path}: {exc}") from exc
        _, result = _reply(_unpack(frame[:head_len], "shm"))
        if isinstance(result, BaseException):
            raise result
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(region.fd)
    sock.settimeout(None)
    return sock


# -- sync ---------------------------------------------------------------------


class _ShmChannel(_FrameChannel):
    """A Unix socket carrying frames, and the region its arrays go through: the
    frames' channel (its closing), connected and greeted by :func:`_connect`."""

    what = "shm"
    call_frames = False  # a step's layer calls go as documents: their arrays are in the region

    def __init__(self, target: ShmTarget, open_timeout: float | None):  # (not the TCP connect of the frames')
        self.sinks: dict[int, CallSink] = {}  # by id: where a layer call's reply arrays go (its out=)
        self.region = _Region(target.region_bytes, target.copy_outputs)
        try:
            self._sock = _connect(target, self.region, open_timeout)
        except BaseException:
            self.region.close()
            raise

    def stage(self, doc: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
        """``doc`` as sent (its arrays in a range of the region, waited for while the
        operations in flight hold the region), and the range's start."""
        req, rep = self.region.needs(doc)
        start = None
        if req + rep:
            with self.region.cond:
                while (start := self.region.take(req + rep)) is None:
                    self.region.cond.wait()
        return self.region.fill(doc, start, req, rep), start

    def send_staged(self, rid: int, doc: dict[str, Any], start: int | None) -> None:
        self.region.hold(rid, start)
        try:
            _send_all(self._sock, framing.frame_buffers({"id": rid, **doc}, wire.packb))
        except BaseException:
            with self.region.cond:
                self.region.held.pop(rid, None)
            self.region.give(start)
            raise

    def receive(self) -> Any:
        try:
            prefix = bytearray(framing.PREFIX.size)
            if not _recv_exactly(self._sock, memoryview(prefix), eof_ok=True):
                self.region.end(self.what, None)
                return None
            head_len, body_len = _frame_lengths(prefix)
            frame = memoryview(bytearray(head_len + body_len))
            _recv_exactly(self._sock, frame)
            return self.region.document(frame, head_len, self.sinks)
        except BaseException as exc:
            self.region.end(self.what, exc)
            raise

    def release(self) -> None:
        super().release()
        self.region.end(self.what, None)
        self.region.close()


class _ShmLink(_Link):
    """:class:`_Link` whose operations take their range of the region before they are sent."""

    def __init__(self, channel: _ShmChannel):
        self._shm = channel
        super().__init__(channel)  # a frames channel (its send unused: operations go through send_staged)

    def submit(self, op: str, members: Mapping[str, Any], finish: Any, sink: CallSink | None = None) -> Future[Any]:
        doc, start = self._shm.stage({"op": op, **members})  # may wait for room, outside the lock
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed is not None:
                self._shm.region.give(start)
                raise self._closed
            rid = next(self._ids)
            self._pending[rid] = (fut, finish)
            if sink is not None:
                self._shm.sinks[rid] = sink
            try:
                self._shm.send_staged(rid, doc, start)
            except Exception as exc:
                self._pending.pop(rid, None)
                self._shm.sinks.pop(rid, None)
                raise APIConnectionError(f"shm: send failed: {exc}") from exc
        return fut


class ShmStream(Stream):
    """A :class:`Stream` over the shared-memory transport (``client.stream(transport="shm")``):
    the same methods, one connection to a server on this host, arrays through the
    region both map.

    :meth:`array` lends a writable array of the region: an engine that writes its
    ``q``, ``k``, ``v`` there sends them without a copy. Outputs are copies (the
    stream's ``copy_outputs``); opened with ``copy_outputs=False`` they are views of
    the region, valid until the stream sends its next operation."""

    def __init__(self, base_url: str, target: ShmTarget, open_timeout: float | None):
        self._target = target
        super().__init__(base_url, {}, open_timeout, _one_place)
        link = self._links[None]
        assert isinstance(link, _ShmLink)
        self._region = link._shm.region

    def _open(self, headers: Mapping[str, str]) -> _Link:
        return _ShmLink(_ShmChannel(self._target, self._open_timeout))

    @property
    def region_bytes(self) -> int:
        """The bytes of the shared region."""
        return self._region.size

    @property
    def copy_outputs(self) -> bool:
        return self._region.copy_outputs

    def array(self, shape: Any, dtype: Any = wire.DTYPE) -> np.ndarray:
        """A writable array of ``shape`` and ``dtype`` (``"<f4"``, ``"<f2"``,
        ``"bfloat16"``, or the numpy dtype) in the shared region, lent until
        :meth:`free` (or the stream's close): an operation given it (or a view of it
        that starts at a multiple of 4 bytes) sends it where it is, without a copy.
        Do not write to it while an operation that was given it is in flight.

        Raises:
            InvalidInput: no free range is that large now.
        """
        return self._region.lend(shape, dtype)

    def free(self, arr: np.ndarray) -> None:
        """Give back an array :meth:`array` lent (it must not be used after)."""
        self._region.free(arr)


# -- asyncio ------------------------------------------------------------------


class _AsyncShmChannel(_AsyncFrameChannel):
    """:class:`_ShmChannel` for asyncio: the frames' channel over a Unix socket,
    its arrays in the region."""

    what = "shm"
    call_frames = False  # as _ShmChannel's

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, region: _Region):
        super().__init__(reader, writer)
        self.region = region
        region.freed = asyncio.Event()

    @classmethod
    async def open(cls, target: ShmTarget, open_timeout: float | None) -> _AsyncShmChannel:  # type: ignore[override]
        region = _Region(target.region_bytes, target.copy_outputs)
        try:
            sock = await asyncio.to_thread(_connect, target, region, open_timeout)
            try:
                sock.setblocking(False)
                reader, writer = await asyncio.open_unix_connection(sock=sock)
            except BaseException:
                sock.close()
                raise
        except BaseException:
            region.close()
            raise
        return cls(reader, writer, region)

    async def stage(self, doc: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
        region = self.region
        req, rep = region.needs(doc)
        start = None
        if req + rep:
            assert region.freed is not None
            while True:
                with region.cond:
                    start = region.take(req + rep)
                if start is not None:
                    break
                region.freed.clear()
                await region.freed.wait()
        return region.fill(doc, start, req, rep), start

    async def send_staged(self, rid: int, doc: dict[str, Any], start: int | None) -> None:
        self.region.hold(rid, start)
        try:
            self._writer.writelines(framing.frame_buffers({"id": rid, **doc}, wire.packb))
            await self._writer.drain()
        except BaseException:
            with self.region.cond:
                self.region.held.pop(rid, None)
            self.region.give(start)
            raise

    async def receive(self) -> Any:
        try:
            try:
                prefix = await self._reader.readexactly(framing.PREFIX.size)
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    self.region.end(self.what, None)
                    return None
                raise
            head_len, body_len = _frame_lengths(prefix)
            frame = memoryview(bytearray(await self._reader.readexactly(head_len + body_len)))
            return self.region.document(frame, head_len, self.sinks)
        except BaseException as exc:
            self.region.end(self.what, exc)
            raise

    async def release(self) -> None:
        await super().release()
        self.region.end(self.what, None)
        self.region.close()


class _AsyncShmLink(_AsyncLink):
    """:class:`_AsyncLink` whose operations take their range of the region before they are sent."""

    def __init__(self, channel: _AsyncShmChannel):
        self._shm = channel
        super().__init__(channel)  # a frames channel (its send unused: calls go through send_staged)

    async def call(self, op: str, members: Mapping[str, Any], finish: Any, sink: CallSink | None = None) -> Any:
        if self._closed is not None:
            raise self._closed
        doc, start = await self._shm.stage({"op": op, **members})
        if self._closed is not None:
            self._shm.region.give(start)
            raise self._closed
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, finish)
        if sink is not None:
            self._shm.sinks[rid] = sink
        try:
            await self._shm.send_staged(rid, doc, start)
        except Exception as exc:
            self._pending.pop(rid, None)
            self._shm.sinks.pop(rid, None)
            raise APIConnectionError(f"shm: send failed: {exc}") from exc
        return await fut


class AsyncShmStream(AsyncStream):
    """:class:`ShmStream` for asyncio (``AsyncClient.stream(transport="shm")``)."""

    def __init__(self, base_url: str, target: ShmTarget, open_timeout: float | None):
        super().__init__(base_url, {}, open_timeout, None)
        self._target = target
        self._region: _Region | None = None

    @classmethod
    async def open_shm(cls, base_url: str, target: ShmTarget, open_timeout: float | None) -> AsyncShmStream:
        self = cls(base_url, target, open_timeout)
        link = await self._link(None, None)
        assert isinstance(link, _AsyncShmLink)
        self._region = link._shm.region
        return self

    async def _open(self, headers: Mapping[str, str]) -> _AsyncLink:
        return _AsyncShmLink(await _AsyncShmChannel.open(self._target, self._open_timeout))

    def _opened(self) -> _Region:
        if self._region is None:
            raise APIConnectionError("shm: the stream is not open")
        return self._region

    @property
    def region_bytes(self) -> int:
        return self._opened().size

    @property
    def copy_outputs(self) -> bool:
        return self._opened().copy_outputs

    def array(self, shape: Any, dtype: Any = wire.DTYPE) -> np.ndarray:
        """As :meth:`ShmStream.array`."""
        return self._opened().lend(shape, dtype)

    def free(self, arr: np.ndarray) -> None:
        """As :meth:`ShmStream.free`."""
        self._opened().free(arr)
