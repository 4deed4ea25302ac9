"""POST /v1/sessions/{id}/fork: a session that shares its source's full pages.

A fork, and its source after it, answer bit for bit like sessions built by
replaying the same appends; deleting either side frees only what nobody else
holds; snapshots of a fork are self-contained; bad forks change nothing."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from attnserve_client import Client, wire
from svc_helpers import PAGE, rows

SHAPES = [(4, 2, 32, "f32"), (6, 2, 64, "turboquant"), (4, 2, 72, "bf16")]


def _fork(api, sid, body=None, enc="json"):
    return api.call("POST", f"/v1/sessions/{sid}/fork", body, enc=enc)


def _pool_pages(api) -> int:
    return sum(p["used_pages"] for p in api.call("GET", "/v1/info").body["pool"]["pools"])


def _twin(api, spec, appends):
    """A session built by replaying ``appends`` [(layer, k, v), ...]."""
    sid = api.create(**spec)["session_id"]
    for layer, k, v in appends:
        assert api.append(sid, layer, k, v).status == 200
    return sid


@pytest.mark.parametrize("h, hkv, d, fmt", SHAPES)
@pytest.mark.parametrize("cut", ["whole-pages", "partial-page"])
def test_a_fork_and_its_source_answer_like_replayed_sessions(api, rng, enc, h, hkv, d, fmt, cut):
    spec = dict(
        num_qo_heads=h, num_kv_heads=hkv, head_dim=d, kv_format=fmt, num_layers=2, seed=int(rng.integers(2**40))
    )
    n0 = 2 * PAGE if cut == "whole-pages" else 2 * PAGE + 5
    history = [(layer, rows(rng, n0 - 3 * layer, hkv, d), rows(rng, n0 - 3 * layer, hkv, d)) for layer in (0, 1)]
    src = _twin(api, spec, history)
    pages0 = _pool_pages(api)
    r = _fork(api, src, {"session_id": "fork-" + cut + fmt}, enc=enc)
    assert r.status == 201, r.body
    assert r.headers["location"] == f"/v1/sessions/fork-{cut}{fmt}"
    fork = r.body["session_id"]
    assert r.body["lengths"] == api.info(src)["lengths"] == [n0, n0 - 3]
    grown = _pool_pages(api) - pages0
    assert grown == (0 if cut == "whole-pages" else 1) + 1  # a copy of each partial last page only
    # the two diverge: different rows appended to each
    extra_src = [(layer, rows(rng, 7, hkv, d), rows(rng, 7, hkv, d)) for layer in (0, 1)]
    extra_fork = [(layer, rows(rng, PAGE + 1, hkv, d), rows(rng, PAGE + 1, hkv, d)) for layer in (0, 1)]
    for sid, extra in ((src, extra_src), (fork, extra_fork)):
        for layer, k, v in extra:
            assert api.append(sid, layer, k, v).status == 200
    twins = {src: _twin(api, spec, history + extra_src), fork: _twin(api, spec, history + extra_fork)}
    for sid, twin in twins.items():
        for layer in (0, 1):
            q = rows(rng, 2, h, d)
            a, b = api.attend(sid, layer, q), api.attend(twin, layer, q)
            assert a.status == b.status == 200
            assert a.body["out"].tobytes() == b.body["out"].tobytes()  # bit for bit
    for sid in (src, fork, *twins.values()):
        api.delete(sid)


def test_a_fork_at_a_shorter_length(api, rng):
    h, hkv, d = 2, 1, 16
    spec = dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2)
    k, v = rows(rng, 3 * PAGE, hkv, d), rows(rng, 3 * PAGE, hkv, d)
    src = _twin(api, spec, [(0, k, v), (1, k[: PAGE + 2], v[: PAGE + 2])])
    r = _fork(api, src, {"length": PAGE + 1})
    assert r.status == 201 and r.body["lengths"] == [PAGE + 1, PAGE + 1]
    twin = _twin(api, spec, [(0, k[: PAGE + 1], v[: PAGE + 1]), (1, k[: PAGE + 1], v[: PAGE + 1])])
    q = rows(rng, 1, h, d)
    for layer in (0, 1):
        assert api.attend(r.body["session_id"], layer, q).body["out"].tobytes() == (
            api.attend(twin, layer, q).body["out"].tobytes()
        )
    assert api.info(src)["lengths"] == [3 * PAGE, PAGE + 2]  # the source is untouched
    for sid in (src, r.body["session_id"], twin):
        api.delete(sid)


def test_deleting_either_side_frees_only_what_nobody_else_holds(api, server, rng):
    h, hkv, d = 2, 1, 16
    k, v = rows(rng, 4 * PAGE, hkv, d), rows(rng, 4 * PAGE, hkv, d)
    base = _pool_pages(api)
    src = _twin(api, dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d), [(0, k, v)])
    store = server.runtime.store
    used = store.used_bytes
    held = api.info(src)["bytes"]
    fork = _fork(api, src).body["session_id"]
    assert _pool_pages(api) == base + 4  # shared: held once
    # ... and charged once: to the source; the fork shares whole pages and pays for none
    assert api.info(fork)["bytes"] == 0 and api.info(src)["bytes"] == held and store.used_bytes == used
    q = rows(rng, 1, h, d)
    before = api.attend(fork, 0, q).body["out"].tobytes()
    assert api.delete(src).status == 204
    assert _pool_pages(api) == base + 4  # the fork still holds them all
    assert api.info(fork)["bytes"] == held and store.used_bytes == used  # and now pays for them
    assert api.attend(fork, 0, q).body["out"].tobytes() == before
    fork2 = _fork(api, fork, {"length": 2 * PAGE}).body["session_id"]
    assert api.info(fork2)["bytes"] == 0
    assert api.delete(fork).status == 204
    assert _pool_pages(api) == base + 2  # fork2 holds the first two
    assert api.info(fork2)["bytes"] == held // 2  # and pays for them now
    assert api.delete(fork2).status == 204
    assert _pool_pages(api) == base and store.used_bytes == used - held


def test_a_snapshot_of_a_fork_is_self_contained(api, rng):
    h, hkv, d = 4, 2, 32
    spec = dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, kv_format="turboquant")
    k, v = rows(rng, PAGE + 3, hkv, d), rows(rng, PAGE + 3, hkv, d)
    src = _twin(api, spec, [(0, k, v)])
    fork = _fork(api, src).body["session_id"]
    q = rows(rng, 1, h, d)
    want = api.attend(fork, 0, q).body["out"].tobytes()
    blob = api.client.get(f"/v1/sessions/{fork}/snapshot").content
    api.delete(src)
    api.delete(fork)
    r = api.call("PUT", "/v1/sessions/from-fork/snapshot", content=blob, headers={"Content-Type": wire.MSGPACK})
    assert r.status == 201, r.body
    assert api.attend("from-fork", 0, q).body["out"].tobytes() == want
    api.delete("from-fork")


def test_bad_forks_are_problems_and_change_nothing(api, rng):
    h, hkv, d = 2, 1, 8
    src = _twin(
        api, dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2), [(0, *[rows(rng, 5, hkv, d)] * 2)]
    )
    taken = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)["session_id"]
    n = len(api.call("GET", "/v1/sessions").body["sessions"])
    for body, status, slug in (
        ({"length": 1}, 422, "invalid-request"),  # layer 1 holds 0 rows
        ({"length": -1}, 422, "invalid-request"),
        ({"length": "3"}, 422, "invalid-request"),
        ({"session_id": "no/slash"}, 422, "invalid-request"),
        ({"session_id": taken}, 409, "session-exists"),
        ({"colour": "red"}, 422, "invalid-request"),
        ([1, 2], 422, "invalid-request"),
    ):
        r = _fork(api, src, body)
        assert r.status == status and r.problem_type == f"/problems/{slug}", (body, r.status, r.body)
    r = _fork(api, "nobody-has-this", {})
    assert r.status == 404 and r.problem_type == "/problems/session-not-found"
    assert len(api.call("GET", "/v1/sessions").body["sessions"]) == n
    api.delete(src)
    api.delete(taken)


def test_the_client_forks(server, rng):
    h, hkv, d = 4, 2, 16
    with Client(server.url) as client:
        s = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=1)
        k, v = rows(rng, PAGE + 1, hkv, d), rows(rng, PAGE + 1, hkv, d)
        s.append(0, k, v)
        f = s.fork(session_id="client-fork")
        assert f.session_id == "client-fork" and f.lengths == (PAGE + 1,)
        q = rows(rng, 1, h, d)
        np.testing.assert_array_equal(f.attend(0, q), s.attend(0, q))
        g = s.fork(length=3)
        assert g.lengths == (3,)
        for x in (s, f, g):
            x.delete()


def test_a_fork_whose_source_is_deleted_while_its_body_arrives_is_not_found(api, server, rng):
    """The source is looked up again once the body is read: deleted between the
    body's first and last byte, the fork is 404 session-not-found and nothing is made."""
    h, hkv, d = 2, 1, 8
    for length in (None, 3):  # the default length, and one the deleted source held
        src = _twin(api, dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d), [(0, *[rows(rng, 5, hkv, d)] * 2)])
        body = json.dumps({"session_id": "fork-of-deleted", "length": length}).encode()
        n = len(api.call("GET", "/v1/sessions").body["sessions"])
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(
                (
                    f"POST /v1/sessions/{src}/fork HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                ).encode()
                + body[:-1]
            )
            time.sleep(0.2)  # the route has looked the source up and waits for the body's last byte
            assert api.delete(src).status == 204
            sock.sendall(body[-1:])
            head, _, rest = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 404"), head
        assert json.loads(rest)["type"] == "/problems/session-not-found"
        assert api.call("GET", "/v1/sessions/fork-of-deleted").status == 404
        assert len(api.call("GET", "/v1/sessions").body["sessions"]) == n - 1


def _read_response(sock: socket.socket) -> tuple[bytes, bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head, b"", body


def test_a_fork_past_the_budget_names_the_fork_and_its_source(api, server, rng):
    h, hkv, d = 2, 1, 8
    src = _twin(api, dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d), [(0, *[rows(rng, 5, hkv, d)] * 2)])
    store = server.runtime.store
    budget = store.memory_budget_bytes
    store.memory_budget_bytes = store.used_bytes  # the fork's copy of the partial page does not fit
    try:
        r = _fork(api, src, {"session_id": "fork-past-budget"})
    finally:
        store.memory_budget_bytes = budget
    assert r.status == 507 and r.problem_type == "/problems/out-of-memory", r.body
    assert f"the fork 'fork-past-budget' of session {src!r} needs" in r.body["detail"], r.body["detail"]
    assert api.call("GET", "/v1/sessions/fork-past-budget").status == 404
    api.delete(src)
