"""Sessions: create, look up, drop; lengths, capacities and GPU bytes reserved ahead.

Everything here runs on the event loop (one thread), so a route can check a
request against the store and queue its GPU job with no ``await`` in between:
that is what makes requests atomic and concurrent appends to one session
deterministic.

The GPU worker runs jobs later, in submission order. So each layer keeps a
*reserved* length and capacity (its state after every queued job), and each
session its reserved GPU bytes. A request is validated against the reserved
state (offset, capacity, start_pos, memory budget) and, once its job is queued,
:meth:`Store.commit` moves the reserved state forward. When a job fails, its
rows are given back; whenever a session has no job left in flight, its reserved
state is set again from what the caches really hold (:meth:`Store.finish`), so
the accounting can never drift.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import CapacityExceeded, OffsetMismatch, OutOfMemory, SessionExists, SessionNotFound
from .kvcache import LayerCache, SessionConfig, SessionKV, grow_capacity

__all__ = ["SESSION_ID_RE", "new_session_id", "LayerState", "Session", "Reservation", "Store"]

log = logging.getLogger("attnserve.store")

SESSION_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def new_session_id() -> str:
    """22 random URL-safe characters (128 bits): ``[A-Za-z0-9_-]``."""
    return secrets.token_urlsafe(16)


@dataclass
class LayerState:
    """One layer's cache and its reserved state (after every queued job)."""

    cache: LayerCache
    length: int = 0
    capacity: int = 0

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
        self.signs_reserved = False
        self.pending = 0
        self.closed = False
        self.dirty = False
        self.created = time.time()

    @property
    def kv_format(self) -> str:
        return self.config.kv_format

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
            "kv_format": c.kv_format,
            "max_tokens": c.max_tokens,
            "seed": c.seed,
            "lengths": [ls.length for ls in self.layers],
            "bytes": self.nbytes,
        }


@dataclass
class Reservation:
    """What one queued job will do to a session: ``rows`` appended to ``layer``."""

    session: Session
    layer: LayerState
    rows: int = 0
    new_length: int = 0
    new_capacity: int = 0
    delta_bytes: int = 0
    signs: bool = False
    committed: bool = field(default=False, repr=False)


