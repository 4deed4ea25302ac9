"""One logical session spread over several servers by timestep ranges.

:class:`ShardedSession` (and :class:`AsyncShardedSession`, the same awaitable)
holds one sequence's KV cache as consecutive *shards*: ordinary server sessions,
each holding a range of timesteps of every layer, on the replicas given as a list
of clients (one per server, or the same router several times). A context longer
than one server holds, or one spread so that its attention runs on several GPUs at
once, is used like one :class:`~attnserve_client.Session`::

    with ShardedSession.create([Client(a), Client(b)], num_qo_heads=32, num_kv_heads=8,
                               head_dim=128, num_layers=32, shard_tokens=32768) as s:
        s.append(0, k, v)                       # new rows go to the last shard
        out = s.attend(0, q, k=k1, v=v1)        # every shard at once, merged

Design, as a production user expects it:

* **Shards.** Shard ``j`` is the server session ``{session_id}-s{j}`` (so it is an
  ordinary session: visible in ``GET /v1/sessions``, created with a ``PUT`` that is
  safe to retry, pinned by a router like any other). Every shard has the logical
  session's configuration and seed (``seed`` when given, else the one the server
  chose for shard 0): a row compresses identically in whichever shard it lands.
  ``shard_tokens`` is each shard's ``max_tokens`` (default: the server's
  ``max_tokens`` for the shape); ``max_tokens`` is the logical session's cap per
  layer (default: none, as many shards as the replicas hold).
* **Placement: round robin.** Shard 0 goes to the replica the logical id hashes to
  (so many sessions' first shards spread evenly), each next shard to the replica
  after its predecessor's, skipping one that refuses it (``507``: its memory budget,
  session limit or quota) or does not answer. Round robin needs no extra round
  trip, puts a long session's shards on different GPUs (so an attend's shard calls
  run in parallel there) and is deterministic; least-loaded placement would need a
  ``/v1/info`` of every replica per shard opened, reads memory that lags the pages
  already reserved, and herds concurrent sessions onto the same replica.
* **Appends** go to the last shard; the rows that do not fit close it and go to
  the next one (one append may be split over shards). A shard *fills* when a layer
  reaches ``shard_tokens`` or when its server refuses the rows with ``507
  out-of-memory`` (its budget): it is closed (no layer appends to it again) and the
  rows go to a new shard on the next replica. Ranges are kept **per layer**: a
  layer's shard ``j`` holds the timesteps from where its shard ``j - 1`` ends, so
  layers appended differently stay correct; an engine that appends the same rows to
  every layer (the usual case) gets the same borders on every layer.
* **Attends** run on every shard holding a timestep some query row can see, all at
  once (threads for :class:`ShardedSession`, ``asyncio.gather`` for
  :class:`AsyncShardedSession`), each with ``return_lse=True`` and
  ``out_dtype="<f4"``, and the parts are merged exactly on the host
  (:func:`attnserve_client.merge.merge`), then rounded once to the dtype the
  attend answers in (``out_dtype``, default ``q``'s). A fused append (``k``,
  ``v``) rides on the last shard's call when the rows fit in it; otherwise (a
  border crossed) the rows are appended first. Across borders, for a shard
  holding ``[a, b)`` and query rows at positions ``p = start_pos + i``: causal
  rows with ``p < a`` see nothing of it (left out of its call), rows with
  ``a <= p < b`` a causal prefix (local ``start_pos = p - a``), rows with ``p >= b``
  the whole shard (a non-causal call; split into calls of at most ``b - a`` rows,
  since the server requires ``start_pos + n <= length``); non-causal attends see
  every shard whole. Cost: one round trip per shard, in parallel (two on a shard
  that some rows see whole and others in part), and the merge on the host.
* **Re-attaching.** :meth:`ShardedSession.open` finds an existing sharded session
  from its id alone (after a restart, or in another process): it asks every replica
  for shard ``j`` at once, ``j = 0, 1, ...`` up to the first shard none holds, and
  rebuilds the shards from their info (lengths per layer, capacity; every shard but
  the last closed, so appends go on in the last one). It never settles for part of
  the session: a replica that does not answer raises :class:`ShardLost` (it might
  hold a shard), as does a missing shard followed by a present one; a shard on two
  replicas, or one whose configuration differs from shard 0's, raises
  :class:`~attnserve_client.InvalidResponse`.
* **Failures.** A shard whose server does not answer (connection refused, reset,
  timeout, after the client's retries), no longer has it (``404`` after a restart
  without a snapshot directory) or is draining (``503 not-ready``) raises
  :class:`ShardLost`, naming every such shard (its session id, its timesteps of
  the layer, its server's URL), after all the round's calls are done: an answer is
  never made from the other shards alone. Other errors are raised as a
  :class:`~attnserve_client.Session` raises them. A fused append whose shard call
  succeeded stays appended when another shard's call fails: check :attr:`lengths`
  before sending the rows again.

Not supported: ``sinks`` and ``window`` (their exact rows are defined by positions
in one session's layer), a server-assigned id. numpy in and out; torch tensors in,
tensors out as the queries were given (on their device, in their dtype).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from . import tensors, wire
from ._client import AsyncClient, Client, SessionSpec, _check_session_id, _int_arg, new_session_id
from ._steps import as_given
from .errors import (
    APIConnectionError,
    AttnServeError,
    CapacityExceeded,
    InvalidInput,
    InvalidRequest,
    InvalidResponse,
    NotReady,
    OutOfMemory,
    SessionNotFound,
    refused,
)
from .merge import merge

if TYPE_CHECKING:  # annotations only
    from typing_extensions import Unpack

__all__ = [
    "AsyncShardedSession",
    "ShardCall",
    "ShardLost",
    "ShardRef",
    "ShardView",
    "ShardedSession",
    "plan_attend",
]

T = TypeVar("T")

#: Errors that mean a shard cannot answer: its server is gone, or no longer has it.
_LOST = (APIConnectionError, SessionNotFound, NotReady)
#: The longest logical id: shard ids add ``-s`` and the shard's number.
_MAX_ID = 56
#: What every shard of a re-opened session must share with shard 0.
_SAME_CONFIG = ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "layer_formats", "seed", "sinks", "window")


def _replica_key(client: Any) -> tuple[str, str | None]:
    """Which server and tenant a client reaches: its URL and API key."""
    return client.base_url, client._api_key


# -- planning: which query rows each shard answers, and how -------------------------


@dataclass(frozen=True)
class ShardCall:
    """One attend of query rows ``rows_start:rows_stop`` on shard ``shard``, at the
    shard's local ``start_pos``, causal or over the whole shard."""

    shard: int
    rows_start: int
    rows_stop: int
    start_pos: int
    causal: bool


