"""Batched steps and the streaming connection.

* :class:`AttendItem`: one attend of a batched step (``client.attend_batch``), for
  one session and layer.
* :class:`Stream` / :class:`AsyncStream`: one WebSocket to ``/v1/stream`` that
  carries append, attend and batched steps as MessagePack frames. Calls pipeline:
  ``submit_*`` (sync) returns a future at once, and concurrent ``await``\\ s
  (async) share the connection; the server applies operations in the order they
  were sent.

Requests are built and answers decoded here once for both transports (HTTP for
batches, frames for streams) and both drivers (sync and async).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, Union

import numpy as np

from . import wire
from .errors import APIConnectionError, APIError, AttnServeError, InvalidInput, InvalidResponse, parse_problem

if TYPE_CHECKING:  # annotations only
    from typing_extensions import Unpack

__all__ = [
    "AttendItem",
    "AttendOptions",
    "StackedOptions",
    "BatchError",
    "StackedStep",
    "Stream",
    "AsyncStream",
    "STREAM_PATH",
]

STREAM_PATH = "/v1/stream"


@dataclass(frozen=True)
class AttendItem:
    """One attend of a batched step: ``q`` over ``layer`` of ``session`` (a session
    object or its id), with an optional fused append of ``k``, ``v`` (checked at
    ``offset`` when given) and the options of ``Session.attend``."""

    session: Any
    layer: int
    q: Any
    k: Any = None
    v: Any = None
    offset: int | None = None
    start_pos: int | None = None
    causal: bool = True
    scale: float | None = None

    @property
    def session_id(self) -> str:
        sid = getattr(self.session, "session_id", self.session)
        if not isinstance(sid, str):
            raise InvalidInput(f"session: expected a session or its id, got {self.session!r}")
        return sid


ItemLike = Union[AttendItem, Mapping[str, Any]]


class AttendOptions(TypedDict, total=False):
    """The options of one attend: a fused append of ``k``, ``v`` (checked at ``offset``
    when given), ``start_pos``, ``causal`` and ``scale`` (as ``Session.attend``)."""

    k: Any
    v: Any
    offset: int | None
    start_pos: int | None
    causal: bool
    scale: float | None


class StackedOptions(TypedDict, total=False):
    """The options of a stacked step: one value per session in ``offsets`` and
    ``start_pos`` (None: none), and ``causal``, ``scale`` for all."""

    offsets: Sequence[int | None] | None
    start_pos: Sequence[int | None] | None
    causal: bool
    scale: float | None


class BatchError(AttnServeError):
    """Some items of a batched step failed. ``results`` holds, per item in order,
    its output (the item was applied) or its error: an :class:`APIError` (it changed
    nothing), or, for the items of a request to one replica that got no answer, the
    :class:`APIConnectionError` of that request; ``errors`` maps item index to error."""

    def __init__(self, results: list[Any]):
        self.results = results
        self.errors = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
        first = next(iter(self.errors.items()))
        super().__init__(f"{len(self.errors)} of {len(results)} batch items failed; item {first[0]}: {first[1]}")


def as_item(item: ItemLike) -> AttendItem:
    if isinstance(item, AttendItem):
        return item
    if isinstance(item, Mapping):
        try:
            return AttendItem(**item)
        except TypeError as exc:
            raise InvalidInput(f"batch item: {exc}") from None
    raise InvalidInput(f"batch item: expected an AttendItem or a mapping, got {type(item).__name__}")


def _array(a: Any, name: str) -> dict[str, Any]:
    try:
        return wire.encode_array(wire.check_finite(wire.as_float32(a, name=name), name=name), name=name)
    except wire.WireError as exc:
        raise InvalidInput(str(exc)) from None


def attend_members(item: AttendItem) -> dict[str, Any]:
    """The wire members of one attend (arrays encoded once)."""
    if isinstance(item.layer, bool) or not isinstance(item.layer, (int, np.integer)) or item.layer < 0:
        raise InvalidInput(f"layer: expected an int >= 0, got {item.layer!r}")
    doc: dict[str, Any] = {
        "session_id": item.session_id,
        "layer": int(item.layer),
        "q": _array(item.q, "q"),
        "causal": bool(item.causal),
    }
    if (item.k is None) != (item.v is None):
        raise InvalidInput("k, v: expected both or neither")
    if item.k is not None:
        doc["k"], doc["v"] = _array(item.k, "k"), _array(item.v, "v")
    for name in ("offset", "start_pos"):
        value = getattr(item, name)
        if value is not None:
            doc[name] = int(value)
    if item.scale is not None:
        doc["scale"] = float(item.scale)
    return doc


def batch_body(items: Sequence[ItemLike]) -> tuple[list[AttendItem], dict[str, Any]]:
    checked = [as_item(i) for i in items]
    if not checked:
        raise InvalidInput("items: expected at least one item")
    return checked, {"items": [attend_members(i) for i in checked]}


def batch_idempotent(items: list[AttendItem]) -> bool:
    """A batch may be retried safely when no item appends without an offset."""
    return all(i.k is None or i.offset is not None for i in items)


def _out(doc: Any, what: str) -> tuple[np.ndarray, int]:
    if not isinstance(doc, Mapping) or type(doc.get("length")) is not int:
        raise InvalidResponse(f"{what}: expected {{out, length}}, got {doc!r:.200}")
    try:
        out = wire.decode_array(doc.get("out"), name="out", ndim=3, finite=False)
    except wire.WireError as exc:
        raise InvalidResponse(f"{what}: {exc}") from None
    return out, doc["length"]


def _track(item: AttendItem, length: int) -> None:
    """Keep a session object's tracked length current (its next append's offset)."""
    lengths = getattr(item.session, "_lengths", None)
    if isinstance(lengths, list) and 0 <= item.layer < len(lengths):
        lengths[item.layer] = length


def batch_results(items: list[AttendItem], doc: Any) -> list[np.ndarray]:
    """Per item its output; raises :class:`BatchError` when any item failed."""
    return raise_failed(item_results(items, doc))


def raise_failed(results: list[Any]) -> list[Any]:
    """``results`` (per item an output or an error), or :class:`BatchError` when any
    item failed."""
    if any(isinstance(r, BaseException) for r in results):
        raise BatchError(results)
    return results


def item_results(items: list[AttendItem], doc: Any) -> list[Any]:
    """Per item its output, or the :class:`APIError` of an item that failed."""
    results = doc.get("results") if isinstance(doc, Mapping) else None
    if not isinstance(results, list) or len(results) != len(items):
        raise InvalidResponse(f"attend_batch: expected {len(items)} results, got {results!r:.200}")
    out: list[Any] = []
    for i, (item, r) in enumerate(zip(items, results)):
        if isinstance(r, Mapping) and isinstance(r.get("error"), Mapping):
            err = r["error"]
            status = err.get("status") if type(err.get("status")) is int else 500
            out.append(parse_problem(status, err))
            continue
        arr, length = _out(r, f"attend_batch item {i}")
        _track(item, length)
        out.append(arr)
    return out


# -- the stacked form -----------------------------------------------------------


@dataclass(frozen=True)
class StackedStep:
    """One stacked batched step (``attend_stacked``): the sessions in item order,
    the layer, and whether ``q`` came without its row axis (``[B, H, d]``: one query
    row per session, answered as ``[B, H, d]``)."""

    sessions: list[Any]
    layer: int
    squeeze: bool

    def result(self, doc: Any) -> np.ndarray:
        """The stacked output; raises :class:`BatchError` when any item failed."""
        out, failed = self.outcome(doc)
        if failed:
            raise BatchError([failed.get(i, out[i]) for i in range(len(out))])
        return out

    def outcome(self, doc: Any) -> tuple[np.ndarray, dict[int, APIError]]:
        """The stacked output and the errors of the items that failed, by index."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("lengths"), list):
            raise InvalidResponse(f"attend_stacked: expected {{out, lengths, errors}}, got {doc!r:.200}")
        lengths, errors = doc["lengths"], doc.get("errors") or []
        try:
            out = wire.decode_array(doc.get("out"), name="out", ndim=4, finite=False)
        except wire.WireError as exc:
            raise InvalidResponse(f"attend_stacked: {exc}") from None
        b = len(self.sessions)
        if out.shape[0] != b or len(lengths) != b or not isinstance(errors, list):
            raise InvalidResponse(f"attend_stacked: expected {b} items, got out {list(out.shape)}")
        if self.squeeze:
            out = out[:, 0]
        failed: dict[int, APIError] = {}
        for err in errors:
            i = err.get("item") if isinstance(err, Mapping) else None
            if type(i) is not int or not 0 <= i < b:
                raise InvalidResponse(f"attend_stacked: expected errors with an item index, got {err!r:.200}")
            failed[i] = parse_problem(err.get("status") if type(err.get("status")) is int else 500, err)
        for i, (session, length) in enumerate(zip(self.sessions, lengths)):
            if i not in failed and type(length) is int:
                _track(AttendItem(session, self.layer, None), length)
        return out, failed


