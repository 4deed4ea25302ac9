"""Client, AsyncClient and their sessions.

All protocol logic (request building, input checks, retries, offset tracking and
the recovery of calls whose answer was lost) is written once, as generators
("flows") on :class:`_BaseClient` and :class:`_SessionBase`. A flow yields the I/O
it needs, :class:`_Send` (one HTTP attempt) or :class:`_Sleep` (a backoff), and
receives its result; :meth:`Client._run` performs them with ``httpx.Client`` and
:meth:`AsyncClient._run` with ``httpx.AsyncClient``. So the sync and async clients
cannot drift apart: they differ only in those two small drivers.
"""

from __future__ import annotations

import asyncio
import json
import operator
import os
import random
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, TypedDict, TypeVar, Union, overload

import httpx
import numpy as np

from . import tensors, wire
from ._routing import ROUTE_HEADER, ReplicaMap
from ._shm import AsyncShmStream, ShmStream, ShmTarget, shm_target
from ._streams import STREAM_TRANSPORTS, AsyncStream, AsyncStreamOpening, FrameTarget, Groups, Stream
from ._steps import (
    AttendItem,
    StackedOptions,
    StackedStep,
    StepOptions,
    StepState,
    answer_dtype,
    attend_answer,
    batch_body,
    batch_idempotent,
    batch_results,
    decode_out,
    item_parts,
    item_results,
    merge_items,
    merge_stacked,
    session_id_of,
    one_replica,
    stacked_body,
    stacked_parts,
    step_open_body,
)
from ._step_handles import AsyncStep, Step
from ._types import SessionInfo
from ._version import __version__
from .merge import Attention
from .errors import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    InvalidInput,
    InvalidRequest,
    InvalidResponse,
    LayerNotFound,
    OffsetMismatch,
    SessionExists,
    SessionNotFound,
    StepNotFound,
    parse_problem,
    parse_retry_after,
    refused,
)

__all__ = [
    "API_KEY_ENV",
    "BASE_URL_ENV",
    "DEFAULT_BASE_URL",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT",
    "AsyncClient",
    "AsyncSession",
    "Client",
    "Session",
    "new_session_id",
]

#: Where a client connects when neither ``base_url`` nor :data:`BASE_URL_ENV` says.
DEFAULT_BASE_URL = "http://127.0.0.1:8421"
#: The environment variable of the ``base_url`` a client connects to when none is given.
BASE_URL_ENV = "ATTNSERVE_BASE_URL"
#: The environment variable of the API key a client sends when none is given.
API_KEY_ENV = "ATTNSERVE_API_KEY"
#: Seconds every request may take (connect, each read and write, pool wait).
DEFAULT_TIMEOUT = 60.0
#: Extra attempts after the first one, for the failures that are safe to retry.
DEFAULT_MAX_RETRIES = 2

_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# What the server accepts as an API key (and what an HTTP header can carry as it is).
_API_KEY = re.compile(r"[!-~]{1,4096}")
# Transport errors raised before any byte of the request left: always safe to retry.
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Transport errors worth another attempt of an idempotent request.
_RETRYABLE = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
_RETRY_STATUSES = frozenset({429, 503})

if TYPE_CHECKING:  # annotations only: nothing of typing_extensions is needed at run time
    from typing_extensions import Required, Unpack

T = TypeVar("T")
_C = TypeVar("_C", bound="_BaseClient")


class ClientOptions(TypedDict, total=False):
    """The options ``Client`` and ``AsyncClient`` share (see :class:`Client`)."""

    api_key: str | None
    timeout: float | httpx.Timeout | None
    max_retries: int
    headers: Mapping[str, str] | None


class SessionSpec(TypedDict, total=False):
    """What ``create_session`` takes (see :meth:`Client.create_session`)."""

    num_qo_heads: Required[int]
    num_kv_heads: Required[int]
    head_dim: Required[int]
    num_layers: int
    kv_format: str | Sequence[str]
    exact_layers: Sequence[int] | None
    exact_format: str | None
    sinks: int | None
    window: int | None
    max_tokens: int | None
    seed: int | None
    session_id: str | None
    server_assigned_id: bool


@dataclass(frozen=True)
class _Send:
    """One HTTP attempt; the driver answers with an ``httpx.Response`` or throws an
    ``httpx.RequestError`` into the flow."""

    method: str
    url: str
    content: bytes | None
    headers: Mapping[str, str]


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Parallel:
    """Run these flows at once; the driver answers with each one's result, or the
    exception it raised, in order."""

    flows: list[Any]


_Op = Union[_Send, _Sleep, _Parallel]
Flow = Generator[_Op, Any, T]


@dataclass(frozen=True)
class _Reply:
    """The final answer to one call, after any retries.

    ``maybe_landed`` is true when an earlier attempt failed after its request was
    sent, so the server may have carried it out although its answer was lost.
    """

    response: httpx.Response
    maybe_landed: bool

    @property
    def ok(self) -> bool:
        return self.response.is_success

    def error(self) -> APIError:
        return parse_problem(self.response.status_code, self.response.content, self.response.headers)


def _wrap_transport_error(exc: httpx.RequestError, base_url: str, method: str, path: str) -> APIConnectionError:
    """The error of a call that got no answer, naming where it went (never the key:
    that travels in a header, which no httpx error shows)."""
    cls = APITimeoutError if isinstance(exc, httpx.TimeoutException) else APIConnectionError
    what = "could not connect to" if isinstance(exc, _UNSENT) else "no answer from"
    return cls(f"{what} {base_url} ({method} {path}): {type(exc).__name__}: {exc or 'no details'}")


def _base_url(given: str | httpx.URL | None) -> str:
    """The base URL a client talks to: ``given``, else :data:`BASE_URL_ENV` (unset or
    empty: not set), else :data:`DEFAULT_BASE_URL`; an http(s) URL, trailing ``/`` dropped."""
    if given is not None:
        name, url = "base_url", str(given).rstrip("/")
    else:
        name, url = BASE_URL_ENV, (os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL).rstrip("/")
    try:
        scheme = httpx.URL(url).scheme
    except httpx.InvalidURL:
        scheme = ""
    if scheme not in ("http", "https"):
        raise InvalidInput(f"{name}: expected an http:// or https:// URL, got {url!r}")
    return url


def _api_key(given: str | None) -> str | None:
    """The API key a client sends: ``given``, else :data:`API_KEY_ENV` (unset or
    empty: none). Checked as the server checks keys; a refusal never shows the key."""
    name, key = ("api_key", given) if given is not None else (API_KEY_ENV, os.environ.get(API_KEY_ENV) or None)
    if key is not None and not (isinstance(key, str) and _API_KEY.fullmatch(key)):
        raise InvalidInput(f"{name}: expected 1 to 4096 visible ASCII characters without spaces (the key is not shown)")
    return key