def plan_attend(spans: Sequence[tuple[int, int]], start_pos: int, n: int, causal: bool) -> list[ShardCall]:
    """The shard calls of an attend of ``n`` query rows at positions ``start_pos ..
    start_pos + n - 1`` over shards holding timesteps ``spans[j] = (a, b)`` (``[a, b)``
    of the layer, consecutive; empty ones are skipped).

    Causal: rows before ``a`` see nothing of a shard; rows in ``[a, b)`` a causal
    prefix of it (local position ``p - a``); rows from ``b`` on all of it, as
    non-causal calls of at most ``b - a`` rows (the server's ``start_pos + n <=
    length``). Non-causal: every row sees every shard whole. Every call keeps
    ``0 <= start_pos`` and ``start_pos + rows <= b - a``."""
    calls: list[ShardCall] = []

    def whole(j: int, lo: int, hi: int, size: int) -> None:
        for first in range(lo, hi, size):
            last = min(hi, first + size)
            calls.append(ShardCall(j, first, last, size - (last - first), False))

    for j, (a, b) in enumerate(spans):
        size = b - a
        if size <= 0:
            continue
        if not causal:
            whole(j, 0, n, size)
            continue
        sees = min(n, max(0, a - start_pos))  # the first row at a position >= a
        sees_all = min(n, max(0, b - start_pos))  # the first row at a position >= b
        if sees < sees_all:
            calls.append(ShardCall(j, sees, sees_all, start_pos + sees - a, True))
        whole(j, max(sees, sees_all), n, size)
    return calls


# -- errors and views ----------------------------------------------------------------


@dataclass(frozen=True)
class ShardRef:
    """Which shard: its index, its server session's id, its server's URL, and the
    timesteps ``[start, end)`` of ``layer`` it holds (``None``: not known)."""

    index: int
    session_id: str
    base_url: str
    layer: int | None = None
    start: int | None = None
    end: int | None = None

    def __str__(self) -> str:
        where = f"shard {self.index} ({self.session_id} on {self.base_url}"
        if self.layer is not None and self.start is not None:
            where += f", timesteps [{self.start}, {self.end}) of layer {self.layer}"
        return where + ")"


