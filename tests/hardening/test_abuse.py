"""Abuse, one kind at a time, against a real server process: bodies over the limit
(refused before they are read), MessagePack and JSON bombs (deep nesting, huge
declared lengths, containers by the million), shapes whose product overflows, ids
with path characters, slow and stalled bodies, and non-finite values.

Each refusal is the documented problem, answers promptly, and leaves every session
as it was; the sessions made at the start still answer oracle-exact at the end,
and the server's memory is back near where it started."""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import threading
import time

import httpx
import numpy as np
import pytest

from attnserve import codec
from attnserve.config import Settings
from attnserve_client import wire
from hard_helpers import OracleSession, ServerProcess, metric_sum
from svc_helpers import Api, LiveServer, rows

pytestmark = pytest.mark.gpu

LIMIT = 1 << 20  # the abuse server's body limit
H, KV, D = 4, 2, 16


@pytest.fixture(scope="module")
def target(spawn):
    srv: ServerProcess = spawn("abuse", ATTNSERVE_MAX_BODY_BYTES=LIMIT)
    api = Api(srv.url)
    rng = np.random.default_rng(11)
    oracles = [
        OracleSession(api, rng, h=H, hkv=KV, d=D, layers=2, fill=(20, 3)),
        OracleSession(api, rng, h=4, hkv=1, d=32, layers=1, fill=(9,), kv_format="turboquant"),
    ]
    victim = OracleSession(api, rng, h=H, hkv=KV, d=D, layers=2, fill=(10, 0), session_id="victim")
    time.sleep(0.5)
    rss0 = srv.rss_bytes()
    yield srv, api, victim, oracles, rss0
    api.close()


def expect(r, status: int, slug: str) -> dict:
    body = r.json() if isinstance(r, httpx.Response) else r.body
    code = r.status_code if isinstance(r, httpx.Response) else r.status
    assert code == status, (code, body)
    assert body["type"] == f"/problems/{slug}" and body["status"] == status, body
    return body


def unchanged(api: Api, victim: OracleSession) -> None:
    victim.check(queries=2)
    sessions = {s["session_id"] for s in api.call("GET", "/v1/sessions").body["sessions"]}
    assert all(len(s) <= 64 and s.replace("-", "").replace("_", "").isalnum() for s in sessions), sessions


