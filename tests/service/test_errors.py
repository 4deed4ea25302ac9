"""Every error row of api.md, each followed by a check that every cache is exactly as it was:
the session's info (lengths, bytes, ...) is unchanged and attends still equal the oracle
on the rows appended before."""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
from fastapi import Request

from attnserve.config import Settings
from attnserve.transport.deps import get_owner
from attnserve_client import wire
from svc_helpers import F32_TOL, PAGE, Api, LiveServer, Model, rel_err, rows

H, KV, D, LAYERS, MAX_TOKENS = 4, 2, 16, 3, 16


@dataclass
class Seeded:
    api: Api
    sid: str
    model: Model
    info: dict
    rng: np.random.Generator

    @property
    def kv(self) -> str:
        return f"/v1/sessions/{self.sid}/layers/0/kv"

    @property
    def at(self) -> str:
        return f"/v1/sessions/{self.sid}/layers/0/attend"

    def k(self, n: int = 1, heads: int = KV, d: int = D) -> np.ndarray:
        return rows(self.rng, n, heads, d)

    def q(self, n: int = 1, heads: int = H, d: int = D) -> np.ndarray:
        return rows(self.rng, n, heads, d)

    def assert_unchanged(self) -> None:
        assert self.api.info(self.sid) == self.info
        for layer in range(LAYERS):
            if not self.model.lengths[layer]:
                continue
            q = self.q(2)
            r = self.api.attend(self.sid, layer, q)
            assert r.status == 200, r.body
            assert r.body["length"] == self.model.lengths[layer]
            assert rel_err(r.body["out"], self.model.attention(layer, q)) <= F32_TOL


def seed_session(api: Api, rng: np.random.Generator) -> Seeded:
    """Layer 0: 10 rows, layer 1: 3 rows, layer 2: empty (so an append there needs new GPU memory)."""
    sid = api.create(num_qo_heads=H, num_kv_heads=KV, head_dim=D, num_layers=LAYERS, max_tokens=MAX_TOKENS)[
        "session_id"
    ]
    m = Model(H, KV, D, LAYERS)
    for layer, n in ((0, 10), (1, 3)):
        k, v = rows(rng, n, KV, D), rows(rng, n, KV, D)
        assert api.append(sid, layer, k, v).status == 200
        m.add(layer, k, v)
    return Seeded(api, sid, m, api.info(sid), rng)


@pytest.fixture
def st(api, rng):
    s = seed_session(api, rng)
    yield s
    api.delete(s.sid)


def expect(r, status: int, slug: str) -> dict:
    assert r.status == status, (r.status, r.body)
    assert r.content_type == wire.PROBLEM_JSON
    body = r.body
    assert body["type"] == f"/problems/{slug}" and body["status"] == status
    assert isinstance(body["title"], str) and isinstance(body["detail"], str) and body["detail"]
    return body


def raw(api: Api, method: str, path: str, content: bytes, ctype: str | None = wire.MSGPACK):
    headers = {"Content-Type": ctype} if ctype else {}
    return api.call(method, path, content=content, headers=headers)


# ── 400 malformed-body ──────────────────────────────────────────────────────

MALFORMED: list[tuple[str, Callable[[Seeded], tuple[str, bytes, str]]]] = [
    ("msgpack-garbage", lambda s: (s.kv, b"\xc1\xc1", wire.MSGPACK)),
    (
        "msgpack-truncated",
        lambda s: (s.kv, wire.packb({"k": wire.encode_array(s.k()), "v": wire.encode_array(s.k())})[:-9], wire.MSGPACK),
    ),
    (
        "msgpack-trailing",
        lambda s: (
            s.kv,
            wire.packb({"k": wire.encode_array(s.k()), "v": wire.encode_array(s.k())}) + b"\x00",
            wire.MSGPACK,
        ),
    ),
    ("msgpack-empty", lambda s: (s.at, b"", wire.MSGPACK)),
    ("msgpack-ext", lambda s: (s.at, b"\xd4\x01\x00", wire.MSGPACK)),
    ("json-garbage", lambda s: (s.kv, b"{not json", wire.JSON)),
    ("json-empty", lambda s: (s.at, b"", wire.JSON)),
    ("json-bad-utf8", lambda s: (s.at, b'{"q": "\xff\xfe"}', "application/json; charset=utf-8")),
    ("json-truncated", lambda s: (s.at, json.dumps({"q": s.q().tolist()}).encode()[:-3], wire.JSON)),
    ("create-garbage", lambda s: ("/v1/sessions", b"\x92\x01", wire.MSGPACK)),
]