class ShardLost(AttnServeError):
    """Shards of a sharded session could not answer: their server did not answer
    (connection refused, reset or timed out after the retries), no longer holds the
    session (404 after a restart without snapshots) or is draining (503). Nothing was
    answered from the other shards.

    Attributes:
        shards: the :class:`ShardRef` of each shard that failed.
        errors: the error of each, in the same order (the first is ``__cause__``).
    """

    def __init__(self, session_id: str, shards: Sequence[ShardRef], errors: Sequence[BaseException]) -> None:
        self.session_id = session_id
        self.shards = tuple(shards)
        self.errors = tuple(errors)
        what = "; ".join(f"{ref}: {type(e).__name__}: {e}" for ref, e in zip(self.shards, self.errors))
        super().__init__(f"sharded session {session_id}: {len(self.shards)} shard(s) unavailable: {what}")

    @property
    def shard(self) -> ShardRef:
        """The first shard that failed."""
        return self.shards[0]


@dataclass(frozen=True)
class ShardView:
    """One shard as the sharded session knows it: its server session's id, its
    server's URL, its capacity per layer, whether it is closed to appends, and per
    layer the timesteps ``(start, end)`` it holds (``None``: a length not known now)."""

    index: int
    session_id: str
    base_url: str
    capacity: int
    closed: bool
    spans: tuple[tuple[int, int] | None, ...]


@dataclass
class _Shard:
    index: int
    replica: int  # index into the clients
    session: Any  # a Session or an AsyncSession
    capacity: int
    closed: bool = False
    seen: dict[int, int] = field(default_factory=dict)  # each layer's length as last known

    def length(self, layer: int) -> int | None:
        """The layer's length (None: not known now, an answer was lost)."""
        length: int | None = self.session.lengths[layer]
        if length is not None:
            self.seen[layer] = length
        return length


@dataclass(frozen=True)
class _Call:
    """One call of a shard's session (or of a client) that a driver performs."""

    target: Any
    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


# A flow yields the calls to make at once; the driver sends back each one's result or
# the exception it raised, in order.
Flow = Generator[list[_Call], list[Any], T]


