"""One router per resource: sessions, kv (append and attend), probes."""

from . import kv, probes, sessions

__all__ = ["kv", "probes", "sessions"]
