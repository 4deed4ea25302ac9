"""Sessions: create, look up, drop; lengths, capacities and GPU bytes reserved ahead.

Everything here runs on the event loop (one thread), so a route can check a
request against the store and queue its GPU job with no ``await`` in between:
that is what makes requests atomic and concurrent appends to one session
deterministic.

The GPU worker runs jobs later, in submission order. So each layer keeps a
*reserved* length and capacity (its state after every queued job), and each
session its reserved GPU bytes. A request is validated against the reserved
state (offset, capacity, start_pos, memory budget) and, once its job is queued,
:meth:`Store.commit_step` moves the reserved state forward. When a job fails, its
rows are given back; whenever a session has no job left in flight, its reserved
state is set again from what the caches really hold (:meth:`Store.finish_step`), so
the accounting can never drift.

Tenants: a session belongs to an *owner* (an API key's id, or ``None`` without
keys), and ids are per owner: the store is keyed by ``(owner, id)``, so one
tenant can neither see nor block another's ids. Per-owner quotas (sessions, GPU
bytes) are checked with the global limits and answer 507 out-of-memory with a
``quota`` member.
"""

from __future__ import annotations

import builtins
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Callable, Optional, cast

import numpy as np

from .errors import (
    ApiError,
    CapacityExceeded,
    InvalidRequest,
    OffsetMismatch,
    OutOfMemory,
    SessionExists,
    SessionInStep,
    SessionNotFound,
)
from .gpu.step_plan import StepPlans
from .kv.config import SessionConfig
from .kv.layer import LayerCache
from .kv.session import SessionKV, bytes_growth

__all__ = [
    "SESSION_ID_RE", "new_session_id", "LayerState", "Session", "StepReservation", "Store", "Owner", "step_conflict",
]  # fmt: skip

Owner = Optional[str]

log = logging.getLogger("attnserve.store")

SESSION_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_session_id(session_id: object) -> str:
    """A client's id for a new session, or InvalidRequest (422) saying what ids are."""
    if not (isinstance(session_id, str) and SESSION_ID_RE.fullmatch(session_id)):
        raise InvalidRequest(f"session_id: expected 1 to 64 of [A-Za-z0-9_-], got {session_id!r}")
    return session_id


def new_session_id() -> str:
    """22 random URL-safe characters (128 bits): ``[A-Za-z0-9_-]``."""
    return secrets.token_urlsafe(16)


@dataclass
class LayerState:
    """One layer's cache and its reserved state (after every queued job)."""

    cache: LayerCache
    length: int = 0
    capacity: int = 0
    # committed jobs not yet done, in queue order (the last one may be cancelled safely)
    inflight: list["StepReservation"] = field(default_factory=list)

    @property
    def max_tokens(self) -> int:
        return self.cache.max_tokens


class Session:
    def __init__(self, session_id: str, owner: str | None, kv: SessionKV):
        self.id = session_id
        self.owner = owner
        self.kv = kv
        self.config: SessionConfig = kv.config
        self.layers = [LayerState(c) for c in kv.layers]
        self.reserved_bytes = 0
        self.pending = 0
        self.closed = False
        self.dirty = False
        self.failed = False  # a job failed since the last resync (resync every layer)
        self.created = time.time()
        self.last_used = time.monotonic()
        # the sessions that may share pages with this one (forks of forks): one set, shared
        self.family: set[Session] = {self}
        # the plans of the steps that name this session alone (StepGroup.plans' twin)
        self.plans = StepPlans()
        # the handle of the open step the session is in (None: none), which owns its
        # append positions (set and cleared by step_registry.StepRegistry only)
        self.step: int | None = None

    @property
    def key(self) -> tuple[Owner, str]:
        return (self.owner, self.id)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def cache(self, layer: int) -> LayerCache:
        """The GPU cache of ``layer`` (what a job plans on)."""
        return self.kv.layers[layer]

    @property
    def nbytes(self) -> int:
        """GPU bytes the session really holds now."""
        return self.kv.nbytes

    def info(self) -> dict[str, Any]:
        c = self.config
        return {
            "session_id": self.id,
            "num_layers": c.num_layers,
            "num_qo_heads": c.num_qo_heads,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "kv_format": c.kv_format if isinstance(c.kv_format, str) else list(c.kv_format),
            "layer_formats": list(c.layer_formats),
            "max_tokens": c.max_tokens,
            "seed": c.seed,
            "sinks": c.sinks,
            "window": c.window,
            "lengths": [ls.length for ls in self.layers],
            "bytes": self.nbytes,
        }