def _merge_calls(shape: tuple[int, ...], calls: list[ShardCall], results: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The attention of queries of ``shape`` over every shard, from each call's
    ``(out, lse)``: per shard its rows' parts (lse ``-inf`` for the rows that see
    nothing of it), merged."""
    parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for call, (out, lse) in zip(calls, results):
        if call.shard not in parts:
            parts[call.shard] = (np.zeros(shape, np.float32), np.full(shape[:-1], -np.inf, np.float32))
        parts[call.shard][0][call.rows_start : call.rows_stop] = out
        parts[call.shard][1][call.rows_start : call.rows_stop] = lse
    if len(parts) == 1:  # one shard answered every row (the first one holding keys always does)
        return next(iter(parts.values()))
    merged = merge(list(parts.values()))
    return merged.out, merged.lse


def _open_spec(session_id: Any, max_tokens: int | None) -> dict[str, Any]:
    """What :meth:`ShardedSession.open` knows of the session before asking: its id
    (one the servers could hold, else :class:`SessionNotFound` before sending) and cap."""
    return {"session_id": _check_session_id(session_id), "max_tokens": max_tokens}


class _ShardedBase:
    """What :class:`ShardedSession` and :class:`AsyncShardedSession` share: the shards,
    the checks and the flows (the drivers differ only in how calls run at once)."""

    def __init__(self, clients: Sequence[Any], spec: dict[str, Any], shard_tokens: int | None) -> None:
        self._clients = list(clients)
        if not self._clients:
            raise InvalidInput("clients: expected at least one client")
        spec = dict(spec)
        if spec.pop("server_assigned_id", False):
            raise InvalidInput("server_assigned_id: a sharded session names its shards after its own id")
        for name in ("sinks", "window"):
            if spec.get(name):
                raise InvalidInput(f"{name}: not supported by sharded sessions (exact rows are per session)")
        session_id = spec.pop("session_id", None)
        if session_id is None:
            session_id = new_session_id()
        if not isinstance(session_id, str) or not 1 <= len(session_id) <= _MAX_ID:
            raise refused(InvalidRequest, f"session_id: expected 1 to {_MAX_ID} of [A-Za-z0-9_-], got {session_id!r}")
        self.session_id: str = session_id
        max_tokens = spec.pop("max_tokens", None)
        self.max_tokens: int | None = None if max_tokens is None else _int_arg("max_tokens", max_tokens)
        if shard_tokens is not None:
            shard_tokens = _int_arg("shard_tokens", shard_tokens)
            if shard_tokens < 1:
                raise InvalidInput(f"shard_tokens: expected an int >= 1, got {shard_tokens}")
        self.shard_tokens: int | None = shard_tokens
        self._spec = spec
        self._shards: list[_Shard] = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.session_id!r}, shards={len(self._shards)}, lengths={self.lengths})"

    # -- views -------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        n: int = self._shards[0].session._config.num_layers
        return n

    @property
    def lengths(self) -> tuple[int | None, ...]:
        """Each layer's length over all shards, as last seen (``None``: not known now)."""
        return tuple(self._total(layer) for layer in range(self.num_layers))

    @property
    def shards(self) -> tuple[ShardView, ...]:
        """The shards, in timestep order."""
        spans = [self._spans(layer) for layer in range(self.num_layers)]
        return tuple(
            ShardView(
                s.index,
                s.session.session_id,
                self._clients[s.replica].base_url,
                s.capacity,
                s.closed,
                tuple(None if per_layer is None else per_layer[s.index] for per_layer in spans),
            )
            for s in self._shards
        )

    def _total(self, layer: int) -> int | None:
        lengths = [s.length(layer) for s in self._shards]
        return None if None in lengths else sum(x for x in lengths if x is not None)

    def _spans(self, layer: int, grow: tuple[int, int] | None = None) -> list[tuple[int, int]] | None:
        """Per shard its timesteps ``[a, b)`` of ``layer``; ``grow = (j, m)``: as they
        will be once ``m`` rows are appended to shard ``j``."""
        spans, start = [], 0
        for s in self._shards:
            length = s.length(layer)
            if length is None:
                return None
            if grow is not None and grow[0] == s.index:
                length += grow[1]
            spans.append((start, start + length))
            start += length
        return spans

    def _ref(self, shard: _Shard, layer: int | None) -> ShardRef:
        """``shard`` named for an error: its timesteps of ``layer`` as last known."""
        url = self._clients[shard.replica].base_url
        if layer is None:
            return ShardRef(shard.index, shard.session.session_id, url)
        for s in self._shards[: shard.index + 1]:
            s.length(layer)  # notes it when it is known
        start = sum(s.seen.get(layer, 0) for s in self._shards[: shard.index])
        return ShardRef(shard.index, shard.session.session_id, url, layer, start, start + shard.seen.get(layer, 0))

    # -- checks ------------------------------------------------------------------

    def _check_room(self, layer: int, m: int) -> None:
        total = self._total(layer)
        if self.max_tokens is not None and total is not None and total + m > self.max_tokens:
            raise refused(
                CapacityExceeded,
                f"layer {layer}: {m} rows would take it from {total} past max_tokens {self.max_tokens}",
            )

    def _target(self, layer: int) -> int | None:
        """The shard the next rows of ``layer`` go to: the layer's last shard holding
        rows if it is open and has room, else the next open one (None: open one)."""
        held = [s.index for s in self._shards if s.length(layer)]
        for s in self._shards[(held[-1] if held else 0) :]:
            length = s.length(layer)
            if not s.closed and length is not None and length < s.capacity:
                return s.index
        return None

    def _raise_failed(self, calls: list[_Call], results: list[Any], layer: int | None) -> None:
        """Raise :class:`ShardLost` naming every shard that could not answer, else the
        first other error of ``results``; nothing when every call succeeded."""
        lost: dict[int, tuple[ShardRef, BaseException]] = {}
        other: BaseException | None = None
        for call, result in zip(calls, results):
            if not isinstance(result, BaseException):
                continue
            shard = next((s for s in self._shards if s.session is call.target), None)
            if shard is not None and isinstance(result, _LOST):
                lost.setdefault(shard.index, (self._ref(shard, layer), result))
            elif other is None:
                other = result
        if lost:
            refs, errors = zip(*(lost[i] for i in sorted(lost)))
            raise ShardLost(self.session_id, refs, errors) from errors[0]
        if other is not None:
            raise other

    # -- flows -------------------------------------------------------------------

    def _next_replica(self) -> int:
        """The replica the next shard goes to first: the one after the last shard's,
        or for shard 0 the one the logical id hashes to."""
        turn = (self._shards[-1].replica + 1) if self._shards else zlib.crc32(self.session_id.encode())
        return turn % len(self._clients)

    def _open_flow(self) -> Flow[_Shard]:
        """Create the next shard on the next replica in turn, skipping replicas that
        refuse it (507) or do not answer; raise the last error when all of them did."""
        index, count = len(self._shards), len(self._clients)
        first = self._next_replica()
        spec = dict(self._spec, session_id=f"{self.session_id}-s{index}", max_tokens=self.shard_tokens)
        error: BaseException | None = None
        for turn in range(count):
            replica = (first + turn) % count
            [result] = yield [_Call(self._clients[replica], "create_session", kwargs=spec)]
            if isinstance(result, (OutOfMemory, APIConnectionError, NotReady)):
                error = result
                continue
            if isinstance(result, BaseException):
                raise result
            capacity = result._config.max_tokens or self.shard_tokens
            if capacity is None:
                raise InvalidResponse(f"create {spec['session_id']}: the server gave no max_tokens")
            if not self._shards:  # every later shard: the first one's capacity and seed
                self.shard_tokens = capacity
                self._spec["seed"] = result._config.seed
            shard = _Shard(index, replica, result, capacity)
            self._shards.append(shard)
            return shard
        assert error is not None
        raise error

    def _reopen_flow(self) -> Flow[None]:
        """Find the shards ``{session_id}-s{j}``, j = 0, 1, ... up to the first one that
        no replica holds (every replica asked for each at once), and rebuild the shards
        from their info: the last one open to appends, the others closed."""
        # One question per replica: clients of the same server and API key are one.
        askers: dict[tuple[str, str | None], int] = {}
        for i, client in enumerate(self._clients):
            askers.setdefault(_replica_key(client), i)
        asked = list(askers.values())
        while True:
            index = len(self._shards)
            session, answers = yield from self._find_flow(asked, index)
            if session is None:
                break
            # Its replica: the first client of its server from where round robin put
            # it unless it skipped (the same index as created, a client given twice too).
            key, first, count = _replica_key(session._client), self._next_replica(), len(self._clients)
            turns = ((first + turn) % count for turn in range(count))
            replica = next(r for r in turns if _replica_key(self._clients[r]) == key)
            self._shards.append(self._rebuilt(index, replica, session))
        if not self._shards:
            error = SessionNotFound(
                f"sharded session {self.session_id}: no replica holds its shard 0 ({self.session_id}-s0)",
                status=404,
                problem={"type": f"/problems/{SessionNotFound.slug}", "detail": f"{self.session_id}-s0 not found"},
            )
            raise error from next((a for a in answers if isinstance(a, SessionNotFound)), None)
        # A shard lost (its server restarted without snapshots) must not end the list
        # silently: the one after it, anywhere, says so.
        after, _ = yield from self._find_flow(asked, index + 1)
        if after is not None:
            expected = self._next_replica()
            lost = ShardRef(index, f"{self.session_id}-s{index}", self._clients[expected].base_url)
            gone = answers[asked.index(askers[_replica_key(self._clients[expected])])]
            raise ShardLost(self.session_id, [lost], [gone]) from gone
        for shard in self._shards[:-1]:
            shard.closed = True
        config = self._shards[0].session._config  # what a new shard is created with
        self._spec = {
            "num_qo_heads": config.num_qo_heads,
            "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "num_layers": config.num_layers,
            "kv_format": config.kv_format if isinstance(config.kv_format, str) else list(config.kv_format),
            "seed": config.seed,
        }

    def _find_flow(self, asked: list[int], index: int) -> Flow[tuple[Any, list[Any]]]:
        """Ask the clients ``asked`` for shard ``index`` at once: its session (None: on
        none of them) and every answer. Raises :class:`ShardLost` naming each replica
        that did not answer (it might hold the shard), ``InvalidResponse`` when two
        hold it, any other error as it came."""
        shard_id = f"{self.session_id}-s{index}"
        answers = yield [_Call(self._clients[i], "get_session", (shard_id,)) for i in asked]
        refs, errors, holders = [], [], []
        for i, answer in zip(asked, answers):
            if isinstance(answer, (APIConnectionError, NotReady)):
                refs.append(ShardRef(index, shard_id, self._clients[i].base_url))
                errors.append(answer)
            elif isinstance(answer, InvalidInput) or (
                isinstance(answer, BaseException) and not isinstance(answer, SessionNotFound)
            ):
                raise answer
            elif not isinstance(answer, BaseException):
                holders.append(answer)
        if errors:
            raise ShardLost(self.session_id, refs, errors) from errors[0]
        if len(holders) > 1:
            where = " and ".join(h._client.base_url for h in holders)
            raise InvalidResponse(f"sharded session {self.session_id}: shard {index} ({shard_id}) is on {where}")
        return (holders[0] if holders else None), answers

    def _rebuilt(self, index: int, replica: int, session: Any) -> _Shard:
        """Shard ``index`` from its session, checked against shard 0's configuration."""
        info = session._config
        what = f"sharded session {self.session_id}: shard {index} ({info.session_id})"
        if index == 0 and (info.sinks or info.window):
            raise InvalidResponse(f"{what} has sinks or a window, which sharded sessions do not support")
        if index > 0:
            first = self._shards[0].session._config
            for name in _SAME_CONFIG:
                if getattr(info, name) != getattr(first, name):
                    raise InvalidResponse(
                        f"{what}: {name} {getattr(info, name)!r}, shard 0's is {getattr(first, name)!r}"
                    )
        if self.shard_tokens is None and index == 0:
            self.shard_tokens = info.max_tokens  # later shards: the first one's size, as created
        capacities = [c for c in (self.shard_tokens, info.max_tokens) if c is not None]
        if not capacities:
            raise InvalidResponse(f"{what}: the server gave no max_tokens (give shard_tokens)")
        return _Shard(index, replica, session, min(capacities))

    def _known_flow(self, layer: int) -> Flow[None]:
        """Ask the shards whose length of ``layer`` is not known (an answer was lost)."""
        unknown = [s for s in self._shards if s.length(layer) is None]
        if unknown:
            calls = [_Call(s.session, "info") for s in unknown]
            self._raise_failed(calls, (yield calls), layer)

    def _append_flow(self, layer: int, k: np.ndarray, v: np.ndarray) -> Flow[int]:
        """Append ``k``, ``v`` to ``layer``: into its last shard while it has room, the
        rest into the next ones (opened as needed); a shard whose server refuses the
        rows for memory (507) is closed and the rows go on to the next shard."""
        m, done, refusals = k.shape[0], 0, 0
        while done < m:
            index = self._target(layer)
            shard = (yield from self._open_flow()) if index is None else self._shards[index]
            length = shard.length(layer)
            assert length is not None
            take = min(m - done, shard.capacity - length)
            calls = [_Call(shard.session, "append", (layer, k[done : done + take], v[done : done + take]))]
            results = yield calls
            if isinstance(results[0], OutOfMemory):
                shard.closed = True
                refusals += 1
                if refusals >= len(self._clients):
                    raise results[0]
                continue
            self._raise_failed(calls, results, layer)
            done, refusals = done + take, 0
        total = self._total(layer)
        assert total is not None
        return total

    def _checked_append_flow(self, layer: Any, k: Any, v: Any) -> Flow[int]:
        first = self._shards[0].session
        layer = first._check_layer(layer)
        k, v = first._check_pair(k, v)
        yield from self._known_flow(layer)
        self._check_room(layer, k.shape[0])
        return (yield from self._append_flow(layer, k, v))

    def _attend_flow(
        self,
        layer: Any,
        q: Any,
        k: Any,
        v: Any,
        start_pos: int | None,
        causal: bool,
        scale: float | None,
        return_lse: bool,
        out_dtype: Any,
    ) -> Flow[Any]:
        checked = self._shards[0].session._check_attend(layer, q, k, v, start_pos, causal, scale, out_dtype)
        layer, like, q, k, v, start_pos, causal, scale, out_dtype = checked
        n = q.shape[0]
        fused = k is not None

        yield from self._known_flow(layer)
        m = k.shape[0] if fused else 0
        self._check_room(layer, m)
        total = self._total(layer)
        assert total is not None
        length = total + m
        if start_pos is None:
            start_pos = length - n
        if start_pos < 0 or start_pos + n > length:
            raise refused(InvalidRequest, f"start_pos {start_pos} + {n} rows: past the layer's length {length}")

        # The fused rows ride on their shard's call when they all fit in the layer's
        # last shard and that shard gets at most one call; else they go first.
        into = self._target(layer) if fused else None
        if into is not None and m > self._shards[into].capacity - (self._shards[into].length(layer) or 0):
            into = None
        calls: list[ShardCall] = []
        if into is not None:
            spans = self._spans(layer, (into, m))
            assert spans is not None
            calls = plan_attend(spans, start_pos, n, causal)
            if sum(c.shard == into for c in calls) > 1:
                into = None
        if fused and into is None:
            yield from self._append_flow(layer, k, v)
        while True:
            if into is None:
                spans = self._spans(layer)
                assert spans is not None
                calls = plan_attend(spans, start_pos, n, causal)
            sent = [self._shard_call(layer, q, c, scale, (k, v) if c.shard == into else None) for c in calls]
            if into is not None and not any(c.shard == into for c in calls):
                sent.append(_Call(self._shards[into].session, "append", (layer, k, v)))
            results = yield sent
            if into is not None:
                landed = results[[c.target for c in sent].index(self._shards[into].session)]
                if isinstance(landed, OutOfMemory):  # its server is full: close it, append elsewhere
                    self._shards[into].closed = True
                    into = None
                    yield from self._append_flow(layer, k, v)
                    continue
            self._raise_failed(sent, results, layer)
            break

        out, lse = _merge_calls(q.shape, calls, results)  # float32: the shards answer float32
        out = tensors.to_wire_dtype(out, out_dtype or wire.dtype_name(q))  # as one session answers
        return as_given(out, lse if return_lse else None, like, out_dtype)

    def _shard_call(
        self, layer: int, q: np.ndarray, call: ShardCall, scale: float | None, kv: tuple[Any, Any] | None
    ) -> _Call:
        # float32 parts: merged in float32 (float64 on the host), rounded once at the end
        kwargs: dict[str, Any] = {
            "start_pos": call.start_pos, "causal": call.causal, "return_lse": True, "out_dtype": wire.DTYPE,
        }  # fmt: skip
        if scale is not None:
            kwargs["scale"] = scale
        if kv is not None:
            kwargs["k"], kwargs["v"] = kv
        return _Call(self._shards[call.shard].session, "attend", (layer, q[call.rows_start : call.rows_stop]), kwargs)

    def _delete_flow(self) -> Flow[None]:
        """Delete every shard at once; one already gone (404) counts as deleted."""
        calls = [_Call(s.session, "delete") for s in self._shards]
        results = yield calls
        results = [None if isinstance(r, SessionNotFound) else r for r in results]
        self._raise_failed(calls, results, None)


