"""The shared-memory transport's region, for the client and the server alike.

A client on the server's host (``docs/api.md``, "Shared-memory transport") speaks
the frame transport's framing (:mod:`attnserve_client.framing`) over a Unix socket,
and its hello passes one file descriptor: a memfd of ``region`` bytes, sealed
against shrinking, that both sides map. An array of a request may then be a
reference into that region instead of into the frame's body::

    {"dtype": "<f4", "shape": [d0, ...], "shm": [offset, nbytes]}

(``offset`` a multiple of 4, as for ``at``), and a request may name the range its
reply's arrays are to be written to, ``"reply_at": [offset, nbytes]`` (``offset`` a
multiple of :data:`ALIGN`): the server writes them there back to back, each at the
next multiple of :data:`ALIGN`, and its reply refers to them the same way. The
reply needs :func:`reply_bytes` of the request (each array rounded up to
:data:`ALIGN`), which the server checks before it runs anything.

* :func:`create_region`: a sealed memfd and its mapping (Linux);
* :func:`peer_uid`: the user of the process at the socket's other end, which each
  side checks before it trusts the other (Linux, ``SO_PEERCRED``);
* :func:`reply_bytes`: the bytes a request's reply takes in the region;
* :func:`request_bytes` and :func:`place_arrays`: a request's arrays copied into
  a range of the region (those already in it referred to where they are), or a
  reply's, replaced by references;
* :class:`Ranges`: a first-fit allocator of aligned ranges of a region.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .framing import _DEPTH, _holds_containers
from .wire import DTYPES, MAX_NDIM, WireError

__all__ = [
    "ALIGN",
    "SEALS",
    "aligned",
    "create_region",
    "peer_uid",
    "reply_bytes",
    "request_bytes",
    "place_arrays",
    "Ranges",
]

#: Where a reply's arrays start in the region (and where the client's ranges start).
ALIGN = 64
#: The seals a client's region carries, by name (``fcntl.F_SEAL_*``; the server
#: requires ``F_SEAL_SHRINK``: a region that could shrink under its mapping would
#: fault the server, SIGBUS).
SEALS = ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")
_ARRAY = frozenset({"dtype", "shape", "data"})


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


#: ``struct ucred`` (``SO_PEERCRED``): pid (signed), uid, gid (unsigned).
_UCRED = struct.Struct("iII")


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a connected Unix socket."""
    _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(uid)


def create_region(nbytes: int, name: str = "attnserve-region") -> tuple[int, mmap.mmap]:
    """A region of ``nbytes`` (zeros): an anonymous memory file (``memfd``, nothing
    in the file system, freed when the last descriptor and mapping go), sealed
    against shrinking, growing and further seals, and its read-write shared
    mapping. Returns ``(fd, mapping)``; the caller passes ``fd`` to the server and
    closes it.

    Raises:
        OSError: the platform has no memfd (not Linux) or the memory is refused.
    """
    if sys.platform != "linux":
        raise OSError("the shared-memory transport needs Linux (memfd_create, SO_PEERCRED)")
    import fcntl  # (POSIX only: imported where it is used)

    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, sum(getattr(fcntl, seal) for seal in SEALS))
        region = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, region


# -- sizes ----------------------------------------------------------------------


def _shape_dtype(value: Any) -> tuple[list[int], int] | None:
    """The shape and itemsize of an array as a request carries it (a wire map, a
    reference, or nested lists of numbers: float32), or None where it is none (the
    operation's own checks refuse it then)."""
    if isinstance(value, Mapping):
        dtype = DTYPES.get(value["dtype"]) if isinstance(value.get("dtype"), str) else None
        shape = value.get("shape")
        if dtype is None or not isinstance(shape, list) or len(shape) > MAX_NDIM:
            return None
        if not all(type(d) is int and d >= 0 for d in shape):
            return None
        data = value.get("data")
        if data is not None:  # a resolved array whose bytes do not match is refused later
            try:
                if memoryview(data).nbytes != _count(shape) * dtype.itemsize:
                    return None
            except TypeError:
                return None
        return shape, dtype.itemsize
    if isinstance(value, list):
        dims: list[int] = []
        node: Any = value
        while isinstance(node, list) and len(dims) <= MAX_NDIM:
            dims.append(len(node))
            node = node[0] if node else None
        return (dims, 4) if len(dims) <= MAX_NDIM else None
    return None


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _attend_reply(doc: Mapping[str, Any]) -> int:
    """The bytes of an attend's ``out`` (and ``lse``) in the region."""
    q = _shape_dtype(doc.get("q"))
    if q is None:
        return 0
    shape, itemsize = q
    out_dtype = doc.get("out_dtype")
    if isinstance(out_dtype, str) and out_dtype in DTYPES:
        itemsize = DTYPES[out_dtype].itemsize
    need = aligned(_count(shape) * itemsize)
    if doc.get("return_lse") is True and shape:
        need += aligned(_count(shape[:-1]) * 4)  # float32, one per row and head
    return need