def step_conflict(session: Session, via: int | None = None) -> SessionInStep | None:
    """The rule of a session in an open step, which owns its append positions: an
    append, attend or batch naming it other than through that step (``via``: the
    handle of the step making the call, None for none), a second step over it and
    its delete are refused (409 session-in-step). The one place the rule is
    written: ``step/rules.py`` (every append and attend), the delete route and
    the step's open ask it."""
    handle = session.step
    if handle is None or handle == via:
        return None
    return SessionInStep(
        f"session {session.id!r} is in step {handle} (opened by this tenant); call it through the step "
        "or close the step first",
        step=handle,
    )


class StepReservation:
    """What one step's job will do to its sessions, as columns: ``rows`` appended to
    one layer of each of ``sessions`` (distinct, one owner), and per item the layer's
    new length, capacity and bytes (``new_length[i]``, ...). One object for the whole
    step: it stands in each of its layers' ``inflight`` queues, so a step makes no
    object per item."""

    __slots__ = ("sessions", "layers", "rows", "new_length", "new_capacity", "delta_bytes", "total_bytes", "committed")

    def __init__(
        self, sessions: list[Session], layers: list[LayerState], rows: int, new_length: list[int],
        new_capacity: list[int], delta_bytes: list[int], total_bytes: int,
    ):  # fmt: skip
        self.sessions = sessions
        self.layers = layers
        self.rows = rows
        self.new_length = new_length
        self.new_capacity = new_capacity
        self.delta_bytes = delta_bytes
        self.total_bytes = total_bytes
        self.committed = False

    def __len__(self) -> int:
        return len(self.sessions)

    def __repr__(self) -> str:
        return f"StepReservation(items={len(self)}, rows={self.rows}, total_bytes={self.total_bytes})"

    def layer_states(self) -> list[LayerState]:
        return self.layers


class StepGroup:
    """The sessions one stacked step names, resolved once and kept while no session
    is added or removed (``generation``): an engine's step sends the same batch of
    sessions for every layer, and step after step (vLLM's persistent batch). ``memo``
    holds what callers derive from the sessions alone (their shapes, a layer's
    formats), which cannot change while the group is valid; ``plans`` the plans of
    their steps (each made on a step's first layer, run on the later ones)."""

    __slots__ = ("generation", "sessions", "memo", "plans")

    def __init__(self, generation: int, sessions: list["Session"]):
        self.generation = generation
        self.sessions = sessions
        self.memo: dict[Any, Any] = {}
        self.plans = StepPlans()


