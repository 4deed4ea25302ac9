"""Fixtures for the service tests.

* ``server``: the app with default settings, served by uvicorn on a free port of
  127.0.0.1 for the whole test session, on the shared GPU ``engine`` of
  tests/conftest.py (so without an adapter these tests skip, and FAIL under CI).
* ``api``: an :class:`~svc_helpers.Api` on it (httpx, one connection pool).
* ``enc``: each encoding in turn ("json", "msgpack").

Tests that need other settings start their own :class:`~svc_helpers.LiveServer`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from attnserve.config import Settings
from svc_helpers import ENCODINGS, Api, LiveServer


@pytest.fixture(scope="session")
def server(engine) -> Iterator[LiveServer]:
    srv = LiveServer(Settings(), engine=engine).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def shm_server(engine, tmp_path_factory) -> Iterator[LiveServer]:
    """A server with the frame transport and the shared-memory one (a module's own)."""
    path = str(tmp_path_factory.mktemp("shm") / "attnserve.sock")
    srv = LiveServer(Settings(frames_port=0, shm_socket=path), engine=engine).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def api(server) -> Iterator[Api]:
    a = Api(server.url)
    yield a
    a.close()


@pytest.fixture(params=ENCODINGS)
def enc(request) -> str:
    return request.param