def new_session_id() -> str:
    """A fresh session id: 32 random hex digits (a UUID4), which the server's
    ``[A-Za-z0-9_-]{1,64}`` accepts."""
    return uuid.uuid4().hex


def _check_session_id(session_id: Any, cls: type[APIError] = SessionNotFound) -> str:
    """``cls``: what the server answers for such an id (404 session-not-found where
    it looks a session up, 422 invalid-request where it creates one)."""
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise refused(cls, f"session_id: expected 1 to 64 of [A-Za-z0-9_-], got {session_id!r}")
    return session_id


def _int_arg(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise refused(InvalidRequest, f"{name}: expected an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise refused(InvalidRequest, f"{name}: expected an int, got {value!r}") from None


def _attend_options(start_pos: Any, causal: Any, scale: Any) -> tuple[int | None, bool, float | None]:
    """An attend's ``start_pos`` (an int >= 0, or None), ``causal`` (a bool) and
    ``scale`` (a finite number, or None), checked before anything is sent."""
    if start_pos is not None:
        start_pos = _int_arg("start_pos", start_pos)
        if start_pos < 0:
            raise refused(InvalidRequest, f"start_pos: expected an int >= 0, got {start_pos}")
    if not isinstance(causal, (bool, np.bool_)):
        raise refused(InvalidRequest, f"causal: expected a bool, got {causal!r}")
    if scale is not None:
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float, np.floating, np.integer))
            or not np.isfinite(scale)
        ):
            raise refused(InvalidRequest, f"scale: expected a finite float, got {scale!r}")
        scale = float(scale)
    return start_pos, bool(causal), scale


class _AttendArgs(NamedTuple):
    """An attend's arguments as checked before anything is sent
    (:meth:`_SessionBase._check_attend`): ``k``, ``v`` None unless the attend is fused."""

    layer: int
    like: Any  # q as given (the answer takes its kind: tensors.answer)
    q: np.ndarray
    k: np.ndarray | None
    v: np.ndarray | None
    start_pos: int | None
    causal: bool
    scale: float | None
    out_dtype: str | None  # the wire name asked for (None: q's)


def _int_member(body: Any, key: str, what: str) -> int:
    value = body.get(key) if isinstance(body, Mapping) else None
    if type(value) is not int:
        raise InvalidResponse(f"{what}: expected {key!r} as an int in the answer, got {value!r}")
    return value


