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
import threading
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from . import wire
from ._routing import ROUTE_HEADER
from ._steps import (
    AttendItem,
    AttendOptions,
    StackedOptions,
    attend_members,
    attend_out,
    batch_body,
    batch_results,
    item_parts,
    item_results,
    merge_items,
    merge_stacked,
    stacked_body,
    stacked_parts,
    track_length,
)
from .errors import APIConnectionError, InvalidInput, InvalidResponse, parse_problem

if TYPE_CHECKING:  # annotations only
    from typing_extensions import Unpack

__all__ = ["Stream", "AsyncStream", "STREAM_PATH", "Groups"]

STREAM_PATH = "/v1/stream"

# The client's answer to "where do these sessions live": per replica (None: the
# stream's first connection), the indexes of the ids it holds.
Groups = list[tuple[Any, list[int]]]


def _ws_url(base_url: str) -> str:
    if base_url.startswith("https://"):
        return "wss://" + base_url[len("https://") :] + STREAM_PATH
    if base_url.startswith("http://"):
        return "ws://" + base_url[len("http://") :] + STREAM_PATH
    raise InvalidInput(f"base_url: expected http:// or https://, got {base_url!r}")


class _Frames:
    """Request ids and the decoding of replies, shared by both stream drivers."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def frame(self, op: str, members: Mapping[str, Any]) -> tuple[int, bytes]:
        rid = next(self._ids)
        return rid, wire.packb({"id": rid, "op": op, **members})

    @staticmethod
    def reply(raw: Any) -> tuple[Any, Any]:
        """``(id, result doc or APIError)`` of one reply frame."""
        if not isinstance(raw, (bytes, bytearray)):
            raise InvalidResponse("stream: expected a binary (MessagePack) frame")
        try:
            doc = wire.unpackb(bytes(raw), max_bytes=1 << 31)
        except wire.WireError as exc:
            raise InvalidResponse(f"stream: undecodable frame ({exc})") from None
        if not isinstance(doc, Mapping) or type(doc.get("status")) is not int:
            raise InvalidResponse(f"stream: expected {{id, status, ...}}, got {doc!r:.200}")
        if doc["status"] != 200:
            return doc.get("id"), parse_problem(doc["status"], doc.get("error") or {})
        return doc.get("id"), doc.get("result")


def _append_members(session: Any, layer: int, k: Any, v: Any, offset: int | None) -> dict[str, Any]:
    item = AttendItem(session, layer, q=np.zeros((1, 1, 1), np.float32), k=k, v=v, offset=offset)
    doc = attend_members(item)
    if "k" not in doc:
        raise InvalidInput("k, v: an append needs both")
    del doc["q"], doc["causal"]
    return doc


def _attend_result(item: AttendItem, doc: Any) -> np.ndarray:
    out, length = attend_out(doc, "attend")
    track_length(item, length)
    return out


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


def _one_place(ids: list[str]) -> Groups:
    return [(None, list(range(len(ids))))]


# -- sync ---------------------------------------------------------------------


class _Link:
    """One WebSocket and its reader thread."""

    def __init__(self, base_url: str, headers: Mapping[str, str], open_timeout: float | None):
        from websockets.sync.client import connect

        self._frames = _Frames()
        self._pending: dict[int, tuple[Future[Any], Any]] = {}
        self._lock = threading.Lock()
        self._closed: BaseException | None = None
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
        self._reader = threading.Thread(target=self._read, name="attnserve-stream", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for raw in self._ws:
                rid, result = _Frames.reply(raw)
                with self._lock:
                    fut, finish = self._pending.pop(rid, (None, None))
                if fut is not None:
                    _settle(fut, finish, result)
        except Exception as exc:
            self._fail(exc)
        else:
            self._fail(None)

    def _fail(self, exc: BaseException | None) -> None:
        err = APIConnectionError(
            f"stream: the connection closed{f' ({exc})' if exc else ''}; operations whose "
            "reply did not arrive may or may not have been applied"
        )
        with self._lock:
            self._closed = self._closed or err
            pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            fut.set_exception(err)

    def submit(self, op: str, members: Mapping[str, Any], finish: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed is not None:
                raise self._closed
            rid, frame = self._frames.frame(op, members)
            self._pending[rid] = (fut, finish)
            try:
                self._ws.send(frame)
            except Exception as exc:
                self._pending.pop(rid, None)
                raise APIConnectionError(f"stream: send failed: {exc}") from exc
        return fut

    def close(self) -> None:
        """Close the connection (after the replies of what is in flight)."""
        with self._lock:
            pending = [f for f, _ in self._pending.values()]
        for f in pending:
            try:
                f.exception()
            except BaseException:
                pass
        self._ws.close()
        self._reader.join(timeout=10)


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
    ):
        self._base_url, self._headers, self._open_timeout = base_url, dict(headers), open_timeout
        self._groups = groups
        self._lock = threading.Lock()
        self._closed = False
        self._links: dict[Any, _Link] = {None: _Link(base_url, headers, open_timeout)}

    def _link(self, place: Any, route: str) -> _Link:
        with self._lock:
            if self._closed:
                raise APIConnectionError("stream: closed")
            link = self._links.get(place)
            if link is None:
                link = _Link(self._base_url, {**self._headers, ROUTE_HEADER: route}, self._open_timeout)
                self._links[place] = link
            return link

    def _one(self, session_id: str, op: str, members: Mapping[str, Any], finish: Any) -> Future[Any]:
        place, _ = self._groups([session_id])[0]
        return self._link(place, session_id).submit(op, members, finish)

    def submit_attend(self, session: Any, layer: int, q: Any, **options: Unpack[AttendOptions]) -> Future[Any]:
        """Send an attend (the options of ``Session.attend``, and ``offset``); its
        future gives the output."""
        item = AttendItem(session, layer, q, **options)
        return self._one(item.session_id, "attend", attend_members(item), lambda doc: _attend_result(item, doc))

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
            return self._link(groups[0][0], ids[0]).submit("attend_batch", body, lambda d: batch_results(checked, d))
        parts = [
            self._link(place, sub[0].session_id).submit("attend_batch", sub_body, lambda d, s=sub: item_results(s, d))
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
                groups, stacked_parts(step, body, q, k, v, kw, [g for _, g in groups])
            )
        ]
        return _joined(parts, lambda got: merge_stacked(len(ids), [g for _, g in groups], got))

    def attend_stacked(
        self, sessions: Sequence[Any], layer: int, q: Any, k: Any = None, v: Any = None, **kw: Unpack[StackedOptions]
    ) -> np.ndarray:
        """As ``Client.attend_stacked``, over the stream."""
        out: np.ndarray = self.submit_attend_stacked(sessions, layer, q, k, v, **kw).result()
        return out

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


class _AsyncLink:
    """One WebSocket and its reader task."""

    def __init__(self) -> None:
        self._frames = _Frames()
        self._pending: dict[int, tuple[asyncio.Future[Any], Any]] = {}
        self._closed: BaseException | None = None
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, base_url: str, headers: Mapping[str, str], open_timeout: float | None) -> _AsyncLink:
        from websockets.asyncio.client import connect

        self = cls()
        try:
            self._ws = await connect(
                _ws_url(base_url),
                additional_headers=dict(headers),
                max_size=None,
                open_timeout=open_timeout,
                compression=None,
            )
        except Exception as exc:
            raise APIConnectionError(f"stream: cannot connect to {base_url}{STREAM_PATH}: {exc}") from exc
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        err: BaseException | None = None
        try:
            async for raw in self._ws:
                rid, result = _Frames.reply(raw)
                fut, finish = self._pending.pop(rid, (None, None))
                if fut is not None and not fut.done():
                    _settle(fut, finish, result)
        except Exception as exc:
            err = exc
        self._closed = APIConnectionError(
            f"stream: the connection closed{f' ({err})' if err else ''}; operations whose reply did not "
            "arrive may or may not have been applied"
        )
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(self._closed)

    async def call(self, op: str, members: Mapping[str, Any], finish: Any) -> Any:
        if self._closed is not None:
            raise self._closed
        rid, frame = self._frames.frame(op, members)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, finish)
        try:
            await self._ws.send(frame)
        except Exception as exc:
            self._pending.pop(rid, None)
            raise APIConnectionError(f"stream: send failed: {exc}") from exc
        return await fut

    async def close(self) -> None:
        if self._pending:
            await asyncio.gather(*(f for f, _ in self._pending.values()), return_exceptions=True)
        await self._ws.close()
        if self._reader is not None:
            await self._reader


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
    ):
        self._base_url, self._headers, self._open_timeout = base_url, dict(headers), open_timeout
        self._groups = groups
        self._closed = False
        self._links: dict[Any, asyncio.Future[_AsyncLink]] = {}

    @classmethod
    async def open(
        cls,
        base_url: str,
        headers: Mapping[str, str],
        open_timeout: float | None,
        groups: Callable[[list[str]], Awaitable[Groups]] | None = None,
    ) -> AsyncStream:
        self = cls(base_url, headers, open_timeout, groups)
        await self._link(None, None)
        return self

    async def _link(self, place: Any, route: str | None) -> _AsyncLink:
        if self._closed:
            raise APIConnectionError("stream: closed")
        fut = self._links.get(place)
        if fut is None:  # opened once: concurrent callers wait for the same connection
            fut = self._links[place] = asyncio.get_running_loop().create_future()
            headers = self._headers if route is None else {**self._headers, ROUTE_HEADER: route}
            try:
                fut.set_result(await _AsyncLink.open(self._base_url, headers, self._open_timeout))
            except BaseException as exc:
                del self._links[place]
                fut.set_exception(exc)
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
        out: np.ndarray = await self._one(
            item.session_id, "attend", attend_members(item), lambda doc: _attend_result(item, doc)
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
            outs: list[np.ndarray] = await link.call("attend_batch", body, lambda d: batch_results(checked, d))
            return outs
        parts = item_parts(checked, body, [g for _, g in groups])
        got = await self._split(
            ids,
            [
                (place, sub[0].session_id, sub_body, lambda d, s=sub: item_results(s, d))
                for (place, _), (sub, sub_body, _) in zip(groups, parts)
            ],
        )
        return merge_items(len(checked), [g for _, g in groups], got)

    async def attend_stacked(
        self, sessions: Sequence[Any], layer: int, q: Any, k: Any = None, v: Any = None, **kw: Unpack[StackedOptions]
    ) -> np.ndarray:
        """As ``Client.attend_stacked``, over the stream."""
        step, body, _ = stacked_body(sessions, layer, q, k, v, **kw)
        ids = body["session_ids"]
        groups = await self._where(ids)
        if len(groups) == 1:
            out: np.ndarray = await (await self._link(groups[0][0], ids[0])).call("attend_batch", body, step.result)
            return out
        parts = stacked_parts(step, body, q, k, v, kw, [g for _, g in groups])
        got = await self._split(
            ids,
            [
                (place, sub_body["session_ids"][0], sub_body, sub_step.outcome)
                for (place, _), (sub_step, sub_body, _) in zip(groups, parts)
            ],
        )
        return merge_stacked(len(ids), [g for _, g in groups], got)

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