@pytest.mark.parametrize("name, make", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_400_malformed_body(st, name, make):
    path, content, ctype = make(st)
    n = len(st.api.call("GET", "/v1/sessions").body["sessions"])
    expect(raw(st.api, "POST", path, content, ctype), 400, "malformed-body")
    st.assert_unchanged()
    assert len(st.api.call("GET", "/v1/sessions").body["sessions"]) == n


# ── 404 ─────────────────────────────────────────────────────────────────────


def test_404_session_not_found(st, enc):
    api = st.api
    for method, path, body in [
        ("GET", "/v1/sessions/nope", None),
        ("DELETE", "/v1/sessions/nope", None),
        ("POST", "/v1/sessions/nope/layers/0/kv", {"k": st.k(), "v": st.k()}),
        ("POST", "/v1/sessions/nope/layers/0/attend", {"q": st.q()}),
        ("GET", "/v1/sessions/bad.id", None),
    ]:
        expect(api.call(method, path, body, enc=enc), 404, "session-not-found")
    st.assert_unchanged()


@pytest.mark.parametrize("layer", ["3", "99", "-1", "x", "1.0", "99999999999999999999999"])
def test_404_layer_not_found(st, enc, layer):
    base = f"/v1/sessions/{st.sid}/layers/{layer}"
    expect(st.api.call("POST", base + "/kv", {"k": st.k(), "v": st.k()}, enc=enc), 404, "layer-not-found")
    expect(
        st.api.call("POST", base + "/attend", {"q": st.q(), "k": st.k(), "v": st.k()}, enc=enc), 404, "layer-not-found"
    )
    st.assert_unchanged()


def test_404_another_tenants_session(engine):
    """Sessions belong to their owner: another tenant gets 404 for every route, and
    lists only its own (the tenant comes from one dependency, overridden here)."""
    srv = LiveServer(Settings(), engine=engine)

    def owner(request: Request) -> str | None:
        return request.headers.get("x-tenant")

    srv.app.dependency_overrides[get_owner] = owner
    srv.start()
    try:
        rng = np.random.default_rng(1)
        a = Api(srv.url)
        a.client.headers["x-tenant"] = "alice"
        b = Api(srv.url)
        b.client.headers["x-tenant"] = "bob"
        st = seed_session(a, rng)
        assert [s["session_id"] for s in b.call("GET", "/v1/sessions").body["sessions"]] == []
        assert [s["session_id"] for s in a.call("GET", "/v1/sessions").body["sessions"]] == [st.sid]
        for method, path, body in [
            ("GET", f"/v1/sessions/{st.sid}", None),
            ("DELETE", f"/v1/sessions/{st.sid}", None),
            ("POST", st.kv, {"k": st.k(), "v": st.k()}),
            ("POST", st.at, {"q": st.q(), "k": st.k(), "v": st.k()}),
        ]:
            r = b.call(method, path, body, enc="msgpack")
            expect(r, 404, "session-not-found")
            assert st.sid in r.body["detail"]
        st.assert_unchanged()
        a.close()
        b.close()
    finally:
        srv.stop()


# ── 409 ─────────────────────────────────────────────────────────────────────


def test_409_offset_mismatch(st, enc):
    api, s = st.api, st
    for offset in (0, 9, 11, 10**12):
        body = expect(api.append(s.sid, 0, s.k(), s.k(), offset=offset, enc=enc), 409, "offset-mismatch")
        assert body["length"] == 10
        s.assert_unchanged()
    body = expect(api.attend(s.sid, 0, s.q(), k=s.k(), v=s.k(), offset=9, enc=enc), 409, "offset-mismatch")
    assert body["length"] == 10
    body = expect(api.attend(s.sid, 1, s.q(), offset=0, enc=enc), 409, "offset-mismatch")
    assert body["length"] == 3
    s.assert_unchanged()


def test_409_session_exists(st, enc):
    body = {"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 8}
    expect(st.api.call("PUT", f"/v1/sessions/{st.sid}", body, enc=enc), 409, "session-exists")
    st.assert_unchanged()


def test_409_capacity_exceeded(st, enc):
    api, s = st.api, st
    body = expect(api.append(s.sid, 0, s.k(7), s.k(7), enc=enc), 409, "capacity-exceeded")
    assert (body["length"], body["max_tokens"]) == (10, MAX_TOKENS)
    s.assert_unchanged()
    body = expect(api.attend(s.sid, 0, s.q(), k=s.k(7), v=s.k(7), enc=enc), 409, "capacity-exceeded")
    assert (body["length"], body["max_tokens"]) == (10, MAX_TOKENS)
    s.assert_unchanged()
    body = expect(api.append(s.sid, 2, s.k(17), s.k(17), offset=0, enc=enc), 409, "capacity-exceeded")
    assert (body["length"], body["max_tokens"]) == (0, MAX_TOKENS)
    s.assert_unchanged()


# ── 415 ─────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    "ctype",
    [
        "text/plain",
        "application/xml",
        "application/problem+json",
        "application/octet-stream",
        "multipart/form-data; boundary=x",
        None,
    ],
)
def test_415_unsupported_media_type(st, ctype):
    content = json.dumps({"k": st.k().tolist(), "v": st.k().tolist()}).encode()
    for path in (st.kv, st.at, "/v1/sessions"):
        expect(raw(st.api, "POST", path, content, ctype), 415, "unsupported-media-type")
    expect(raw(st.api, "PUT", "/v1/sessions/new-one", content, ctype), 415, "unsupported-media-type")
    assert st.api.call("GET", "/v1/sessions/new-one").status == 404
    st.assert_unchanged()


# ── 422 invalid-request ─────────────────────────────────────────────────────


def _bad_map(arr: np.ndarray, **over: Any) -> dict:
    m = wire.encode_array(arr)
    m = {**m, "data": bytes(m["data"])}
    m.update(over)
    return m


def _nan(s: Seeded, n: int = 1, heads: int = KV) -> np.ndarray:
    a = s.k(n, heads)
    a[0, 0, 3] = np.nan
    return a


def _inf(s: Seeded, heads: int = KV) -> np.ndarray:
    a = s.k(1, heads)
    a[0, 1, 0] = -np.inf
    return a


# (name, path kind, body builder, encodings, detail needle)
INVALID: list[tuple[str, str, Callable[[Seeded], Any], tuple[str, ...], str]] = [
    ("unknown-field", "kv", lambda s: {"k": s.k(), "v": s.k(), "extra": 1}, ("json", "msgpack"), "extra"),
    ("missing-v", "kv", lambda s: {"k": s.k()}, ("json", "msgpack"), "v"),
    ("missing-k", "kv", lambda s: {"v": s.k()}, ("json", "msgpack"), "k"),
    ("kv-heads", "kv", lambda s: {"k": s.k(1, 3), "v": s.k(1, 3)}, ("json", "msgpack"), "k"),
    ("head-dim", "kv", lambda s: {"k": s.k(1, KV, 8), "v": s.k(1, KV, 8)}, ("json", "msgpack"), "k"),
    ("zero-rows", "kv", lambda s: {"k": s.k(0), "v": s.k(0)}, ("msgpack",), "k"),
    ("2d", "kv", lambda s: {"k": s.k()[0], "v": s.k()[0]}, ("json", "msgpack"), "dimensions"),
    ("4d", "kv", lambda s: {"k": s.k()[None], "v": s.k()[None]}, ("json", "msgpack"), "dimensions"),
    ("v-shape", "kv", lambda s: {"k": s.k(2), "v": s.k(1)}, ("json", "msgpack"), "v"),
    ("dtype-f8", "kv", lambda s: {"k": _bad_map(s.k(), dtype="<f8"), "v": s.k()}, ("msgpack",), "dtype"),
    ("dtype-name", "kv", lambda s: {"k": _bad_map(s.k(), dtype="float16"), "v": s.k()}, ("msgpack",), "dtype"),
    ("dtype-kv-mixed", "kv", lambda s: {"k": s.k().astype(np.float16), "v": s.k()}, ("msgpack",), "dtype"),
    ("bytes-of-dtype", "kv", lambda s: {"k": _bad_map(s.k(), dtype="<f2"), "v": s.k()}, ("msgpack",), "bytes"),
    ("dtype-big-endian", "kv", lambda s: {"k": _bad_map(s.k(), dtype=">f4"), "v": s.k()}, ("msgpack",), "dtype"),
    ("bytes-short", "kv", lambda s: {"k": s.k(), "v": _bad_map(s.k(), data=b"\0" * 7)}, ("msgpack",), "bytes"),
    (
        "bytes-long",
        "kv",
        lambda s: {"k": _bad_map(s.k(), data=b"\0" * (KV * D * 4 + 4)), "v": s.k()},
        ("msgpack",),
        "bytes",
    ),
    ("shape-vs-bytes", "kv", lambda s: {"k": _bad_map(s.k(2), shape=[1, KV, D]), "v": s.k()}, ("msgpack",), "bytes"),
    ("array-extra-key", "kv", lambda s: {"k": _bad_map(s.k(), order="C"), "v": s.k()}, ("msgpack",), "keys"),
    ("nan", "kv", lambda s: {"k": _nan(s), "v": s.k()}, ("msgpack",), "finite"),
    ("inf", "kv", lambda s: {"k": s.k(), "v": _inf(s)}, ("msgpack",), "finite"),
    ("ragged", "kv", lambda s: {"k": [[[0.0] * D, [0.0] * D], [[0.0] * D]], "v": s.k()}, ("json",), "k"),
    ("strings", "kv", lambda s: {"k": [[["a"] * D] * KV], "v": s.k()}, ("json",), "numbers"),
    ("bools", "kv", lambda s: {"k": [[[True] * D] * KV], "v": s.k()}, ("json",), "numbers"),
    ("not-an-object", "kv", lambda s: [1, 2, 3], ("json", "msgpack"), "object"),
    ("offset-negative", "kv", lambda s: {"k": s.k(), "v": s.k(), "offset": -1}, ("json", "msgpack"), "offset"),
    ("offset-bool", "kv", lambda s: {"k": s.k(), "v": s.k(), "offset": True}, ("json", "msgpack"), "offset"),
    ("offset-float", "kv", lambda s: {"k": s.k(), "v": s.k(), "offset": 10.0}, ("json", "msgpack"), "offset"),
    ("q-missing", "at", lambda s: {"k": s.k(), "v": s.k()}, ("json", "msgpack"), "q"),
    ("q-heads", "at", lambda s: {"q": s.q(1, KV)}, ("json", "msgpack"), "q"),
    ("q-head-dim", "at", lambda s: {"q": s.q(1, H, 8)}, ("json", "msgpack"), "q"),
    ("q-nan", "at", lambda s: {"q": _nan(s, 1, H)}, ("msgpack",), "finite"),
    ("k-without-v", "at", lambda s: {"q": s.q(), "k": s.k()}, ("json", "msgpack"), "k"),
    ("v-without-k", "at", lambda s: {"q": s.q(), "v": s.k()}, ("json", "msgpack"), "k"),
    ("fused-kv-heads", "at", lambda s: {"q": s.q(), "k": s.k(1, 1), "v": s.k(1, 1)}, ("json", "msgpack"), "k"),
    ("fused-nan", "at", lambda s: {"q": s.q(), "k": s.k(), "v": _nan(s)}, ("msgpack",), "finite"),
    ("start-pos-past", "at", lambda s: {"q": s.q(), "start_pos": 10}, ("json", "msgpack"), "start_pos"),
    ("start-pos-rows-past", "at", lambda s: {"q": s.q(3), "start_pos": 8}, ("json", "msgpack"), "start_pos"),
    ("start-pos-negative", "at", lambda s: {"q": s.q(), "start_pos": -1}, ("json", "msgpack"), "start_pos"),
    ("start-pos-huge", "at", lambda s: {"q": s.q(), "start_pos": 2**62}, ("json", "msgpack"), "start_pos"),
    ("too-many-queries", "at", lambda s: {"q": s.q(11)}, ("json", "msgpack"), "start_pos"),
    (
        "fused-start-pos-past",
        "at",
        lambda s: {"q": s.q(), "k": s.k(), "v": s.k(), "start_pos": 11},
        ("json", "msgpack"),
        "start_pos",
    ),
    ("causal-string", "at", lambda s: {"q": s.q(), "causal": "yes"}, ("json", "msgpack"), "causal"),
    ("causal-int", "at", lambda s: {"q": s.q(), "causal": 1}, ("json", "msgpack"), "causal"),
    ("scale-nan", "at", lambda s: {"q": s.q(), "scale": math.nan}, ("msgpack",), "scale"),
    ("scale-inf", "at", lambda s: {"q": s.q(), "scale": math.inf}, ("msgpack",), "scale"),
    ("scale-string", "at", lambda s: {"q": s.q(), "scale": "0.1"}, ("json", "msgpack"), "scale"),
    ("scale-bool", "at", lambda s: {"q": s.q(), "scale": True}, ("json", "msgpack"), "scale"),
    ("attend-unknown-field", "at", lambda s: {"q": s.q(), "length": 3}, ("json", "msgpack"), "length"),
]


INVALID_CASES = [(enc, name, kind, make, needle) for name, kind, make, encs, needle in INVALID for enc in encs]


@pytest.mark.parametrize("enc, name, kind, make, needle", INVALID_CASES, ids=[f"{c[1]}-{c[0]}" for c in INVALID_CASES])
def test_422_invalid_request(st, enc, name, kind, make, needle):
    path = st.kv if kind == "kv" else st.at
    body = make(st)
    r = st.api.call("POST", path, body, enc=enc)
    problem = expect(r, 422, "invalid-request")
    assert needle in problem["detail"], problem["detail"]
    st.assert_unchanged()


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_422_non_finite_json_numbers(st, literal):
    row = ", ".join(["0.5"] * (D - 1) + [literal.decode()])
    body = ('{"k": [[[%s], [%s]]], "v": [[[%s], [%s]]]}' % ((row,) * 4)).encode()
    expect(raw(st.api, "POST", st.kv, body, wire.JSON), 422, "invalid-request")
    body = ('{"q": [[%s]], "scale": %s}' % (", ".join([f"[{row}]"] * H), literal.decode())).encode()
    expect(raw(st.api, "POST", st.at, body, wire.JSON), 422, "invalid-request")
    st.assert_unchanged()


def test_422_head_dim_unsupported_for_the_format(st, enc):
    for fields in ({"head_dim": 40, "kv_format": "turboquant"}, {"head_dim": 256}):
        body = {"num_qo_heads": 2, "num_kv_heads": 1, **fields}
        problem = expect(st.api.call("POST", "/v1/sessions", body, enc=enc), 422, "invalid-request")
        assert "head_dim" in problem["detail"]
    st.assert_unchanged()


# ── 503 and 507 ─────────────────────────────────────────────────────────────


def test_503_overloaded_when_the_gpu_queue_is_full(st, server, enc):
    worker = server.runtime.engine.worker
    old = worker.max_queue
    worker.max_queue = 0  # every submit finds the queue full
    try:
        for r in (
            st.api.append(st.sid, 0, st.k(), st.k(), enc=enc),
            st.api.append(st.sid, 2, st.k(), st.k(), enc=enc, offset=0),
            st.api.attend(st.sid, 0, st.q(), k=st.k(), v=st.k(), enc=enc),
            st.api.attend(st.sid, 1, st.q(), enc=enc),
        ):
            expect(r, 503, "overloaded")
            assert int(r.headers["retry-after"]) >= 1
    finally:
        worker.max_queue = old
    st.assert_unchanged()


def test_503_not_ready_while_draining(st, server, enc):
    rt = server.runtime
    rt.begin_drain()
    try:
        r = st.api.call("GET", "/readyz")
        expect(r, 503, "not-ready")
        assert st.api.call("GET", "/livez").status == 200
        for r in (
            st.api.append(st.sid, 0, st.k(), st.k(), enc=enc),
            st.api.attend(st.sid, 0, st.q(), k=st.k(), v=st.k(), enc=enc),
            st.api.call("POST", "/v1/sessions", {"num_qo_heads": 1, "num_kv_heads": 1, "head_dim": 4}, enc=enc),
            st.api.call("GET", f"/v1/sessions/{st.sid}"),
        ):
            expect(r, 503, "not-ready")
            assert "retry-after" in r.headers
    finally:
        rt.draining = False
    assert st.api.call("GET", "/readyz").status == 200
    st.assert_unchanged()


def test_507_out_of_memory_past_the_budget(st, server, enc):
    store = server.runtime.store
    old = store.memory_budget_bytes
    store.memory_budget_bytes = store.used_bytes + 1000  # less than a new layer's first buffers
    try:
        for r in (
            st.api.append(st.sid, 2, st.k(), st.k(), enc=enc),
            st.api.attend(st.sid, 2, st.q(), k=st.k(), v=st.k(), enc=enc),
        ):
            problem = expect(r, 507, "out-of-memory")
            assert problem["budget_bytes"] == store.memory_budget_bytes
            assert problem["requested_bytes"] == 2 * PAGE * KV * D * 4  # a layer's first page
        # appends that need no new memory still pass the budget
        k, v = st.k(), st.k()
        assert st.api.append(st.sid, 1, k, v, enc=enc).status == 200
        st.model.add(1, k, v)
        st.info = st.api.info(st.sid)
    finally:
        store.memory_budget_bytes = old
    st.assert_unchanged()


def test_507_session_limit(st, server, enc):
    store = server.runtime.store
    old = store.max_sessions
    store.max_sessions = len(store)
    try:
        body = {"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 8}
        problem = expect(st.api.call("POST", "/v1/sessions", body, enc=enc), 507, "out-of-memory")
        assert problem["max_sessions"] == len(store)
        expect(st.api.call("PUT", "/v1/sessions/one-too-many", body, enc=enc), 507, "out-of-memory")
    finally:
        store.max_sessions = old
    assert st.api.call("GET", "/v1/sessions/one-too-many").status == 404
    st.assert_unchanged()


# ── other routes and methods ────────────────────────────────────────────────


def test_unknown_routes_and_methods_are_problems(st):
    r = st.api.call("GET", "/v1/nothing-here")
    expect(r, 404, "not-found")
    r = st.api.call("PATCH", f"/v1/sessions/{st.sid}")
    expect(r, 405, "method-not-allowed")
    assert set(r.headers["allow"].split(", ")) == {"GET", "PUT", "DELETE"}
    r = st.api.call("GET", st.kv)
    expect(r, 405, "method-not-allowed")
    st.assert_unchanged()


def test_unexpected_errors_are_500_problems_without_traceback(engine):
    srv = LiveServer(Settings(), engine=engine)

    @srv.app.get("/boom")
    async def boom():
        raise RuntimeError("secret internal state")

    srv.start()
    try:
        a = Api(srv.url)
        r = a.call("GET", "/boom")
        body = expect(r, 500, "internal-error")
        assert "secret" not in r.raw.decode() and "Traceback" not in r.raw.decode()
        assert r.headers["x-request-id"] in body["detail"]
        assert a.call("GET", "/livez").status == 200
        a.close()
    finally:
        srv.stop()


# ── 413 payload-too-large (a server with a small limit) ─────────────────────

LIMIT = 4096


@pytest.fixture(scope="module")
def small(engine):
    srv = LiveServer(Settings(max_body_bytes=LIMIT), engine=engine).start()
    a = Api(srv.url)
    yield srv, a
    a.close()
    srv.stop()


def _http_raw(url: str, head: bytes, parts: list[bytes]) -> bytes:
    """Send the head and parts of a request on a raw socket (never finishing a big
    body) and return what the server answers."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head)
        for p in parts:
            s.sendall(p)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head_end = data.index(b"\r\n\r\n") + 4
        length = int(
            [ln.split(b":")[1] for ln in data[:head_end].split(b"\r\n") if ln.lower().startswith(b"content-length")][0]
        )
        while len(data) < head_end + length:
            data += s.recv(65536)
        return data


def test_413_payload_too_large(small, rng):
    srv, a = small
    assert a.call("GET", "/v1/info").body["limits"]["max_body_bytes"] == LIMIT
    st = seed_session(a, rng)
    big = {"k": st.k(40), "v": st.k(40)}  # 2 * 40 * 2 * 16 * 4 bytes of data > 4096
    for enc in ("json", "msgpack"):
        r = a.append(st.sid, 0, big["k"], big["v"], enc=enc)
        problem = expect(r, 413, "payload-too-large")
        assert problem["max_body_bytes"] == LIMIT
        st.assert_unchanged()
        r = a.attend(st.sid, 0, st.q(), k=big["k"], v=big["v"], enc=enc)
        expect(r, 413, "payload-too-large")
        st.assert_unchanged()
    # streamed without a Content-Length (chunked): refused once the bytes pass the limit
    payload = wire.packb({"k": wire.encode_array(big["k"]), "v": wire.encode_array(big["v"])})
    r = a.client.post(
        st.kv,
        content=iter([payload[i : i + 1000] for i in range(0, len(payload), 1000)]),
        headers={"Content-Type": wire.MSGPACK},
    )
    assert r.status_code == 413 and r.json()["type"] == "/problems/payload-too-large"
    st.assert_unchanged()
    # a body of exactly the limit is read (then judged on its content)
    k, v = st.k(2), st.k(2)
    body = json.dumps({"k": k.tolist(), "v": v.tolist()}).encode()
    body = body[:-1] + b" " * (LIMIT - len(body)) + b"}"
    assert len(body) == LIMIT
    r = raw(a, "POST", st.kv, body, wire.JSON)
    assert r.status == 200 and r.body == {"length": 12}
    st.model.add(0, k, v)
    st.info = a.info(st.sid)
    st.assert_unchanged()
    a.delete(st.sid)


def test_413_comes_before_the_body_is_read(small, rng):
    """The answer comes while most of the body is still unsent: the server never waits for it."""
    srv, a = small
    st = seed_session(a, rng)
    path = st.kv.encode()
    # a Content-Length far past the limit, and only a few bytes of the body sent
    head = (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/vnd.msgpack\r\n"
        b"Content-Length: 10000000000\r\n\r\n"
    )
    answer = _http_raw(srv.url, head, [b"\x82" + b"\0" * 100])
    assert answer.startswith(b"HTTP/1.1 413") and b"/problems/payload-too-large" in answer
    # chunked, never finished: refused as soon as the streamed bytes pass the limit
    head = (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/vnd.msgpack\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunks = [b"%x\r\n" % 1024 + b"\0" * 1024 + b"\r\n" for _ in range(6)]  # 6 KiB, no final chunk
    answer = _http_raw(srv.url, head, chunks)
    assert answer.startswith(b"HTTP/1.1 413") and b"/problems/payload-too-large" in answer
    st.assert_unchanged()
    a.delete(st.sid)