class _BaseClient:
    """What :class:`Client` and :class:`AsyncClient` share: configuration and flows."""

    # Backoff between attempts: initial * 2**attempt seconds, at most _backoff_max,
    # less up to 25 % jitter; a Retry-After is honoured up to _retry_after_max.
    _backoff_initial = 0.5
    _backoff_max = 8.0
    _retry_after_max = 60.0
    # Largest answer body decoded (an attend output of 2 GiB is far past any limit).
    _max_response_bytes = 1 << 31

    def __init__(
        self,
        base_url: str | httpx.URL | None = None,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        max_retries = _int_arg("max_retries", max_retries)
        if max_retries < 0:
            raise InvalidInput(f"max_retries: expected an int >= 0, got {max_retries}")
        self.base_url = _base_url(base_url)
        self.max_retries = max_retries
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self._headers = {"Accept": wire.MSGPACK, "User-Agent": f"attnserve-client/{__version__}"}
        api_key = _api_key(api_key)
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._api_key = api_key
        self._headers.update(headers or {})
        self._replicas = ReplicaMap()  # where each session lives, behind a router

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def _pool(self, http_client: Any, transport: Any, make: Callable[..., Any]) -> Any:
        """The connection pool: ``http_client`` (not ours to close), or a new one of
        ``make`` on ``transport``."""
        if http_client is not None and transport is not None:
            raise InvalidInput("transport, http_client: expected at most one, got both")
        self._owns_http = http_client is None
        return http_client if http_client is not None else make(transport=transport, timeout=self.timeout)

    # -- the request loop -------------------------------------------------------

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self._retry_after_max)
        delay = min(self._backoff_max, self._backoff_initial * 2.0**attempt)
        return delay * (1.0 - 0.25 * random.random())

    def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        idempotent: bool = True,
        retry: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> Flow[_Reply]:
        """Send one request, retrying what is safe to retry; return the final answer.

        Retried (at most ``max_retries`` times, with backoff): answers 429 and 503
        (the server did nothing; ``Retry-After`` honoured), transport errors before
        the request was sent, and for idempotent requests also timeouts and dropped
        connections after it was sent. Error answers are returned, not raised.

        Raises:
            APIConnectionError, APITimeoutError: no answer came, after the retries.
        """
        sent_headers = {**self._headers, **(headers or {})}
        content = None
        if body is not None:
            content = wire.packb(body)
            sent_headers["Content-Type"] = wire.MSGPACK
        send = _Send(method, self.base_url + path, content, sent_headers)
        maybe_landed = False
        attempt = 0
        while True:
            try:
                response: httpx.Response = yield send
            except httpx.RequestError as exc:
                sent = not isinstance(exc, _UNSENT)
                retryable = isinstance(exc, _RETRYABLE) and (idempotent or not sent)
                if not (retry and retryable and attempt < self.max_retries):
                    raise _wrap_transport_error(exc, self.base_url, method, path) from exc
                maybe_landed = maybe_landed or sent
                yield _Sleep(self._backoff(attempt, None))
            else:
                if not (retry and response.status_code in _RETRY_STATUSES and attempt < self.max_retries):
                    if response.is_success:
                        self._replicas.note(method, path, response.headers)
                    return _Reply(response, maybe_landed)
                retry_after = parse_retry_after(response.headers.get("retry-after"))
                yield _Sleep(self._backoff(attempt, retry_after))
            attempt += 1

    def _decode(self, reply: _Reply) -> Any:
        """The decoded body of a success answer (MessagePack or JSON), ``None`` if empty."""
        response = reply.response
        if not response.content:
            return None
        try:
            if wire.is_msgpack(response.headers.get("content-type")):
                return wire.unpackb(response.content, max_bytes=self._max_response_bytes)
            return json.loads(response.content)
        except (wire.WireError, ValueError, RecursionError) as exc:
            raise InvalidResponse(
                f"{response.request.method} {response.request.url.path}: undecodable answer ({exc})"
            ) from None

    def _call_ok(self, method: str, path: str, body: Mapping[str, Any] | None = None, **kw: Any) -> Flow[Any]:
        """:meth:`_call`, raising the error of an error answer; returns the decoded body."""
        reply = yield from self._call(method, path, body, **kw)
        if not reply.ok:
            raise reply.error()
        return self._decode(reply)

    # -- flows ---------------------------------------------------------------

    def _create_flow(
        self,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        kv_format: str | Sequence[str] = "f32",
        exact_layers: Sequence[int] | None = None,
        exact_format: str | None = None,
        sinks: int | None = None,
        window: int | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
        session_id: str | None = None,
        server_assigned_id: bool = False,
    ) -> Flow[SessionInfo]:
        body: dict[str, Any] = {
            "num_layers": _int_arg("num_layers", num_layers),
            "num_qo_heads": _int_arg("num_qo_heads", num_qo_heads),
            "num_kv_heads": _int_arg("num_kv_heads", num_kv_heads),
            "head_dim": _int_arg("head_dim", head_dim),
        }
        if isinstance(kv_format, str):
            body["kv_format"] = kv_format
        elif isinstance(kv_format, Sequence) and kv_format and all(isinstance(f, str) for f in kv_format):
            body["kv_format"] = list(kv_format)
        else:
            raise refused(
                InvalidRequest, f"kv_format: expected a str or a sequence of str (one per layer), got {kv_format!r}"
            )
        if exact_layers is not None:
            if isinstance(exact_layers, (str, bytes)) or not isinstance(exact_layers, Sequence):
                raise refused(
                    InvalidRequest, f"exact_layers: expected a sequence of layer indexes, got {exact_layers!r}"
                )
            body["exact_layers"] = [_int_arg(f"exact_layers[{i}]", x) for i, x in enumerate(exact_layers)]
        if exact_format is not None:
            body["exact_format"] = exact_format
        for name, value in (("sinks", sinks), ("window", window)):
            if value is not None:
                body[name] = _int_arg(name, value)
        if max_tokens is not None:
            body["max_tokens"] = _int_arg("max_tokens", max_tokens)
        if seed is not None:
            body["seed"] = _int_arg("seed", seed)
        if server_assigned_id:
            if session_id is not None:
                raise InvalidInput("session_id, server_assigned_id: expected at most one, got both")
            # POST is not idempotent: retried only when the request surely did not arrive.
            reply = yield from self._call("POST", "/v1/sessions", body, idempotent=False)
            if not reply.ok:
                raise reply.error()
            created = SessionInfo.from_dict(self._decode(reply))
            self._replicas.note("POST", "/v1/sessions", reply.response.headers, created.session_id)
            return created
        if session_id is None:
            session_id = new_session_id()
        path = f"/v1/sessions/{_check_session_id(session_id, InvalidRequest)}"
        reply = yield from self._call("PUT", path, body)
        if reply.ok:
            return SessionInfo.from_dict(self._decode(reply))
        error = reply.error()
        if isinstance(error, SessionExists) and reply.maybe_landed:
            # Our own earlier attempt may have created it: adopt it if it is exactly
            # what we asked for and still empty.
            info = SessionInfo.from_dict((yield from self._call_ok("GET", path)))
            asked = {key: tuple(value) if isinstance(value, list) else value for key, value in body.items()}
            if all(getattr(info, key) == value for key, value in asked.items()) and not any(info.lengths):
                return info
        raise error

    def _get_info_flow(self, session_id: str) -> Flow[SessionInfo]:
        body = yield from self._call_ok("GET", f"/v1/sessions/{_check_session_id(session_id)}")
        return SessionInfo.from_dict(body)

    def _list_flow(self) -> Flow[list[SessionInfo]]:
        body = yield from self._call_ok("GET", "/v1/sessions")
        items = body.get("sessions") if isinstance(body, Mapping) else body
        if not isinstance(items, list):
            raise InvalidResponse(f"list sessions: expected {{'sessions': [...]}}, got {type(body).__name__}")
        return [SessionInfo.from_dict(item) for item in items]

    def _delete_flow(self, session_id: str) -> Flow[None]:
        reply = yield from self._call("DELETE", f"/v1/sessions/{_check_session_id(session_id)}")
        if reply.ok:
            return None
        error = reply.error()
        # A lost answer to an earlier attempt that did delete it: done all the same.
        if isinstance(error, SessionNotFound) and reply.maybe_landed:
            return None
        raise error

    def _server_info_flow(self) -> Flow[dict[str, Any]]:
        body = yield from self._call_ok("GET", "/v1/info")
        if not isinstance(body, dict):
            raise InvalidResponse(f"server info: expected an object, got {type(body).__name__}")
        return body

    def _frame_target_flow(self, transport: str, address: tuple[str, int] | None) -> Flow[FrameTarget | None]:
        """Where a stream over the frame transport connects (``None``: the WebSocket)."""
        if transport not in STREAM_TRANSPORTS:
            raise InvalidInput(f"transport: expected one of {', '.join(STREAM_TRANSPORTS)}, got {transport!r}")
        if transport == "websocket":
            if address is not None:
                raise InvalidInput("frames_address: only with transport='frames'")
            return None
        if address is None:
            info = yield from self._server_info_flow()
            frames = info.get("frames")
            if not isinstance(frames, dict) or type(frames.get("port")) is not int:
                raise InvalidInput(
                    "transport='frames': the server does not serve the frame transport "
                    "(start it with --frames-port or ATTNSERVE_FRAMES_PORT)"
                )
            address = (httpx.URL(self.base_url).host, frames["port"])
        return FrameTarget((str(address[0]), int(address[1])), self._api_key)

    def _shm_target_flow(
        self, transport: str, frames_address: Any, shm_socket: Any, region_bytes: Any, copy_outputs: Any
    ) -> Flow[ShmTarget | None]:
        """Where a stream over the shared-memory transport connects (``None``: another transport)."""
        if transport == "shm" and frames_address is not None:
            raise InvalidInput("frames_address: only with transport='frames'")
        target = yield from shm_target(
            transport, shm_socket, region_bytes, copy_outputs, self._api_key, self._server_info_flow
        )
        return target

    def _stream_headers(self, route: Any) -> dict[str, str]:
        if route is None:
            return self._headers
        return {**self._headers, ROUTE_HEADER: session_id_of(route)}

    def _places_flow(self, ids: list[str]) -> Flow[Groups]:
        """Where a stream sends operations on ``ids``: per replica, the indexes of its
        ids (one place, the stream's first connection, on a single server)."""
        groups = yield from self._replica_groups(ids)
        if len(self._replicas.instances) <= 1:
            return [(None, list(range(len(ids))))]
        return [(self._replicas.where(ids[idx[0]]), idx) for idx in groups]

    def _replica_groups(self, ids: list[str]) -> Flow[list[list[int]]]:
        """The indexes of ``ids`` by the replica that holds them (one group on a
        single server); a session this client has not seen yet is looked up first."""
        for sid in self._replicas.unknown(ids):
            yield from self._call("GET", f"/v1/sessions/{sid}")  # a 404 stays unknown: its item will say so
        return self._replicas.groups(ids)

    def _routed_batch(self, ids: list[str], body: Mapping[str, Any], idempotent: bool) -> Flow[Any]:
        """``POST /v1/batch/attend`` to the replica of ``ids`` (``X-Attnserve-Route``:
        a router sends it where the first id lives; a single server ignores it)."""
        route = {ROUTE_HEADER: ids[0]}
        return (yield from self._call_ok("POST", "/v1/batch/attend", body, idempotent=idempotent, headers=route))

    def _batch_flow(self, items: Any) -> Flow[list[np.ndarray]]:
        checked, body = batch_body(items)
        ids = [item.session_id for item in checked]
        groups = yield from self._replica_groups(ids)
        if len(groups) == 1:
            doc = yield from self._routed_batch(ids, body, batch_idempotent(checked))
            return batch_results(checked, body, doc)

        def part(sub: list[AttendItem], sub_body: dict[str, Any], idempotent: bool) -> Flow[list[Any]]:
            doc = yield from self._routed_batch([i.session_id for i in sub], sub_body, idempotent)
            return item_results(sub, sub_body, doc)

        parts = yield _Parallel([part(*p) for p in item_parts(checked, body, groups)])
        return merge_items(len(checked), groups, parts)

    def _stacked_flow(
        self, sessions: Any, layer: int, q: Any, k: Any, v: Any, kw: StackedOptions
    ) -> Flow[tensors.Answer]:
        step, body, idempotent = stacked_body(sessions, layer, q, k, v, **kw)
        groups = yield from self._replica_groups(body["session_ids"])
        if len(groups) == 1:
            doc = yield from self._routed_batch(body["session_ids"], body, idempotent)
            return step.result(doc)

        def part(sub_step: StackedStep, sub_body: dict[str, Any], idempotent: bool) -> Flow[Any]:
            doc = yield from self._routed_batch(sub_body["session_ids"], sub_body, idempotent)
            return sub_step.outcome(doc)

        parts = yield _Parallel([part(*p) for p in stacked_parts(step, body, kw, groups)])
        return merge_stacked(step, groups, parts)

    # -- open steps ---------------------------------------------------------------

    def _step_open_flow(self, sessions: Any, options: StepOptions) -> Flow[StepState]:
        """``POST /v1/steps``: a step over ``sessions``, which must live on one replica."""
        sessions, body = step_open_body(sessions, **options)
        ids = body["session_ids"]
        groups = yield from self._replica_groups(ids)
        if len(groups) > 1:
            raise one_replica(len(groups))
        reply = yield from self._call("POST", "/v1/steps", body, idempotent=False, headers={ROUTE_HEADER: ids[0]})
        if not reply.ok:
            raise reply.error()
        return StepState(sessions, body, self._decode(reply))

    def _step_call_flow(self, state: StepState, layer: Any, q: Any, k: Any, v: Any, out: Any = None) -> Flow[Any]:
        """``POST /v1/steps/{step}/layers/{layer}``: one layer call (not retried once
        it may have arrived: a second one would find the layer called); ``out``: its
        destination (the decoded answer copied into it)."""
        step, members = state.call(layer, q, k, v, out)
        path = f"/v1/steps/{state.handle}/layers/{step.layer}"
        doc = yield from self._call_ok("POST", path, members, idempotent=False, headers={ROUTE_HEADER: state.route})
        return state.finish(step, doc)

    def _step_info_flow(self, state: StepState) -> Flow[dict[str, Any]]:
        doc = yield from self._call_ok("GET", f"/v1/steps/{state.handle}", headers={ROUTE_HEADER: state.route})
        return state.update(doc)

    def _step_close_flow(self, state: StepState) -> Flow[None]:
        """``DELETE /v1/steps/{step}``; a step the server does not have is closed too."""
        if state.closed:
            return None
        reply = yield from self._call("DELETE", f"/v1/steps/{state.handle}", headers={ROUTE_HEADER: state.route})
        if not reply.ok:
            error = reply.error()
            if not isinstance(error, StepNotFound):
                raise error
        state.closed = True
        return None

    def _probe_flow(self, path: str) -> Flow[bool]:
        reply = yield from self._call("GET", path, retry=False)
        return reply.ok


