"""Helpers of the service tests: a real server (uvicorn on 127.0.0.1 in a thread),
a small HTTP helper speaking both encodings, and the oracle bookkeeping."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tools import reference as ref
from _core import CORE_PAGE_TOKENS
from attnserve_client import wire
from tools.common import free_port  # noqa: F401  (the tests import it from here)
from live_server import LiveServer  # noqa: F401  (the tests import it from here)
from attnserve_client.framing import PREFIX, frame_buffers, read_prefix, resolve_arrays
from contract_helpers import TYPES, Model, Resp, decode, rel_err, request_parts, rows, to_wire  # noqa: F401

ENCODINGS = ("json", "msgpack")
# Relative error of the GPU's float32 attention against the float64 oracle
# (max abs error over max abs value), as in the core tests.
# timesteps per page of the test servers' KV pool (they share the core tests' engine):
# GPU bytes are whole pages
PAGE = CORE_PAGE_TOKENS
F32_TOL = 1e-5


def from_wire(obj: Any) -> Any:
    if isinstance(obj, dict) and set(obj) == {"dtype", "shape", "data"}:
        return wire.decode_array(obj, name="out")
    if isinstance(obj, dict):
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_wire(v) for v in obj]
    return obj


class Api:
    def __init__(self, url: str):
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=120)

    def close(self) -> None:
        self.client.close()

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        enc: str = "json",
        accept: str | None = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Resp:
        content, h = request_parts(body, enc, content, headers, accept)
        r = self.client.request(method, path, content=content, headers=h)
        return Resp(r.status_code, r.headers, decode(r), r.content)

    # shortcuts ---------------------------------------------------------------

    def create(self, enc: str = "json", session_id: str | None = None, **fields: Any) -> dict:
        r = (
            self.call("PUT", f"/v1/sessions/{session_id}", fields, enc=enc)
            if session_id
            else self.call("POST", "/v1/sessions", fields, enc=enc)
        )
        assert r.status == 201, r.body
        return r.body

    def info(self, sid: str) -> dict:
        r = self.call("GET", f"/v1/sessions/{sid}")
        assert r.status == 200, r.body
        return r.body

    def append(self, sid: str, layer: int, k, v, *, enc: str = "msgpack", **kw: Any) -> Resp:
        return self.call("POST", f"/v1/sessions/{sid}/layers/{layer}/kv", {"k": k, "v": v, **kw}, enc=enc)

    def attend(self, sid: str, layer: int, q, *, enc: str = "msgpack", **kw: Any) -> Resp:
        r = self.call("POST", f"/v1/sessions/{sid}/layers/{layer}/attend", {"q": q, **kw}, enc=enc)
        if r.status == 200:
            r.body = from_wire(r.body)
            r.body["out"] = np.asarray(r.body["out"], dtype=np.float32)
        return r

    def delete(self, sid: str) -> Resp:
        return self.call("DELETE", f"/v1/sessions/{sid}")


def oracle(q, k, v, **kw) -> np.ndarray:
    return ref.attention(q, k, v, **kw)


class Scrape:
    """/metrics text parsed by prometheus_client's own parser, which raises on a
    line the exposition format does not allow."""

    def __init__(self, text: str):
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[str, dict[frozenset, float]] = {}
        for family in self.families.values():
            for s in family.samples:
                self.samples.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value

    def __call__(self, name: str, **labels: str) -> float:
        """One sample's value (KeyError when there is none)."""
        return self.samples[name][frozenset(labels.items())]

    def get(self, name: str, default: float = 0.0, **labels: str) -> float:
        return self.samples.get(name, {}).get(frozenset(labels.items()), default)

    def has(self, name: str, **labels: str) -> bool:
        return frozenset(labels.items()) in self.samples.get(name, {})


#: The twins' shapes and formats of the transports' bit-identity tests.
TWIN_SHAPES = [(8, 2, 32, "f32"), (3, 1, 17, "f32"), (4, 4, 64, "turboquant"), (6, 2, 32, "tq4")]


def drive_twins(client: Any, under_test: Any, beside: Any, rng: np.random.Generator) -> None:
    """Three twins of each of :data:`TWIN_SHAPES`: one driven over the stream
    ``under_test`` (stacked steps and a batched step of items, fused decode steps one
    by one pipelined, appends across a page border), one over the stream ``beside``
    (stacked steps), one by one over HTTP: every output bit-identical, f32 within the
    float64 oracle's tolerance."""
    from attnserve_client import AttendItem

    for h, hkv, d, fmt in TWIN_SHAPES:
        spec = dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2, kv_format=fmt, seed=7)
        tested = [client.create_session(**spec) for _ in range(3)]
        besides = [client.create_session(**spec) for _ in range(3)]
        by_http = [client.create_session(**spec) for _ in range(3)]
        models = [Model(h, hkv, d, layers=2) for _ in range(3)]
        for n in [37, 1, 29, 1, 1]:  # 68 timesteps: past a page border (page 64)
            for layer in (0, 1):
                q = np.stack([rows(rng, n, h, d) for _ in range(3)])
                k = np.stack([rows(rng, n, hkv, d) for _ in range(3)])
                v = np.stack([rows(rng, n, hkv, d) for _ in range(3)])
                for i, m in enumerate(models):
                    m.add(layer, k[i], v[i])
                want = [s.attend(layer, q[i], k=k[i], v=v[i]) for i, s in enumerate(by_http)]
                got_beside = beside.attend_stacked(besides, layer, q, k, v)
                if n > 1:  # a stacked step, and a batched step of items
                    got = list(under_test.attend_stacked(tested[:2], layer, q[:2], k[:2], v[:2]))
                    got += under_test.attend_batch([AttendItem(tested[2], layer, q[2], k[2], v[2])])
                else:  # fused decode steps one by one, pipelined
                    futs = [under_test.submit_attend(s, layer, q[i], k=k[i], v=v[i]) for i, s in enumerate(tested)]
                    got = [f.result(timeout=60) for f in futs]
                for i in range(3):
                    assert got[i].dtype == np.float32 and got[i].shape == want[i].shape
                    assert got[i].tobytes() == want[i].tobytes() == got_beside[i].tobytes()
                    if fmt == "f32":
                        assert rel_err(got[i], models[i].attention(layer, q[i])) <= F32_TOL
        for i, s in enumerate(tested):
            assert under_test.append(s, 0, k[i], v[i]) == models[i].lengths[0] + n
            assert s.info().lengths[0] == models[i].lengths[0] + n
        for s in tested + besides + by_http:
            s.delete()