def raw_http(
    url: str,
    head: bytes,
    parts: list[bytes] = (),
    *,
    pause: float = 0.0,
    timeout: float = 10.0,
    wait_close: float = 0.0,
) -> tuple[int, dict[str, str], bytes, float, bool]:
    """Send a request's head and parts over a plain socket (never finishing a body
    that is declared longer), then read the answer: (status, headers, body,
    seconds until the answer's first byte, whether the server closed the
    connection within ``wait_close`` seconds after it)."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        t0 = time.monotonic()
        s.sendall(head)
        for p in parts:
            try:
                s.sendall(p)
            except (BrokenPipeError, ConnectionResetError):
                break
            if pause:
                time.sleep(pause)
        data = b""
        first = None
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            first = first if first is not None else time.monotonic() - t0
            data += chunk
        head_end = data.index(b"\r\n\r\n") + 4
        lines = data[:head_end].decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {ln.split(":", 1)[0].lower(): ln.split(":", 1)[1].strip() for ln in lines[1:] if ":" in ln}
        length = int(headers.get("content-length", 0))
        while len(data) < head_end + length:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        body = data[head_end : head_end + length]
        closed = False
        if wait_close:
            s.settimeout(wait_close)
            try:
                closed = s.recv(1) == b""
            except socket.timeout:
                closed = False
            except ConnectionResetError:
                closed = True
        return status, headers, body, first or 0.0, closed


def head(method: str, path: str, ctype: str = wire.MSGPACK, length: int | None = None, chunked: bool = False) -> bytes:
    h = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
    if length is not None:
        h += f"Content-Length: {length}\r\n"
    if chunked:
        h += "Transfer-Encoding: chunked\r\n"
    return (h + "\r\n").encode()


BODY_ROUTES = [
    ("POST", "/v1/sessions"),
    ("PUT", "/v1/sessions/new-one"),
    ("POST", "/v1/sessions/victim/layers/0/kv"),
    ("POST", "/v1/sessions/victim/layers/1/attend"),
    ("PUT", "/v1/sessions/new-one/snapshot"),
    ("POST", "/v1/sessions/victim/fork"),
    ("POST", "/v1/batch/attend"),
]


# ── bodies over the limit ───────────────────────────────────────────────────


@pytest.mark.parametrize("method, path", BODY_ROUTES)
def test_bodies_over_the_limit_are_refused_before_they_are_read(target, method, path):
    srv, api, victim, _, _ = target
    # a declared length far past the limit: answered with only 100 bytes of it sent
    status, headers, body, first, closed = raw_http(
        srv.url, head(method, path, length=10**12), [b"\x80" * 100], wait_close=3
    )
    assert status == 413 and json.loads(body)["type"] == "/problems/payload-too-large"
    assert json.loads(body)["max_body_bytes"] == LIMIT and first < 5
    assert closed and headers.get("connection") == "close"  # and the rest is not read either
    # chunked, never finished: refused as soon as the bytes pass the limit
    chunk = b"%x\r\n" % 65536 + b"\x80" * 65536 + b"\r\n"
    status, _, body, first, closed = raw_http(srv.url, head(method, path, chunked=True), [chunk] * 20)
    assert status == 413 and json.loads(body)["type"] == "/problems/payload-too-large"
    # a declared length within the limit but a body that goes on past it
    status, _, body, _, _ = raw_http(srv.url, head(method, path, length=LIMIT), [b"\x80" * (LIMIT + 4096)])
    assert status in (400, 413, 422), body  # the declared bytes are read and judged; the rest is not
    assert api.call("GET", "/v1/sessions/new-one").status == 404
    unchanged(api, victim)


def test_many_refused_big_bodies_leave_memory_where_it_was(target):
    srv, api, victim, _, rss0 = target
    before = srv.rss_bytes()
    for _ in range(30):
        raw_http(srv.url, head("POST", "/v1/sessions/victim/layers/0/kv", length=1 << 40), [b"\0" * 65536])
    assert srv.rss_bytes() - before < 32 << 20
    unchanged(api, victim)


# ── MessagePack and JSON bombs ──────────────────────────────────────────────

U32 = struct.Struct(">I")
BOMBS = {
    # deep nesting
    "msgpack-deep-arrays": b"\x91" * 200_000 + b"\xc0",
    "msgpack-deep-maps": b"\x81\xa1k" * 100_000 + b"\xc0",
    "msgpack-deep-in-field": b"\x82\xa1k" + b"\x91" * 50_000 + b"\xc0" + b"\xa1v\xc0",
    # huge declared lengths, nothing behind them
    "msgpack-array32-4G": b"\xdd\xff\xff\xff\xff",
    "msgpack-map32-4G": b"\xdf\xff\xff\xff\xff",
    "msgpack-bin32-4G": b"\x81\xa1k\xc6\xff\xff\xff\xff",
    "msgpack-str32-4G": b"\x81\xa1k\xdb\xff\xff\xff\xff",
    "msgpack-nested-declared": b"\xdd\x00\xff\xff\xff" * 100,
    "msgpack-ext32": b"\x81\xa1k\xc9\xff\xff\xff\xff\x01",
    # many containers in few bytes (each costs ~60 bytes of Python)
    "msgpack-1M-empty-maps": b"\xdd" + U32.pack((LIMIT - 16)) + b"\x80" * (LIMIT - 16),
    "msgpack-1M-empty-arrays": b"\x81\xa1k\xdd" + U32.pack(LIMIT - 16) + b"\x90" * (LIMIT - 16),
    # JSON
    "json-deep-arrays": b"[" * 200_000 + b"]" * 200_000,
    "json-deep-objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "json-5000-digit-int": b'{"offset": ' + b"9" * 5000 + b"}",
}


BOMB_CASES = [
    (name, route)
    for name in BOMBS
    for route in ("kv", "attend", "create", "snapshot", "fork")
    if not (route == "snapshot" and name.startswith("json"))
]  # a snapshot is MessagePack only


@pytest.mark.parametrize("name, route", BOMB_CASES, ids=[f"{n}-{r}" for n, r in BOMB_CASES])
def test_bombs_are_refused_fast_and_change_nothing(target, name, route):
    srv, api, victim, _, _ = target
    body = BOMBS[name]
    ctype = wire.JSON if name.startswith("json") else wire.MSGPACK
    path = {
        "kv": "/v1/sessions/victim/layers/0/kv",
        "attend": "/v1/sessions/victim/layers/0/attend",
        "create": "/v1/sessions",
        "snapshot": "/v1/sessions/bomb/snapshot",
        "fork": "/v1/sessions/victim/fork",
    }[route]
    method = "PUT" if route == "snapshot" else "POST"
    t0 = time.monotonic()
    r = api.client.request(method, path, content=body, headers={"Content-Type": ctype})
    elapsed = time.monotonic() - t0
    problem = r.json()
    if route == "snapshot":
        assert (r.status_code, problem["type"]) == (422, "/problems/invalid-snapshot"), problem
    else:
        assert (r.status_code, problem["type"]) in {
            (400, "/problems/malformed-body"),
            (422, "/problems/invalid-request"),
        }, problem
        if "1M-empty" in name or "deep" in name or "4G" in name or "declared" in name:
            assert r.status_code == 400, problem  # refused by the parser itself
    assert elapsed < 3, elapsed
    assert api.call("GET", "/v1/sessions/bomb").status == 404
    unchanged(api, victim)


def test_a_64mib_container_bomb_costs_little(spawn):
    """Before the cap on arrays and maps, this body took 4.8 GB and 21 s to refuse."""
    srv = spawn("bomb-64m")  # the default limit: 64 MiB
    n = (64 << 20) - 16
    body = b"\xdd" + U32.pack(n) + b"\x80" * n
    rss0 = srv.rss_bytes()
    peak = [rss0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], srv.rss_bytes())
            time.sleep(0.005)

    t = threading.Thread(target=watch)
    t.start()
    t0 = time.monotonic()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            sid = c.post("/v1/sessions", json={"num_qo_heads": 1, "num_kv_heads": 1, "head_dim": 4}).json()[
                "session_id"
            ]
            r = c.post(f"/v1/sessions/{sid}/layers/0/kv", content=body, headers={"Content-Type": wire.MSGPACK})
    finally:
        done.set()
        t.join()
    detail = r.json()["detail"]  # the array's header already declares more members than a document may hold
    assert r.status_code == 400 and ("arrays and maps" in detail or "members" in detail), detail
    assert time.monotonic() - t0 < 10
    assert peak[0] - rss0 < 600 << 20, (peak[0] - rss0) >> 20  # the body itself, twice, and a little


def process_cpu_seconds(pid: int) -> float:
    """The CPU time a process has used (user and system, Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _flat_map(n: int) -> tuple[bytes, bytes]:
    """A JSON object and a MessagePack map of ``n`` keys ``k0``, ``k1``, ... with the value 0."""
    keys = [b"k%d" % i for i in range(n)]
    as_json = b"{" + b",".join(b'"%s":0' % k for k in keys) + b"}"
    as_msgpack = b"\xdf" + U32.pack(n) + b"".join(bytes([0xA0 | len(k)]) + k + b"\x00" for k in keys)
    return as_json, as_msgpack


def test_flat_wide_bodies_are_refused_fast_in_little_memory_and_probes_keep_answering(spawn):
    """One flat map of 4M keys (48 MiB of JSON, 37 MiB of MessagePack, under the
    default 64 MiB body limit): before the cap on members they took 37 s and 27 s
    to refuse, +493 MB and +612 MB of memory, and /livez waited up to 23 s. Now
    each is refused as soon as its members are counted (the MessagePack map from
    its header), while /livez is polled every 10 ms."""
    srv = spawn("flat-bodies")  # the default limits
    as_json, as_msgpack = _flat_map(4_000_000)
    assert 32 << 20 < len(as_msgpack) < len(as_json) < 64 << 20
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        sid = c.post("/v1/sessions", json={"num_qo_heads": 1, "num_kv_heads": 1, "head_dim": 4}).json()["session_id"]
    rss0 = srv.rss_bytes()
    peak, livez, done = [rss0], [], threading.Event()

    def watch_memory():
        while not done.is_set():
            peak[0] = max(peak[0], srv.rss_bytes())
            time.sleep(0.002)

    def poll_livez():
        with httpx.Client(base_url=srv.url, timeout=30) as probe:
            while not done.is_set():
                t0 = time.monotonic()
                assert probe.get("/livez").status_code == 200
                livez.append(time.monotonic() - t0)
                time.sleep(0.01)

    watchers = [threading.Thread(target=watch_memory), threading.Thread(target=poll_livez)]
    for t in watchers:
        t.start()
    took, cpu = {}, {}
    try:
        time.sleep(0.3)  # the probes' latency before the attack is in the sample too
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for name, body, ctype in (("json", as_json, wire.JSON), ("msgpack", as_msgpack, wire.MSGPACK)):
                for path in (f"/v1/sessions/{sid}/layers/0/kv", "/v1/batch/attend", "/v1/sessions"):
                    t0, cpu0 = time.monotonic(), process_cpu_seconds(srv.pid)
                    r = c.post(path, content=body, headers={"Content-Type": ctype})
                    took[name, path] = time.monotonic() - t0
                    cpu[name, path] = process_cpu_seconds(srv.pid) - cpu0
                    detail = r.json()["detail"]
                    assert r.status_code == 400 and ("entries" in detail or "members" in detail), detail
        time.sleep(0.3)
    finally:
        done.set()
        for t in watchers:
            t.join()
    grew = (peak[0] - rss0) >> 20
    print(
        f"refused in {max(took.values()):.3f} s at most ({max(cpu.values()):.3f} s of the server's CPU), "
        f"RSS +{grew} MiB, /livez max {max(livez) * 1e3:.1f} ms"
    )
    # The refusal's cost is the server's CPU time, which waits for no one: 0.18-0.25 s
    # for the JSON map, 0.04-0.07 s for the MessagePack one, measured on the 2-core host
    # while other work ran (the wall clock then read 0.35-3.3 s, past the 3 s bound this
    # had); before the cap on members, a single thread parsing, these took 27-37 s.
    assert max(cpu.values()) < 2, cpu
    assert grew < 64, grew
    # /livez: a wall clock, so the bound is set from its spread under load: its worst
    # wait read 0.27-0.39 s on the 2-core host while other work ran (0.25 s, the bound
    # this had, failed there), where a loop held by the parse made it wait 23 s.
    assert len(livez) > 20 and sorted(livez)[int(len(livez) * 0.99)] < 2, sorted(livez)[-5:]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get(f"/v1/sessions/{sid}").json()["lengths"] == [0]


# ── shapes whose product overflows ──────────────────────────────────────────

BIG = 2**64 - 1
SHAPES = [
    [2**32, 2**32, 2**32],
    [BIG, BIG, 1],
    [0, BIG, BIG],
    [1, KV, 2**62],
    [2**63, 0, D],
    [3, 2**61, 2**61],
    [1, KV, D * 2**32],
    [-1, KV, D],
    [1.0, KV, D],
    [True, KV, D],
    [1, KV],
    [1, KV, D, 1],
    [],
    [1] * 9,
]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s)[:40] for s in SHAPES])
def test_shapes_whose_product_overflows(target, shape):
    srv, api, victim, _, _ = target
    data = b"\0" * (KV * D * 4)
    bad = {"dtype": "<f4", "shape": shape, "data": data}
    good = wire.encode_array(rows(np.random.default_rng(0), 1, KV, D))
    for path, doc in [
        ("kv", {"k": bad, "v": good}),
        ("kv", {"k": good, "v": bad}),
        ("attend", {"q": {**bad, "shape": shape}}),
        ("attend", {"q": good, "k": bad, "v": good}),
    ]:
        r = api.client.post(
            f"/v1/sessions/victim/layers/0/{path}", content=wire.packb(doc), headers={"Content-Type": wire.MSGPACK}
        )
        expect(r, 422, "invalid-request")
    # the batched step's stacked form: the same shapes with an item axis in front
    stacked_bad = {"dtype": "<f4", "shape": [1, *shape], "data": data}
    for doc in (
        {"session_ids": ["victim"], "layer": 0, "q": stacked_bad},
        {"session_ids": ["victim"], "layer": 0, "q": wire.encode_array(rows(np.random.default_rng(1), 1, H, D)[None]),
         "k": stacked_bad, "v": stacked_bad},
    ):  # fmt: skip
        r = api.client.post("/v1/batch/attend", content=wire.packb(doc), headers={"Content-Type": wire.MSGPACK})
        expect(r, 422, "invalid-request")
    unchanged(api, victim)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 2**63),
        ("max_tokens", BIG),
        ("num_layers", BIG),
        ("num_layers", 2**31),
        ("head_dim", 2**32),
        ("num_qo_heads", 2**63),
        ("num_kv_heads", 2**63),
        ("seed", 2**64),
        ("seed", -1),
        ("max_tokens", 0),
    ],
)
def test_session_sizes_that_overflow(target, field, value):
    srv, api, victim, _, _ = target
    doc = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 16, field: value}
    before = metric_sum(srv.metrics(), "attnserve_sessions")
    r = api.client.post("/v1/sessions", content=json.dumps(doc), headers={"Content-Type": wire.JSON})
    expect(r, 422, "invalid-request")
    if value < 2**64:
        r = api.client.post("/v1/sessions", content=wire.packb(doc), headers={"Content-Type": wire.MSGPACK})
        expect(r, 422, "invalid-request")
    assert metric_sum(srv.metrics(), "attnserve_sessions") == before


