"""The frame transport's framing, for the client and the server alike.

Every frame, either way, on a plain TCP connection::

    b"ATF1" | u32 head_len | u32 body_len | head | body

(lengths little-endian). ``head`` is one MessagePack map (a request or reply
document of the stream); its arrays are *references* into ``body``::

    {"dtype": "<f4", "shape": [d0, ...], "at": [offset, nbytes]}

(``offset`` a multiple of 4: a sender pads a half-precision array of an odd
element count with zero bytes up to the next), so array bytes are never copied into or out of
MessagePack: a sender hands its arrays' memory to the socket, a receiver views
them in the buffer it received the frame into. An array may also be the usual
inline wire map (``data`` as ``bin``). The first frame of a connection is
``{"op": "hello", "id", "version": 1, "key"?}``, answered with the server's
limits or with a problem that closes the connection.

A layer call of an open step may instead travel as a *call frame*, with no
MessagePack at all (docs/api.md, "Call frames: a step's layer call with no MessagePack")::

    b"ATC1" | u32 step | u32 layer | u32 seq | u32 body_len | q | k | v

(the arrays' bytes back to back in the step's dtype and shapes), answered, when
every item applied, by a *call reply* ``b"ATR1" | u32 seq | u32 status (200) |
u32 body_len | out | lse`` (lse only with the step's ``return_lse``), and
otherwise by an ordinary reply frame whose document's ``id`` is ``seq``.

The shared-memory transport (:mod:`attnserve_client.shm`) speaks the same frames
over a Unix socket, and its arrays may also refer to a range of the region both
sides map: ``{"dtype", "shape", "shm": [offset, nbytes]}``.
"""

from __future__ import annotations

import struct
from typing import Any

from .wire import WireError

__all__ = [
    "MAGIC", "PREFIX", "CALL_MAGIC", "CALL_HEAD", "REPLY_MAGIC", "REPLY_HEAD", "VERSION", "MAX_HEAD_BYTES",
    "frame_buffers", "read_prefix", "resolve_arrays",
]  # fmt: skip

MAGIC = b"ATF1"
#: magic, head length, body length
PREFIX = struct.Struct("<4sII")
#: A call frame's head: magic, step, layer, seq, body length (the server's parser:
#: attnserve/plane/callframe.c, whose constants tests/test_callframe.py checks against these)
CALL_MAGIC = b"ATC1"
CALL_HEAD = struct.Struct("<4sIIII")
#: A call reply's head: magic, seq, status, body length
REPLY_MAGIC = b"ATR1"
REPLY_HEAD = struct.Struct("<4sIII")
#: The protocol version a hello names.
VERSION = 1
#: Most bytes of one frame's head (its arrays travel in the body).
MAX_HEAD_BYTES = 1 << 20
#: How deep in a document arrays are looked for: a request's member (``q``) or a
#: member of one of its items (``items[i].q``); a reply's ``result.out`` or
#: ``result.results[i].out``.
_DEPTH = 4
_ARRAY = frozenset({"dtype", "shape", "data"})
_ARRAY_REF = frozenset({"dtype", "shape", "at"})
_REGION_REF = frozenset({"dtype", "shape", "shm"})


def frame_buffers(doc: dict[str, Any], pack: Any) -> list[Any]:
    """The buffers of one frame carrying ``doc`` (``pack``: the MessagePack packer):
    the prefix, the head, then each array's bytes as they are (no copy). ``doc`` is
    not changed (the maps and lists that hold arrays are copied)."""
    parts: list[memoryview] = []
    head = pack(_refer(doc, parts, [0], 0))
    body_len = sum(p.nbytes for p in parts)
    return [PREFIX.pack(MAGIC, len(head), body_len), head, *parts]


def _refer(obj: Any, parts: list[memoryview], offset: list[int], depth: int) -> Any:
    if isinstance(obj, dict):
        if obj.keys() == _ARRAY and isinstance(obj["data"], (bytes, bytearray, memoryview)):
            data = memoryview(obj["data"]).cast("B")
            parts.append(data)
            ref = {"dtype": obj["dtype"], "shape": obj["shape"], "at": [offset[0], data.nbytes]}
            offset[0] += data.nbytes
            if offset[0] % 4:  # the next array starts at a multiple of 4
                pad = 4 - offset[0] % 4
                parts.append(memoryview(bytes(pad)))
                offset[0] += pad
            return ref
        if depth < _DEPTH:
            return {k: _refer(v, parts, offset, depth + 1) for k, v in obj.items()}
    elif _holds_containers(obj) and depth < _DEPTH:
        return [_refer(v, parts, offset, depth + 1) for v in obj]
    return obj


def _holds_containers(obj: Any) -> bool:
    """Whether ``obj`` is a list whose items may hold arrays (maps or lists): a list
    of ids or lengths is passed over whole, without a look at each item."""
    return isinstance(obj, list) and bool(obj) and isinstance(obj[0], (dict, list))


def read_prefix(prefix: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(head_len, body_len)`` of a frame's first :data:`PREFIX` bytes.

    Raises:
        WireError: they do not start with :data:`MAGIC`.
    """
    magic, head_len, body_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError(
            f"frame: expected the magic {MAGIC!r} that starts every frame of attnserve's frame transport, "
            f"got {bytes(magic)!r} (HTTP and WebSocket clients use the HTTP port)"
        )
    return head_len, body_len


def resolve_arrays(doc: Any, body: memoryview, depth: int = 0, *, region: memoryview | None = None) -> None:
    """Replace, in place, each array reference of a received head by the wire map
    whose ``data`` is its range of ``body`` (``at``), or of ``region`` (``shm``: the
    shared-memory transport's region, where there is one): a view, no copy.

    Raises:
        WireError: a reference is malformed or outside the body (the region), or
            refers to a region where there is none; the message names it.
    """
    if depth >= _DEPTH:
        return
    members = doc.items() if isinstance(doc, dict) else enumerate(doc) if _holds_containers(doc) else ()
    for name, value in list(members):
        if isinstance(value, dict) and ("at" in value or "shm" in value):
            doc[name] = _array_of(value, body, str(name), region)
        elif isinstance(value, (dict, list)):
            resolve_arrays(value, body, depth + 1, region=region)


def _array_of(ref: dict[str, Any], body: memoryview, name: str, region: memoryview | None) -> dict[str, Any]:
    key, keys, buf, what = "at", _ARRAY_REF, body, "the body"
    if "shm" in ref:
        if region is None:
            raise WireError(
                f"{name}: shm: a reference into a shared-memory region, which only a connection of the "
                "shared-memory transport has; send the array's bytes in the frame's body (at)"
            )
        key, keys, buf, what = "shm", _REGION_REF, region, "the region"
    if ref.keys() != keys:
        raise WireError(f"{name}: expected exactly the keys {sorted(keys)}, got {sorted(map(str, ref))}")
    at = ref[key]
    if not (isinstance(at, list) and len(at) == 2 and all(type(x) is int and x >= 0 for x in at)):
        raise WireError(f"{name}: {key}: expected [offset, nbytes], two integers >= 0, got {at!r:.60}")
    offset, nbytes = at
    if offset % 4 or offset + nbytes > buf.nbytes:
        raise WireError(
            f"{name}: {key}: expected a range of {what}'s {buf.nbytes} bytes starting at a multiple of 4, "
            f"got [{offset}, {nbytes}]"
        )
    return {"dtype": ref["dtype"], "shape": ref["shape"], "data": buf[offset : offset + nbytes]}