def errors_stay_per_operation(client: Any, stream: Any, rng: np.random.Generator) -> Any:
    """Problems over ``stream`` are each one operation's and change nothing: an
    unknown session, an offset mismatch, a batch with one bad item among good ones,
    then a ping on the same stream. Returns the session (3 timesteps) for the
    caller's own checks; the caller deletes it."""
    import pytest

    from attnserve_client import AttendItem, BatchError, OffsetMismatch, SessionNotFound

    s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
    assert stream.append(s, 0, rows(rng, 3, 1, 8), rows(rng, 3, 1, 8)) == 3
    with pytest.raises(SessionNotFound):
        stream.attend("nope", 0, rows(rng, 1, 2, 8))
    with pytest.raises(OffsetMismatch) as e:
        stream.append(s, 0, rows(rng, 1, 1, 8), rows(rng, 1, 1, 8), offset=7)
    assert e.value.length == 3
    with pytest.raises(BatchError) as be:
        stream.attend_batch(
            [
                AttendItem(s, 0, rows(rng, 1, 2, 8)),
                AttendItem("nope", 0, rows(rng, 1, 2, 8)),
                AttendItem(s, 0, rows(rng, 1, 2, 8)),
            ]
        )
    assert isinstance(be.value.results[0], np.ndarray) and isinstance(be.value.errors[1], SessionNotFound)
    assert isinstance(be.value.results[2], np.ndarray)
    stream.ping()
    assert s.info().lengths == (3,)
    return s


def keys_and_tenants_hold(url: str, transport: str, rng: np.random.Generator, **where: Any) -> None:
    """On a server of the keys ``key-a`` and ``key-b``: a ``transport`` stream (opened
    with ``where``, its address) needs a right key, and one tenant's stream does not
    see the other's sessions."""
    import pytest

    from attnserve_client import Client, SessionNotFound, Unauthorized

    with pytest.raises(Unauthorized):
        Client(url).stream(transport=transport, **where)
    with pytest.raises(Unauthorized):
        Client(url, api_key="wrong").stream(transport=transport, **where)
    with Client(url, api_key="key-a") as a, Client(url, api_key="key-b") as b:
        sb = b.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
        with a.stream(transport=transport) as other:
            with pytest.raises(SessionNotFound):
                other.append(sb.session_id, 0, rows(rng, 1, 1, 8), rows(rng, 1, 1, 8))
        with b.stream(transport=transport) as own:
            assert own.append(sb.session_id, 0, rows(rng, 1, 1, 8), rows(rng, 1, 1, 8)) == 1
        assert sb.info().lengths == (1,)


def busy_and_draining_are_503(srv: Any, client: Any, stream: Any, second: Any, rng: np.random.Generator) -> None:
    """With a server capped at one connection and ``stream`` holding it: ``second``
    (a raw connection, no hello sent) is refused at once with a 503 and closed; a
    drain makes each operation on ``stream`` a 503 (NotReady), and its end lets them
    through again."""
    import pytest

    from attnserve_client import NotReady

    s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
    r = second.recv()  # refused at once, before any hello
    assert r["status"] == 503 and r["error"]["type"] == "/problems/not-ready", r
    assert second.closed()
    second.close()
    srv.runtime.begin_drain()
    with pytest.raises(NotReady):  # a connection open before the drain: each op is 503
        stream.append(s, 0, rows(rng, 1, 1, 8), rows(rng, 1, 1, 8))
    srv.runtime.draining = False
    assert stream.append(s, 0, rows(rng, 1, 1, 8), rows(rng, 1, 1, 8)) == 1


class RawFrames:
    """A bare socket speaking the framing, for what the client library never sends."""

    #: the shared-memory region a reply's ``shm`` references point into (RawShm's)
    region: memoryview | None = None

    def __init__(self, port: int, hello: bool = True, key: str | None = None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        if hello:
            r = self.call({"id": 0, "op": "hello", "version": 1, **({"key": key} if key else {})})
            assert r["status"] == 200, r

    def send(self, doc) -> None:
        self.sock.sendmsg(frame_buffers(doc, wire.packb))

    def recv(self):
        prefix = self._exactly(PREFIX.size)
        if prefix is None:
            return None
        head_len, body_len = read_prefix(prefix)
        buf = self._exactly(head_len + body_len)
        doc = wire.unpackb(buf[:head_len], max_bytes=1 << 20)
        resolve_arrays(doc, memoryview(buf)[head_len:], region=self.region)
        return doc

    def call(self, doc):
        self.send(doc)
        return self.recv()

    def _exactly(self, n: int):
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                assert not buf, "the connection closed mid-frame"
                return None
            buf += chunk
        return bytes(buf)

    def closed(self, timeout: float = 10) -> bool:
        """Whether the server closed the connection (EOF) within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1 << 16) == b""
        except ConnectionResetError:  # closed with bytes of ours unread
            return True
        except socket.timeout:
            return False

    def close(self) -> None:
        self.sock.close()