# ── ids with path characters ────────────────────────────────────────────────

BAD_IDS = [
    "a%2Fb",
    "%2F",
    "..",
    "%2E%2E",
    "%2e",
    "a%5Cb",
    "a%00b",
    "a%20b",
    "%C3%A9t%C3%A9",
    "a.b",
    "a:b",
    "a;b",
    "a%3Fb",
    "a%23b",
    "%25",
    "*",
    "~",
    "x" * 65,
    "a%0D%0AX-Injected:%201",
    "%FF",
    "..%2F..%2Fetc%2Fpasswd",
]


@pytest.mark.parametrize("sid", BAD_IDS)
def test_ids_with_path_characters_create_nothing(target, sid):
    srv, api, victim, _, _ = target
    before = sorted(s["session_id"] for s in api.call("GET", "/v1/sessions").body["sessions"])
    create = json.dumps({"num_qo_heads": 1, "num_kv_heads": 1, "head_dim": 4}).encode()
    blob = api.client.get("/v1/sessions/victim/snapshot").content
    for method, suffix, content, ctype in [
        ("PUT", "", create, wire.JSON),
        ("PUT", "/snapshot", blob, wire.MSGPACK),
        ("GET", "", None, None),
        ("GET", "/snapshot", None, None),
        ("DELETE", "", None, None),
        ("POST", "/layers/0/kv", create, wire.JSON),
        ("POST", "/layers/0/attend", create, wire.JSON),
    ]:
        path = f"/v1/sessions/{sid}{suffix}"
        h = (
            head(method, path, ctype, len(content))
            if content is not None
            else f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        )
        status, headers, body, _, _ = raw_http(srv.url, h, [content] if content else [])
        assert "x-injected" not in headers
        if status == 307:  # "/v1/sessions/%2F" is "/v1/sessions/": Starlette redirects the trailing slash
            assert sid.upper().endswith("%2F") and headers["location"].endswith("/v1/sessions"), headers
            continue
        assert status in (404, 405, 422), (method, path, status, body)
        problem = json.loads(body)
        assert problem["type"] in (
            "/problems/not-found",
            "/problems/session-not-found",
            "/problems/invalid-request",
            "/problems/method-not-allowed",
        ), problem
    after = sorted(s["session_id"] for s in api.call("GET", "/v1/sessions").body["sessions"])
    assert after == before
    unchanged(api, victim)