def reply_bytes(doc: Any) -> int:
    """The bytes the reply to the request ``doc`` takes in the region at most: its
    arrays (``out``, ``lse``; of every item, or the stacked ones), each rounded up to
    :data:`ALIGN`; a step's layer call, whose ``out_dtype`` and ``return_lse`` its
    step fixed, as if float32 with ``lse``. An append's, a ``ping``'s or a
    ``session``'s is 0."""
    if not isinstance(doc, Mapping):
        return 0
    op = doc.get("op")
    if op == "attend" or (op == "attend_batch" and "session_ids" in doc):
        return _attend_reply(doc)
    if op == "attend_batch" and isinstance(doc.get("items"), list):
        return sum(_attend_reply(item) for item in doc["items"] if isinstance(item, Mapping))
    if op == "step_call":  # out_dtype and return_lse are the step's: the most they can take
        return _attend_reply({"q": doc.get("q"), "out_dtype": "<f4", "return_lse": True})
    return 0


# -- arrays into and out of the region ------------------------------------------


def _arrays(obj: Any, depth: int = 0) -> Iterator[Mapping[str, Any]]:
    """Every inline array (wire map with ``data``) of a document, where framing looks."""
    if isinstance(obj, Mapping):
        if obj.keys() == _ARRAY:
            yield obj
            return
        if depth < _DEPTH:
            for v in obj.values():
                yield from _arrays(v, depth + 1)
    elif _holds_containers(obj) and depth < _DEPTH:
        for v in obj:
            yield from _arrays(v, depth + 1)


def request_bytes(doc: Any, in_place: Callable[[memoryview], int | None] | None = None) -> int:
    """The bytes :func:`place_arrays` copies ``doc``'s arrays into: each rounded up
    to :data:`ALIGN`, but for those ``in_place`` finds in the region already."""
    need = 0
    for arr in _arrays(doc):
        data = memoryview(arr["data"])
        if in_place is None or in_place(data) is None:
            need += aligned(data.nbytes)
    return need


def place_arrays(
    doc: Any,
    region: memoryview,
    start: int,
    end: int,
    in_place: Callable[[memoryview], int | None] | None = None,
) -> tuple[Any, int]:
    """``doc`` with each inline array (a wire map with ``data``, where framing looks
    for arrays) copied into ``region[start:end]``, each at the next multiple of
    :data:`ALIGN`, and replaced by its reference ``{"dtype", "shape", "shm"}``; an
    array whose bytes ``in_place`` finds in the region already (its offset) is
    referred to there, not copied. ``doc`` is not changed (the maps and lists that
    hold arrays are copied). Returns the new document and the end of what was written.

    Raises:
        WireError: the arrays do not fit in the range.
    """
    pos = [start]

    def place(obj: Any, depth: int) -> Any:
        if isinstance(obj, dict):
            if obj.keys() == _ARRAY and isinstance(obj["data"], (bytes, bytearray, memoryview)):
                data = memoryview(obj["data"]).cast("B")
                at = None if in_place is None else in_place(data)
                if at is None:
                    at = aligned(pos[0])
                    if at + data.nbytes > end:
                        raise WireError(
                            f"shm: the arrays need more than the {end - start} bytes of the range at {start}"
                        )
                    region[at : at + data.nbytes] = data
                    pos[0] = at + data.nbytes
                return {"dtype": obj["dtype"], "shape": obj["shape"], "shm": [at, data.nbytes]}
            if depth < _DEPTH:
                return {k: place(v, depth + 1) for k, v in obj.items()}
        elif _holds_containers(obj) and depth < _DEPTH:
            return [place(v, depth + 1) for v in obj]
        return obj

    placed = place(doc, 0)
    return placed, pos[0]


# -- the client's ranges ----------------------------------------------------------


class Ranges:
    """A first-fit allocator of the ranges of a region of ``size`` bytes: each starts
    at a multiple of :data:`ALIGN` and takes a multiple of it. Not thread-safe."""

    def __init__(self, size: int):
        self.size = size - size % ALIGN
        self._free: list[list[int]] = [[0, self.size]] if self.size else []  # [start, end), sorted, disjoint
        self._taken: dict[int, int] = {}  # start -> end

    @property
    def taken_bytes(self) -> int:
        return sum(end - start for start, end in self._taken.items())

    def take(self, nbytes: int) -> int | None:
        """The start of a free range of ``nbytes`` (at least :data:`ALIGN`), now
        taken; None when no free range is that large."""
        n = max(ALIGN, aligned(nbytes))
        for i, (start, end) in enumerate(self._free):
            if end - start >= n:
                if end - start == n:
                    del self._free[i]
                else:
                    self._free[i][0] = start + n
                self._taken[start] = start + n
                return start
        return None

    def give(self, start: int) -> None:
        """Free the range :meth:`take` gave at ``start``.

        Raises:
            KeyError: no range taken starts there.
        """
        end = self._taken.pop(start)
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        free.insert(i, [start, end])
        if i + 1 < len(free) and free[i][1] == free[i + 1][0]:  # merge with the next
            free[i][1] = free.pop(i + 1)[1]
        if i and free[i - 1][1] == free[i][0]:  # and the one before
            free[i - 1][1] = free.pop(i)[1]

    def owner(self, offset: int) -> int | None:
        """The start of the taken range that holds ``offset``, or None."""
        for start, end in self._taken.items():
            if start <= offset < end:
                return start
        return None