class ShardedSession(_ShardedBase):
    """One logical session over several servers' sessions (see the module's docs):
    the methods of a :class:`~attnserve_client.Session`, its calls to the shards made
    at once on threads of its own. Made by :meth:`create`, or found again by
    :meth:`open`; a context manager that deletes every shard on exit."""

    def __init__(self, clients: Sequence[Client], spec: dict[str, Any], shard_tokens: int | None) -> None:
        super().__init__(clients, spec, shard_tokens)
        self._threads: ThreadPoolExecutor | None = None

    @classmethod
    def create(
        cls, clients: Sequence[Client], *, shard_tokens: int | None = None, **spec: Unpack[SessionSpec]
    ) -> ShardedSession:
        """Create a sharded session (its first shard now, the others as rows need them).

        Args:
            clients: one :class:`~attnserve_client.Client` per replica (a client may
                appear several times: a router in front of them, or weights).
            shard_tokens: timesteps per shard and layer (each shard's ``max_tokens``);
                default: the server's ``max_tokens`` for the shape.
            spec: as :meth:`Client.create_session`; ``session_id`` (at most 56 of
                ``[A-Za-z0-9_-]``, default a fresh one) names the shards
                ``{session_id}-s{j}``; ``max_tokens`` caps the logical session's
                length per layer (default: none); ``seed`` (default: the server's
                choice for shard 0) is every shard's.

        Raises:
            InvalidInput: ``sinks``, ``window`` or ``server_assigned_id``, or an
                argument refused before sending.
            InvalidRequest, ...: the first shard's creation was refused.
        """
        session = cls(clients, dict(spec), shard_tokens)
        session._run(session._open_flow())
        return session

    @classmethod
    def open(
        cls,
        clients: Sequence[Client],
        session_id: str,
        *,
        shard_tokens: int | None = None,
        max_tokens: int | None = None,
    ) -> ShardedSession:
        """Re-attach to the sharded session ``session_id`` that :meth:`create` made (in
        this process or another): its shards ``{session_id}-s0``, ``-s1``, ... up to the
        first that no replica holds, each looked up on every client at once, shard by
        shard. Appends go on into the last shard; :meth:`delete` deletes every shard.

        Args:
            clients: the replicas, as for :meth:`create` (in any order: a shard's
                replica is the client of its server; new shards go round robin after
                the last one in this order).
            shard_tokens: the size of shards opened from now on (default: shard 0's
                ``max_tokens``, as created); an existing shard holds at most its own
                ``max_tokens`` and at most this.
            max_tokens: the logical session's cap per layer (not kept on the servers:
                give it again; default none).

        Raises:
            SessionNotFound: no replica holds shard 0.
            ShardLost: a replica did not answer (it might hold a shard), or a shard is
                on none while a later one exists (lost in a restart without snapshots).
            InvalidResponse: a shard is on two replicas, or its configuration (heads,
                head_dim, layers, formats, seed) differs from shard 0's.
        """
        session = cls(clients, _open_spec(session_id, max_tokens), shard_tokens)
        try:
            session._run(session._reopen_flow())
        except BaseException:
            session.close()
            raise
        return session

    def append(self, layer: int, k: Any, v: Any) -> int:
        """Append ``k``, ``v`` ``[m, num_kv_heads, head_dim]`` to ``layer`` (into the last
        shard, and the next ones when it fills); return the layer's new length.

        Raises:
            ShardLost: a shard's server did not answer or lost it.
            CapacityExceeded: past ``max_tokens`` (refused before sending).
            OutOfMemory: every replica refused the rows (507).
        """
        return self._run(self._checked_append_flow(layer, k, v))

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
        """Attention of ``q`` ``[n, num_qo_heads, head_dim]`` over ``layer``'s timesteps
        in every shard, as :meth:`Session.attend` (``k``, ``v`` appended first, in the
        same call where they fit in the last shard).

        Returns:
            ``out [n, num_qo_heads, head_dim]`` in ``out_dtype``, default ``q``'s (a
            tensor when ``q`` is one): the shards answer float32, merged in float32 and
            rounded once, to nearest even; with ``return_lse``,
            :class:`~attnserve_client.merge.Attention` ``(out, lse)``.

        Raises:
            ShardLost: a shard's server did not answer or lost it; nothing answered.
        """
        return self._run(self._attend_flow(layer, q, k, v, start_pos, causal, scale, return_lse, out_dtype))

    def delete(self) -> None:
        """Delete every shard (at once); raises :class:`ShardLost` for a shard whose
        server did not answer (the others are deleted)."""
        try:
            self._run(self._delete_flow())
        finally:
            self.close()

    def close(self) -> None:
        """Stop the threads the shard calls run on (the shards stay on their servers)."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None

    def __enter__(self) -> ShardedSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.delete()

    def _run(self, flow: Flow[T]) -> T:
        try:
            calls = next(flow)
            while True:
                calls = flow.send(self._perform(calls))
        except StopIteration as stop:
            result: T = stop.value
            return result

    def _perform(self, calls: list[_Call]) -> list[Any]:
        """Make ``calls`` at once: the first on this thread, the others on the session's
        threads; each one's result or exception, in order."""
        others = []
        if len(calls) > 1:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(16, thread_name_prefix="attnserve-shards")
            others = [self._threads.submit(_outcome, c) for c in calls[1:]]
        return [_outcome(calls[0]), *(f.result() for f in others)]


