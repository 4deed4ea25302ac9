"""Open steps: batches of sessions held open across layers (docs/api.md,
"Steps: a batch held open across layers").

A step is opened over a fixed batch of sessions (their order, the rows each
appends per layer call, the query rows, the layers it calls, the arrays' dtype
and the attend's options) and called once per layer per token; this module
owns what lives between the calls, on the event loop only:

* handles: positive integers, never reused while the server runs, each scoped
  to the tenant that opened it (any other tenant's, an unknown or a closed one
  is ``404 step-not-found``);
* the sessions' membership (``Store.enter_step``, ``Store.leave_step``): a
  session is in at most one open step, so open steps are bounded by sessions;
* per token, which layers are called and which have a call in flight, and
  whether a partial call broke the step: the compiled step table's
  (``plane/_callframe``: ``callframe.c``'s ``atc_claim``/``atc_settle``), the
  one owner of that bookkeeping, which the binary call frame's parser checks
  against too; the first partial failure's detail is kept here;
* a connection's steps (closed with it) and the idle expiry of the others.

What a layer call *is* (a stacked attend) is ``step/steps.py``'s, above this.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

from .errors import StepNotFound
from .plane._callframe import CallFrameError, StepTable
from .store import Owner, Session, Store

__all__ = ["CallFrameError", "OpenStep", "StepRegistry", "CLOSE_REASONS"]

#: Why a step closed (``attnserve_steps_closed_total``'s ``reason``): its close
#: (``DELETE``, ``step_close``), its connection's end, its idle timeout, shutdown.
CLOSE_REASONS = ("closed", "connection", "idle", "shutdown")


class OpenStep:
    """One open step: its tenant, sessions and fixed options, its record in the
    step table (``table``: the layers of the token called and in flight), its
    first failure once broken, the connection it is bound to (None: opened over
    HTTP, closed by ``DELETE`` or its idle timeout)."""

    __slots__ = (
        "table", "handle", "owner", "sessions", "layers", "rows", "queries", "dtype", "causal", "scale",
        "return_lse", "out_dtype", "failure", "bound", "last_used", "in_flight", "closed",
    )  # fmt: skip

    def __init__(
        self,
        table: StepTable,
        handle: int,
        owner: Owner,
        sessions: list[Session],
        *,
        layers: list[int],
        rows: int,
        queries: int,
        dtype: str,
        causal: bool,
        scale: float | None,
        return_lse: bool,
        out_dtype: str | None,
        bound: Hashable | None,
    ):
        self.table = table
        self.handle = handle
        self.owner = owner
        self.sessions = sessions
        self.layers = layers
        self.rows = rows
        self.queries = queries
        self.dtype = dtype
        self.causal = causal
        self.scale = scale
        self.return_lse = return_lse
        self.out_dtype = out_dtype
        self.failure: dict[str, Any] | None = None  # the first partial failure (broken)
        self.bound = bound
        self.last_used = time.monotonic()
        self.in_flight = 0  # calls queued and not settled
        self.closed = False

    @property
    def session_ids(self) -> list[str]:
        return [s.id for s in self.sessions]

    @property
    def token(self) -> int:
        """The token the step's calls are in (tokens completed so far)."""
        return int(self.table.info(self.handle)["token"])

    def in_flight_layers(self) -> list[int]:
        """The layers with a call in flight (claimed, not settled)."""
        return list(self.table.info(self.handle)["in_flight"])

    def claim(self, layer: int) -> int:
        """Take ``layer`` for a call; returns the token it belongs to.

        Raises:
            CallFrameError: ``BROKEN``, ``LAYER_NOT_IN_STEP`` or ``LAYER_CALLED``
                (called this token, or a call of it in flight), in that order.
        """
        return self.table.claim(self.handle, layer)

    def release(self, layer: int) -> None:
        """Give back a claim whose call was refused before it was queued."""
        self.table.settle(self.handle, layer, 0, 0)

    def settle(self, layer: int, applied: int, failed: int) -> str:
        """A claimed call of ``layer`` is done, ``applied`` items applied and
        ``failed`` not: ``"applied"`` (every item), ``"partial"`` (some) or
        ``"failed"`` (none; metrics.STEP_CALL_OUTCOMES). Once every layer of the
        token is applied the token advances; a partial call breaks the step; a
        call that applied nothing frees its layer (a retry is safe). A step closed
        meanwhile keeps no record (its handle is gone)."""
        if not self.closed:
            self.table.settle(self.handle, layer, applied, failed)
        return "failed" if not applied else "partial" if failed else "applied"

    def document(self) -> dict[str, Any]:
        """The step as ``step_open`` and ``GET /v1/steps/{step}`` answer it (lengths:
        each session's reserved length of each of the step's layers, after every
        call queued)."""
        return {
            "step": self.handle,
            "session_ids": self.session_ids,
            "layers": list(self.layers),
            "rows": self.rows,
            "queries": self.queries,
            "dtype": self.dtype,
            "causal": self.causal,
            "scale": self.scale,
            "return_lse": self.return_lse,
            "out_dtype": self.out_dtype,
            "token": self.token,
            "broken": self.failure,
            "lengths": [[s.layers[layer].length for layer in self.layers] for s in self.sessions],
        }

    def break_at(self, layer: int, token: int, item: int, slug: str, detail: str) -> None:
        """Remember the step's first partial failure (later ones change nothing)."""
        if self.failure is None:
            self.failure = {"layer": layer, "token": token, "item": item, "type": f"/problems/{slug}", "detail": detail}


