#!/usr/bin/env python3
"""How many times the server copies an item's bytes on the host, per stage, on the
way in (socket -> GPU upload) and back (GPU readback -> socket), per transport:
issue 43's copy budget ("at most twice each way") checked, not assumed.

    python bench/probes/copy_probe.py [--adapter ADAPTER] [--mib 4]
        [--transports http,stacked,stream,frames,shm] [--json-out FILE] [--records]

The real app (``create_app``, the uvicorn configuration of ``attnserve serve``:
uvloop, httptools, websockets' sans-I/O protocol, the frame transport on
``frames_port``) serves 127.0.0.1 in a thread of this process; a client (this file
with ``--client``) in a child process sends one attend with a fused append, ``q``
``[n, 32, 128]`` of ``--mib`` MiB and ``k``, ``v`` ``[2n, 8, 128]`` of half that each
(sizes no other allocation has), after two warm-up requests of the same shapes on
the same connection and session, so lazy one-time allocations are not counted.
Transports: ``http`` (``POST .../attend``, MessagePack), ``stacked`` (``POST
/v1/batch/attend``, the stacked form of ``--items`` sessions, the arrays the same
sizes in all), ``stream`` (an ``attend`` frame on ``/v1/stream``), ``frames`` (the
same on the frame transport), ``shm`` (the same on the shared-memory transport: the
arrays in the client's region, the reply written there) and ``json`` (``POST .../attend`` in JSON, only when
named: its "copies" are Python objects built, for contrast).

While the one request is handled, four counters run:

* ``tracemalloc``: every allocation of Python's allocators, numpy's data among
  them (numpy reports its buffers to tracemalloc). A profile hook on every thread
  of the server (``threading.setprofile``, set before the server starts; the
  switch interval raised so threads interleave only where they block) reads
  tracemalloc's peak at every call and return, Python or C, and resets it: a
  peak that grew by ``--min-kib`` or more since the last event is an allocation
  (or several) of that size made since then, transient ones included. A
  tracemalloc snapshot taken then names each new allocation still alive by its
  own traceback (the allocating thread's stack); growth that is no longer alive
  (a buffer built and freed inside one C call, as msgpack's packer's) is charged
  to the call that returned. A buffer that grows by ``realloc`` counts its growth
  (and, where the block moved, the bytes it held: a copy too).
* the ``data`` argument of every ``data_received`` call: uvloop copies each read
  chunk from its own read buffer into a new bytes object in C, while the chunk
  before it is freed in the same gap between two events, which the peak cannot
  tell; tracemalloc's sightings of those chunks are shown as duplicates.
* wrappers of ``GPUQueue.write_buffer`` and of the writes of a batch's compiled
  recording (``attnserve.gpu.native``: the same wgpu-native call, made in C), where
  wgpu-native copies the bytes into its staging memory (outside Python's
  allocators, so counted by the write's size), and
  ``GPUBuffer.read_mapped`` (the readback; with ``copy=False`` a view, no copy: the
  copy out of the mapped memory is numpy's, which tracemalloc sees). The first
  readback divides the request into its way in and its way back.
* for ``shm``, wrappers of ``place_arrays`` on both sides, which copy arrays into
  the shared region (a mapping: no allocation for tracemalloc to see): the
  client's, in its process (its arrays into the region: the way in's one move of
  the bytes to the server, in place of the socket), reported with its answer; and
  the server's (the reply's arrays into the client's ``reply_at``).
* the event loop thread's ``read``/``write`` system calls (``rchar``, ``wchar``
  of ``/proc/self/task/TID/io``; libuv reads and writes sockets with them): the
  kernel's copy between the socket and user memory, counted before the readback
  (reads) and after it (writes).

An allocation is where a copy lands: one the size of an array (``q``; ``k``, ``v``;
``out``, whose readback carries the log-sum-exp too) is a copy of that array; any
other (the body, a chunk of it) counts its bytes against every array of its
direction, a stage of chunks at most one copy (a growing buffer's capacity runs
ahead of its bytes). Each is named by its stage (``STAGES``: known sites by file
and function, in the pipeline's order; a site not in it is reported as
``unknown`` and counted, so a new copy shows up rather than hides) and its site
(the deepest frame of the server's code or of a library on the data path, as
``file:line function``, and the C call for growth no longer alive). Some
stages are shown and not counted: a ``buffer`` a counted copy lands in (the frame
transport's, which the kernel's read fills), a ``temporary`` derived from the
item (``np.isfinite``'s mask), a ``view``, a ``duplicate``, ``other`` bytes
(params, page tables). ``--records`` puts every allocation seen, with its
stacks, in the JSON.

What it cannot see, so that nobody over-trusts it:

* copies into memory allocated before the request or outside Python's
  allocators, beyond what the wrappers count: a preallocated buffer filled again
  (the counted allocation is where a copy lands; the copy itself is not seen),
  uvloop's own 256 KiB read buffer (libuv reads into it; the bytes made from it are
  counted), a C library's ``malloc`` (wgpu-native's internals beyond
  ``write_buffer``'s staging);
* device copies: the GPU's copy from wgpu's staging to the input arena and from
  the output arena to the mapped readback buffer (DMA on a discrete GPU; a CPU
  memcpy on lavapipe, the default adapter here; not counted as host copies);
* a copy that allocates nothing, or less than ``--min-kib`` between two events,
  or whose allocation replaces a freed one of the same size in the same gap
  between two events (the read chunks, counted from ``data_received`` instead);
* a transient allocation freed while another thread ran (a call that released the
  GIL) is charged to that thread's call; two threads' allocations between two
  events are charged together;
* the kernel's socket buffers themselves (``rchar``/``wchar`` count the copy
  between them and user memory; loopback's copy from the client's memory is the
  client's) and any other reader or writer of the loop thread during the request
  (none here).
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "client"), str(ROOT)]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

import numpy as np  # noqa: E402

H, HKV, D = 32, 8, 128
TRANSPORTS = ("http", "stacked", "stream", "frames", "shm", "json")
DEFAULT_TRANSPORTS = "http,stacked,stream,frames,shm"
#: The issue's budget: host copies of an item's bytes each way.
BUDGET = 2
WARM_REQUESTS = 2


def shapes(mib: float, items: int) -> tuple[int, int]:
    """``(n, m)``: query rows and appended rows per item, so that ``q`` (all items)
    is about ``mib`` MiB and ``k``, ``v`` half of it each."""
    n = max(1, round(mib * (1 << 20) / (items * H * D * 4)))
    return n, 2 * n


# ── the client (a child process: its own copies are not the server's) ───────


def client_main(args: argparse.Namespace) -> int:
    import httpx

    from attnserve_client import Client

    items = args.items if args.transport == "stacked" else 1
    n, m = shapes(args.mib, items)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((items, n, H, D), dtype=np.float32)
    k = rng.standard_normal((items, m, HKV, D), dtype=np.float32)
    v = rng.standard_normal((items, m, HKV, D), dtype=np.float32)
    with Client(args.client, timeout=600) as client, httpx.Client(base_url=args.client, timeout=600) as raw:
        sessions = [client.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D) for _ in range(items)]
        stream = None
        region_writes: list[int] = []  # the bytes of each array the client copied into its region
        if args.transport in ("stream", "frames"):
            stream = client.stream(transport="websocket" if args.transport == "stream" else "frames")
        elif args.transport == "shm":
            count_region_writes(region_writes)
            stream = client.stream(transport="shm", shm_socket=args.shm_socket)

        def one() -> np.ndarray:
            s = sessions[0]
            if args.transport == "http":
                return s.attend(0, q[0], k=k[0], v=v[0])
            if args.transport == "stacked":
                return client.attend_stacked(sessions, 0, q, k, v)
            if args.transport == "json":
                body = {"q": q[0].tolist(), "k": k[0].tolist(), "v": v[0].tolist()}
                r = raw.post(f"/v1/sessions/{s.session_id}/layers/0/attend", json=body)
                r.raise_for_status()
                return np.asarray(r.json()["out"], np.float32)
            assert stream is not None
            return stream.attend(s, 0, q[0], k=k[0], v=v[0])

        print(json.dumps({"ready": True, "n": n, "m": m, "items": items}), flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            region_writes.clear()
            out = one()
            want = q.shape if args.transport == "stacked" else q.shape[1:]
            ok = tuple(out.shape) == tuple(want) and bool(np.isfinite(out).all())
            print(json.dumps({"done": True, "ok": ok, "shape": list(out.shape), "region_writes": region_writes}),
                  flush=True)  # fmt: skip
        if stream is not None:
            stream.close()
        for s in sessions:
            s.delete()
    return 0


def _copied_arrays(doc: Any, in_place: Any) -> list[int]:
    """The bytes of each array ``shm.place_arrays(doc, ..., in_place)`` copies into
    the region: every inline array (``shm``'s own walk of a document) whose bytes
    ``in_place`` does not find there."""
    from attnserve_client import shm

    views = [
        memoryview(a["data"]).cast("B")
        for a in shm._arrays(doc)
        if isinstance(a["data"], (bytes, bytearray, memoryview))
    ]
    return [v.nbytes for v in views if in_place is None or in_place(v) is None]


def count_region_writes(into: list[int]) -> None:
    """Count, into ``into``, the arrays the client's shm channel copies into its region."""
    from attnserve_client import _shm

    place = _shm.place_arrays

    def counted(doc, region, start, end, in_place=None):  # noqa: ANN001, ANN202
        into.extend(_copied_arrays(doc, in_place))
        return place(doc, region, start, end, in_place)

    _shm.place_arrays = counted


# ── the counters (in the server's process) ───────────────────────────────────


def _func_name(c_func: Any) -> str:
    name = getattr(c_func, "__qualname__", None) or getattr(c_func, "__name__", repr(c_func))
    owner = getattr(c_func, "__self__", None)
    if owner is not None and not isinstance(owner, type(sys)) and "." not in name:
        name = f"{type(owner).__name__}.{name}"
    return str(name)


def _stack(frame: Any, limit: int = 16) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of ``frame`` and its callers, innermost first."""
    out = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        out.append((code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name)))
        frame = frame.f_back
    return out


def _io_counters(tid: int | None) -> dict[str, int]:
    """``rchar``, ``wchar``, ``syscr``, ``syscw`` of one thread of this process."""
    if tid is None:
        return {}
    try:
        text = Path(f"/proc/self/task/{tid}/io").read_text()
    except OSError:
        return {}
    return {
        k: int(v)
        for k, v in (line.split(": ") for line in text.splitlines())
        if k in ("rchar", "wchar", "syscr", "syscw")
    }


class Recorder:
    """The profile hook, tracemalloc's bookkeeping and the wgpu wrappers (module
    docstring). ``records`` holds what one armed window saw, in order."""

    def __init__(self, min_bytes: int, nframe: int = 32):
        self.min_bytes = min_bytes
        self.nframe = nframe
        self.armed = False
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.seen: collections.Counter[tuple[Any, ...]] = collections.Counter()
        self.base = 0
        self.loop_tid: int | None = None
        self.io: dict[str, dict[str, int]] = {}
        self.boundary: int | None = None  # the first readback's record index
        self._saved_switch = sys.getswitchinterval()
        self._local = threading.local()  # .busy: inside note() (its own calls are not events)

    # -- arming --------------------------------------------------------------

    def arm(self) -> None:
        self.records, self.seen, self.boundary, self.io = [], collections.Counter(), None, {}
        self._saved_switch = sys.getswitchinterval()
        sys.setswitchinterval(1.0)  # threads take turns where they block, not mid-way
        tracemalloc.start(self.nframe)
        self.io["start"] = _io_counters(self.loop_tid)
        self.base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        self.armed = True

    def disarm(self) -> None:
        with self.lock:
            self._check(None, "end", None)
            self.armed = False
        self.io["end"] = _io_counters(self.loop_tid)
        if "boundary" not in self.io:
            self.io["boundary"] = self.io["end"]
        tracemalloc.stop()
        sys.setswitchinterval(self._saved_switch)

    # -- the hook --------------------------------------------------------------

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if not self.armed or getattr(self._local, "busy", False):
            return
        with self.lock:
            if self.armed:
                self._check(frame, event, arg)
                if event == "call" and frame.f_code.co_name == "data_received":
                    self._loop_bytes(frame)

    def _loop_bytes(self, frame: Any) -> None:
        """The chunk an event loop hands a protocol's ``data_received``: uvloop made it
        a new bytes object in C, between two events (the chunk before it freed in the
        same gap, which the peak cannot tell), so it is counted from the argument."""
        code = frame.f_code
        if code.co_argcount < 2:
            return
        data = frame.f_locals.get(code.co_varnames[1])
        if isinstance(data, (bytes, bytearray, memoryview)):
            nbytes = memoryview(data).nbytes
            self.records.append(
                {"kind": "loop_bytes", "bytes": nbytes, "size": nbytes, "traceback": None, "event": "call",
                 "thread": threading.current_thread().name, "c_func": None, "stack": _stack(frame)}
            )  # fmt: skip

    def _check(self, frame: Any, event: str, arg: Any) -> None:
        current, peak = tracemalloc.get_traced_memory()
        grown = peak - self.base
        if grown >= self.min_bytes:
            self._observe(frame, event, arg, grown)
            current = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        self.base = current

    def _observe(self, frame: Any, event: str, arg: Any, grown: int) -> None:
        large: collections.Counter[tuple[Any, ...]] = collections.Counter(
            (domain, size, tb) for domain, size, tb, _ in tracemalloc._get_traces() if size >= self.min_bytes
        )
        new, gone = large - self.seen, self.seen - large
        self.seen = large
        gone_by_tb: dict[Any, list[int]] = collections.defaultdict(list)
        for (_, size, tb), count in gone.items():
            gone_by_tb[tb].extend([size] * count)
        context = {
            "thread": threading.current_thread().name,
            "event": event,
            "c_func": _func_name(arg) if event.startswith("c_") else None,
            "stack": _stack(frame),
        }
        held = 0
        for (domain, size, tb), count in sorted(new.items(), key=lambda kv: kv[0][1], reverse=True):
            for _ in range(count):
                was = gone_by_tb[tb]
                old = max((s for s in was if s < size), default=0)  # realloc: the same site's smaller trace went
                if old:
                    was.remove(old)
                nbytes = size - old
                held += nbytes
                self.records.append(
                    {"kind": "held", "bytes": nbytes, "size": size, "realloc": bool(old), "domain": domain,
                     "traceback": [(f, ln) for f, ln in tb], **context}
                )  # fmt: skip
        rest = grown - held
        if rest >= self.min_bytes:
            self.records.append({"kind": "freed", "bytes": rest, "size": rest, "traceback": None, **context})

    # -- wgpu ------------------------------------------------------------------

    def install_wgpu_wrappers(self) -> None:
        from wgpu.backends.wgpu_native import _api

        recorder = self
        write_buffer, read_mapped = _api.GPUQueue.write_buffer, _api.GPUBuffer.read_mapped

        @functools.wraps(write_buffer)
        def counted_write_buffer(queue, buffer, buffer_offset, data, data_offset=0, size=None):  # noqa: ANN001
            if recorder.armed:
                nbytes = int(size) if size else memoryview(data).nbytes - int(data_offset)
                recorder.note("wgpu_write_buffer", nbytes, sys._getframe(1))
            return write_buffer(queue, buffer, buffer_offset, data, data_offset, size)

        @functools.wraps(read_mapped)
        def counted_read_mapped(buffer, buffer_offset=None, size=None, *, copy=True):  # noqa: ANN001
            if recorder.armed:
                nbytes = int(size) if size is not None else int(buffer.size)
                recorder.note("wgpu_read_mapped", nbytes, sys._getframe(1), copy=copy)
            return read_mapped(buffer, buffer_offset, size, copy=copy)

        _api.GPUQueue.write_buffer = counted_write_buffer
        _api.GPUBuffer.read_mapped = counted_read_mapped

        # a batch's uploads: the writes of its compiled recording, one queue.write_buffer each in C
        from attnserve.gpu import native

        compiled = native._commands

        class CountedCommands:
            def __getattr__(self, name: str) -> Any:
                return getattr(compiled, name)

            def record(self, device, queue, writes, program, query_set):  # noqa: ANN001, ANN201
                if recorder.armed:
                    for _, _, data in writes:
                        recorder.note("wgpu_write_buffer", memoryview(data).nbytes, sys._getframe(1))
                return compiled.record(device, queue, writes, program, query_set)

        native._commands = CountedCommands()  # type: ignore[assignment]

        # the shared-memory transport's reply: its arrays copied into the client's region
        from attnserve.transport import shm

        place = shm.place_arrays

        def counted_place_arrays(doc, region, start, end, in_place=None):  # noqa: ANN001, ANN202
            if recorder.armed:
                for nbytes in _copied_arrays(doc, in_place):
                    recorder.note("shm_region_write", nbytes, sys._getframe(1))
            return place(doc, region, start, end, in_place)

        shm.place_arrays = counted_place_arrays

    def note(self, kind: str, nbytes: int, frame: Any, **extra: Any) -> None:
        self._local.busy = True
        try:
            self._note(kind, nbytes, frame, **extra)
        finally:
            self._local.busy = False

    def _note(self, kind: str, nbytes: int, frame: Any, **extra: Any) -> None:
        with self.lock:
            if not self.armed:
                return
            self._check(frame, "c_call", None)  # what came before it is its own
            if kind == "wgpu_read_mapped" and self.boundary is None:
                self.boundary = len(self.records)
                self.io["boundary"] = _io_counters(self.loop_tid)
            self.records.append(
                {"kind": kind, "bytes": nbytes, "size": nbytes, "traceback": None, "thread": threading.current_thread().name,
                 "event": "wrapper", "c_func": None, "stack": _stack(frame), **extra}
            )  # fmt: skip
            self.base = tracemalloc.get_traced_memory()[0]  # what this bookkeeping allocated is not the server's
            tracemalloc.reset_peak()


# ── stages: which site is which copy ─────────────────────────────────────────


@functools.lru_cache(maxsize=None)
def _functions(path: str) -> list[tuple[int, int, str]]:
    """``(first line, last line, qualified name)`` of every function of a source file."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    out: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((child.lineno, child.end_lineno or child.lineno, name))
                walk(child, name + ("." if isinstance(child, ast.ClassDef) else ".<locals>."))
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def function_at(path: str, line: int) -> str:
    """The innermost function of ``path`` that holds ``line`` (``<module>`` if none)."""
    best = None
    for first, last, name in _functions(path):
        if first <= line <= last and (best is None or first >= best[0]):
            best = (first, name)
    return best[1] if best else "<module>"