def _outcome(call: _Call) -> Any:
    try:
        return getattr(call.target, call.method)(*call.args, **call.kwargs)
    except Exception as exc:
        return exc


class AsyncShardedSession(_ShardedBase):
    """:class:`ShardedSession` over :class:`~attnserve_client.AsyncClient` s: the same
    methods, awaitable; the shard calls of one step are awaited together."""

    @classmethod
    async def create(
        cls, clients: Sequence[AsyncClient], *, shard_tokens: int | None = None, **spec: Unpack[SessionSpec]
    ) -> AsyncShardedSession:
        """See :meth:`ShardedSession.create`."""
        session = cls(clients, dict(spec), shard_tokens)
        await session._run(session._open_flow())
        return session

    @classmethod
    async def open(
        cls,
        clients: Sequence[AsyncClient],
        session_id: str,
        *,
        shard_tokens: int | None = None,
        max_tokens: int | None = None,
    ) -> AsyncShardedSession:
        """See :meth:`ShardedSession.open`."""
        session = cls(clients, _open_spec(session_id, max_tokens), shard_tokens)
        await session._run(session._reopen_flow())
        return session

    async def append(self, layer: int, k: Any, v: Any) -> int:
        """See :meth:`ShardedSession.append`."""
        return await self._run(self._checked_append_flow(layer, k, v))

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
        """See :meth:`ShardedSession.attend`."""
        return await self._run(self._attend_flow(layer, q, k, v, start_pos, causal, scale, return_lse, out_dtype))

    async def delete(self) -> None:
        """See :meth:`ShardedSession.delete`."""
        await self._run(self._delete_flow())

    async def __aenter__(self) -> AsyncShardedSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.delete()

    async def _run(self, flow: Flow[T]) -> T:
        try:
            calls = next(flow)
            while True:
                calls = flow.send(await self._perform(calls))
        except StopIteration as stop:
            result: T = stop.value
            return result

    @staticmethod
    async def _perform(calls: list[_Call]) -> list[Any]:
        async def outcome(call: _Call) -> Any:
            method: Callable[..., Awaitable[Any]] = getattr(call.target, call.method)
            try:
                return await method(*call.args, **call.kwargs)
            except Exception as exc:
                return exc

        return list(await asyncio.gather(*map(outcome, calls)))
