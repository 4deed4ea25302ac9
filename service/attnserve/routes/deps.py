"""The app's runtime state and the typed dependencies every router shares.

``Runtime`` holds what lives as long as the app: settings, the session store,
metrics, the engine once the device is open, and the ready/draining flags.
Routes get it, and everything derived from it, through ``Annotated`` dependencies
(``RuntimeDep``, ``WireDep``, ``EngineDep``, ``OwnerDep``, ``SessionDep``), so a
test or a later issue (API keys) swaps one function to change behaviour
everywhere.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from typing import Annotated, Any, Callable, Optional

from fastapi import Depends, Path, Request

from ..codec import Wire, negotiate, offload
from ..config import Settings
from ..engine import Engine
from ..errors import NotReady
from ..metrics import Metrics
from ..store import Reservation, Session, Store

__all__ = [
    "Runtime",
    "get_runtime",
    "get_owner",
    "get_wire",
    "get_engine",
    "get_session",
    "RuntimeDep",
    "OwnerDep",
    "WireDep",
    "EngineDep",
    "SessionDep",
    "SessionIdPath",
    "LayerPath",
]

log = logging.getLogger("attnserve")


class Runtime:
    def __init__(self, settings: Settings, engine: Engine | None = None):
        self.settings = settings
        self.store = Store(max_sessions=settings.max_sessions, memory_budget_bytes=settings.memory_budget_bytes)
        self.metrics = Metrics()
        self.engine: Engine | None = engine
        self.ready = False
        self.draining = False
        self.in_flight = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None

    # ── lifecycle ───────────────────────────────────────────────────────────

    def begin_drain(self) -> None:
        """Stop being ready: /readyz answers 503 and new /v1 requests are refused."""
        if not self.draining:
            log.info("draining", extra={"in_flight": self.in_flight})
        self.draining = True

    def request_started(self) -> None:
        self.in_flight += 1

    def request_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float, *, leave: int = 0) -> bool:
        """Wait until at most ``leave`` requests are in flight; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight > leave:
            self._idle = asyncio.Event()
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._idle.wait(), min(left, 0.05))
            except asyncio.TimeoutError:
                pass
        return True

    # ── work ────────────────────────────────────────────────────────────────

    async def offload(self, fn: Callable[..., Any], *args: Any, size: int) -> Any:
        return await offload(fn, *args, size=size, threshold=self.settings.offload_bytes)

    def track(self, fut: Future, res: Reservation) -> None:
        """Settle ``res`` in the store on the event loop as soon as ``fut`` is done
        (independently of the request that queued it)."""
        self.store.commit(res)
        loop = self.loop or asyncio.get_running_loop()

        def done(f: Future) -> None:
            err: BaseException | None
            err = asyncio.CancelledError() if f.cancelled() else f.exception()
            try:
                loop.call_soon_threadsafe(self.store.finish, res, err)
            except RuntimeError:  # pragma: no cover - the loop is gone (shutdown)
                pass

        fut.add_done_callback(done)


# ── dependencies ─────────────────────────────────────────────────────────────


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_owner(request: Request) -> str | None:
    """The tenant a request acts for. ``None`` (one tenant) until API keys exist;
    sessions record it and list/get/every session route filter by it."""
    return None


OwnerDep = Annotated[Optional[str], Depends(get_owner)]


def get_wire(request: Request, rt: RuntimeDep) -> Wire:
    """Encodings of the request and its answer; 415 and a declared-length 413 here,
    before anything else (and before any byte of the body is read)."""
    return negotiate(request, rt.settings.max_body_bytes)


WireDep = Annotated[Wire, Depends(get_wire)]


def get_engine(rt: RuntimeDep) -> Engine:
    if rt.engine is None or not rt.ready or rt.draining:
        raise NotReady(
            "the server is draining" if rt.draining else "the GPU device is not ready",
            headers={"Retry-After": "1"},
        )
    return rt.engine


EngineDep = Annotated[Engine, Depends(get_engine)]

SessionIdPath = Annotated[str, Path(description="The session's id.", examples=["my-session-1"])]
LayerPath = Annotated[
    str, Path(pattern=r"^[0-9]{1,10}$", description="Layer index, 0..num_layers-1.", examples=["0"])
]


def get_session(session_id: SessionIdPath, rt: RuntimeDep, owner: OwnerDep) -> Session:
    return rt.store.get(session_id, owner)


SessionDep = Annotated[Session, Depends(get_session)]
