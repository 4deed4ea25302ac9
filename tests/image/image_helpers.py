"""Helpers of tests/image: the target under test (read from the environment), an
HTTP helper speaking both encodings, and oracle bookkeeping.

The target is a running attnserve reached over HTTP only (no in-process app, no
GPU here): one container, or a router in front of several replicas.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from attnserve_client import wire
from contract_helpers import TYPES, Model, Resp, decode, rel_err, request_parts, rows, to_wire  # noqa: F401

ENCODINGS = ("json", "msgpack")
KV_FORMATS = ("f32", "f16", "bf16", "turboquant")
PROBLEM = "application/problem+json"
# Relative error (max abs error over max abs value) of float32 attention on the
# device against the float64 oracle, and of TurboQuant against its own float64
# oracle computed from the same codes (as in tests/test_core_attention.py).
F32_TOL = 1e-5
TQ_TOL = 1e-4
# TurboQuant against exact attention on random data: relative error about 0.4,
# correlation about 0.9 (tests/service/test_turboquant.py).
TQ_MAX_REL, TQ_MIN_CORR = 0.6, 0.8
SESSION_PATH = re.compile(r"^/v1/sessions/([A-Za-z0-9_-]{1,64})(/|$)")


def _replicas(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, url = part.partition("=")
        assert name and url.startswith("http"), f"ATTNSERVE_TEST_REPLICAS: {part!r} is not name=url"
        out[name] = url.rstrip("/")
    return out


@dataclass(frozen=True)
class Target:
    """What deploy/test-image.sh (or a person) points the tests at."""

    url: str
    instance: str | None = None
    adapter: str | None = None
    replicas: dict[str, str] = field(default_factory=dict)
    access_log: str | None = None
    stop_replica: str | None = None

    @classmethod
    def from_env(cls) -> Target:
        env = os.environ
        return cls(
            url=env.get("ATTNSERVE_TEST_URL", "").rstrip("/"),
            instance=env.get("ATTNSERVE_TEST_INSTANCE") or None,
            adapter=env.get("ATTNSERVE_TEST_ADAPTER") or None,
            replicas=_replicas(env.get("ATTNSERVE_TEST_REPLICAS", "")),
            access_log=env.get("ATTNSERVE_TEST_ROUTER_ACCESS_LOG") or None,
            stop_replica=env.get("ATTNSERVE_TEST_STOP_REPLICA") or None,
        )

    @property
    def routed(self) -> bool:
        return bool(self.replicas)

    def address(self, name: str) -> str:
        """host:port of a replica, as the router's access log names its upstream."""
        return urlsplit(self.replicas[name]).netloc


TARGET = Target.from_env()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def out_array(body: dict) -> np.ndarray:
    """The ``out`` of an attend answer, in either encoding, as float32."""
    out = body["out"]
    if isinstance(out, dict):
        return wire.decode_array(out, name="out")
    return np.asarray(out, dtype=np.float32)


class Api:
    """httpx on the target (no proxies from the environment); every answer must name
    the replica that made it in X-Attnserve-Instance."""

    def __init__(self, url: str, *, expect_instance: str | set[str] | None = None):
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=120, trust_env=False)
        self.expect_instance = expect_instance
        self.seen: list[tuple[str, str, int, str | None]] = []

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
        instance = r.headers.get("x-attnserve-instance")
        self.seen.append((method, path, r.status_code, instance))
        if self.expect_instance is not None and not path.startswith("/_router/"):
            allowed = {self.expect_instance} if isinstance(self.expect_instance, str) else self.expect_instance
            assert instance in allowed, f"{method} {path}: X-Attnserve-Instance {instance!r}, expected one of {allowed}"
        return Resp(r.status_code, r.headers, decode(r), r.content)

    # shortcuts ---------------------------------------------------------------

    def create(self, sid: str, enc: str = "json", **fields: Any) -> dict:
        r = self.call("PUT", f"/v1/sessions/{sid}", fields, enc=enc)
        assert r.status == 201, (r.status, r.body)
        return r.body

    def info(self, sid: str) -> dict:
        r = self.call("GET", f"/v1/sessions/{sid}", accept=wire.JSON)
        assert r.status == 200, (r.status, r.body)
        return r.body

    def append(self, sid: str, layer: int, k, v, *, enc: str = "msgpack", **kw: Any) -> Resp:
        return self.call("POST", f"/v1/sessions/{sid}/layers/{layer}/kv", {"k": k, "v": v, **kw}, enc=enc)

    def attend(self, sid: str, layer: int, q, *, enc: str = "msgpack", **kw: Any) -> Resp:
        r = self.call("POST", f"/v1/sessions/{sid}/layers/{layer}/attend", {"q": q, **kw}, enc=enc)
        if r.status == 200:
            r.body["out"] = out_array(r.body)
        return r

    def delete(self, sid: str) -> Resp:
        return self.call("DELETE", f"/v1/sessions/{sid}")


def band(out: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    out, exact = np.asarray(out, np.float64), np.asarray(exact, np.float64)
    rel = float(np.linalg.norm(out - exact) / np.linalg.norm(exact))
    corr = float(np.corrcoef(out.ravel(), exact.ravel())[0, 1])
    return rel, corr