# ── slow bodies ─────────────────────────────────────────────────────────────


@pytest.fixture
def quick_timeout(engine, monkeypatch):
    """An in-process server whose body idle timeout is half a second."""
    monkeypatch.setattr(codec, "BODY_IDLE_TIMEOUT_S", 0.5)
    srv = LiveServer(Settings(), engine=engine).start()
    api = Api(srv.url)
    victim = OracleSession(api, np.random.default_rng(3), h=H, hkv=KV, d=D, layers=1, fill=(5,), session_id="slow")
    yield srv, api, victim
    api.close()
    srv.stop()


def test_a_stalled_body_is_408_and_appends_nothing(quick_timeout):
    srv, api, victim = quick_timeout
    k = rows(np.random.default_rng(1), 2, KV, D)
    body = wire.packb({"k": wire.encode_array(k), "v": wire.encode_array(k)})
    for path in (
        "/v1/sessions/slow/layers/0/kv",
        "/v1/sessions/slow/layers/0/attend",
        "/v1/sessions",
        "/v1/sessions/slow2/snapshot",
    ):
        method = "PUT" if path.endswith("snapshot") else "POST"
        status, headers, answer, first, closed = raw_http(
            srv.url, head(method, path, length=len(body)), [body[:10]], timeout=10, wait_close=3
        )
        assert status == 408 and json.loads(answer)["type"] == "/problems/body-timeout", answer
        assert 0.4 < first < 5 and closed and headers.get("connection") == "close"
    unchanged(api, victim)
    assert api.call("GET", "/v1/sessions/slow2").status == 404


