"""Sessions placed from a GPU call (a snapshot's load, a fork), and the rule of
which sessions a server that keeps snapshots may hold."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, Callable

from .engine import Engine
from .errors import InvalidRequest
from .kv.config import SessionConfig
from .kv.session import SessionKV
from .runtime import Runtime
from .store import Session

__all__ = ["check_kept", "place_session"]


def check_kept(rt: Runtime, config: SessionConfig) -> None:
    """A session with exact sinks or a window cannot live on a server that keeps its
    sessions in a snapshot directory (its journals do not hold the exact rows yet):
    a create or a restore of one there is refused (422) before anything is made."""
    if config.windowed and rt.settings.snapshot_dir:
        raise InvalidRequest(
            "sinks, window: this server keeps its sessions across restarts (snapshot_dir), and does not yet keep "
            "a session's exact sinks and window rows there; use a session without them, or a server without a "
            "snapshot directory"
        )


async def place_session(
    rt: Runtime, engine: Engine, kv: SessionKV, fill: Callable[[], Future[Any]], hold: tuple[str | None, str]
) -> Session:
    """A new session whose caches ``fill()`` queues the GPU call to fill (a snapshot's
    load, a fork), under the id and bytes ``hold`` took (``Store.hold``): waits for
    it, then adds the session to the store. The hold is given back either way (a full
    queue included); if the request goes away first, what the call loads is released
    when it lands."""
    try:
        filled = fill()  # may raise Overloaded: the hold goes back below
        try:
            await asyncio.shield(asyncio.wrap_future(filled))
        except asyncio.CancelledError:
            filled.add_done_callback(lambda f: f.exception() is None and engine.release(kv))
            raise
    finally:
        rt.store.unhold(hold)
    owner, session_id = hold
    return rt.store.adopt(kv, owner=owner, session_id=session_id)
