"""Fixtures of the hardening tests (fuzzing, abuse, snapshots across replicas).

These tests run real server processes (``python -m attnserve serve`` on a free
port of 127.0.0.1, see :class:`hard_helpers.ServerProcess`), so a crash, a leak
or a hang of the server is seen as it would be in production. Without a wgpu
adapter they skip on a developer machine and FAIL when CI is set.

They reuse the live-server helpers of tests/service (``svc_helpers``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "service"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from hard_helpers import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def spawn(tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    """``spawn(name, **env)`` starts a server process (stopped at the end of the module)."""
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("servers")

    def start(name: str = "server", **env: str) -> ServerProcess:
        srv = ServerProcess(log_dir, name, {k: str(v) for k, v in env.items()})
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.stop()