def test_a_slow_but_steady_body_is_taken(quick_timeout):
    srv, api, victim = quick_timeout
    k = rows(np.random.default_rng(2), 3, KV, D)
    body = wire.packb({"k": wire.encode_array(k), "v": wire.encode_array(k), "offset": 5})
    parts = [body[i : i + 40] for i in range(0, len(body), 40)]
    status, _, answer, first, _ = raw_http(
        srv.url, head("POST", "/v1/sessions/slow/layers/0/kv", length=len(body)), parts, pause=0.1
    )
    assert status == 200 and wire.unpackb(answer, max_bytes=1 << 20) == {"length": 8}
    assert first > 0.1 * (len(parts) - 1) - 0.05  # it really took its time
    victim.model.add(0, k, k)
    unchanged(api, victim)


def test_stalled_bodies_do_not_stall_the_server(target):
    """With the default timeout (60 s): connections that stall mid-body or mid-headers
    hold only themselves; everyone else is answered at once."""
    srv, api, victim, _, _ = target
    host, port = srv.url.split("//")[1].split(":")
    held = []
    try:
        for i in range(40):
            s = socket.create_connection((host, int(port)), timeout=5)
            if i % 2:
                s.sendall(head("POST", "/v1/sessions/victim/layers/0/kv", length=1000) + b"\x82")
            else:
                s.sendall(b"POST /v1/sessions/victim/layers/0/kv HTTP/1.1\r\nHost: x\r\nContent-Ty")
            held.append(s)
        t0 = time.monotonic()
        for _ in range(5):
            assert api.call("GET", "/livez").status == 200
            victim.check(queries=1)
        assert time.monotonic() - t0 < 5
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    unchanged(api, victim)