class _SessionBase(Generic[_C]):
    """What :class:`Session` and :class:`AsyncSession` share: checks, tracking, flows."""

    def __init__(self, client: _C, info: SessionInfo) -> None:
        self._client = client
        self._config = info
        # The length of each layer as this client believes it; None: unknown (then
        # the next write first asks the server with GET).
        self._lengths: list[int | None] = list(info.lengths)

    @property
    def session_id(self) -> str:
        return self._config.session_id

    @property
    def lengths(self) -> tuple[int | None, ...]:
        """Each layer's length as last seen in an answer (``None``: not known now)."""
        return tuple(self._lengths)

    def __repr__(self) -> str:
        c = self._config
        return (
            f"{type(self).__name__}({c.session_id!r}, num_layers={c.num_layers},"
            f" num_qo_heads={c.num_qo_heads}, num_kv_heads={c.num_kv_heads},"
            f" head_dim={c.head_dim}, kv_format={c.kv_format!r})"
        )

    # -- checks, before anything is sent ------------------------------------------

    def _check_layer(self, layer: Any) -> int:
        n = self._config.num_layers
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < n:
            raise refused(LayerNotFound, f"layer: expected an int in 0..{n - 1}, got {layer!r}")
        return int(layer)

    def _check_rows(self, a: Any, name: str, heads: int, rows: str) -> np.ndarray:
        try:
            arr = tensors.as_wire_array(a, name=name)
        except wire.WireError as exc:
            raise refused(InvalidRequest, str(exc)) from None
        d = self._config.head_dim
        if arr.ndim != 3 or arr.shape[1:] != (heads, d) or arr.shape[0] < 1:
            raise refused(
                InvalidRequest, f"{name}: expected shape ({rows}, {heads}, {d}) with {rows} >= 1, got {arr.shape}"
            )
        try:
            return wire.check_finite(arr, name=name)
        except wire.WireError as exc:
            raise refused(InvalidRequest, str(exc)) from None

    def _check_pair(self, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray]:
        """``k``, ``v`` of an attend that has either: both, checked (:meth:`_check_kv`)."""
        if (k is None) != (v is None):
            raise refused(InvalidRequest, f"k, v: expected both or neither, got only {'k' if v is None else 'v'}")
        return self._check_kv(k, v)

    def _check_attend(
        self, layer: Any, q: Any, k: Any, v: Any, start_pos: Any, causal: Any, scale: Any, out_dtype: Any
    ) -> _AttendArgs:
        """An attend's arguments, each checked before anything is sent (the fused rows
        when ``k`` or ``v`` is given)."""
        layer = self._check_layer(layer)
        rows = self._check_rows(q, "q", self._config.num_qo_heads, "n")
        if k is not None or v is not None:
            k, v = self._check_pair(k, v)
        try:
            out_dtype = tensors.out_dtype_name(out_dtype)
        except wire.WireError as exc:
            raise refused(InvalidRequest, str(exc)) from None
        return _AttendArgs(layer, q, rows, k, v, *_attend_options(start_pos, causal, scale), out_dtype)

    def _check_kv(self, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray]:
        k = self._check_rows(k, "k", self._config.num_kv_heads, "m")
        v = self._check_rows(v, "v", self._config.num_kv_heads, "m")
        if v.shape != k.shape:
            raise refused(InvalidRequest, f"v: expected the shape of k {k.shape}, got {v.shape}")
        if v.dtype != k.dtype:
            raise refused(
                InvalidRequest, f"v: expected the dtype of k ({wire.dtype_name(k)}), got {wire.dtype_name(v)}"
            )
        return k, v

    # -- flows -------------------------------------------------------------------

    def _path(self, layer: int, what: str) -> str:
        return f"/v1/sessions/{self.session_id}/layers/{layer}/{what}"

    def _info_flow(self) -> Flow[SessionInfo]:
        info = yield from self._client._get_info_flow(self.session_id)
        self._lengths = list(info.lengths)
        return info

    def _offset_flow(self, layer: int) -> Flow[int]:
        length = self._lengths[layer]
        if length is None:
            yield from self._info_flow()
            length = self._lengths[layer]
        assert length is not None
        return length

    def _write(self, layer: int, what: str, body: Mapping[str, Any]) -> Flow[_Reply]:
        """POST a body that appends; if no answer comes at all, forget the layer's length."""
        try:
            return (yield from self._client._call("POST", self._path(layer, what), body))
        except APIConnectionError:
            self._lengths[layer] = None
            raise

    def _length_from(self, layer: int, body: Any, what: str) -> int:
        length = _int_member(body, "length", what)
        self._lengths[layer] = length
        return length

    def _landed_length(self, layer: int, reply: _Reply, landed: int) -> int:
        """Settle a write that got an error answer: return ``landed`` (the layer's length
        had the write been done) if the error shows that a lost earlier attempt of this
        very call did it; else refresh the tracked length if the error tells it, and
        raise the error."""
        error = reply.error()
        if isinstance(error, OffsetMismatch) and error.length is not None:
            self._lengths[layer] = error.length
            if reply.maybe_landed and error.length == landed:
                return landed
        raise error

    def _append_flow(self, layer: Any, k: Any, v: Any) -> Flow[int]:
        layer = self._check_layer(layer)
        k, v = self._check_kv(k, v)
        offset = yield from self._offset_flow(layer)
        body = {"k": wire.encode_array(k, name="k"), "v": wire.encode_array(v, name="v"), "offset": offset}
        reply = yield from self._write(layer, "kv", body)
        if reply.ok:
            return self._length_from(layer, self._client._decode(reply), "append")
        return self._landed_length(layer, reply, offset + k.shape[0])

    def _attend_flow(
        self,
        layer: Any,
        q: Any,
        k: Any,
        v: Any,
        start_pos: int | None,
        causal: bool,
        scale: float | None,
        return_lse: bool = False,
        out_dtype: Any = None,
    ) -> Flow[Any]:
        checked = self._check_attend(layer, q, k, v, start_pos, causal, scale, out_dtype)
        layer, like, q, k, v, start_pos, causal, scale, out_dtype = checked
        n = q.shape[0]

        query: dict[str, Any] = {"q": wire.encode_array(q, name="q"), "causal": causal}
        if return_lse:
            query["return_lse"] = True
        if out_dtype is not None:
            query["out_dtype"] = out_dtype
        if scale is not None:
            query["scale"] = scale
        if start_pos is not None:
            query["start_pos"] = start_pos
        if k is None or v is None:  # not fused (both or neither, checked)
            reply = yield from self._client._call("POST", self._path(layer, "attend"), query)
            return self._answer_from(layer, reply, n, like, query)

        offset = yield from self._offset_flow(layer)
        body = dict(query, k=wire.encode_array(k, name="k"), v=wire.encode_array(v, name="v"), offset=offset)
        reply = yield from self._write(layer, "attend", body)
        if not reply.ok:
            length = self._landed_length(layer, reply, offset + k.shape[0])
            # The lost first attempt appended k, v but its output was lost with its
            # answer: attend again, without k, v, at the position that call had.
            query.setdefault("start_pos", length - n)
            reply = yield from self._client._call("POST", self._path(layer, "attend"), query)
        return self._answer_from(layer, reply, n, like, query)

    def _exit_flow(self) -> Flow[None]:
        """The delete at the end of a ``with`` block: a session already gone (deleted
        in the block, or by anyone else) counts as deleted."""
        try:
            yield from self._client._delete_flow(self.session_id)
        except SessionNotFound:
            pass

    def _fork_flow(self, session_id: str | None, length: int | None) -> Flow[SessionInfo]:
        body: dict[str, Any] = {"session_id": _check_session_id(
            new_session_id() if session_id is None else session_id, InvalidRequest)}  # fmt: skip
        if length is not None:
            body["length"] = _int_arg("length", length)
        reply = yield from self._client._call("POST", f"/v1/sessions/{self.session_id}/fork", body)
        if reply.ok:
            return SessionInfo.from_dict(self._client._decode(reply))
        error = reply.error()
        if isinstance(error, SessionExists) and reply.maybe_landed:
            # our own earlier attempt made it: the fork is the session under that id
            return (yield from self._client._get_info_flow(body["session_id"]))
        raise error

    def _answer_from(self, layer: int, reply: _Reply, n: int, like: Any, sent: Mapping[str, Any]) -> Any:
        """The answer to the attend whose members were ``sent``."""
        if not reply.ok:
            raise reply.error()
        body = self._client._decode(reply)
        self._length_from(layer, body, "attend")
        out = decode_out(body, answer_dtype(sent), 3, "attend")
        expected = (n, self._config.num_qo_heads, self._config.head_dim)
        if out.shape != expected:
            raise InvalidResponse(f"attend: expected out of shape {expected}, got {out.shape}")
        return attend_answer(body, out, like, sent, "attend")


