"""Wire-level helpers for tests that drive the HTTP contract: answers, array
encoding both ways, error measures and a float64 model of a session's layers.
Shared by tests/service (in-process servers) and tests/image (a container)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from tools import reference as ref
from attnserve_client import wire
from tools.common import rel_err  # noqa: F401  (the tests import it from here)


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
    if isinstance(obj, list):
        return [to_wire(v, enc) for v in obj]
    return obj


#: The media type of each encoding.
TYPES = {"json": wire.JSON, "msgpack": wire.MSGPACK}


def request_parts(
    body: Any, enc: str, content: bytes | None, headers: dict[str, str] | None, accept: str | None
) -> tuple[bytes | None, dict[str, str]]:
    """The bytes and headers of a test request: ``body`` (arrays inside it in the
    encoding's form) encoded as ``enc`` unless ``content`` is given raw, its
    Content-Type unless ``headers`` set one, and ``accept``."""
    h = dict(headers or {})
    if body is not None:
        payload = to_wire(body, enc)
        content = wire.packb(payload) if enc == "msgpack" else json.dumps(payload).encode()
        if "content-type" not in {k.lower() for k in h}:
            h["Content-Type"] = TYPES[enc]
    if accept is not None:
        h["Accept"] = accept
    return content, h


def decode(r: httpx.Response) -> Any:
    """An answer's body: MessagePack or JSON by its content type, else its text."""
    if not r.content:
        return None
    ctype = r.headers.get("content-type", "")
    if wire.is_msgpack(ctype):
        return wire.unpackb(r.content, max_bytes=1 << 31)
    if "json" in ctype:
        return json.loads(r.content)
    return r.text


def rows(rng: np.random.Generator, n: int, heads: int, d: int) -> np.ndarray:
    return rng.standard_normal((n, heads, d)).astype(np.float32)


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
        return ref.attention(q, self.k[layer], self.v[layer], **kw)