def _stacked_array(a: Any, name: str, b: int | None) -> tuple[dict[str, Any], np.ndarray]:
    try:
        arr = wire.check_finite(wire.as_float32(a, name=name), name=name)
    except wire.WireError as exc:
        raise InvalidInput(str(exc)) from None
    if arr.ndim == 3:
        arr = arr[:, None]
    if arr.ndim != 4 or (b is not None and arr.shape[0] != b):
        want = f"[{b if b is not None else 'B'}, rows, heads, head_dim] or [B, heads, head_dim]"
        raise InvalidInput(f"{name}: expected shape {want}, got {list(np.shape(a))}")
    return wire.encode_array(arr, name=name), arr


def _per_session(values: Sequence[Any] | None, name: str, b: int) -> list[int | None] | None:
    if values is None:
        return None
    out = [None if x is None else int(x) for x in values]
    if len(out) != b:
        raise InvalidInput(f"{name}: expected {b} values (one per session, None for none), got {len(out)}")
    return out


def stacked_body(
    sessions: Sequence[Any], layer: int, q: Any, k: Any = None, v: Any = None, **options: Unpack[StackedOptions]
) -> tuple[StackedStep, dict[str, Any], bool]:
    """The body of a stacked step, what decodes its answer, and whether it is safe
    to retry (no append, or every session's append checked at its offset)."""
    offsets, start_pos = options.get("offsets"), options.get("start_pos")
    causal, scale = options.get("causal", True), options.get("scale")
    sessions = list(sessions)
    if not sessions:
        raise InvalidInput("sessions: expected at least one session")
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
        raise InvalidInput(f"layer: expected an int >= 0, got {layer!r}")
    b = len(sessions)
    ids = [AttendItem(s, int(layer), None).session_id for s in sessions]
    body: dict[str, Any] = {"session_ids": ids, "layer": int(layer), "causal": bool(causal)}
    body["q"], qa = _stacked_array(q, "q", b)
    if (k is None) != (v is None):
        raise InvalidInput("k, v: expected both or neither")
    if k is not None:
        body["k"], _ = _stacked_array(k, "k", b)
        body["v"], _ = _stacked_array(v, "v", b)
    for name, values in (("offsets", offsets), ("start_pos", start_pos)):
        checked = _per_session(values, name, b)
        if checked is not None:
            body[name] = checked
    if scale is not None:
        body["scale"] = float(scale)
    idempotent = k is None or (offsets is not None and None not in body["offsets"])
    return StackedStep(sessions, int(layer), np.ndim(q) == 3), body, idempotent


