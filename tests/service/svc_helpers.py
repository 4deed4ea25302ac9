"""Helpers of the service tests: a real server (uvicorn on 127.0.0.1 in a thread),
a small HTTP helper speaking both encodings, and the oracle bookkeeping."""

from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import uvicorn

from attnserve import reference as ref
from attnserve.app import create_app
from attnserve.config import Settings
from attnserve_client import wire

ENCODINGS = ("json", "msgpack")
TYPES = {"json": wire.JSON, "msgpack": wire.MSGPACK}
# Relative error of the GPU's float32 attention against the float64 oracle
# (max abs error over max abs value), as in the core tests.
F32_TOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The real app under uvicorn in a background thread."""

    def __init__(self, settings: Settings | None = None, *, engine=None, app=None):
        self.app = app or create_app(settings or Settings(), engine=engine)
        self.runtime = self.app.state.runtime
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                           access_log=False)
        )
        self.thread = threading.Thread(target=self.server.run, name=f"attnserve-{self.port}", daemon=True)

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the attnserve server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


@dataclass
class Resp:
    status: int
    headers: httpx.Headers
    body: Any
    raw: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    @property
    def problem_type(self) -> str | None:
        return self.body.get("type") if isinstance(self.body, dict) else None


def to_wire(obj: Any, enc: str) -> Any:
    """Arrays inside ``obj`` in the encoding's form (map for msgpack, lists for JSON)."""
    if isinstance(obj, np.ndarray):
        return wire.encode_array(obj) if enc == "msgpack" else obj.tolist()
    if isinstance(obj, dict):
        return {k: to_wire(v, enc) for k, v in obj.items()}
    return obj


def from_wire(obj: Any) -> Any:
    if isinstance(obj, dict) and set(obj) == {"dtype", "shape", "data"}:
        return wire.decode_array(obj, name="out")
    if isinstance(obj, dict):
        return {k: from_wire(v) for k, v in obj.items()}
    return obj


class Api:
    def __init__(self, url: str):
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=120)

    def close(self) -> None:
        self.client.close()

    def call(self, method: str, path: str, body: Any = None, *, enc: str = "json", accept: str | None = None,
             content: bytes | None = None, headers: dict[str, str] | None = None) -> Resp:
        h = dict(headers or {})
        if body is not None:
            payload = to_wire(body, enc)
            content = wire.packb(payload) if enc == "msgpack" else httpx_json(payload)
            if "content-type" not in {k.lower() for k in h}:
                h["Content-Type"] = TYPES[enc]
        if accept is not None:
            h["Accept"] = accept
        r = self.client.request(method, path, content=content, headers=h)
        return Resp(r.status_code, r.headers, decode(r), r.content)

    # shortcuts ---------------------------------------------------------------

    def create(self, enc: str = "json", session_id: str | None = None, **fields: Any) -> dict:
        r = (self.call("PUT", f"/v1/sessions/{session_id}", fields, enc=enc) if session_id
             else self.call("POST", "/v1/sessions", fields, enc=enc))
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


def httpx_json(payload: Any) -> bytes:
    import json

    return json.dumps(payload).encode()


def decode(r: httpx.Response) -> Any:
    if not r.content:
        return None
    ctype = r.headers.get("content-type", "")
    if wire.is_msgpack(ctype):
        return wire.unpackb(r.content, max_bytes=1 << 31)
    if "json" in ctype:
        import json

        return json.loads(r.content)
    return r.text


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def rows(rng: np.random.Generator, n: int, heads: int, d: int) -> np.ndarray:
    return rng.standard_normal((n, heads, d)).astype(np.float32)


def oracle(q, k, v, **kw) -> np.ndarray:
    return ref.attention(q, k, v, **kw)


class Model:
    """What a session's layers should hold, for oracle checks after every request."""

    def __init__(self, h: int, hkv: int, d: int, layers: int = 1):
        self.h, self.hkv, self.d = h, hkv, d
        self.k = [np.zeros((0, hkv, d), np.float32) for _ in range(layers)]
        self.v = [np.zeros((0, hkv, d), np.float32) for _ in range(layers)]

    def add(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])

    @property
    def lengths(self) -> list[int]:
        return [len(k) for k in self.k]

    def attention(self, layer: int, q: np.ndarray, **kw: Any) -> np.ndarray:
        return oracle(q, self.k[layer], self.v[layer], **kw)


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
