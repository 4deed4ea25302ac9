"""InstanceHeaderMiddleware: X-Attnserve-Instance on every HTTP answer, nothing else touched."""

from __future__ import annotations

import asyncio
import socket

import pytest

from attnserve.instance import ENV_VAR, HEADER, InstanceHeaderMiddleware, instance_name


def _run(app, scope, body_chunks=(b"",)):
    """Drive an ASGI app with one request; return the messages it sent."""
    sent = []
    incoming = [
        {"type": "http.request", "body": c, "more_body": i < len(body_chunks) - 1} for i, c in enumerate(body_chunks)
    ]

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


async def _plain_app(scope, receive, send):
    if scope["type"] == "lifespan":
        message = await receive()
        assert message["type"] == "lifespan.startup"
        await send({"type": "lifespan.startup.complete"})
        return
    await send(
        {
            "type": "http.response.start",
            "status": 404,
            "headers": [(b"content-type", b"application/problem+json"), (b"x-attnserve-instance", b"stale")],
        }
    )
    await send({"type": "http.response.body", "body": b'{"a":', "more_body": True})
    await send({"type": "http.response.body", "body": b"1}"})


HTTP_SCOPE = {"type": "http", "method": "GET", "path": "/x", "headers": [], "query_string": b""}


def _headers(messages):
    start = next(m for m in messages if m["type"] == "http.response.start")
    return start["headers"]


def test_header_added_once_and_body_streamed_untouched():
    messages = _run(InstanceHeaderMiddleware(_plain_app, name="replica-a"), HTTP_SCOPE)
    headers = _headers(messages)
    assert [v for k, v in headers if k == b"x-attnserve-instance"] == [b"replica-a"]
    assert (b"content-type", b"application/problem+json") in headers
    assert messages[0]["status"] == 404
    bodies = [m for m in messages if m["type"] == "http.response.body"]
    assert [m["body"] for m in bodies] == [b'{"a":', b"1}"]
    assert bodies[0]["more_body"] is True


def test_name_from_environment_then_hostname(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "attnserve-3")
    assert InstanceHeaderMiddleware(_plain_app).name == "attnserve-3"
    assert instance_name() == "attnserve-3"
    monkeypatch.delenv(ENV_VAR)
    assert instance_name() == instance_name(None) != ""
    assert instance_name() == socket.gethostname()[:128] or not socket.gethostname()
    monkeypatch.setenv(ENV_VAR, "   ")
    assert instance_name() == instance_name(None)  # blank: the host name


def test_unsafe_names_are_made_header_safe():
    assert instance_name("gpu 0\r\nX-Evil: 1") == "gpu 0__X-Evil: 1"
    assert instance_name("réplica") == "r_plica"
    assert len(instance_name("x" * 500)) == 128


def test_lifespan_and_websocket_pass_through():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])
        await _plain_app(scope, receive, send)

    wrapped = InstanceHeaderMiddleware(app, name="a")
    sent = []

    async def receive():
        return {"type": "lifespan.startup"}

    async def send(message):
        sent.append(message)

    asyncio.run(wrapped({"type": "lifespan"}, receive, send))
    assert seen == ["lifespan"] and sent == [{"type": "lifespan.startup.complete"}]


def _fastapi_app():
    fastapi = pytest.importorskip("fastapi")

    app = fastapi.FastAPI()

    @app.get("/ok")
    def ok():
        return {"ok": True}

    @app.get("/boom")
    def boom():
        raise RuntimeError("boom")

    return app


def test_with_fastapi_add_middleware():
    from fastapi.testclient import TestClient

    app = _fastapi_app()
    app.add_middleware(InstanceHeaderMiddleware, name="replica-b")
    with TestClient(app, raise_server_exceptions=False) as client:
        for path, status in (("/ok", 200), ("/missing", 404)):
            response = client.get(path)
            assert response.status_code == status
            assert response.headers.get_list(HEADER) == ["replica-b"], path


def test_wrapping_the_app_marks_unhandled_errors_too():
    # Starlette's ServerErrorMiddleware sits outside add_middleware's stack, so only
    # wrapping the whole app also marks the 500 of an unhandled exception.
    from fastapi.testclient import TestClient

    with TestClient(
        InstanceHeaderMiddleware(_fastapi_app(), name="replica-c"), raise_server_exceptions=False
    ) as client:
        for path, status in (("/ok", 200), ("/missing", 404), ("/boom", 500)):
            response = client.get(path)
            assert response.status_code == status
            assert response.headers.get_list(HEADER) == ["replica-c"], path