class Store:
    """All sessions of this replica, with the global limits."""

    def __init__(self, *, max_sessions: int, memory_budget_bytes: int):
        self.max_sessions = max_sessions
        self.memory_budget_bytes = memory_budget_bytes
        self.sessions: dict[str, Session] = {}
        self.reserved_bytes = 0  # reserved GPU bytes of live sessions
        self.releasing_bytes = 0  # bytes of deleted sessions whose release is still queued
        self.holds: dict[str, int] = {}  # ids (and their bytes) of sessions being restored

    # ── sessions ────────────────────────────────────────────────────────────

    def __len__(self) -> int:
        return len(self.sessions)

    def check_room(self, session_id: str | None = None) -> None:
        if session_id is not None and (session_id in self.sessions or session_id in self.holds):
            raise SessionExists(f"session {session_id!r} already exists")
        if len(self.sessions) + len(self.holds) >= self.max_sessions:
            raise OutOfMemory(
                f"this server holds at most {self.max_sessions} sessions; delete one first",
                max_sessions=self.max_sessions,
            )

    def create(self, config: SessionConfig, *, owner: str | None, session_id: str | None = None) -> Session:
        """Add an empty session (no GPU memory until its first append).

        Raises:
            SessionExists: ``session_id`` is taken.
            OutOfMemory: the session limit is reached.
            ValueError: the configuration is invalid (checked by the routes first).
        """
        self.check_room(session_id)
        if session_id is None:
            session_id = new_session_id()
            while session_id in self.sessions:  # pragma: no cover - 128 random bits
                session_id = new_session_id()
        session = Session(session_id, owner, SessionKV(config))
        self.sessions[session_id] = session
        return session

    def hold(self, session_id: str, nbytes: int) -> str:
        """Take an id and ``nbytes`` of the budget for a session being restored.

        Raises:
            SessionExists, OutOfMemory: as :meth:`create` and :meth:`check_budget`.
        """
        self.check_room(session_id)
        budget = self.memory_budget_bytes
        if budget and nbytes > 0 and self.used_bytes + nbytes > budget:
            raise OutOfMemory(
                f"the snapshot needs {nbytes} GPU bytes; {self.used_bytes} of the budget of {budget} are in use",
                budget_bytes=budget,
                used_bytes=self.used_bytes,
                requested_bytes=nbytes,
            )
        self.holds[session_id] = nbytes
        return session_id

    def unhold(self, session_id: str) -> None:
        self.holds.pop(session_id, None)

    def adopt(self, kv: SessionKV, *, owner: str | None, session_id: str) -> Session:
        """Add a session whose caches are already on the GPU (a restored snapshot)."""
        if session_id in self.sessions:  # pragma: no cover - the id was held
            raise SessionExists(f"session {session_id!r} already exists")
        session = Session(session_id, owner, kv)
        self.sessions[session_id] = session
        session.dirty = True  # its bytes come from the caches, not from reservations
        self.resync(session)
        return session

    def get(self, session_id: str, owner: str | None) -> Session:
        """The session, if it exists and belongs to ``owner`` (else 404, the same
        answer for both, so ids of other tenants cannot be probed)."""
        s = self.sessions.get(session_id)
        if s is None or s.owner != owner:
            raise SessionNotFound(f"no session {session_id!r}")
        return s

    def list(self, owner: str | None) -> list[Session]:
        return [s for s in self.sessions.values() if s.owner == owner]

    def remove(self, session: Session) -> int:
        """Drop the session from the store (its release is queued by the caller);
        returns the bytes to give back once the release is done (:meth:`released`)."""
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
        session.closed = True
        freed = session.reserved_bytes
        self.reserved_bytes -= freed
        self.releasing_bytes += freed
        return freed

    def released(self, nbytes: int) -> None:
        self.releasing_bytes -= nbytes

    # ── reservations ────────────────────────────────────────────────────────

    @property
    def used_bytes(self) -> int:
        """GPU bytes held or reserved by queued jobs (what the budget counts)."""
        return self.reserved_bytes + self.releasing_bytes + sum(self.holds.values())

    def plan_append(self, session: Session, layer: int, rows: int, offset: int | None) -> Reservation:
        """Check an append of ``rows`` to ``layer`` at ``offset`` against the reserved
        state; returns the reservation (nothing changes until :meth:`commit`).

        Raises:
            OffsetMismatch: ``offset`` is not the layer's length.
            CapacityExceeded: the append would pass ``max_tokens``.
        """
        ls = session.layers[layer]
        if offset is not None and offset != ls.length:
            raise OffsetMismatch(
                f"offset {offset} is not the layer's length {ls.length}; nothing was appended",
                length=ls.length,
            )
        new_length = ls.length + rows
        if new_length > ls.max_tokens:
            raise CapacityExceeded(
                f"appending {rows} rows to length {ls.length} would pass max_tokens {ls.max_tokens}",
                length=ls.length,
                max_tokens=ls.max_tokens,
            )
        new_cap = grow_capacity(ls.capacity, new_length, ls.max_tokens)
        delta = ls.cache.bytes_for(new_cap) - ls.cache.bytes_for(ls.capacity) if new_cap != ls.capacity else 0
        signs = False
        if not session.signs_reserved and session.kv.signs_bytes():
            signs = True
            delta += session.kv.signs_bytes()
        return Reservation(session, ls, rows, new_length, new_cap, delta, signs)

    def plan_read(self, session: Session, layer: int, offset: int | None) -> Reservation:
        """An attend without a fused append: only ``offset`` is checked."""
        ls = session.layers[layer]
        if offset is not None and offset != ls.length:
            raise OffsetMismatch(f"offset {offset} is not the layer's length {ls.length}", length=ls.length)
        return Reservation(session, ls, 0, ls.length, ls.capacity, 0, False)

    def check_budget(self, res: Reservation) -> None:
        """Raises OutOfMemory when the reservation would pass the memory budget."""
        budget = self.memory_budget_bytes
        if budget and res.delta_bytes > 0 and self.used_bytes + res.delta_bytes > budget:
            raise OutOfMemory(
                f"the request needs {res.delta_bytes} more GPU bytes; {self.used_bytes} of the "
                f"budget of {budget} are in use",
                budget_bytes=budget,
                used_bytes=self.used_bytes,
                requested_bytes=res.delta_bytes,
            )

    def commit(self, res: Reservation) -> None:
        """The job is queued: move the reserved state forward."""
        s, ls = res.session, res.layer
        ls.length, ls.capacity = res.new_length, res.new_capacity
        s.reserved_bytes += res.delta_bytes
        self.reserved_bytes += res.delta_bytes
        s.signs_reserved = s.signs_reserved or res.signs
        s.pending += 1
        res.committed = True

    def finish(self, res: Reservation, error: BaseException | None) -> None:
        """The job is done (on the event loop, right after it completes)."""
        s = res.session
        s.pending -= 1
        if error is not None and res.rows:
            res.layer.length -= res.rows  # later queued jobs were checked against it; resynced below
            s.dirty = True
        if s.pending == 0 and not s.closed:
            self.resync(s)

    def resync(self, s: Session) -> None:
        """Set the reserved state from the caches (only while no job is in flight)."""
        for ls in s.layers:
            ls.length, ls.capacity = ls.cache.length, ls.cache.capacity
        real = s.kv.nbytes
        if real != s.reserved_bytes and not s.dirty:
            log.warning(
                "gpu byte accounting drift",
                extra={"session_id": s.id, "reserved": s.reserved_bytes, "real": real},
            )
        self.reserved_bytes += real - s.reserved_bytes
        s.reserved_bytes = real
        s.signs_reserved = real > sum(ls.cache.nbytes for ls in s.layers)
        s.dirty = False

    # ── views ───────────────────────────────────────────────────────────────

    def by_format(self) -> dict[str, tuple[int, int]]:
        """``{kv_format: (sessions, GPU bytes held)}``."""
        out: dict[str, tuple[int, int]] = {}
        for s in self.sessions.values():
            n, b = out.get(s.kv_format, (0, 0))
            out[s.kv_format] = (n + 1, b + s.nbytes)
        return out
