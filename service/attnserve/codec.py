"""Content negotiation, body reading with a size limit, decoding and answers.

The array codec itself lives in the client package (:mod:`attnserve_client.wire`)
and is imported from there: this module only decides *which* encoding a request
uses and answers in, reads bodies without ever holding more than the limit, and
turns documents into checked Python values.

* Request ``Content-Type``: MessagePack (``application/vnd.msgpack``,
  ``application/x-msgpack``, ``application/msgpack``) or ``application/json``,
  parameters such as ``charset`` ignored; anything else with a body is
  ``415 unsupported-media-type``.
* Answer type: the best of those types the ``Accept`` header names (``q``
  values honoured), else the request's type, else JSON. Errors are always
  ``application/problem+json``.
* Decoding copies array data at most once: MessagePack ``bin`` fields become
  ``bytes`` inside the parser and :func:`wire.decode_array` wraps them without a
  copy (read-only arrays).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import msgpack
import anyio.to_thread
import numpy as np
from attnserve_client import wire  # the attnserve-client distribution, a dependency
from starlette.requests import Request
from starlette.responses import Response

from .errors import ApiError, BodyTimeout, InvalidRequest, MalformedBody, PayloadTooLarge, UnsupportedMediaType

__all__ = [
    "wire",
    "MediaKind",
    "Wire",
    "media_kind",
    "accept_kind",
    "negotiate",
    "read_body",
    "decode_document",
    "encode",
    "respond",
    "array_out",
    "problem_response",
    "offload",
    "MEDIA_TYPES",
    "BodyTimeout",
    "BODY_IDLE_TIMEOUT_S",
]

MediaKind = Literal["json", "msgpack"]
# A refused body is not read on: the answer closes the connection (else the server
# would go on receiving, and dropping, whatever the client still sends).
_CLOSE = {"Connection": "close"}
MEDIA_TYPES: dict[str, str] = {"json": wire.JSON, "msgpack": wire.MSGPACK}
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def media_kind(value: str | None) -> MediaKind | None:
    """``"msgpack"``, ``"json"`` or ``None`` for a Content-Type / media range."""
    if not value:
        return None
    base = value.split(";", 1)[0].strip().lower()
    if base in wire.MSGPACK_TYPES:
        return "msgpack"
    if base == wire.JSON:
        return "json"
    return None


def accept_kind(accept: str | None) -> MediaKind | None:
    """The supported type an ``Accept`` header prefers (highest ``q``, then first named)."""
    if not accept:
        return None
    best: MediaKind | None = None
    best_q = 0.0
    for part in accept.split(","):
        base, *params = part.split(";")
        kind = media_kind(base)
        if kind is None:
            continue
        q = 1.0
        for p in params:
            key, _, val = p.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(val.strip())
                except ValueError:
                    q = 0.0
                if not math.isfinite(q):
                    q = 0.0
        if q > best_q:
            best, best_q = kind, q
    return best


@dataclass(frozen=True)
class Wire:
    """How one request is encoded (``None``: it has no body) and how to answer it."""

    request: MediaKind | None
    response: MediaKind

    @property
    def response_type(self) -> str:
        return MEDIA_TYPES[self.response]


def _has_body(request: Request) -> bool:
    cl = request.headers.get("content-length")
    if cl is not None:
        return cl.strip() not in ("", "0")
    return "transfer-encoding" in request.headers


def negotiate(request: Request, max_body_bytes: int) -> Wire:
    """Pick the encodings, refusing other content types (415) and a declared
    ``Content-Length`` over the limit (413) before any of the body is read."""
    ctype = request.headers.get("content-type")
    kind = media_kind(ctype)
    if request.method in _BODY_METHODS and _has_body(request):
        if kind is None:
            raise UnsupportedMediaType(
                f"Content-Type {ctype or '(none)'} is not supported; send application/vnd.msgpack "
                "(or application/x-msgpack, application/msgpack) or application/json"
            )
        cl = request.headers.get("content-length")
        if cl is not None and cl.strip().isdigit() and int(cl) > max_body_bytes:
            raise PayloadTooLarge(
                f"the body is {int(cl)} bytes; this server takes at most {max_body_bytes}",
                max_body_bytes=max_body_bytes,
                headers=_CLOSE,
            )
    return Wire(request=kind, response=accept_kind(request.headers.get("accept")) or kind or "json")


#: Longest wait for the next piece of a request body (like nginx's client_body_timeout):
#: a client that stalls mid-body is answered 408 body-timeout and its connection closed,
#: instead of holding a request (and its partial body) open for ever.
BODY_IDLE_TIMEOUT_S = 60.0


async def read_body(request: Request, max_body_bytes: int, *, idle_timeout_s: float | None = None) -> bytes | bytearray:
    """The whole body, refusing it (413) as soon as it passes ``max_body_bytes``:
    before reading anything when ``Content-Length`` says so, else as soon as the
    streamed bytes pass the limit (the rest is never buffered); and refusing it
    (408) when no byte arrives for ``idle_timeout_s`` (default
    :data:`BODY_IDLE_TIMEOUT_S`). A body of a declared length is received into
    one buffer of that length (its bytes held once, not again to join them), or,
    where the server hands it over whole (uvicorn does, once it has it all), kept
    as it came: no copy."""
    cl = request.headers.get("content-length")
    declared = int(cl) if cl is not None and cl.strip().isdigit() else None
    if declared is not None and declared > max_body_bytes:
        raise PayloadTooLarge(
            f"the body is {declared} bytes; this server takes at most {max_body_bytes}",
            max_body_bytes=max_body_bytes,
            headers=_CLOSE,
        )
    idle = BODY_IDLE_TIMEOUT_S if idle_timeout_s is None else idle_timeout_s
    # a declared body of more than one chunk goes straight into a buffer of its length
    # (made once the first chunk shows the body does not come whole)
    want = declared if declared is not None and declared > _ONE_CHUNK else None
    into: bytearray | None = None
    chunks: list[bytes] = []
    total = 0
    stream = request.stream().__aiter__()
    while True:
        try:
            with anyio.fail_after(idle):
                chunk = await stream.__anext__()
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise BodyTimeout(
                f"no byte of the body arrived for {idle:g} s ({total} bytes came); send it whole and promptly",
                headers=_CLOSE,
            ) from None
        if not chunk:
            continue
        total += len(chunk)
        if total > max_body_bytes:
            raise PayloadTooLarge(
                f"the body passed {max_body_bytes} bytes, the most this server takes",
                max_body_bytes=max_body_bytes,
                headers=_CLOSE,
            )
        if want is not None and total <= want and not (total == len(chunk) == want):
            if into is None:
                into = bytearray(want)
            # (through a memoryview: a slice of a bytearray set from bytes copies them twice)
            memoryview(into)[total - len(chunk) : total] = chunk
        else:  # kept as it came: the whole declared body in one piece, a body of no declared length, bytes past it
            chunks.append(chunk)
    if into is not None:
        if chunks or total < len(into):  # not the length declared: the server checks it, this keeps it right
            return bytes(into[: min(total, len(into))]) + b"".join(chunks)
        return into
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


#: The most bytes a body arrives in at once (uvicorn's read size): a longer declared
#: body is received into a buffer of its length.
_ONE_CHUNK = 64 * 1024


def decode_document(raw: bytes, kind: MediaKind | None, max_bytes: int) -> Any:
    """Parse the body as its declared type; ``{}`` for an empty body with no type.
    Either type's arrays and maps are bounded (:func:`wire.max_containers`) before
    they are built.

    Raises:
        MalformedBody: the bytes are not a document of that type, or hold too
            many arrays and maps.
    """
    if kind is None:
        return {}
    try:
        if kind == "msgpack":
            return wire.unpackb(raw, max_bytes=max_bytes)
        return wire.loads_json(raw, max_bytes=max_bytes)
    except wire.WireError as e:
        raise MalformedBody(str(e)) from None


def check_finite(a: np.ndarray, name: str) -> None:
    """Refuse (422, naming the first bad element's index) an array with a NaN or
    infinity, as a decoded request array is refused."""
    try:
        wire.check_finite(a, name=name)
    except wire.WireError as e:
        raise InvalidRequest(str(e)) from None


# ── answers ─────────────────────────────────────────────────────────────────


def array_out(arr: np.ndarray, kind: MediaKind) -> Any:
    """An array for an answer: the wire map for MessagePack (in its dtype), nested
    lists of numbers for JSON (a half array's values, exactly)."""
    if kind == "msgpack":
        return wire.encode_array(arr)
    return wire.to_float32(arr).tolist()


def encode(obj: Any, kind: MediaKind) -> bytes | memoryview:
    """An answer's bytes: MessagePack as the packer wrote them (a view of its buffer,
    not copied again into a ``bytes``: ``wire.packb``'s result is one more copy of
    every array), or JSON."""
    if kind == "msgpack":
        packer = msgpack.Packer(use_bin_type=True, autoreset=False)  # wire.packb's options
        packer.pack(obj)
        view: memoryview = packer.getbuffer()
        return view
    return json.dumps(obj, separators=(",", ":")).encode()


def respond(
    obj: Any, wire_: Wire, status: int = 200, headers: dict[str, str] | None = None, body: bytes | None = None
) -> Response:
    content = encode(obj, wire_.response) if body is None else body
    return Response(content, status_code=status, media_type=wire_.response_type, headers=headers)


def problem_response(err: ApiError, instance: str | None = None) -> Response:
    body = json.dumps(err.problem(instance), separators=(",", ":"), default=str).encode()
    return Response(body, status_code=err.status, media_type=wire.PROBLEM_JSON, headers=err.headers or None)


async def offload(fn: Callable[..., Any], *args: Any, size: int, threshold: int) -> Any:
    """``fn(*args)``, on a worker thread when ``size`` bytes pass ``threshold``
    (large bodies must not stall the event loop and with it the probes)."""
    if size > threshold:
        return await anyio.to_thread.run_sync(fn, *args)
    return fn(*args)
