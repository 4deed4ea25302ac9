"""The exception tree and parse_problem."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
from email.utils import formatdate
import time

import httpx
import pytest

import attnserve_client as ac
from attnserve_client import wire
from attnserve_client.errors import parse_retry_after
from attnserve_client.problems import PROBLEM_TYPES

# (status, slug, class) of every problem type with a client class of its own; the
# slugs and statuses from the one list, attnserve_client.problems
SLUGS = [
    (PROBLEM_TYPES[cls.slug].status, cls.slug, cls)
    for cls in ac.APIError.__subclasses__()
    if cls is not ac.APIStatusError
]
assert len(SLUGS) == 21, SLUGS  # 17, and the step's four (issue 53)


def problem(status, slug, **extra):
    return {
        "type": f"/problems/{slug}",
        "title": slug.replace("-", " "),
        "status": status,
        "detail": f"detail of {slug}",
        **extra,
    }


@pytest.mark.parametrize("status, slug, cls", SLUGS)
@pytest.mark.parametrize("form", ["json", "msgpack", "dict"])
def test_every_slug_maps_to_its_class(status, slug, cls, form):
    body = problem(status, slug, extra_member=[1, 2])
    raw = {"json": json.dumps(body).encode(), "msgpack": wire.packb(body), "dict": body}[form]
    err = ac.parse_problem(status, raw, {"Retry-After": "3"})
    assert type(err) is cls and cls.slug == slug
    assert isinstance(err, ac.APIError) and isinstance(err, ac.AttnServeError)
    assert err.status == status and err.problem == body
    assert err.type == f"/problems/{slug}" and err.title == body["title"] and err.detail == body["detail"]
    assert err.retry_after == 3.0 and err.headers["retry-after"] == "3"
    assert str(err) == f"{status} {slug}: detail of {slug}"


def test_the_slug_is_the_last_path_segment_of_type():
    err = ac.parse_problem(404, problem(404, "x") | {"type": "https://errors.example/problems/session-not-found/"})
    assert type(err) is ac.SessionNotFound


def test_offset_mismatch_carries_length():
    assert ac.parse_problem(409, problem(409, "offset-mismatch", length=17)).length == 17
    assert ac.parse_problem(409, problem(409, "offset-mismatch")).length is None
    assert ac.parse_problem(409, problem(409, "offset-mismatch", length="17")).length is None


def test_unknown_type_and_non_problem_bodies():
    err = ac.parse_problem(418, problem(418, "teapot"))
    assert type(err) is ac.APIStatusError and err.status == 418 and err.problem["type"] == "/problems/teapot"
    err = ac.parse_problem(500, b"<html>Internal Server Error</html>")
    assert type(err) is ac.APIStatusError and err.detail == "<html>Internal Server Error</html>"
    assert str(err) == "500 error: <html>Internal Server Error</html>"
    err = ac.parse_problem(502, b"")
    assert type(err) is ac.APIStatusError and err.problem == {} and err.detail is None
    err = ac.parse_problem(404, {"detail": "Not Found"})  # a framework's default 404, no type
    assert type(err) is ac.APIStatusError and err.detail == "Not Found"
    # A status that names one problem type only, without a problem body (e.g. from a proxy).
    assert type(ac.parse_problem(413, b"<html>413 Request Entity Too Large</html>")) is ac.PayloadTooLarge
    assert type(ac.parse_problem(401, b"")) is ac.Unauthorized
    assert type(ac.parse_problem(503, b"")) is ac.APIStatusError  # overloaded or not-ready: unknown


def test_retry_after_forms():
    assert parse_retry_after(None) is None
    assert parse_retry_after(" 2.5 ") == 2.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None
    assert 8 <= parse_retry_after(formatdate(time.time() + 10, usegmt=True)) <= 10
    assert parse_retry_after(formatdate(time.time() - 100, usegmt=True)) == 0.0


def test_hierarchy():
    assert issubclass(ac.InvalidInput, ValueError) and issubclass(ac.InvalidInput, ac.AttnServeError)
    assert issubclass(ac.APITimeoutError, ac.APIConnectionError)
    assert issubclass(ac.APIConnectionError, ac.AttnServeError)
    assert issubclass(ac.InvalidResponse, ac.AttnServeError)
    assert issubclass(ac.APIStatusError, ac.APIError)
    for _, _, cls in SLUGS:
        assert issubclass(cls, ac.APIError) and not issubclass(cls, ac.APIStatusError)
    assert issubclass(ac.WireError, ValueError)
    err = ac.InvalidInput("q: bad")
    assert err.status is None and err.problem == {} and err.type is None


KEY = "planted-key-4b7e"


@pytest.fixture
def closed_url():
    """The URL of a loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_connection_error_names_the_url_tried_never_the_key(closed_url, caplog):
    with ac.Client(closed_url, api_key=KEY, max_retries=0) as client:
        with pytest.raises(ac.APIConnectionError) as info:
            client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=4, server_assigned_id=True)
        assert str(info.value).startswith(f"could not connect to {closed_url} (POST /v1/sessions): ConnectError: ")
        assert isinstance(info.value.__cause__, httpx.ConnectError)
        with pytest.raises(ac.APIConnectionError, match=rf"^stream: cannot connect to {closed_url}/v1/stream: "):
            client.stream()
        port = int(closed_url.rsplit(":", 1)[1])
        with pytest.raises(ac.APIConnectionError, match=rf"^frames: cannot connect to 127\.0\.0\.1:{port}: "):
            client.stream(transport="frames", frames_address=("127.0.0.1", port))

    def shown(err):
        assert KEY not in str(err) and KEY not in repr(err) and KEY not in str(err.__cause__)
        return str(err)

    async def run():
        async with ac.AsyncClient(closed_url, api_key=KEY, max_retries=0) as aclient:
            with pytest.raises(ac.APIConnectionError) as got:
                await aclient.info()
            with pytest.raises(ac.APIConnectionError) as streamed:
                await aclient.stream()
        return shown(got.value), shown(streamed.value)  # the messages only: the errors (and what they hold) go

    shown(info.value)
    got, streamed = asyncio.run(run())
    assert got.startswith(f"could not connect to {closed_url} (GET /v1/info): ConnectError: ")
    assert streamed.startswith(f"stream: cannot connect to {closed_url}/v1/stream: ")
    gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []  # no "exception never retrieved"


def test_an_answer_lost_after_sending_names_the_url_too(make_client, fake):
    client = make_client(max_retries=0)
    fake.fail("drop", method="GET")
    with pytest.raises(ac.APIConnectionError) as info:
        client.info()
    assert str(info.value) == (
        "no answer from http://attnserve.test (GET /v1/info): RemoteProtocolError: "
        "server disconnected without sending a response"
    )
    fake.fail("late", method="GET")
    with pytest.raises(ac.APITimeoutError) as late:
        client.info()
    assert str(late.value) == "no answer from http://attnserve.test (GET /v1/info): ReadTimeout: timed out"
