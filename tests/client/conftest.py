"""Fixtures for the client tests.

- ``fake``: an in-memory emulation of the HTTP contract (``api.md``) behind
  ``httpx.MockTransport``, with injectable faults (dropped or late answers, 503s,
  any problem answer), so the client's logic is tested without a server.
- ``make_client``: a client on that transport, sync or async (``mode``), whose
  backoff sleeps are recorded instead of slept. An async client is wrapped so the
  same test body drives both: every test that uses it runs twice.
- ``live_server_url``: the real server in-process (uvicorn on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

try:
    import attnserve_client  # noqa: F401  (installed: pip install ./client)
except ImportError:  # a plain checkout: use the sources
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client"))

from attnserve_client import AsyncClient, AsyncSession, Client, tensors, wire

BASE_URL = "http://attnserve.test"
MAX_BODY = 1 << 20


def reference_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, start_pos: int, causal: bool, scale: float
) -> np.ndarray:
    """float64 attention: q [n, H, D], k/v [L, KV, D] -> [n, H, D] float64 (GQA, causal)."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    out = np.empty(q.shape, dtype=np.float64)
    for i in range(n):
        end = start_pos + i + 1 if causal else k.shape[0]
        for h in range(heads):
            kk = k[:end, h // group].astype(np.float64)
            scores = kk @ q[i, h].astype(np.float64) * scale
            w = np.exp(scores - scores.max())
            out[i, h] = (w / w.sum()) @ v[:end, h // group].astype(np.float64)
    return out


class Problem(Exception):
    def __init__(self, status: int, slug: str, detail: str, **extra: Any) -> None:
        self.status, self.slug, self.detail, self.extra = status, slug, detail, extra


@dataclass
class Fault:
    """What to do to the next matching request.

    kind: "refuse" (ConnectError, nothing reaches the server), "drop" (the server
    does the work, the answer is lost: RemoteProtocolError), "late" (likewise,
    ReadTimeout), "answer" (answer ``status`` with problem ``slug`` and ``headers``,
    doing nothing), "raw" (answer ``status``, ``headers`` and ``content``, doing nothing).
    """

    kind: str
    method: str | None = None
    path: str | None = None  # regex searched in the URL path
    status: int = 503
    slug: str = "overloaded"
    headers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    content: bytes = b""

    def matches(self, request: httpx.Request) -> bool:
        return (self.method is None or request.method == self.method) and (
            self.path is None or re.search(self.path, request.url.path) is not None
        )


class FakeServer:
    """The contract of api.md in memory, with faults to inject."""

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, Any]] = {}
        self.requests: list[httpx.Request] = []
        self.faults: list[Fault] = []
        self.api_key: str | None = None
        self.answer_json = False
        self.ready = True
        self.memory_budget: int | None = None
        self.out_dtype: str | None = None  # answer every out in this dtype, whatever was asked (a wrong server)
        self._next_id = 0

    # -- test controls --
    def fail(self, kind: str, **kw: Any) -> None:
        self.faults.append(Fault(kind, **kw))

    def count(self, method: str | None = None, path: str | None = None) -> int:
        return sum(Fault("x", method, path).matches(r) for r in self.requests)

    def kv(self, session_id: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
        s = self.sessions[session_id]
        return s["k"][layer], s["v"][layer]

    # -- transport --
    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        fault = next((f for f in self.faults if f.matches(request)), None)
        if fault is not None:
            self.faults.remove(fault)
            if fault.kind == "refuse":
                raise httpx.ConnectError("connection refused", request=request)
            if fault.kind == "raw":
                return httpx.Response(fault.status, content=fault.content, headers=fault.headers)
            if fault.kind == "answer":
                return self._problem(Problem(fault.status, fault.slug, "injected", **fault.extra), fault.headers)
        response = self._serve(request)
        if fault is not None and fault.kind == "drop":
            raise httpx.RemoteProtocolError("server disconnected without sending a response", request=request)
        if fault is not None and fault.kind == "late":
            raise httpx.ReadTimeout("timed out", request=request)
        return response

    def _problem(self, p: Problem, headers: dict[str, str] | None = None) -> httpx.Response:
        body = {
            "type": f"/problems/{p.slug}",
            "title": p.slug.replace("-", " "),
            "status": p.status,
            "detail": p.detail,
            **p.extra,
        }
        return httpx.Response(p.status, json=body, headers={"content-type": wire.PROBLEM_JSON, **(headers or {})})

    def _answer(self, status: int, body: Any) -> httpx.Response:
        if self.answer_json:
            return httpx.Response(status, json=_to_json(body))
        return httpx.Response(status, content=wire.packb(body), headers={"content-type": wire.MSGPACK})

    def _serve(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        try:
            if path == "/livez":
                return httpx.Response(200, json={"status": "ok"})
            if path == "/readyz":
                if not self.ready:
                    raise Problem(503, "not-ready", "device not ready")
                return httpx.Response(200, json={"status": "ready"})
            if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
                raise Problem(401, "unauthorized", "missing or wrong bearer token")
            body = self._body(request)
            if path == "/v1/info" and method == "GET":
                return self._answer(200, {"version": "fake", "kv_formats": ["f32", "turboquant"]})
            if path == "/v1/sessions" and method == "POST":
                self._next_id += 1
                return self._answer(201, self._create(f"s{self._next_id}", body))
            if path == "/v1/sessions" and method == "GET":
                return self._answer(200, {"sessions": [self._info(s) for s in self.sessions]})
            m = re.fullmatch(r"/v1/sessions/([A-Za-z0-9_-]{1,64})", path)
            if m and method == "PUT":
                if m[1] in self.sessions:
                    raise Problem(409, "session-exists", f"session {m[1]} exists")
                return self._answer(201, self._create(m[1], body))
            if m and method in ("GET", "DELETE"):
                self._session(m[1])
                if method == "DELETE":
                    del self.sessions[m[1]]
                    return httpx.Response(204)
                return self._answer(200, self._info(m[1]))
            m = re.fullmatch(r"/v1/sessions/([^/]+)/layers/(-?\d+)/(kv|attend)", path)
            if m and method == "POST":
                s = self._session(m[1])
                layer = int(m[2])
                if not 0 <= layer < s["num_layers"]:
                    raise Problem(404, "layer-not-found", f"layer {layer} not in 0..{s['num_layers'] - 1}")
                return self._answer(200, self._kv(s, layer, body) if m[3] == "kv" else self._attend(s, layer, body))
            return httpx.Response(404, json={"detail": "Not Found"})
        except Problem as p:
            return self._problem(p)

    def _body(self, request: httpx.Request) -> Any:
        content = request.content
        if not content:
            return None
        if len(content) > MAX_BODY:
            raise Problem(413, "payload-too-large", f"body over {MAX_BODY} bytes")
        ctype = request.headers.get("content-type")
        try:
            if wire.is_msgpack(ctype):
                return wire.unpackb(content, max_bytes=MAX_BODY)
            if ctype == wire.JSON:
                return json.loads(content)
        except (wire.WireError, ValueError) as exc:
            raise Problem(400, "malformed-body", str(exc)) from None
        raise Problem(415, "unsupported-media-type", f"content type {ctype!r}")

    def _session(self, sid: str) -> dict[str, Any]:
        if sid not in self.sessions:
            raise Problem(404, "session-not-found", f"no session {sid}")
        return self.sessions[sid]

    def _create(self, sid: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise Problem(422, "invalid-request", "expected an object")
        cfg = {"num_layers": 1, "kv_format": "f32", "max_tokens": 4096, "seed": 1234, **body}
        for key in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "max_tokens", "seed"):
            if type(cfg.get(key)) is not int or cfg[key] < (0 if key == "seed" else 1):
                raise Problem(422, "invalid-request", f"{key}: expected an int >= 1, got {cfg.get(key)!r}")
        if cfg["num_qo_heads"] % cfg["num_kv_heads"]:
            raise Problem(422, "invalid-request", "num_kv_heads must divide num_qo_heads")
        if cfg["kv_format"] not in ("f32", "turboquant"):
            raise Problem(422, "invalid-request", f"kv_format {cfg['kv_format']!r}")
        shape = (0, cfg["num_kv_heads"], cfg["head_dim"])
        cfg["k"] = [np.zeros(shape, np.float32) for _ in range(cfg["num_layers"])]
        cfg["v"] = [np.zeros(shape, np.float32) for _ in range(cfg["num_layers"])]
        self.sessions[sid] = cfg
        return self._info(sid)

    def _info(self, sid: str) -> dict[str, Any]:
        s = self.sessions[sid]
        info = {
            key: s[key]
            for key in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "kv_format", "max_tokens", "seed")
        }
        lengths = [k.shape[0] for k in s["k"]]
        return {
            "session_id": sid,
            **info,
            "lengths": lengths,
            "bytes": 2 * 4 * sum(lengths) * s["num_kv_heads"] * s["head_dim"],
        }

    def _array(self, body: dict[str, Any], key: str, heads: int, s: dict[str, Any]) -> np.ndarray:
        """``body[key]`` in the dtype it came in (float32, float16, or bfloat16)."""
        try:
            a = wire.decode_array(body[key], name=key, ndim=3)
        except wire.WireError as exc:
            raise Problem(422, "invalid-request", str(exc)) from None
        if a.shape[0] < 1 or a.shape[1:] != (heads, s["head_dim"]):
            raise Problem(422, "invalid-request", f"{key}: bad shape {a.shape}")
        return a

    def _append(self, s: dict[str, Any], layer: int, body: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
        """Check k, v, offset and capacity; return what to append (nothing changed yet)."""
        if "k" not in body and "v" not in body:
            return None
        k = self._array(body, "k", s["num_kv_heads"], s)
        v = self._array(body, "v", s["num_kv_heads"], s)
        if k.shape != v.shape:
            raise Problem(422, "invalid-request", "k and v differ in shape")
        if k.dtype != v.dtype:
            raise Problem(422, "invalid-request", "k and v differ in dtype")
        length = s["k"][layer].shape[0]
        if "offset" in body and body["offset"] != length:
            raise Problem(409, "offset-mismatch", f"offset {body['offset']} != length {length}", length=length)
        if length + k.shape[0] > s["max_tokens"]:
            raise Problem(409, "capacity-exceeded", f"max_tokens {s['max_tokens']}")
        if self.memory_budget is not None and k.nbytes * 2 > self.memory_budget:
            raise Problem(507, "out-of-memory", "over the memory budget")
        return wire.to_float32(k), wire.to_float32(v)  # held as float32, as the server computes

    def _kv(self, s: dict[str, Any], layer: int, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or "k" not in body or "v" not in body:
            raise Problem(422, "invalid-request", "k and v are required")
        k, v = self._append(s, layer, body)  # type: ignore[misc]
        s["k"][layer] = np.concatenate([s["k"][layer], k])
        s["v"][layer] = np.concatenate([s["v"][layer], v])
        return {"length": s["k"][layer].shape[0]}

    def _attend(self, s: dict[str, Any], layer: int, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or "q" not in body:
            raise Problem(422, "invalid-request", "q is required")
        q = self._array(body, "q", s["num_qo_heads"], s)
        out_dtype = body.get("out_dtype", wire.dtype_name(q))
        if out_dtype not in wire.DTYPES:
            raise Problem(422, "invalid-request", f"out_dtype: expected one of {sorted(wire.DTYPES)}")
        kv = self._append(s, layer, body)
        length = s["k"][layer].shape[0] + (kv[0].shape[0] if kv else 0)
        n = q.shape[0]
        start_pos = body.get("start_pos", length - n)
        if type(start_pos) is not int or start_pos < 0 or start_pos + n > length:
            raise Problem(422, "invalid-request", f"start_pos {start_pos} out of range for length {length}")
        if kv:
            s["k"][layer] = np.concatenate([s["k"][layer], kv[0]])
            s["v"][layer] = np.concatenate([s["v"][layer], kv[1]])
        scale = body.get("scale", 1.0 / math.sqrt(s["head_dim"]))
        q = wire.to_float32(q)
        out = reference_attention(q, s["k"][layer], s["v"][layer], start_pos, body.get("causal", True), scale)
        # computed in float64, answered in float32 rounded once to the dtype asked (as the server does)
        out = tensors.to_wire_dtype(out.astype(np.float32), self.out_dtype or out_dtype)
        return {"out": wire.encode_array(out), "length": length}


def _to_json(body: Any) -> Any:
    if isinstance(body, dict) and set(body) == {"dtype", "shape", "data"}:
        return wire.to_float32(wire.decode_array(body, name="out", finite=False)).tolist()
    if isinstance(body, dict):
        return {k: _to_json(v) for k, v in body.items()}
    if isinstance(body, list):
        return [_to_json(v) for v in body]
    return body


class Blocking:
    """Drive an AsyncClient or AsyncSession with blocking calls on one event loop,
    so that one test body checks the sync and the async client alike."""

    def __init__(self, target: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.target = target
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            result = self._loop.run_until_complete(attr(*args, **kwargs))
            return Blocking(result, self._loop) if isinstance(result, AsyncSession) else result

        return call


@pytest.fixture(autouse=True)
def _no_client_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests' clients see no ``ATTNSERVE_BASE_URL`` or ``ATTNSERVE_API_KEY`` of
    the shell that runs them (a test that wants one sets it)."""
    monkeypatch.delenv("ATTNSERVE_BASE_URL", raising=False)
    monkeypatch.delenv("ATTNSERVE_API_KEY", raising=False)


@pytest.fixture
def fake() -> FakeServer:
    return FakeServer()


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def sleeps() -> list[float]:
    """The backoff delays the client asked for (it never really sleeps in these tests)."""
    return []


@pytest.fixture
def make_client(mode: str, fake: FakeServer, sleeps: list[float]) -> Iterator[Callable[..., Any]]:
    loop = asyncio.new_event_loop()
    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        transport = httpx.MockTransport(fake.handler)
        if mode == "sync":
            client: Any = Client(BASE_URL, transport=transport, **kwargs)
            client._sleep = sleeps.append
            made.append(client)
            return client

        async def record(seconds: float) -> None:
            sleeps.append(seconds)

        aclient = AsyncClient(BASE_URL, transport=transport, **kwargs)
        aclient._sleep = record
        made.append(aclient)
        return Blocking(aclient, loop)

    yield make
    for client in made:
        if isinstance(client, AsyncClient):
            loop.run_until_complete(client.close())
        else:
            client.close()
    loop.close()


@pytest.fixture
def client(make_client: Callable[..., Any]) -> Any:
    return make_client()


@pytest.fixture
def attention() -> Callable[..., np.ndarray]:
    return reference_attention


# -- the real server --------------------------------------------------------------


@pytest.fixture(scope="session")
def start_live_server() -> Callable[..., Any]:
    """Starts the real attnserve server in-process (``tests/live_server.py``:
    uvicorn on a free loopback port, as ``attnserve serve`` configures it) with the
    given settings; the caller stops it. Skips when the server package cannot be
    imported, except under CI (``CI`` set), where that is a failure."""
    try:
        from attnserve.config import Settings
        from live_server import LiveServer
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"live server tests need the attnserve server package: {exc}")
        pytest.skip(f"attnserve server not importable yet ({exc}); live tests skipped")
    return lambda **settings: LiveServer(Settings(**settings)).start()


@pytest.fixture(scope="session")
def live_server_url(start_live_server) -> Iterator[str]:
    """Base URL of the real attnserve server with the default settings."""
    server = start_live_server()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def live_client(mode: str, live_server_url: str) -> Iterator[Any]:
    """A Client, or an AsyncClient behind blocking calls, on the live server."""
    if mode == "sync":
        with Client(live_server_url) as client:
            yield client
        return
    loop = asyncio.new_event_loop()
    aclient = AsyncClient(live_server_url)
    try:
        yield Blocking(aclient, loop)
    finally:
        loop.run_until_complete(aclient.close())
        loop.close()
