"""The control plane over HTTP, one router per resource: sessions, snapshots,
steps (open, get, close), probes, problem pages. The data plane's routes (append, attend, the batched step)
are ``transport/``'s, whose dependencies these import (the bodies' models and
schemas: ``attnserve.contract``)."""

from . import probes, sessions, snapshots, steps

__all__ = ["probes", "sessions", "snapshots", "steps"]