# -- streams ------------------------------------------------------------------


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
    out, length = _out(doc, "attend")
    _track(item, length)
    return out


def _append_result(item: AttendItem, doc: Any) -> int:
    length = doc.get("length") if isinstance(doc, Mapping) else None
    if type(length) is not int:
        raise InvalidResponse(f"append: expected {{length}}, got {doc!r:.200}")
    _track(item, length)
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


class Stream:
    """A synchronous streaming connection (``Client.stream()``). Thread-safe: calls
    from several threads pipeline on the one connection.

    ``attend``/``append``/``attend_batch`` send and wait; ``submit_*`` send and
    return a ``concurrent.futures.Future`` at once, so many operations are in
    flight together (the server applies them in the order sent)."""

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

    def _submit(self, op: str, members: Mapping[str, Any], finish: Any) -> Future[Any]:
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

    def submit_attend(self, session: Any, layer: int, q: Any, **options: Unpack[AttendOptions]) -> Future[Any]:
        """Send an attend (the options of ``Session.attend``, and ``offset``); its
        future gives the output."""
        item = AttendItem(session, layer, q, **options)
        return self._submit("attend", attend_members(item), lambda doc: _attend_result(item, doc))

    def attend(self, session: Any, layer: int, q: Any, **kw: Any) -> np.ndarray:
        """As ``Session.attend``, for ``session`` (a session or its id)."""
        out: np.ndarray = self.submit_attend(session, layer, q, **kw).result()
        return out

    def submit_append(self, session: Any, layer: int, k: Any, v: Any, *, offset: int | None = None) -> Future[Any]:
        item = AttendItem(session, layer, None)
        return self._submit(
            "append", _append_members(session, layer, k, v, offset), lambda doc: _append_result(item, doc)
        )

    def append(self, session: Any, layer: int, k: Any, v: Any, *, offset: int | None = None) -> int:
        length: int = self.submit_append(session, layer, k, v, offset=offset).result()
        return length

    def submit_attend_batch(self, items: Sequence[ItemLike]) -> Future[Any]:
        checked, body = batch_body(items)
        return self._submit("attend_batch", body, lambda doc: batch_results(checked, doc))

    def attend_batch(self, items: Sequence[ItemLike]) -> list[np.ndarray]:
        """As ``Client.attend_batch``, over the stream."""
        outs: list[np.ndarray] = self.submit_attend_batch(items).result()
        return outs

    def submit_attend_stacked(
        self, sessions: Sequence[Any], layer: int, q: Any, k: Any = None, v: Any = None, **kw: Unpack[StackedOptions]
    ) -> Future[Any]:
        step, body, _ = stacked_body(sessions, layer, q, k, v, **kw)
        return self._submit("attend_batch", body, step.result)

    def attend_stacked(
        self, sessions: Sequence[Any], layer: int, q: Any, k: Any = None, v: Any = None, **kw: Unpack[StackedOptions]
    ) -> np.ndarray:
        """As ``Client.attend_stacked``, over the stream."""
        out: np.ndarray = self.submit_attend_stacked(sessions, layer, q, k, v, **kw).result()
        return out

    def ping(self) -> None:
        self._submit("ping", {}, lambda doc: None).result()

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

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncStream:
    """The asyncio streaming connection (``AsyncClient.stream()``): concurrent
    awaits of its methods pipeline on the one connection."""

    def __init__(self) -> None:
        self._frames = _Frames()
        self._pending: dict[int, tuple[asyncio.Future[Any], Any]] = {}
        self._closed: BaseException | None = None
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, base_url: str, headers: Mapping[str, str], open_timeout: float | None) -> AsyncStream:
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

    async def _call(self, op: str, members: Mapping[str, Any], finish: Any) -> Any:
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

    async def attend(self, session: Any, layer: int, q: Any, **options: Unpack[AttendOptions]) -> np.ndarray:
        """As ``Session.attend``, for ``session`` (a session or its id), with ``offset``."""
        item = AttendItem(session, layer, q, **options)
        out: np.ndarray = await self._call("attend", attend_members(item), lambda doc: _attend_result(item, doc))
        return out

    async def append(self, session: Any, layer: int, k: Any, v: Any, *, offset: int | None = None) -> int:
        item = AttendItem(session, layer, None)
        length: int = await self._call(
            "append", _append_members(session, layer, k, v, offset), lambda doc: _append_result(item, doc)
        )
        return length

    async def attend_batch(self, items: Sequence[ItemLike]) -> list[np.ndarray]:
        checked, body = batch_body(items)
        outs: list[np.ndarray] = await self._call("attend_batch", body, lambda doc: batch_results(checked, doc))
        return outs

    async def attend_stacked(
        self, sessions: Sequence[Any], layer: int, q: Any, k: Any = None, v: Any = None, **kw: Unpack[StackedOptions]
    ) -> np.ndarray:
        """As ``Client.attend_stacked``, over the stream."""
        step, body, _ = stacked_body(sessions, layer, q, k, v, **kw)
        out: np.ndarray = await self._call("attend_batch", body, step.result)
        return out

    async def ping(self) -> None:
        await self._call("ping", {}, lambda doc: None)

    async def close(self) -> None:
        if self._pending:
            await asyncio.gather(*(f for f, _ in self._pending.values()), return_exceptions=True)
        await self._ws.close()
        if self._reader is not None:
            await self._reader

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