def test_a_client_that_hangs_up_mid_body_changes_nothing(target):
    srv, api, victim, _, _ = target
    host, port = srv.url.split("//")[1].split(":")
    k = rows(np.random.default_rng(4), 2, KV, D)
    body = wire.packb({"k": wire.encode_array(k), "v": wire.encode_array(k)})
    for cut in (1, len(body) // 2, len(body) - 1):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(head("POST", "/v1/sessions/victim/layers/0/kv", length=len(body)) + body[:cut])
        time.sleep(0.1)
    unchanged(api, victim)


# ── non-finite values ───────────────────────────────────────────────────────


def _with(value: float, heads: int = KV, at: tuple = (0, 1, 3)) -> np.ndarray:
    a = rows(np.random.default_rng(5), 2, heads, D)
    with np.errstate(over="ignore"):
        a[at] = value  # past float32's range: infinite as float32
    return a


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e39, -3.5e38])
def test_non_finite_values_are_refused_everywhere(target, value):
    srv, api, victim, _, _ = target
    good_k, good_q = rows(np.random.default_rng(6), 2, KV, D), rows(np.random.default_rng(7), 2, H, D)
    for enc in ("msgpack", "json"):
        cases = [
            ("kv", {"k": _with(value), "v": good_k}),
            ("kv", {"k": good_k, "v": _with(value)}),
            ("attend", {"q": _with(value, H)}),
            ("attend", {"q": good_q, "k": _with(value), "v": good_k}),
            ("attend", {"q": good_q, "scale": value}),
        ]
        for path, doc in cases:
            if enc == "json":
                text = json.dumps({k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in doc.items()})
                r = api.client.post(
                    f"/v1/sessions/victim/layers/0/{path}", content=text.encode(), headers={"Content-Type": wire.JSON}
                )
            else:
                r = api.call("POST", f"/v1/sessions/victim/layers/0/{path}", doc, enc="msgpack")
            problem = expect(r, 422, "invalid-request")
            assert "finite" in problem["detail"], problem
    # a batched step, both forms: the item with the value fails alone (the other is a read)
    bad_q, good_q1 = _with(value, H)[:1], good_q[:1]
    items = {
        "items": [{"session_id": "victim", "layer": 0, "q": bad_q}, {"session_id": "victim", "layer": 0, "q": good_q1}]
    }
    stacked = {"session_ids": ["victim", "victim"], "layer": 0, "q": np.stack([bad_q, good_q1])}
    for doc in (items, stacked):
        r = api.call("POST", "/v1/batch/attend", doc, enc="msgpack")
        assert r.status == 200, r.body
        errors = (
            [res["error"] for res in r.body["results"] if "error" in res] if "results" in r.body else r.body["errors"]
        )
        assert len(errors) == 1 and errors[0]["item"] == 0 and "finite" in errors[0]["detail"], errors
    unchanged(api, victim)