class StepRegistry:
    """Every open step of this server, by handle; each session in at most one
    (``Store.enter_step``), so there are at most as many open steps as sessions
    (``capacity``: the server's ``max_sessions``, the step table's size).
    ``on_close(reason)`` is told of each close (a metric)."""

    def __init__(self, store: Store, capacity: int, on_close: Callable[[str], None] | None = None):
        self.store = store
        self.on_close = on_close
        self.table = StepTable(capacity)
        self._owners: dict[Owner, int] = {}  # each tenant's number in the table (its steps' owner)
        self._steps: dict[int, OpenStep] = {}
        self._by_bound: dict[Hashable, set[int]] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self._steps)

    def owner_id(self, owner: Owner) -> int:
        """The tenant's number in the step table (the owner its steps are checked against)."""
        number = self._owners.get(owner)
        if number is None:
            number = self._owners[owner] = len(self._owners) + 1
        return number

    def open(
        self,
        owner: Owner,
        sessions: list[Session],
        sizes: tuple[int, int, int],
        *,
        bound: Hashable | None,
        **fixed: Any,
    ) -> OpenStep:
        """A new step over ``sessions`` (distinct, the owner's, each in no step:
        checked by the caller), with its fixed options (:class:`OpenStep`'s) and
        its call's bytes of q, k and v (``sizes``: what a binary call's body holds)."""
        handle = self._next
        self._next += 1
        step = OpenStep(self.table, handle, owner, sessions, bound=bound, **fixed)
        q_bytes, k_bytes, v_bytes = sizes
        # values are checked item by item by the stacked request (a NaN fails its item alone), not by the table
        self.table.open(handle, self.owner_id(owner), step.layers, q_bytes, k_bytes, v_bytes, step.dtype, False)
        self.store.enter_step(sessions, handle)
        self._steps[handle] = step
        if bound is not None:
            self._by_bound.setdefault(bound, set()).add(handle)
        return step

    def get(self, handle: int, owner: Owner) -> OpenStep:
        """The owner's open step ``handle`` (404 step-not-found otherwise: another
        tenant's steps are simply not there)."""
        step = self._steps.get(handle)
        if step is None or step.owner != owner:
            raise StepNotFound(f"no open step {handle}")
        return step

    def close(self, step: OpenStep, reason: str) -> None:
        """Close ``step``: its handle answers 404 from now on and its sessions are
        free at once (calls still in flight complete and are answered; anything
        queued on the sessions after them applies after them)."""
        if step.closed:
            return
        step.closed = True
        del self._steps[step.handle]
        self.table.close(step.handle)
        if step.bound is not None:
            mine = self._by_bound.get(step.bound)
            if mine is not None:
                mine.discard(step.handle)
                if not mine:
                    del self._by_bound[step.bound]
        self.store.leave_step(step.sessions, step.handle)
        if self.on_close is not None:
            self.on_close(reason)

    def close_bound(self, bound: Hashable) -> int:
        """Close the steps opened on the connection ``bound`` (it closed); returns how many."""
        handles = self._by_bound.pop(bound, set())
        for handle in sorted(handles):
            step = self._steps.get(handle)
            if step is not None:
                step.bound = None  # (already out of _by_bound)
                self.close(step, "connection")
        return len(handles)

    def close_all(self) -> None:
        """Close every step (shutdown)."""
        for step in list(self._steps.values()):
            self.close(step, "shutdown")

    def idle(self, timeout: float, now: float | None = None) -> list[OpenStep]:
        """The steps not bound to a connection that no call used for ``timeout``
        seconds and have none in flight."""
        now = time.monotonic() if now is None else now
        return [
            s for s in self._steps.values() if s.bound is None and s.in_flight == 0 and now - s.last_used >= timeout
        ]