class Store:
    """All sessions of this replica, with the global limits."""

    #: Step groups kept (the least recently made dropped past it).
    STEP_GROUPS = 64

    def __init__(
        self,
        *,
        max_sessions: int,
        memory_budget_bytes: int,
        quota_sessions_per_key: int = 0,
        quota_bytes_per_key: int = 0,
        on_quota: Callable[[str], None] | None = None,
    ):
        self.max_sessions = max_sessions
        self.memory_budget_bytes = memory_budget_bytes
        self.quota_sessions_per_key = quota_sessions_per_key  # 0: none
        self.quota_bytes_per_key = quota_bytes_per_key  # 0: none
        self.on_quota = on_quota  # called with "sessions" or "bytes" when a quota refuses a request
        self.sessions: dict[tuple[Owner, str], Session] = {}
        self._by_owner: dict[Owner, dict[str, Session]] = {}
        self.reserved_bytes = 0  # reserved GPU bytes of live sessions
        self.releasing_bytes = 0  # bytes of deleted sessions whose release is still queued
        self.holds: dict[tuple[Owner, str], int] = {}  # (owner, id) of sessions being restored: their bytes
        self.generation = 0  # counts every session added or removed (StepGroup's validity)
        self._steps: dict[tuple[Owner, tuple[str, ...]], StepGroup] = {}
        self.stepped = 0  # sessions in an open step (0: step_conflict cannot refuse anything)

    # ── sessions ────────────────────────────────────────────────────────────

    def __len__(self) -> int:
        return len(self.sessions)

    def check_room(self, session_id: str | None = None, owner: Owner = None, *, quotas: bool = True) -> None:
        """Raises SessionExists (the owner has that id), or OutOfMemory (the server's
        session limit, or the owner's session quota unless ``quotas`` is False)."""
        if session_id is not None and ((owner, session_id) in self.sessions or (owner, session_id) in self.holds):
            raise SessionExists(f"session {session_id!r} already exists")
        if len(self.sessions) + len(self.holds) >= self.max_sessions:
            raise OutOfMemory(
                f"this server holds at most {self.max_sessions} sessions; delete one first",
                max_sessions=self.max_sessions,
            )
        quota = self.quota_sessions_per_key
        if quotas and quota and self.tenant_sessions(owner) >= quota:
            self._refused("sessions")
            raise OutOfMemory(
                f"this API key may hold at most {quota} sessions at once (its quota); delete one first",
                quota="sessions",
                quota_limit=quota,
                max_sessions=quota,
            )

    def create(self, kv: SessionKV, *, owner: Owner, session_id: str | None = None) -> Session:
        """Add an empty session (no GPU memory until its first append).

        Raises:
            SessionExists: ``session_id`` is taken (by this owner).
            OutOfMemory: the session limit or the owner's quota is reached.
            ValueError: the configuration is invalid (checked by the routes first).
        """
        self.check_room(session_id, owner)
        session = Session(self.unused_id(owner) if session_id is None else session_id, owner, kv)
        self._add(session)
        return session

    def unused_id(self, owner: Owner) -> str:
        """A fresh random id no session of ``owner`` has."""
        session_id = new_session_id()
        while (owner, session_id) in self.sessions or (owner, session_id) in self.holds:  # pragma: no cover
            session_id = new_session_id()  # 128 random bits
        return session_id

    def hold(
        self, session_id: str, nbytes: int, owner: Owner = None, *, quotas: bool = True, what: str = "the snapshot"
    ) -> tuple[Owner, str]:
        """Take an id and ``nbytes`` of the budget (and of the owner's quota) for a
        session being restored or forked; returns the key to give to :meth:`unhold`.
        ``quotas=False`` (restores at start) checks the server's limits only;
        ``what`` names the session being placed in a refusal.

        Raises:
            SessionExists, OutOfMemory: as :meth:`create` and :meth:`reserve_step`.
        """
        self.check_room(session_id, owner, quotas=quotas)
        budget = self.memory_budget_bytes
        if budget and nbytes > 0 and self.used_bytes + nbytes > budget:
            raise OutOfMemory(
                f"{what} needs {nbytes} GPU bytes; {self.used_bytes} of the budget of {budget} are in use",
                budget_bytes=budget,
                used_bytes=self.used_bytes,
                requested_bytes=nbytes,
            )
        if quotas:
            self._check_quota_bytes(owner, nbytes)
        key = (owner, session_id)
        self.holds[key] = nbytes
        return key

    def unhold(self, key: tuple[Owner, str]) -> None:
        self.holds.pop(key, None)

    def adopt(self, kv: SessionKV, *, owner: Owner, session_id: str) -> Session:
        """Add a session whose caches are already on the GPU (a restored snapshot)."""
        if (owner, session_id) in self.sessions:  # pragma: no cover - the id was held
            raise SessionExists(f"session {session_id!r} already exists")
        session = Session(session_id, owner, kv)
        self._add(session)
        session.dirty = True  # its bytes come from the caches, not from reservations
        self.resync(session)
        return session

    def _add(self, session: Session) -> None:
        self.generation += 1
        self.sessions[session.key] = session
        self._by_owner.setdefault(session.owner, {})[session.id] = session

    def get(self, session_id: str, owner: Owner) -> Session:
        """The owner's session with that id (else 404; another owner's sessions are
        simply not there, so their ids cannot be probed). Counts as a use (TTL)."""
        s = self.sessions.get((owner, session_id))
        if s is None:
            raise SessionNotFound(f"no session {session_id!r}")
        s.touch()
        return s

    def step_group(self, session_ids: list[str], owner: Owner) -> StepGroup | None:
        """The owner's sessions named by ``session_ids`` (strings), in order, each
        counted as a use (as :meth:`get` counts one); None when one is not there or is
        named twice (the caller then looks each up with :meth:`get`, which names the
        problem). Resolved once per set of ids while no session is added or removed,
        and kept (its memo and plans) when they resolve to the very same sessions."""
        key = (owner, tuple(session_ids))
        group = self._steps.get(key)
        if group is None or group.generation != self.generation:
            get = self.sessions.get
            found = [get((owner, sid)) for sid in session_ids]
            if any(s is None for s in found) or len({id(s) for s in found}) != len(found):
                return None
            if group is not None and all(a is b for a, b in zip(found, group.sessions)):
                group.generation = self.generation  # the very sessions: their memo and plans hold
            else:
                group = StepGroup(self.generation, cast("list[Session]", found))  # none is None (checked above)
            self._steps.pop(key, None)
            self._steps[key] = group
            while len(self._steps) > self.STEP_GROUPS:
                del self._steps[next(iter(self._steps))]
        now = time.monotonic()
        for s in group.sessions:
            s.last_used = now
        return group

    def enter_step(self, sessions: Sequence[Session], handle: int) -> None:
        """``sessions`` (in no step: ``step_conflict`` said so) are in the open step ``handle``."""
        for s in sessions:
            assert s.step is None, (s.id, s.step)
            s.step = handle
        self.stepped += len(sessions)

    def leave_step(self, sessions: Sequence[Session], handle: int) -> None:
        """The step ``handle`` is closed: its sessions are free (a use each, for the TTL)."""
        now = time.monotonic()
        for s in sessions:
            if s.step == handle:
                s.step = None
                s.last_used = now
                self.stepped -= 1

    def list(self, owner: Owner) -> list[Session]:
        return list(self._by_owner.get(owner, {}).values())

    def remove(self, session: Session) -> int:
        """Drop the session from the store (its release is queued by the caller);
        returns the bytes to give back once the release is done (:meth:`released`)."""
        if self.sessions.get(session.key) is session:
            self.generation += 1
            del self.sessions[session.key]
            mine = self._by_owner.get(session.owner)
            if mine is not None:
                mine.pop(session.id, None)
                if not mine:
                    del self._by_owner[session.owner]
        session.closed = True
        session.family.discard(session)
        freed = session.reserved_bytes
        self.reserved_bytes -= freed
        self.releasing_bytes += freed
        return freed

    def released(self, nbytes: int, family: set[Session] | frozenset[Session] = frozenset()) -> None:
        """A release is done: its bytes are free, and the pages it paid for that a
        session of its ``family`` still holds are now that session's to pay for."""
        self.releasing_bytes -= nbytes
        for s in list(family):
            if not s.closed:
                s.dirty = True  # its charge moves: no drift warning
                if s.pending == 0:
                    self.resync(s)

    def join(self, source: Session, fork: Session) -> None:
        """``fork`` shares pages with ``source`` (and with every session it shares with)."""
        source.family.add(fork)
        fork.family = source.family

    # (Store.list, above, shadows the builtin in the annotations below: builtins.list)

    def idle(self, ttl: float, now: float | None = None) -> builtins.list[Session]:
        """Sessions unused for ``ttl`` seconds, with no job in flight and in no open
        step (the step's own idle timeout governs those)."""
        now = time.monotonic() if now is None else now
        return [
            s
            for s in self.sessions.values()
            if s.pending == 0 and not s.closed and s.step is None and now - s.last_used >= ttl
        ]

    # ── tenants ─────────────────────────────────────────────────────────────

    def tenant_sessions(self, owner: Owner) -> int:
        """Sessions the owner holds or is restoring."""
        return len(self._by_owner.get(owner, ())) + sum(1 for o, _ in self.holds if o == owner)

    def tenant_bytes(self, owner: Owner) -> int:
        """GPU bytes the owner's sessions hold or have reserved (what its quota counts)."""
        held = sum(s.reserved_bytes for s in self._by_owner.get(owner, {}).values())
        return held + sum(n for (o, _), n in self.holds.items() if o == owner)

    def by_tenant(self) -> dict[Owner, tuple[int, int]]:
        """``{owner: (sessions, reserved GPU bytes)}``."""
        return {o: (len(ss), sum(s.reserved_bytes for s in ss.values())) for o, ss in self._by_owner.items()}

    def _refused(self, quota: str) -> None:
        if self.on_quota is not None:
            self.on_quota(quota)

    def _check_quota_bytes(self, owner: Owner, nbytes: int) -> None:
        quota = self.quota_bytes_per_key
        if quota and nbytes > 0:
            used = self.tenant_bytes(owner)
            if used + nbytes > quota:
                self._refused("bytes")
                raise self._quota_problem(used, nbytes, quota)

    @staticmethod
    def _quota_problem(used: int, nbytes: int, quota: int) -> OutOfMemory:
        return OutOfMemory(
            f"the request needs {nbytes} more GPU bytes; this API key's sessions hold {used} of "
            f"its quota of {quota} bytes",
            quota="bytes",
            quota_limit=quota,
            budget_bytes=quota,
            used_bytes=used,
            requested_bytes=nbytes,
        )

    # ── reservations ────────────────────────────────────────────────────────

    @property
    def used_bytes(self) -> int:
        """GPU bytes held or reserved by queued jobs (what the budget counts)."""
        return self.reserved_bytes + self.releasing_bytes + sum(self.holds.values())

    def step_lengths(
        self, states: Sequence[LayerState], rows: int, offsets: Sequence[int | None]
    ) -> tuple[np.ndarray, dict[int, ApiError]]:
        """The rules of a step's ``offsets`` and capacities, as columns: each of
        ``states`` (a layer of distinct sessions) takes ``rows`` appended rows (0: an
        attend without a fused append) at ``offsets[i]`` (None: anywhere). Returns
        each layer's new reserved length and the problem of each item refused (by
        position): an offset that is not the layer's length (409 offset-mismatch), or
        an append past its ``max_tokens`` (409 capacity-exceeded)."""
        count = len(states)
        length = np.fromiter((ls.length for ls in states), np.int64, count)
        new_length = length + rows
        problems: dict[int, ApiError] = {}
        if any(o is not None for o in offsets):  # compared as Python ints: an offset may pass int64
            lengths = length.tolist()
            for i in [i for i, o in enumerate(offsets) if o is not None and o != lengths[i]]:
                detail = f"offset {offsets[i]} is not the layer's length {length[i]}"
                problems[i] = OffsetMismatch(
                    detail + ("; nothing was appended" if rows else ""), length=int(length[i])
                )  # fmt: skip
        if rows:
            max_tokens = np.fromiter((ls.max_tokens for ls in states), np.int64, count)
            past = new_length > max_tokens
            for i in np.flatnonzero(past).tolist() if past.any() else ():
                problems.setdefault(i, CapacityExceeded(
                    f"appending {rows} rows to length {length[i]} would pass max_tokens {max_tokens[i]}",
                    length=int(length[i]), max_tokens=int(max_tokens[i]),
                ))  # fmt: skip
        return new_length, problems

    def reserve_step(
        self, sessions: builtins.list[Session], states: builtins.list[LayerState], rows: int, new_length: np.ndarray
    ) -> tuple[StepReservation, dict[int, ApiError]]:
        """The reservation of a step whose items passed every other rule: ``rows``
        appended to ``states[i]`` (of ``sessions[i]``: distinct, one owner) for its
        new length ``new_length[i]``, with the rule of the memory budget and the
        owner's byte quota, each item in order against the bytes of those before it
        (507 out-of-memory). Returns the reservation of the items that pass (not
        committed: :meth:`commit_step`) and the problem of each refused (by position)."""
        count = len(states)
        capacity = np.fromiter((ls.capacity for ls in states), np.int64, count)
        delta = np.zeros(count, np.int64)
        problems: dict[int, ApiError] = {}
        if rows and count:
            caches = [ls.cache for ls in states]
            page = caches[0].page_tokens  # one page size for every pool of the engine
            new_capacity = np.maximum(capacity, -(-new_length // page) * page)  # a capacity is whole pages
            delta = bytes_growth(caches, capacity, new_capacity)
            capacity = new_capacity
            total = int(delta.sum())
            budget, quota = self.memory_budget_bytes, self.quota_bytes_per_key
            owner = sessions[0].owner
            if total > 0 and (
                (budget and self.used_bytes + total > budget) or (quota and self.tenant_bytes(owner) + total > quota)
            ):
                problems = self._past_budget(owner, delta.tolist())
        if problems:
            keep = [i for i in range(count) if i not in problems]
            sessions, states = [sessions[i] for i in keep], [states[i] for i in keep]
            new_length, capacity, delta = new_length[keep], capacity[keep], delta[keep]
        reservation = StepReservation(
            sessions, states, rows, new_length.tolist(), capacity.tolist(), delta.tolist(), int(delta.sum())
        )  # fmt: skip
        return reservation, problems

    def _past_budget(self, owner: Owner, delta: builtins.list[int]) -> dict[int, ApiError]:
        """Which of a step's items the memory budget or the owner's quota refuse, each
        against the bytes of the items before it that pass: the budget's problem
        first, then the quota's (by position)."""
        problems: dict[int, ApiError] = {}
        budget, quota = self.memory_budget_bytes, self.quota_bytes_per_key
        used, held = self.used_bytes, self.tenant_bytes(owner)
        for i, need in enumerate(delta):
            if need <= 0:
                continue
            if budget and used + need > budget:
                problems[i] = OutOfMemory(
                    f"the request needs {need} more GPU bytes; {used} of the budget of {budget} are in use",
                    budget_bytes=budget, used_bytes=used, requested_bytes=need,
                )  # fmt: skip
            elif quota and held + need > quota:
                self._refused("bytes")
                problems[i] = self._quota_problem(held, need, quota)
            else:
                used += need
                held += need
        return problems

    def commit_step(self, step: StepReservation) -> None:
        """The step's job is queued: move the reserved state of its layers forward."""
        for s, ls, n, c, d in zip(step.sessions, step.layers, step.new_length, step.new_capacity, step.delta_bytes):
            self._commit_item(s, ls, step, n, c, d)
        self.reserved_bytes += step.total_bytes
        step.committed = True

    @staticmethod
    def _commit_item(
        s: Session, ls: LayerState, res: StepReservation, new_length: int, new_capacity: int, delta: int
    ) -> None:
        ls.length, ls.capacity = new_length, new_capacity
        s.reserved_bytes += delta
        s.pending += 1
        ls.inflight.append(res)

    def cancellable(self, step: StepReservation) -> bool:
        """Whether a job with this reservation may be dropped before it runs without
        changing what any other queued job was checked against: it appends nothing,
        or it is the last reservation in each of its layers' queues."""
        if step.rows == 0:
            return True
        return all(layer.inflight and layer.inflight[-1] is step for layer in step.layers)

    def finish_step(self, step: StepReservation, errors: Sequence[BaseException | None] | None) -> None:
        """The step's job is done, failed or was cancelled (on the event loop, right
        after): ``errors[i]`` is item ``i``'s (None: it succeeded), or None when
        every item succeeded."""
        rows, items = step.rows, zip(step.sessions, step.layers, step.delta_bytes)
        if errors is None:
            for s, ls, d in items:
                self._finish_item(s, ls, step, rows, d, None)
        else:
            for (s, ls, d), e in zip(items, errors, strict=True):
                self._finish_item(s, ls, step, rows, d, e)

    def _finish_item(
        self, s: Session, ls: LayerState, res: StepReservation, rows: int, delta_bytes: int, error: BaseException | None
    ) -> None:
        s.pending -= 1
        inflight = ls.inflight
        if inflight and inflight[0] is res:  # jobs finish in queue order
            del inflight[0]
        else:
            for i in range(len(inflight) - 1, -1, -1):
                if inflight[i] is res:
                    del inflight[i]
                    break
        if error is not None:
            if rows:
                ls.length -= rows  # later queued jobs were checked against it; resynced below
                s.dirty = True
            s.failed = True
        if s.pending == 0 and not s.closed:
            if s.dirty or s.failed:
                s.failed = False
                self.resync(s)
            else:  # every job since the last resync succeeded: each layer is as reserved
                ls.length, ls.capacity = ls.cache.length, ls.cache.capacity
                if delta_bytes:
                    self._resync_bytes(s)

    def resync(self, s: Session) -> None:
        """Set the reserved state from the caches (only while no job is in flight)."""
        for ls in s.layers:
            ls.length, ls.capacity = ls.cache.length, ls.cache.capacity
        self._resync_bytes(s)

    def _resync_bytes(self, s: Session) -> None:
        real = s.kv.nbytes
        if real != s.reserved_bytes and not s.dirty:
            log.warning(
                "gpu byte accounting drift",
                extra={"session_id": s.id, "reserved": s.reserved_bytes, "real": real},
            )
        self.reserved_bytes += real - s.reserved_bytes
        s.reserved_bytes = real
        s.dirty = False

    # ── views ───────────────────────────────────────────────────────────────

    def by_format(self) -> dict[str, tuple[int, int]]:
        """``{kv_format: (sessions with a layer of it, GPU bytes its layers hold)}``."""
        out: dict[str, tuple[int, int]] = {}
        for s in self.sessions.values():
            held: dict[str, int] = {}
            for layer in s.kv.layers:
                held[layer.kv_format] = held.get(layer.kv_format, 0) + layer.nbytes
            for fmt, nbytes in held.items():
                n, b = out.get(fmt, (0, 0))
                out[fmt] = (n + 1, b + nbytes)
        return out