def short_path(path: str) -> str:
    """A path as it reads in a report: from the package down (``uvicorn/...``,
    ``attnserve/...``), the stdlib's from its module (``asyncio/runners.py``)."""
    for marker in ("site-packages/", "/service/", "/client/", f"{ROOT}/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + len(marker) :]
    return "/".join(Path(path).parts[-2:])


Frame = tuple[str, int, str]  # (short path, line, function)


def _frames(rec: dict[str, Any]) -> tuple[list[Frame], list[Frame]]:
    """A record's allocation traceback and the stack of the event that saw it,
    innermost first, as ``(short path, line, function)``."""
    tb = [(short_path(f), ln, function_at(f, ln)) for f, ln in rec.get("traceback") or ()]
    stack = [(short_path(f), ln, fn) for f, ln, fn in rec.get("stack") or ()]
    return tb, stack


def _is(frame: Frame | None, file: str, func: str) -> bool:
    return frame is not None and frame[0].endswith(file) and (frame[2] == func or frame[2].endswith("." + func))


class Where:
    """Matchers of a record, by its allocation's traceback (``alloc``: its innermost
    frame) or the event that saw it (``entering``: a call of; ``inside``: one of the
    event's innermost frames)."""

    @staticmethod
    def alloc(file: str, func: str) -> Any:
        return lambda rec, tb, stack: bool(tb) and _is(tb[0], file, func)

    @staticmethod
    def freed_inside(file: str, func: str, depth: int = 2) -> Any:
        return lambda rec, tb, stack: rec["kind"] == "freed" and any(_is(f, file, func) for f in stack[:depth])

    @staticmethod
    def at(file: str, func: str) -> Any:
        """Allocated in ``func`` (alive: its traceback; freed: the event's frame)."""

        def match(rec: dict[str, Any], tb: list[Frame], stack: list[Frame]) -> bool:
            frames = tb if rec["kind"] == "held" else stack if rec["kind"] == "freed" else []
            return bool(frames) and _is(frames[0], file, func)

        return match

    @staticmethod
    def loop_alloc() -> Any:
        """Allocated by the event loop's C code: the innermost frame is the loop's run."""
        loops = ("asyncio/runners.py", "asyncio/base_events.py", "uvloop/__init__.py", "uvicorn/_compat.py")
        return lambda rec, tb, stack: rec["kind"] == "held" and bool(tb) and tb[0][0].endswith(loops)

    @staticmethod
    def kind(kind: str) -> Any:
        return lambda rec, tb, stack: rec["kind"] == kind


class Stage:
    """A known site. ``role``: ``copy`` (counted), ``buffer`` (where a copy counted
    elsewhere lands: the kernel's read into it), ``temporary`` (data derived from the
    item, not a copy of it), ``view`` (no copy). ``whole``: its allocations are whole
    arrays (matched to ``q``, ``k``, ``v``, ``out`` by size), else chunks of the
    stream (each counts its bytes against every array of the direction)."""

    def __init__(self, sid: str, label: str, match: Any, *, role: str = "copy", whole: bool = True):
        self.id, self.label, self.match, self.role, self.whole = sid, label, match, role, whole


STAGES = [
    # the way in: HTTP (uvicorn's httptools protocol)
    Stage("loop_read_bytes", "uvloop: each read chunk copied from its read buffer into new bytes for "
          "data_received", Where.kind("loop_bytes"), whole=False),
    Stage("loop_read_bytes_seen", "uvloop: a read chunk's bytes, as tracemalloc saw it (counted from "
          "data_received's argument)", Where.kind("dup"), role="duplicate", whole=False),
    Stage("loop_c_alloc", "the event loop's C code (uvloop): an allocation that is no chunk handed to "
          "data_received", Where.loop_alloc(), whole=False),
    Stage("httptools_body", "httptools: on_body gets the body's part of the chunk as new bytes",
          Where.alloc("httptools_impl.py", "HttpToolsProtocol.data_received"), whole=False),
    Stage("uvicorn_body_append", "uvicorn: on_body appends it to the request's bytearray (cycle.body +=)",
          Where.alloc("httptools_impl.py", "HttpToolsProtocol.on_body"), whole=False),
    Stage("uvicorn_receive_bytes", "uvicorn: receive() hands the app bytes(cycle.body)",
          Where.alloc("httptools_impl.py", "RequestResponseCycle.receive"), whole=False),
    # the way in: /v1/stream (uvicorn's websockets sans-I/O protocol)
    Stage("ws_reader_append", "websockets: the reader appends each chunk to its bytearray (StreamReader.feed_data)",
          Where.alloc("websockets/streams.py", "StreamReader.feed_data"), whole=False),
    Stage("ws_reader_realloc", "websockets: the reader's bytearray moved as it grew (realloc copies what it held)",
          Where.freed_inside("websockets/streams.py", "StreamReader.feed_data", depth=1), whole=False),
    Stage("ws_read_exact", "websockets: read_exact slices the frame's payload out of the reader (new bytearray)",
          Where.alloc("websockets/streams.py", "StreamReader.read_exact")),
    Stage("ws_unmask", "websockets: Frame.parse unmasks the payload into new bytes (apply_mask)",
          Where.alloc("websockets/frames.py", "Frame.parse")),
    Stage("ws_message_join", "uvicorn: a message of several frames joined (b''.join)",
          Where.alloc("websockets_sansio_impl.py", "WebSocketsSansIOProtocol.handle_bytes")),
    Stage("read_body_buffer", "attnserve read_body: the body's buffer, each chunk copied in",
          Where.alloc("attnserve/codec.py", "read_body")),
    Stage("read_body_slice_temp", "attnserve read_body: CPython copies a bytes chunk to a temporary bytearray "
          "before into[a:b] = chunk stores it", Where.freed_inside("attnserve/codec.py", "read_body"), whole=False),
    # the way in: the frame transport
    Stage("frame_buffer", "frame transport: the frame's buffer (np.empty), filled by the kernel's read",
          Where.alloc("transport/frames.py", "_Connection._prefix_done"), role="buffer"),
    # the way in: decoding
    Stage("msgpack_unpackb", "msgpack: unpackb copies each bin into a bytes object",
          Where.alloc("attnserve_client/wire.py", "unpackb")),
    # the finite check's mask, wherever in wire.py it is made or freed
    *(Stage("check_finite_mask", "check_finite: np.isfinite's mask (a byte per float)", match, role="temporary",
            whole=whole) for match, whole in (
        (Where.alloc("attnserve_client/wire.py", "check_finite"), True),
        (Where.freed_inside("attnserve_client/wire.py", "check_finite"), False),
        (Where.alloc("attnserve_client/wire.py", "nonfinite"), True),
        (Where.freed_inside("attnserve_client/wire.py", "all_finite"), False),
    )),
    Stage("finite_block_buffers", "all_finite: its two block buffers (a mask of 256 Ki elements; bfloat16's bits)",
          Where.alloc("attnserve_client/wire.py", "all_finite"), role="temporary", whole=False),
    Stage("stacked_finite_mask", "_parse_stacked: np.isfinite's mask of each stacked array (a byte per float)",
          Where.alloc("attnserve/step/parse.py", "_parse_stacked"), role="temporary"),
    # the way in: JSON (for contrast: Python objects and text, not copies of the bytes)
    Stage("json_structure", "json: wire.json_structure counts the body's containers (bincount, masks)",
          Where.at("attnserve_client/wire.py", "json_structure"), role="temporary", whole=False),
    Stage("json_structure", "json: wire.json_structure counts the body's containers (bincount, masks)",
          Where.at("attnserve_client/wire.py", "_outside"), role="temporary", whole=False),
    Stage("json_structure", "json: wire.json_structure counts the body's containers (bincount, masks)",
          Where.freed_inside("attnserve_client/wire.py", "json_structure", depth=3), role="temporary", whole=False),
    Stage("json_text", "json: json.loads decodes the body to str", Where.at("json/__init__.py", "loads"),
          whole=False),
    Stage("json_loads", "json: json.loads builds lists of Python floats",
          Where.at("json/decoder.py", "JSONDecoder.raw_decode"), whole=False),
    Stage("json_lists_to_array", "json: the lists made a float64 array, then float32",
          Where.at("attnserve_client/wire.py", "_decode_lists"), whole=False),
    Stage("gathered_uploads", "attnserve Batch: small uploads gathered into one buffer (params, page tables; "
          "an array under 64 KiB would be one of them)", Where.alloc("attnserve/gpu/batch.py", "_Uploads.add"),
          role="other", whole=False),
    Stage("params", "attnserve params.pack_array: kernels' params blocks", Where.at("attnserve/gpu/params.py",
          "pack_array"), role="other", whole=False),
    Stage("wgpu_write_buffer", "wgpu-native: queue.write_buffer copies into its staging memory (the upload)",
          Where.kind("wgpu_write_buffer")),
    Stage("wgpu_write_other", "wgpu-native: queue.write_buffer of other bytes (params, page tables)",
          Where.kind("wgpu_write_other"), role="other", whole=False),
    # the way back
    Stage("wgpu_read_mapped", "wgpu: read_mapped of the readback buffer (copy=False: a view)",
          Where.kind("wgpu_read_mapped"), role="view"),
    Stage("readback_copy", "attnserve read_back: numpy copies the mapped bytes out",
          Where.alloc("gpu/batch.py", "Batch.read_back")),
    Stage("stacked_out_contiguous", "attnserve _stacked_document: np.ascontiguousarray(out) (each item's out "
          "and lse share its readback segment: out is strided)", Where.alloc("attnserve/step/answer.py",
          "_stacked_document")),
    Stage("shm_region_write", "shm transport: the reply's arrays copied into the client's region (reply_at)",
          Where.kind("shm_region_write")),
    Stage("msgpack_packb_buffer", "msgpack: packb's own buffer (written, copied into the result, freed; as many "
          "copies as the result holds)",
          Where.freed_inside("msgpack/__init__.py", "packb", depth=1), whole=False),
    Stage("msgpack_packb", "msgpack: packb's result bytes", Where.alloc("msgpack/__init__.py", "packb")),
    Stage("ws_frame_serialize", "websockets: Frame.serialize writes header and payload into a BytesIO",
          Where.alloc("websockets/frames.py", "Frame.serialize")),
    Stage("json_tolist", "json: out.tolist() (Python floats)", Where.at("attnserve/codec.py", "array_out"),
          whole=False),
    Stage("json_dumps_chunks", "json: json.dumps's text, in pieces", Where.at("json/encoder.py",
          "JSONEncoder.iterencode"), whole=False),
    Stage("json_dumps_chunks", "json: json.dumps's text, in pieces", Where.at("json/encoder.py", "_make_iterencode"),
          whole=False),
    Stage("json_dumps_join", "json: json.dumps joins the pieces into one str", Where.at("json/encoder.py",
          "JSONEncoder.encode"), whole=False),
    Stage("json_encode_bytes", "json: the text encoded to bytes", Where.at("attnserve/codec.py", "encode"),
          whole=False),
]  # fmt: skip

UNKNOWN = Stage("unknown", "not a known site (counted as a copy)", None, whole=True)


def classify(rec: dict[str, Any]) -> tuple[Stage, str]:
    """The stage of a record and its site, ``file:line function`` (the deepest
    frame of the server's code or of a library on the data path; the C function
    that returned, for growth no longer alive)."""
    tb, stack = _frames(rec)
    stage = next((s for s in STAGES if s.match(rec, tb, stack)), UNKNOWN)
    frames = tb or stack
    lib = ("attnserve", "uvicorn", "starlette", "fastapi", "websockets", "msgpack", "httptools", "h11", "anyio", "wgpu")
    deep = next((f for f in frames if f[0].split("/")[0] in lib), frames[0] if frames else None)
    site = f"{deep[0]}:{deep[1]} {deep[2]}" if deep else "?"
    if rec["kind"] == "freed":
        site += f" ({rec['event']} {rec['c_func'] or (stack[0][2] if stack else '?')}, freed before seen)"
    elif rec["kind"] == "held" and tb and tb[0] != deep:
        site += f" (via {tb[0][0]}:{tb[0][1]})"
    return stage, site


def is_probe(rec: dict[str, Any]) -> bool:
    """An allocation of this probe (the coordinator's reads of its client's answers):
    its innermost frame is in this file (every server thread starts here, so a
    deeper frame of this file says nothing)."""
    me = str(Path(__file__).resolve())
    tb, stack = rec.get("traceback"), rec.get("stack")
    return bool(tb and tb[0][0] == me) or (rec["kind"] == "freed" and bool(stack) and stack[0][0] == me)


# ── copies per array ─────────────────────────────────────────────────────────


def _match_array(size: int, arrays: dict[str, int], taken: collections.Counter[str]) -> str | None:
    """The array an allocation of ``size`` bytes holds: one of that size (the
    readback's adds the log-sum-exp, under 1 %), the least taken first."""
    fits = [a for a, nb in arrays.items() if nb <= size <= nb * 1.01 + 4096]
    if not fits:
        return None
    best = min(fits, key=lambda a: (size - arrays[a], taken[a]))
    same = [a for a in fits if arrays[a] == arrays[best]]
    return min(same, key=lambda a: taken[a])


def copies_by_stage(records: list[dict[str, Any]], arrays: dict[str, int]) -> list[dict[str, Any]]:
    """One row per stage, in the pipeline's order (``STAGES``; sites not in it
    after): copies of each array (an allocation the size of one array is a copy of
    it; any other counts its bytes against all of them, a stage of chunks at most
    one copy, as a growing buffer's capacity runs ahead of its bytes), bytes,
    allocations and sites. A row whose role is no copy has ``copies`` 0 and its
    bytes over the payload's as ``equivalent``."""
    total = sum(arrays.values())
    stages: dict[str, dict[str, Any]] = {}
    order: dict[str, tuple[int, int]] = {}
    whole: dict[str, bool] = {}
    taken: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for rec in records:
        stage, site = classify(rec)
        sid = stage.id if stage is not UNKNOWN else f"unknown:{site}"
        if sid not in stages:
            position = STAGES.index(stage) if stage in STAGES else len(STAGES)
            order[sid], whole[sid] = (position, len(order)), stage.whole
            stages[sid] = {
                "stage": stage.id, "label": stage.label, "role": stage.role,
                "method": {"wgpu_write_buffer": "wrapper", "wgpu_write_other": "wrapper", "wgpu_read_mapped": "wrapper",
                           "shm_region_write": "wrapper", "loop_bytes": "data_received's argument"}.get(
                               rec["kind"], "tracemalloc"),
                "copies": dict.fromkeys(arrays, 0.0), "bytes": 0, "allocations": 0, "sites": {},
            }  # fmt: skip
        row = stages[sid]
        row["bytes"] += rec["bytes"]
        row["allocations"] += 1
        row["sites"][site] = row["sites"].get(site, 0) + rec["bytes"]
        if rec["kind"] == "wgpu_read_mapped":
            row["role"] = "copy" if rec.get("copy") else "view"
        name = _match_array(rec["size"], arrays, taken[sid]) if stage.whole else None
        if name is not None:
            taken[sid][name] += 1
            row["copies"][name] += 1.0
        else:  # a chunk (or the whole body): its bytes against all of them
            for a in arrays:
                row["copies"][a] += min(rec["bytes"], total) / total
    rows = []
    for sid in sorted(stages, key=order.__getitem__):
        row = stages[sid]
        copies = {a: round(c if whole[sid] else min(c, 1.0), 2) for a, c in row["copies"].items()}
        if row["role"] == "copy":
            row["copies"] = copies
        else:
            row["copies"], row["equivalent"] = dict.fromkeys(arrays, 0.0), copies
        row["sites"] = [f"{site}: {nbytes} B" for site, nbytes in sorted(row["sites"].items(), key=lambda kv: -kv[1])]
        rows.append(row)
    return rows


def kernel_row(direction: str, io: dict[str, dict[str, int]], arrays: dict[str, int]) -> dict[str, Any] | None:
    start, end = (io.get("start"), io.get("boundary")) if direction == "in" else (io.get("boundary"), io.get("end"))
    key, calls = ("rchar", "syscr") if direction == "in" else ("wchar", "syscw")
    if not start or not end or key not in start:
        return None
    nbytes = end[key] - start[key]
    total = sum(arrays.values())
    what = "read" if direction == "in" else "write"
    return {
        "stage": f"kernel_{what}",
        "label": f"kernel: the socket's bytes {'into' if direction == 'in' else 'out of'} user memory "
        f"(the event loop thread's {what} calls)",
        "role": "copy",
        "method": f"/proc/self/task/TID/io {key}",
        "copies": {a: round(min(nbytes, total) / total, 2) for a in arrays},
        "bytes": nbytes,
        "allocations": end[calls] - start[calls],
        "sites": [f"{end[calls] - start[calls]} {what} system calls"],
    }


_BYTES_HEADER = sys.getsizeof(b"")  # what a bytes object of n bytes takes beyond them


def _prepare(records: list[dict[str, Any]], arrays_in: dict[str, int]) -> None:
    """Mark, in place, the read chunks tracemalloc saw that data_received's argument
    counts already (``dup``), and the uploads that are none of the arrays
    (``wgpu_write_other``: params, page tables)."""
    chunks = collections.Counter(r["bytes"] for r in records if r["kind"] == "loop_bytes")
    loop_alloc = Where.loop_alloc()
    for r in records:
        if r["kind"] == "held" and loop_alloc(r, *_frames(r)) and chunks[r["size"] - _BYTES_HEADER] > 0:
            chunks[r["size"] - _BYTES_HEADER] -= 1
            r["kind"] = "dup"
        elif r["kind"] == "wgpu_write_buffer" and _match_array(r["size"], arrays_in, collections.Counter()) is None:
            r["kind"] = "wgpu_write_other"


def client_region_row(writes: list[int], arrays: dict[str, int]) -> dict[str, Any]:
    """The way in's move of the bytes over the shared-memory transport: the client's
    copies of its arrays into the region (counted in its process), in place of the
    kernel's socket read of the other transports."""
    row = {
        "stage": "client_region_write",
        "label": "shm transport: the client copies each array into its region (the server reads it there)",
        "role": "copy",
        "method": "wrapper (the client's process)",
        "copies": dict.fromkeys(arrays, 0.0),
        "bytes": sum(writes),
        "allocations": len(writes),
        "sites": ["attnserve_client/_shm.py _Region.fill: place_arrays"],
    }
    taken: collections.Counter[str] = collections.Counter()
    for nbytes in writes:
        name = _match_array(nbytes, arrays, taken)
        if name is not None:
            taken[name] += 1
            row["copies"][name] += 1.0
    return row


def analyse(
    raw: dict[str, Any], arrays_in: dict[str, int], arrays_out: dict[str, int], min_bytes: int
) -> dict[str, Any]:
    records = raw["records"]
    _prepare(records, arrays_in)
    probe = [r for r in records if is_probe(r)]
    counted = ("loop_bytes", "wgpu_read_mapped")  # exact sizes, however small (a chunk may be)
    server = [
        (i, r) for i, r in enumerate(records) if not is_probe(r) and (r["bytes"] >= min_bytes or r["kind"] in counted)
    ]
    small = [r for r in records if not is_probe(r) and r["bytes"] < min_bytes and r["kind"] not in counted]
    boundary = raw["boundary"]
    split = len(records) if boundary is None else boundary
    ways = {}
    for direction, arrays, part in (
        ("in", arrays_in, [r for i, r in server if i < split]),
        ("out", arrays_out, [r for i, r in server if i >= split]),
    ):
        rows = copies_by_stage(part, arrays)
        by_id = {r["stage"]: r for r in rows}
        if "msgpack_packb_buffer" in by_id:  # its result is a copy of it: as many copies of each array
            result = by_id.get("msgpack_packb")
            by_id["msgpack_packb_buffer"]["copies"] = dict(result["copies"]) if result else dict.fromkeys(arrays, 0.0)
        kernel = kernel_row(direction, raw["io"], arrays)
        if kernel is not None:
            rows = [kernel, *rows] if direction == "in" else [*rows, kernel]
        if direction == "in" and raw.get("region_writes") is not None:
            rows = [client_region_row(raw["region_writes"], arrays), *rows]
        counted = [r for r in rows if r["role"] == "copy"]
        total = {a: round(sum(r["copies"][a] for r in counted), 2) for a in arrays}
        ways[direction] = {
            "arrays": arrays,
            "stages": rows,
            "copies": total,
            "within_budget": all(c <= BUDGET + 0.05 for c in total.values()),
        }
    return {
        **ways,
        "readback_seen": boundary is not None,
        "small_bytes": sum(r["bytes"] for r in small),
        "probe_bytes": sum(r["bytes"] for r in probe),
        "records": records,
    }


# ── the server and one measured request per transport ──────────────────────


def measure(recorder: Recorder, url: str, transport: str, args: argparse.Namespace) -> dict[str, Any]:
    """One transport: its client child, two warm-up requests, one counted."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--client", url, "--transport", transport,
           "--mib", str(args.mib), "--items", str(args.items), "--shm-socket", args.shm_socket or ""]  # fmt: skip
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert child.stdin is not None and child.stdout is not None

    def reply() -> dict[str, Any]:
        line = child.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise SystemExit(f"the {transport} client exited (status {child.wait()})")
        doc: dict[str, Any] = json.loads(line)
        return doc

    try:
        info = reply()
        for _ in range(WARM_REQUESTS):
            child.stdin.write("go\n")
            reply()
        recorder.arm()
        try:
            child.stdin.write("go\n")
            done = reply()
            time.sleep(args.settle)  # the server's tail of the request (its answer is read whole by then)
        finally:
            recorder.disarm()
        if not done.get("ok"):
            raise SystemExit(f"the {transport} request failed: {done}")
    finally:
        child.stdin.close()
        child.wait(120)
    items, n, m = info["items"], info["n"], info["m"]
    q_bytes, kv_bytes = items * n * H * D * 4, items * m * HKV * D * 4
    shape = [items, n, H, D] if transport == "stacked" else [n, H, D]
    kv_shape = [items, m, HKV, D] if transport == "stacked" else [m, HKV, D]
    raw = {"records": recorder.records, "boundary": recorder.boundary, "io": recorder.io}
    if transport == "shm":
        raw["region_writes"] = done["region_writes"]
    result = analyse(raw, {"q": q_bytes, "k": kv_bytes, "v": kv_bytes}, {"out": q_bytes}, recorder.min_bytes)
    shapes = {"q": shape, "k": kv_shape, "v": kv_shape, "out": shape}
    return {"transport": transport, "shapes": shapes, **result, "io": recorder.io}


def table(result: dict[str, Any]) -> list[str]:
    """The short human table of one transport: copies per array and stage."""
    arrays = {**result["in"]["arrays"], **result["out"]["arrays"]}
    sizes = ", ".join(f"{a} {nb / (1 << 20):.2f} MiB" for a, nb in arrays.items())
    lines = [f"== {result['transport']} ({sizes})", f"  {'way':<4}" + "".join(f"{a:>6}" for a in ("q", "k", "v"))]
    for direction in ("in", "out"):
        way = result[direction]
        width = 6 * 3
        for row in way["stages"]:
            if row["role"] != "copy" and max(row["equivalent"].values()) < 0.01:
                continue  # params and the like: in the JSON
            if row["role"] == "copy":
                cells = "".join(f"{c:6.2f}" for c in row["copies"].values())
                label = row["label"]
            else:
                cells = "".join(f"{'-':>6}" for _ in row["copies"])
                seen = max(row["equivalent"].values())
                label = f"{row['label']} [{row['role']}, not counted; {seen:.2f} of the payload]"
            lines.append(f"  {direction:<4}{cells:<{width}}  {label}")
            lines.append(f"  {'':<4}{'':<{width}}    {row['method']}: {row['sites'][0]}")
        cells = "".join(f"{c:6.2f}" for c in way["copies"].values())
        verdict = "within" if way["within_budget"] else "OVER"
        lines.append(f"  {direction:<4}{cells:<{width}}  = host copies {direction}: {verdict} the budget of {BUDGET}")
    if not result["readback_seen"]:
        lines.append("  (no readback was seen: every stage is counted as the way in)")
    return lines


BLIND_SPOTS = [
    "copies into memory allocated before the request or outside Python's allocators, beyond wgpu's write_buffer "
    "(its wrapper): a reused buffer filled again, uvloop's own 256 KiB read buffer (the bytes made from it are "
    "counted), a C library's malloc (wgpu-native's internals beyond write_buffer's staging)",
    "device copies: wgpu's staging to the input arena, the output arena to the mapped readback buffer (DMA on a "
    "discrete GPU; a CPU memcpy on lavapipe; not counted as host copies)",
    "a copy that allocates nothing, or less than --min-kib between two events, or whose allocation replaces a freed "
    "one of the same size in the same gap between two events (read chunks: counted from data_received instead); "
    "a buffer shrunk by realloc at another site than the one that grew it reads as a new allocation",
    "a transient allocation freed while another thread ran (a call that released the GIL) is charged to that "
    "thread's call; two threads' allocations between two events are charged together",
    "the kernel's socket buffers themselves: rchar/wchar count the copy between them and user memory; loopback's "
    "copy from the client's memory is the client's",
]

METHODS = {
    "tracemalloc": "Python's allocators (numpy's data included): tracemalloc's peak read at every call and return "
    "of every server thread (a profile hook); each growth of --min-kib or more is an allocation, named by its "
    "own traceback when still alive, else by the call that returned; an allocation is where a copy lands",
    "data_received's argument": "the bytes uvloop makes of each read chunk, counted from the argument (the peak "
    "misses them: the chunk before is freed in the same gap)",
    "wrapper": "wgpu's GPUQueue.write_buffer (its bytes copied into wgpu-native's staging) and "
    "GPUBuffer.read_mapped (a view with copy=False) wrapped; the first readback splits in from out",
    "/proc io": "the event loop thread's read/write system calls (rchar, wchar): the kernel's copy between the "
    "socket and user memory",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""), help="the wgpu adapter")
    ap.add_argument("--mib", type=float, default=4.0, help="MiB of q (k, v: half of it each)")
    ap.add_argument("--transports", default=DEFAULT_TRANSPORTS, help=f"comma-separated, of {','.join(TRANSPORTS)}")
    ap.add_argument("--items", type=int, default=4, help="sessions of the stacked transport's step")
    ap.add_argument("--min-kib", type=float, default=8.0, help="smallest growth between two events counted")
    ap.add_argument("--settle", type=float, default=0.3, help="seconds counted after the client has its answer")
    ap.add_argument("--records", action="store_true", help="every allocation counted, with its stacks, in the JSON")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--transport", help=argparse.SUPPRESS)
    ap.add_argument("--shm-socket", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        return client_main(args)
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if bad := sorted(set(transports) - set(TRANSPORTS)):
        ap.error(f"unknown transports {bad}: choose from {','.join(TRANSPORTS)}")
    if "shm" in transports and not args.shm_socket:  # the server's socket, mode 0600, in a folder of its own
        args.shm_socket = os.path.join(tempfile.mkdtemp(prefix="copy-probe-"), "shm.sock")

    recorder = Recorder(int(args.min_kib * 1024))
    threading.setprofile(recorder.hook)  # every thread started from now on: the server's, the GPU worker, anyio's
    recorder.install_wgpu_wrappers()

    import uvicorn

    from attnserve.app import create_app
    from attnserve.cli import server_config
    from attnserve.config import Settings
    from tools.common import free_port, write_result

    settings = Settings(
        adapter=args.adapter or None,
        frames_port=0 if "frames" in transports else None,
        shm_socket=args.shm_socket,
        warmup="none",  # the warm-up requests compile what the counted one runs
        log_level="warning",
    )
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(server_config(app, settings, host="127.0.0.1", port=port, log_level="warning"))

    def serve() -> None:
        recorder.loop_tid = threading.get_native_id()
        server.run()

    thread = threading.Thread(target=serve, name="server-loop", daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not (server.started and getattr(app.state.runtime, "ready", False)):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        for t in transports:
            results.append(measure(recorder, url, t, args))
            print("\n".join(table(results[-1])), file=sys.stderr, flush=True)
        engine = app.state.runtime.engine
        device = engine.describe() if engine is not None else {}
    finally:
        server.should_exit = True
        thread.join(60)
    for r in results:
        if not args.records:
            del r["records"]
    doc = {
        "probe": "copy_probe",
        "budget": {"host_copies_each_way": BUDGET, "issue": "43 item 2"},
        "device": device,
        "args": {k: v for k, v in vars(args).items() if k not in ("json_out", "client", "transport")},
        "loop": type(app.state.runtime.loop).__module__ if getattr(app.state.runtime, "loop", None) else None,
        "methods": METHODS,
        "blind_spots": BLIND_SPOTS,
        "transports": {r["transport"]: r for r in results},
    }
    print(json.dumps(doc, indent=2, default=str))
    write_result(args.json_out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