# -- synchronous -------------------------------------------------------------------


class Session(_SessionBase["Client"]):
    """One session: a KV cache for every layer of one sequence, on the server.

    Made by :meth:`Client.create_session` or :meth:`Client.get_session`. Arrays go in
    as any float array-like or tensor, in their own dtype when the wire carries it
    (float32, float16, bfloat16) and converted once to float32 otherwise, and come
    out in ``q``'s dtype (or an attend's ``out_dtype``). A session tracks each
    layer's length and sends it as ``offset`` with every append, so a retried append
    never appends twice; drive one layer of a session from one thread at a time.

    A context manager: ``with client.create_session(...) as s:`` deletes the session
    when the block ends, also on an exception (a session already gone by then is no
    error).
    """

    def info(self) -> SessionInfo:
        """Fetch the session's info (and refresh the tracked lengths from it)."""
        return self._client._run(self._info_flow())

    def append(self, layer: int, k: Any, v: Any) -> int:
        """Append ``m`` timesteps to ``layer``; return the layer's new length.

        Args:
            layer: ``0 <= layer < num_layers``.
            k, v: ``[m, num_kv_heads, head_dim]`` float arrays of one dtype, ``m >= 1``, finite.

        Raises:
            LayerNotFound, InvalidRequest: a bad layer or array, refused before sending
                (also an ``InvalidInput``), or by the server: the same class either way.
            OffsetMismatch: the layer's length on the server is not the one tracked
                (another writer); the tracked length is refreshed, nothing appended.
            CapacityExceeded, ...: see :mod:`attnserve_client.errors`.
        """
        return self._client._run(self._append_flow(layer, k, v))

    @overload
    def attend(
        self,
        layer: int,
        q: Any,
        *,
        k: Any = None,
        v: Any = None,
        start_pos: int | None = None,
        causal: bool = True,
        scale: float | None = None,
        return_lse: Literal[False] = False,
        out_dtype: Any = None,
    ) -> np.ndarray: ...

    @overload
    def attend(
        self,
        layer: int,
        q: Any,
        *,
        k: Any = None,
        v: Any = None,
        start_pos: int | None = None,
        causal: bool = True,
        scale: float | None = None,
        return_lse: Literal[True],
        out_dtype: Any = None,
    ) -> Attention: ...

    def attend(
        self,
        layer: int,
        q: Any,
        *,
        k: Any = None,
        v: Any = None,
        start_pos: int | None = None,
        causal: bool = True,
        scale: float | None = None,
        return_lse: bool = False,
        out_dtype: Any = None,
    ) -> Any:
        """Attention of ``q`` over ``layer``'s cache; with ``k``, ``v`` append them first (fused).

        Args:
            layer: ``0 <= layer < num_layers``.
            q: ``[n, num_qo_heads, head_dim]`` float array, ``n >= 1``.
            k, v: ``[m, num_kv_heads, head_dim]``, appended before attending (both or none).
            start_pos: position of q's first row; default ``length - n`` (after any append).
            causal: row ``i`` attends to timesteps ``0..start_pos + i``; else to all.
            scale: softmax scale, default ``1 / sqrt(head_dim)``.
            return_lse: also answer each row's log-sum-exp (see Returns).
            out_dtype: the dtype ``out`` comes back in, default ``q``'s as sent:
                ``"<f4"``/``"float32"``, ``"<f2"``/``"float16"``, ``"bfloat16"``, or a
                numpy or torch dtype of those (``tensors.out_dtype_name``).

        Returns:
            ``[n, num_qo_heads, head_dim]`` in ``out_dtype`` (default ``q``'s: float32,
            float16, or bfloat16 as ``wire.BFLOAT16``, two-byte void that
            ``wire.to_float32`` widens; a tensor when ``q`` is one, see
            :mod:`attnserve_client.tensors`), C-contiguous, read-only (a view of
            the answer's bytes; ``.copy()`` it to write). The layer's length after the
            call is in :attr:`lengths`. With ``return_lse``, :class:`Attention`
            ``(out, lse)``: ``lse [n, num_qo_heads]`` float32, the natural log of the sum
            of ``exp(scale * q . k_t)`` over the timesteps each row attended, what
            :func:`attnserve_client.merge` needs to combine attends over disjoint keys.
        """
        flow = self._attend_flow(layer, q, k, v, start_pos, causal, scale, return_lse, out_dtype)
        return self._client._run(flow)

    def fork(self, session_id: str | None = None, length: int | None = None) -> Session:
        """A new session that starts as this one's first ``length`` timesteps of every
        layer (default: each layer's current length), sharing its full GPU pages.

        Args:
            session_id: the new session's id (default: a fresh random one).
            length: fork every layer at this length (at most each layer's length).

        Raises:
            SessionExists: ``session_id`` is taken. InvalidRequest: ``length`` passes a
                layer's length. OutOfMemory: the budget or a quota (a fork is charged as
                a full copy).
        """
        return Session(self._client, self._client._run(self._fork_flow(session_id, length)))

    def delete(self) -> None:
        """Delete the session and free its GPU memory; raises :class:`SessionNotFound`
        if it is gone already."""
        self._client._run(self._client._delete_flow(self.session_id))

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._client._run(self._exit_flow())


