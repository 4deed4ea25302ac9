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


class RawFrames:
    """A bare socket speaking the framing, for what the client library never sends."""

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
        resolve_arrays(doc, memoryview(buf)[head_len:])
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
