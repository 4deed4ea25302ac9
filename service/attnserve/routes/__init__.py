"""One router per resource: sessions, kv (append and attend), snapshots, probes."""

from . import kv, probes, sessions, snapshots

__all__ = ["kv", "probes", "sessions", "snapshots"]