class Client(_BaseClient):
    """Synchronous client of one attnserve server, with one connection pool.

    Args:
        base_url: e.g. ``"http://10.0.0.1:8421"`` (a path prefix is kept); by default
            the environment variable ``ATTNSERVE_BASE_URL``, else
            :data:`DEFAULT_BASE_URL` (``http://127.0.0.1:8421``).
        api_key: sent as ``Authorization: Bearer <api_key>``; by default the
            environment variable ``ATTNSERVE_API_KEY``, else none. Never shown (in
            ``repr``, errors or logs).
        timeout: seconds (or an ``httpx.Timeout``) for every request.
        max_retries: extra attempts after the first, for safe-to-retry failures.
        headers: extra headers for every request.
        transport: an httpx transport for the pool (tests: ``httpx.MockTransport``).
        http_client: an ``httpx.Client`` to use instead of a new one; it is not
            closed by :meth:`close`.
    """

    def __init__(
        self,
        base_url: str | httpx.URL | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(base_url, **options)
        self._http: httpx.Client = self._pool(http_client, transport, httpx.Client)
        self._sleep: Callable[[float], None] = time.sleep
        self._lock = threading.Lock()
        self._threads: ThreadPoolExecutor | None = None  # a batched step's parts, one per replica

    def _run(self, flow: Flow[T]) -> T:
        try:
            op = next(flow)
            while True:
                if isinstance(op, _Sleep):
                    self._sleep(op.seconds)
                    op = flow.send(None)
                    continue
                if isinstance(op, _Parallel):
                    op = flow.send(self._run_parallel(op.flows))
                    continue
                try:
                    response = self._http.request(
                        op.method, op.url, content=op.content, headers=op.headers, timeout=self.timeout
                    )
                except httpx.RequestError as exc:
                    op = flow.throw(exc)
                else:
                    op = flow.send(response)
        except StopIteration as stop:
            result: T = stop.value
            return result

    def create_session(self, **spec: Unpack[SessionSpec]) -> Session:
        """Create a session with ``PUT /v1/sessions/{session_id}``.

        ``session_id``: 1 to 64 of ``[A-Za-z0-9_-]``; by default a fresh random one
        (:func:`new_session_id`). A ``PUT`` is safe to retry (a lost answer to an attempt
        that did create the session is recognised), and a router that pins sessions to
        replicas by their id sends every later call to the same replica.
        ``server_assigned_id=True``: ``POST /v1/sessions`` instead, the server picks
        the id; through a router such a session can land on any replica, and the
        ``POST`` is retried only when it surely did not arrive.
        ``max_tokens`` and ``seed`` default to the server's choice. ``exact_layers``
        (e.g. ``[0, -1]``, negative from the last layer) keeps those layers in
        ``exact_format`` (``"f16"`` unless given) whatever ``kv_format`` says.
        ``sinks`` and ``window`` keep, in every compressed layer, its first ``sinks``
        timesteps and a recent window exact beside the codes (docs/api.md, "Exact
        sinks and window").

        Raises:
            SessionExists: ``session_id`` is taken.
            InvalidRequest: the configuration or ``session_id`` was refused (by the
                server, or before sending: then it is also an ``InvalidInput``).
        """
        info = self._run(self._create_flow(**spec))
        return Session(self, info)

    def get_session(self, session_id: str) -> Session:
        """The existing session ``session_id`` (fetches its info).

        Raises:
            SessionNotFound: no such session for this API key.
        """
        return Session(self, self._run(self._get_info_flow(session_id)))

    def list_sessions(self) -> list[SessionInfo]:
        """Info of every session of this API key."""
        return self._run(self._list_flow())

    def delete_session(self, session_id: str) -> None:
        """Delete session ``session_id``; raises :class:`SessionNotFound` if there is none."""
        self._run(self._delete_flow(session_id))

    def info(self) -> dict[str, Any]:
        """The server's info (``GET /v1/info``): adapter, backend, limits, kv formats, version."""
        return self._run(self._server_info_flow())

    def attend_batch(self, items: list[AttendItem] | list[dict[str, Any]]) -> list[np.ndarray]:
        """A batched step: the attends of many sessions (each an :class:`AttendItem`
        or a dict of its fields) in one request and one GPU submission.

        Returns each item's output, in order. Raises :class:`BatchError` when any item
        failed: its ``results`` hold the outputs of the items that were applied and
        the errors of those that changed nothing."""
        return self._run(self._batch_flow(items))

    def attend_stacked(
        self,
        sessions: Sequence[Any],
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        **options: Unpack[StackedOptions],
    ) -> np.ndarray:
        """A batched step with the arrays stacked, as an engine holds them: item ``i``
        attends ``q[i]`` (with a fused append of ``k[i]``, ``v[i]``) on ``sessions[i]``
        (a session or its id), all on ``layer``. ``q`` is ``[B, n, H, d]`` (``k``,
        ``v``: ``[B, m, Hkv, d]``), or ``[B, H, d]`` (``[B, Hkv, d]``) for one row per
        session; ``offsets`` and ``start_pos`` give one value per session (None: none).

        Returns the outputs stacked in the shape of ``q``. One request, one GPU
        submission; bit-identical to the same attends sent one by one. Raises
        :class:`BatchError` when any item failed (its ``results``: the outputs of the
        items that were applied, the errors of those that changed nothing)."""
        return self._run(self._stacked_flow(sessions, layer, q, k, v, options))

    def open_step(self, sessions: Sequence[Any], **options: Unpack[StepOptions]) -> Step:
        """Open a step over ``sessions`` (sessions or their ids, distinct, of one
        shape, on one server): the server holds it, and each layer call
        (:meth:`Step.call`) carries only ``q``, ``k``, ``v``, answered exactly as
        :meth:`attend_stacked` with the same arrays and options.

        Options (fixed for every call): ``rows`` (default 1: the K/V rows each
        session appends per layer call; 0: none), ``queries`` (query rows; default
        ``rows``, or 1), ``layers`` (the layers it calls, each once a token;
        default all), ``dtype`` of ``q``, ``k``, ``v`` (default ``"<f4"``; also
        ``"<f2"``, ``"bfloat16"`` or a numpy or torch dtype of those), ``causal``,
        ``scale``, ``return_lse``, ``out_dtype``. While the step is open its sessions
        take appends and attends only through it (others raise :class:`SessionInStep`).
        Close it with :meth:`Step.close`, or use it as a context manager. See
        ``docs/client.md``, "Steps".
        """
        return Step(self, self._run(self._step_open_flow(sessions, options)))

    def stream(
        self,
        route: Any = None,
        *,
        transport: str = "websocket",
        frames_address: tuple[str, int] | None = None,
        shm_socket: str | None = None,
        region_bytes: int | None = None,
        copy_outputs: bool = True,
    ) -> Stream:
        """Open a streaming connection: the same operations over one connection,
        pipelined (see :class:`Stream`). Use it as a context manager.

        ``transport="websocket"`` (the default) is ``/v1/stream``. Behind a router of
        several replicas the stream opens one connection per replica as it needs them
        and sends each operation to its session's replica (a batched step is split,
        its answers merged in item order). ``route`` (a session or its id) pins its
        first connection to that session's replica.

        ``transport="frames"`` is the frame transport (``docs/api.md``): plain TCP with
        arrays as raw bytes, the fastest data plane, to one server (no router): at
        ``frames_address`` (host, port), by default the port ``GET /v1/info`` names
        on the host of ``base_url``.

        ``transport="shm"`` is the shared-memory transport (``docs/api.md``), for a
        server on this host: the frames over a Unix socket (``shm_socket``, by default
        the one ``GET /v1/info`` names), the arrays through a memory region of
        ``region_bytes`` both map (default 64 MiB, at most the server's largest). It
        returns a :class:`ShmStream`; ``copy_outputs=False`` answers views of the
        region instead of copies, valid until the stream's next operation is sent."""
        shm = self._run(self._shm_target_flow(transport, frames_address, shm_socket, region_bytes, copy_outputs))
        if shm is not None:
            return ShmStream(self.base_url, shm, self.timeout.connect)
        target = self._run(self._frame_target_flow(transport, frames_address))
        return Stream(
            self.base_url,
            self._stream_headers(route),
            self.timeout.connect,
            lambda ids: self._run(self._places_flow(ids)),
            frames=target,
        )

    def health(self) -> bool:
        """Whether the server process is up (``/livez`` answers 2xx); no retries.

        Raises:
            APIConnectionError: no answer.
        """
        return self._run(self._probe_flow("/livez"))

    def ready(self) -> bool:
        """Whether the server is ready for work (``/readyz`` answers 2xx); no retries.

        Raises:
            APIConnectionError: no answer.
        """
        return self._run(self._probe_flow("/readyz"))

    def _run_parallel(self, flows: list[Any]) -> list[Any]:
        """Run ``flows`` at once: the first on this thread, the others on the client's
        threads (made on first use: a step split over replicas); each one's result or
        exception, in order."""
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(16, thread_name_prefix="attnserve-client")
            threads = self._threads
        others = [threads.submit(self._run, f) for f in flows[1:]]
        try:
            first: Any = self._run(flows[0])
        except Exception as exc:
            first = exc
        return [first, *(f.exception() or f.result() for f in others)]

    def close(self) -> None:
        """Close the connection pool (unless it was passed in as ``http_client``)."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# -- asynchronous ------------------------------------------------------------------


class AsyncSession(_SessionBase["AsyncClient"]):
    """:class:`Session` for :class:`AsyncClient`: the same methods, awaitable; an async
    context manager (``async with await client.create_session(...) as s:`` deletes
    it when the block ends)."""

    async def info(self) -> SessionInfo:
        """See :meth:`Session.info`."""
        return await self._client._run(self._info_flow())

    async def append(self, layer: int, k: Any, v: Any) -> int:
        """See :meth:`Session.append`."""
        return await self._client._run(self._append_flow(layer, k, v))

    @overload
    async def attend(
        self,
        layer: int,
        q: Any,
        *,
        k: Any = None,
        v: Any = None,
        start_pos: int | None = None,
        causal: bool = True,
        scale: float | None = None,
        return_lse: Literal[False] = False,
        out_dtype: Any = None,
    ) -> np.ndarray: ...

    @overload
    async def attend(
        self,
        layer: int,
        q: Any,
        *,
        k: Any = None,
        v: Any = None,
        start_pos: int | None = None,
        causal: bool = True,
        scale: float | None = None,
        return_lse: Literal[True],
        out_dtype: Any = None,
    ) -> Attention: ...

    async def attend(
        self,
        layer: int,
        q: Any,
        *,
        k: Any = None,
        v: Any = None,
        start_pos: int | None = None,
        causal: bool = True,
        scale: float | None = None,
        return_lse: bool = False,
        out_dtype: Any = None,
    ) -> Any:
        """See :meth:`Session.attend`."""
        flow = self._attend_flow(layer, q, k, v, start_pos, causal, scale, return_lse, out_dtype)
        return await self._client._run(flow)

    async def fork(self, session_id: str | None = None, length: int | None = None) -> AsyncSession:
        """See :meth:`Session.fork`."""
        return AsyncSession(self._client, await self._client._run(self._fork_flow(session_id, length)))

    async def delete(self) -> None:
        """See :meth:`Session.delete`."""
        await self._client._run(self._client._delete_flow(self.session_id))

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._client._run(self._exit_flow())


class AsyncClient(_BaseClient):
    """Asynchronous client: :class:`Client`'s arguments and methods, awaitable.

    ``http_client`` is an ``httpx.AsyncClient`` and ``transport`` an
    ``httpx.AsyncBaseTransport``.
    """

    def __init__(
        self,
        base_url: str | httpx.URL | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(base_url, **options)
        self._http: httpx.AsyncClient = self._pool(http_client, transport, httpx.AsyncClient)
        self._sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    async def _run(self, flow: Flow[T]) -> T:
        try:
            op = next(flow)
            while True:
                if isinstance(op, _Sleep):
                    await self._sleep(op.seconds)
                    op = flow.send(None)
                    continue
                if isinstance(op, _Parallel):
                    op = flow.send(list(await asyncio.gather(*map(self._run, op.flows), return_exceptions=True)))
                    continue
                try:
                    response = await self._http.request(
                        op.method, op.url, content=op.content, headers=op.headers, timeout=self.timeout
                    )
                except httpx.RequestError as exc:
                    op = flow.throw(exc)
                else:
                    op = flow.send(response)
        except StopIteration as stop:
            result: T = stop.value
            return result

    async def create_session(self, **spec: Unpack[SessionSpec]) -> AsyncSession:
        """See :meth:`Client.create_session`."""
        info = await self._run(self._create_flow(**spec))
        return AsyncSession(self, info)

    async def get_session(self, session_id: str) -> AsyncSession:
        """See :meth:`Client.get_session`."""
        return AsyncSession(self, await self._run(self._get_info_flow(session_id)))

    async def list_sessions(self) -> list[SessionInfo]:
        """See :meth:`Client.list_sessions`."""
        return await self._run(self._list_flow())

    async def delete_session(self, session_id: str) -> None:
        """See :meth:`Client.delete_session`."""
        await self._run(self._delete_flow(session_id))

    async def info(self) -> dict[str, Any]:
        """See :meth:`Client.info`."""
        return await self._run(self._server_info_flow())

    async def attend_batch(self, items: list[AttendItem] | list[dict[str, Any]]) -> list[np.ndarray]:
        """As :meth:`Client.attend_batch`."""
        return await self._run(self._batch_flow(items))

    async def attend_stacked(
        self,
        sessions: Sequence[Any],
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        **options: Unpack[StackedOptions],
    ) -> np.ndarray:
        """As :meth:`Client.attend_stacked`."""
        return await self._run(self._stacked_flow(sessions, layer, q, k, v, options))

    async def open_step(self, sessions: Sequence[Any], **options: Unpack[StepOptions]) -> AsyncStep:
        """As :meth:`Client.open_step`: an :class:`AsyncStep`."""
        return AsyncStep(self, await self._run(self._step_open_flow(sessions, options)))

    def stream(
        self,
        route: Any = None,
        *,
        transport: str = "websocket",
        frames_address: tuple[str, int] | None = None,
        shm_socket: str | None = None,
        region_bytes: int | None = None,
        copy_outputs: bool = True,
    ) -> AsyncStreamOpening:
        """Open a streaming connection; concurrent awaits of its methods pipeline on
        it. ``async with client.stream() as s: ...`` closes it on exit;
        ``s = await client.stream()`` leaves closing it to the caller. ``route``,
        ``transport``, ``frames_address``, ``shm_socket``, ``region_bytes``,
        ``copy_outputs``: as for :meth:`Client.stream` (``"shm"`` opens an
        :class:`AsyncShmStream`)."""
        headers = self._stream_headers(route)

        async def open_stream() -> AsyncStream:
            flow = self._shm_target_flow(transport, frames_address, shm_socket, region_bytes, copy_outputs)
            shm = await self._run(flow)
            if shm is not None:
                return await AsyncShmStream.open_shm(self.base_url, shm, self.timeout.connect)
            target = await self._run(self._frame_target_flow(transport, frames_address))
            return await AsyncStream.open(
                self.base_url,
                headers,
                self.timeout.connect,
                lambda ids: self._run(self._places_flow(ids)),
                frames=target,
            )

        return AsyncStreamOpening(open_stream)

    async def health(self) -> bool:
        """See :meth:`Client.health`."""
        return await self._run(self._probe_flow("/livez"))

    async def ready(self) -> bool:
        """See :meth:`Client.ready`."""
        return await self._run(self._probe_flow("/readyz"))

    async def close(self) -> None:
        """Close the connection pool (unless it was passed in as ``http_client``)."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