@pytest.mark.parametrize("literal", [b"1e39", b"-1e39", b"1e400", b"NaN", b"-Infinity"])
def test_json_numbers_past_float32_are_refused(target, literal):
    """1e39 is finite for JSON (float64) but not for float32: refused, not stored as inf."""
    srv, api, victim, _, _ = target
    row = b"[" + b", ".join([b"0.5"] * (D - 1) + [literal]) + b"]"
    body = b'{"k": [[' + row + b", " + row + b']], "v": [[' + row + b", " + row + b"]]}"
    r = api.client.post("/v1/sessions/victim/layers/0/kv", content=body, headers={"Content-Type": wire.JSON})
    expect(r, 422, "invalid-request")
    unchanged(api, victim)


def test_huge_finite_inputs_do_not_poison_the_session(target):
    """Finite inputs so large that the scores overflow give NaN answers (documented),
    and nothing else: the server stays up, the other layers and sessions are exact."""
    srv, api, victim, _, _ = target
    sess = OracleSession(api, np.random.default_rng(8), h=H, hkv=KV, d=D, layers=2, fill=(4, 4))
    big = np.full((1, KV, D), 3e38, np.float32)
    r = api.call(
        "POST",
        f"/v1/sessions/{sess.sid}/layers/1/attend",
        {"q": np.full((1, H, D), 3e38, np.float32), "k": big, "v": big},
        enc="msgpack",
    )
    assert r.status == 200 and r.body["length"] == 5
    out = wire.decode_array(r.body["out"], name="out", finite=False)
    assert not np.isfinite(out).all()
    sess.model.add(1, big, big)
    r = api.client.post(
        f"/v1/sessions/{sess.sid}/layers/1/attend",
        content=json.dumps({"q": np.ones((1, H, D)).tolist()}),
        headers={"Content-Type": wire.JSON},
    )
    assert r.status_code == 200 and b"NaN" in r.content  # JSON answers write NaN as NaN (docs/api.md)
    q = rows(np.random.default_rng(9), 2, H, D)
    got = api.attend(sess.sid, 0, q)  # layer 0 is untouched
    want = sess.model.attention(0, q)
    assert np.abs(got.body["out"] - want).max() <= 1e-5 * np.abs(want).max()
    api.delete(sess.sid)
    unchanged(api, victim)


# ── at the end ──────────────────────────────────────────────────────────────


def test_after_the_abuse_everything_is_as_it_was(target):
    srv, api, victim, oracles, rss0 = target
    assert srv.alive()
    for o in oracles + [victim]:
        o.check()
    errors = srv.server_errors()
    assert errors == [], errors[:3]
    m = srv.metrics()
    assert not any(k.startswith("attnserve_requests_total") and 'status="5' in k for k in m), [
        k for k in m if 'status="5' in k
    ]
    time.sleep(0.5)
    grown = srv.rss_bytes() - rss0
    print(f"abuse server RSS: {rss0 >> 20} MiB at the start, {srv.rss_bytes() >> 20} MiB at the end")
    assert grown < 256 << 20, grown >> 20
