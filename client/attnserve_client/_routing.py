"""Where each session lives, for clients behind a router of several replicas.

Every answer names the replica that gave it (``X-Attnserve-Instance``); a router
pins a session to one replica by its id (``docs/deploy.md``). A batched step may
hold sessions of several replicas, so the client splits it: one request per
replica, each carrying ``X-Attnserve-Route: <an id of that replica's sessions>``,
which the router hashes like the id in a session path. ``ReplicaMap`` remembers,
from the answers, which replica holds which session.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence

__all__ = ["ReplicaMap", "ROUTE_HEADER", "INSTANCE_HEADER"]

ROUTE_HEADER = "X-Attnserve-Route"
INSTANCE_HEADER = "x-attnserve-instance"
_SESSION_PATH = re.compile(r"^/v1/sessions/([A-Za-z0-9_-]{1,64})(?:/|$)")


class ReplicaMap:
    """Session id -> the replica (instance name) that answered for it, most recent
    ``capacity`` sessions; and every replica name seen."""

    def __init__(self, capacity: int = 1 << 17) -> None:
        self.capacity = capacity
        self._where: OrderedDict[str, str] = OrderedDict()
        self.instances: set[str] = set()

    def note(self, method: str, path: str, headers: Mapping[str, str], session_id: str | None = None) -> None:
        """Learn from a success answer to ``method path`` (``session_id``: the id of a
        session the answer created, when the path does not name it)."""
        instance = headers.get(INSTANCE_HEADER) or ""  # a server that names no replica: one place
        self.instances.add(instance)
        m = _SESSION_PATH.match(path)
        sid = m.group(1) if m else session_id
        if sid is None:
            return
        if method == "DELETE" and m is not None:
            self._where.pop(sid, None)
            return
        self._where[sid] = instance
        self._where.move_to_end(sid)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def where(self, session_id: str) -> str | None:
        """The replica that last answered for ``session_id`` (None: not known)."""
        return self._where.get(session_id)

    def unknown(self, ids: Sequence[str]) -> list[str]:
        """The ids whose replica is not known (never seen in an answer), once each."""
        return [sid for sid in dict.fromkeys(ids) if sid not in self._where]

    def groups(self, ids: Sequence[str]) -> list[list[int]]:
        """The indexes of ``ids`` by replica, in first-seen order; the ids of unknown
        place (no session answered for them) form a group of their own."""
        by: dict[str | None, list[int]] = {}
        for i, sid in enumerate(ids):
            by.setdefault(self._where.get(sid), []).append(i)
        return list(by.values())
