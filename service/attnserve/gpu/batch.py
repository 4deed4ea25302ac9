"""A batch of GPU work: many jobs' dispatches, one submit, one readback.

Jobs do not touch the device directly. They *plan* into a :class:`Batch`:

* ``upload(data)`` places host bytes (queries, new K/V rows, params blocks) in
  the batch's input arena: small ones gathered and written with one
  ``queue.write_buffer``, large arrays (a stacked step's queries and rows) written
  straight from the caller's memory (no host copy; the copy into wgpu's staging
  runs without the GIL);
* ``scratch(nbytes)`` reserves GPU-only space (e.g. rotated queries);
* ``output(nbytes)`` reserves space in the output arena, copied to one
  persistent ``MAP_READ`` staging buffer and read back once per batch;
* ``upload_wire(data)`` places host bytes that a kernel converts before use (a
  half-precision array as received) in the wire arena, ``reserve_items`` space for
  them in the input arena, and ``answer(nbytes)`` space in the answer arena, where
  a kernel writes outputs in the answer's dtype (read back after the output arena,
  which is then read back only when a job reads it: ``output(..., read=True)``);
* ``dispatch(kernel, bindings, grid)`` and ``copy(...)`` record commands in
  order, referring to real buffers or to arena segments;
* ``attach(name, provider)`` binds a buffer that outlives batches (the page
  tables: ``pool.PageTables``) as ``whole(name)``, brought up to date at encode;
* ``defer(phase, key, item, flush)`` queues an item for a batched kernel: at
  ``flush()`` (``encode()`` calls it) every phase's groups of items are recorded,
  after the commands above, each group by its ``flush(batch, items)`` (one
  dispatch for many jobs' rows). Phases run in order: writes (encodes),
  rotations, attention, merges, answers.

``encode(slot)`` materializes the arenas and encodes every command in recorded
order (consecutive dispatches share one compute pass; wgpu inserts the barriers
between dispatches), ``queue_submit`` submits it once, and ``read_back`` waits for
it and returns the output arena's bytes.
Because K/V appends are recorded in the stream (never ``queue.write_buffer``
straight into a cache) and an attend reads only the rows below the length it
was planned at, an attend planned before an append in the same batch never sees
the appended rows, even though deferred attends are recorded after every write
(rows are append-only, and pages freed while a batch is planned are reused
only after it ran: ``pool.py``).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union, cast

import numpy as np
import wgpu

from . import native
from .shaders import PipelineCache

__all__ = [
    "Seg", "Items", "Batch", "Arenas", "Recorded", "whole", "PERSISTENT",
    "PHASE_WRITE", "PHASE_ROTATE", "PHASE_ATTEND", "PHASE_MERGE", "PHASE_ANSWER",
]  # fmt: skip

# The phases of deferred work, recorded in this order after the batch's commands
# (answers: outputs converted to the answer's dtype, after every kernel wrote them).
PHASE_WRITE, PHASE_ROTATE, PHASE_ATTEND, PHASE_MERGE, PHASE_ANSWER = range(5)
# Params bytes a deferred item may upload at flush, counted when it is deferred
# (so the input arena's size is known while jobs are planned).
DEFERRED_ROW_BYTES = 128

# An upload of at least this many bytes is written to the input arena straight from
# the caller's array (its own ``queue.write_buffer``); smaller ones are gathered into
# one host buffer, so a batch of small jobs stays one write.
DIRECT_UPLOAD_BYTES = 64 * 1024

if TYPE_CHECKING:  # the type only: kernels.py plans into batches, not the other way round
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

    from .kernels import KernelPolicy


@dataclass(frozen=True)
class Seg:
    """A byte range of one of the batch's arenas ("in", "scratch", "partial", "out",
    "wire" or "answer"), or of a persistent buffer (``PERSISTENT``)."""

    arena: str
    offset: int
    size: int


@dataclass(frozen=True)
class Items:
    """``count`` segments of ``nbytes`` each, ``stride`` bytes apart from ``base``
    in one arena (:meth:`Batch.upload_items`, :meth:`Batch.output_items`)."""

    arena: str
    base: int
    stride: int
    nbytes: int
    count: int

    def seg(self, i: int) -> Seg:
        return Seg(self.arena, self.base + i * self.stride, self.nbytes)

    def view(self, data: memoryview | bytes, dtype: str, shape: tuple[int, ...], start: int = 0) -> np.ndarray:
        """The items in ``data`` (the arena's bytes) as one array ``[count, *shape]``
        of ``dtype``, from byte ``start`` of each item: a view, strided when the
        items are padded."""
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if start + size > self.nbytes:
            raise ValueError(f"{size} bytes from {start} pass an item of {self.nbytes}")
        rows = np.frombuffer(data, np.uint8, count=self.count * self.stride, offset=self.base)
        return rows.reshape(self.count, self.stride)[:, start : start + size].view(dtype).reshape(self.count, *shape)


Resource = Union[wgpu.GPUBuffer, Seg]

# A recorded command: ("dispatch", kernel, bindings, grid, constants) or ("copy",
# src, src_offset, dst, dst_offset, size) (:meth:`Batch.dispatch`, :meth:`Batch.copy`).
Op = tuple[Any, ...]
# What :meth:`Batch.encode` made: the command buffer, the readback buffer (None when
# nothing is read back) and the bytes read back.
Encoded = tuple[wgpu.GPUCommandBuffer | None, wgpu.GPUBuffer | None, int]
# What :meth:`Batch.defer` queues: a group's flush, ``flush(batch, items)``.
FlushFn = Callable[["Batch", list[Any]], None]
# Where a batch's planning stood (:meth:`Batch.mark`): ops, dispatches, the uploads'
# mark, the arenas' sizes, undo entries, deferred items, deferred input bytes, the
# wire uploads' mark.
Mark = tuple[int, int, tuple[int, int], dict[str, int], int, int, int, tuple[int, int]]
# A bind group's entries: (binding, buffer, offset, size) each.
BindEntries = tuple[tuple[int, wgpu.GPUBuffer, int, int], ...]

_WHOLE = -1
# a dispatch's grid, padded to three dimensions for the command program
_GRID_PAD = (1, 1, 1)


def whole(arena: str) -> Seg:
    """The whole of an arena as one binding (batched kernels address items by offset)."""
    return _WHOLES[arena]


_ARENA_USAGE = {
    "in": wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST,
    "scratch": wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC,
    # split-KV partials: a buffer of their own, since a split kernel reads a
    # scratch segment (rotated queries) while it writes the partials, and one
    # buffer cannot be bound read-only and read-write in the same dispatch
    "partial": wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC,
    "out": wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST,
    # arrays as they came (half precision), converted into the input arena by a kernel
    # (which binds the input arena read-write: they cannot be in it)
    "wire": wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST,
    # outputs converted to the answer's dtype (from the output arena), read back
    "answer": wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC,
}


# Buffers that outlive batches, bound whole by name like an arena: a batch binds
# the buffer its provider gives at encode (``Batch.attach``); "tables": every
# layer's page table (``pool.PageTables``).
PERSISTENT = ("tables",)

_WHOLES = {arena: Seg(arena, 0, _WHOLE) for arena in (*_ARENA_USAGE, *PERSISTENT)}


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# Readback buffers: one per batch in flight (the worker records and submits the
# next batch while the GPU runs the previous one).
STAGING_SLOTS = 2


@dataclass(frozen=True)
class Recorded:
    """What a job planned into a batch between :meth:`Batch.record` and
    :meth:`Batch.recorded`, to be planned again by :meth:`Batch.replay` into a batch
    in the same state: its commands, its params uploads (structured arrays, each
    at its offset of the input arena), the arenas' sizes after it, and the page
    tables' word offsets its params name (``tables``: one per item, in the order
    the caller gives them again at replay). Each upload comes with where its
    ``table_off`` fields name a table: the rows ``at`` name ``tables[which]`` (both
    None for params without the field; a row naming a placeholder is in neither),
    found once when the plan is made, so a replay only puts the new offsets in."""

    ops: tuple[Op, ...]
    uploads: tuple[tuple[int, np.ndarray, np.ndarray | None, np.ndarray | None], ...]
    sizes: tuple[tuple[str, int], ...]
    n_dispatches: int
    tables: np.ndarray


class Arenas:
    """Persistent arena and staging buffers of one device, grown on demand.

    Reusing them across batches is safe although the next batch is written and
    submitted while the one before still runs: ``queue.write_buffer`` and submits
    are executed in queue order, and each batch in flight reads back through a
    staging buffer of its own (``STAGING_SLOTS``).
    """

    #: Bind groups kept for reuse (least recently used dropped past it).
    BIND_GROUPS = 8192

    def __init__(self, device: wgpu.GPUDevice, max_binding: int | None = None, budget: int | None = None):
        self.device = device
        # arenas are bound whole: never grown past what one binding may cover
        self.max_binding = int(max_binding or device.limits["max-storage-buffer-binding-size"])
        #: the size an arena is kept at (the batch_arena_bytes setting): the worker coalesces
        #: jobs up to it, and an arena a larger job needed is let go before the next batch
        self.budget = min(int(budget or self.max_binding), self.max_binding) // 4 * 4
        self.buffers: dict[str, wgpu.GPUBuffer] = {}
        self.staging: list[wgpu.GPUBuffer | None] = [None] * STAGING_SLOTS
        self._bind_groups: OrderedDict[tuple[wgpu.GPUBindGroupLayout, BindEntries], tuple[wgpu.GPUBindGroup, int]] = (
            OrderedDict()
        )
        self.bind_group_hits = 0
        self.bind_group_misses = 0

    @property
    def cached_bind_groups(self) -> int:
        return len(self._bind_groups)

    @property
    def held_bytes(self) -> int:
        """GPU bytes of the arenas and readback buffers (they grow to the largest
        batch within the budget and are kept); read from any thread (a copy of the lists)."""
        bufs = [*list(self.buffers.values()), *[s for s in list(self.staging) if s is not None]]
        return sum(b.size for b in bufs)

    @property
    def staging_budget(self) -> int:
        """The size a readback buffer is kept at: it holds a batch's output and answer arenas."""
        return 2 * self.budget

    def trim(self) -> int:
        """Let go of the arenas and readback buffers grown past the budget for a job
        larger than it (the batch that used them holds them until it is read back),
        with the bind groups that name them. Returns how many were let go."""
        over = {id(b) for b in self.buffers.values() if b.size > self.budget}
        over |= {id(b) for b in self.staging if b is not None and b.size > self.staging_budget}
        if not over:
            return 0
        self.buffers = {a: b for a, b in self.buffers.items() if id(b) not in over}
        self.staging = [None if b is not None and id(b) in over else b for b in self.staging]
        self._forget(over)
        return len(over)

    def _forget(self, buffers: set[int]) -> None:
        """Drop the cached bind groups that name any of ``buffers`` (by ``id``): a
        buffer let go would otherwise live on in them until they age out."""
        for key in [k for k in self._bind_groups if any(id(e[1]) in buffers for e in k[1])]:
            del self._bind_groups[key]

    def bind_group(self, layout: wgpu.GPUBindGroupLayout, entries: BindEntries) -> tuple[wgpu.GPUBindGroup, int]:
        """The bind group of ``layout`` over ``entries`` ((binding, buffer, offset,
        size), ...) and its wgpu-native handle, made once and reused: a decode loop
        binds the same cache buffers and arena offsets step after step, and making a
        bind group costs more host time than the dispatch it serves. The key holds
        the buffer objects themselves, so a released buffer's entries can never match
        a new buffer (they age out of the cache). The bind group owns the handle: a
        caller that records the handle holds the group until it is recorded (the
        cache may drop it meanwhile)."""
        key = (layout, entries)
        cached = self._bind_groups.get(key)
        if cached is not None:
            self._bind_groups.move_to_end(key)
            self.bind_group_hits += 1
            return cached
        self.bind_group_misses += 1
        bg = self.device.create_bind_group(
            layout=layout,
            entries=[
                {"binding": b, "resource": {"buffer": buf, "offset": off, "size": size}}
                for b, buf, off, size in entries
            ],
        )
        made = self._bind_groups[key] = (bg, native.handle(bg))
        while len(self._bind_groups) > self.BIND_GROUPS:
            self._bind_groups.popitem(last=False)
        return made

    def get(self, arena: str, size: int) -> wgpu.GPUBuffer:
        buf = self.buffers.get(arena)
        if buf is None or buf.size < size:
            new_size = _round_up(max(size, 2 * (buf.size if buf else 0), 1 << 16), 1 << 12)
            new_size = max(size, min(new_size, self.budget))
            if buf is not None:  # grown: the old one goes with the bind groups that name it
                self._forget({id(buf)})
            self.buffers[arena] = buf = self.device.create_buffer(
                label=f"arena-{arena}", size=new_size, usage=_ARENA_USAGE[arena]
            )
        return buf

    def get_staging(self, size: int, slot: int = 0) -> wgpu.GPUBuffer:
        """The readback buffer of ``slot`` (one per batch in flight: a batch's is
        mapped while the next one's is written)."""
        old = self.staging[slot]
        if old is None or old.size < size:
            new_size = _round_up(max(size, 2 * (old.size if old else 0), 1 << 16), 1 << 12)
            new_size = max(size, min(new_size, self.staging_budget))
            self.staging[slot] = old = self.device.create_buffer(
                label=f"staging-{slot}",
                size=new_size,
                usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
            )
        return old


class _Uploads:
    """What a batch writes into its input arena: runs of ``(offset, bytes)``, each
    one ``queue.write_buffer`` at encode. Small uploads are gathered into the last
    run (a host buffer, zero-padded to each one's offset); a large one is a run of
    its own, the caller's memory itself (kept alive, never copied on the host)."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, bytearray | memoryview]] = []

    def add(self, offset: int, data: memoryview) -> None:
        runs = self.runs
        if data.nbytes >= DIRECT_UPLOAD_BYTES:
            runs.append((offset, data))
            return
        if not runs or not isinstance(runs[-1][1], bytearray):
            runs.append((offset, bytearray()))
        start, gathered = runs[-1]
        assert isinstance(gathered, bytearray)
        pad = offset - start - len(gathered)
        assert pad >= 0, "uploads come at rising offsets"
        gathered.extend(b"\0" * pad)
        gathered.extend(data)

    def mark(self) -> tuple[int, int]:
        runs = self.runs
        return len(runs), (len(runs[-1][1]) if runs and isinstance(runs[-1][1], bytearray) else -1)

    def rollback(self, mark: tuple[int, int]) -> None:
        n, last = mark
        del self.runs[n:]
        if last >= 0:
            gathered = self.runs[-1][1]
            assert isinstance(gathered, bytearray)
            del gathered[last:]

    def add_writes(self, writes: "native.Writes", buffer: int) -> None:
        """Append the runs to ``writes``, as writes into ``buffer`` (a handle)."""
        writes += [(buffer, offset, data) for offset, data in self.runs if len(data)]

    def image(self) -> bytes:
        """The input arena's bytes as the runs will write them (tests)."""
        end = max((offset + len(data) for offset, data in self.runs), default=0)
        out = bytearray(end)
        for offset, data in self.runs:
            out[offset : offset + len(data)] = data
        return bytes(out)


@dataclass
class _Recording:
    mark: Mark
    uploads: list[tuple[int, np.ndarray]]
    replayable: bool = True


class Batch:
    """Commands of several jobs, planned on the GPU owner thread."""

    def __init__(
        self, device: wgpu.GPUDevice, pipelines: PipelineCache, arenas: Arenas, align: int, policy: "KernelPolicy"
    ):
        self.device = device
        self.policy = policy  # which kernels the jobs' plans pick (the engine's)
        self.pipelines = pipelines
        self.arenas = arenas
        self.align = max(int(align), 16)
        self._uploads = _Uploads()
        self._wire_uploads = _Uploads()
        self._sizes = {"in": 0, "scratch": 0, "partial": 0, "out": 0, "wire": 0, "answer": 0}
        # whether a job reads the output arena itself (else only the answer arena is
        # read back); where the answer arena starts in what read_back gives (encode)
        self._reads_out = False
        self.answer_at = 0
        self.ops: list[Op] = []
        self.n_dispatches = 0
        self._undo: list[Callable[[], object]] = []
        self._deferred: list[tuple[int, object, object, FlushFn]] = []
        self._deferred_in = 0
        self._memo: dict[object, Seg] = {}
        self._persistent: dict[str, Callable[[wgpu.GPUDevice], wgpu.GPUBuffer]] = {}
        # deferred writes (encodes) group by it: a layer moved to another slab during
        # the batch copies its pages after the writes deferred before the move and
        # before those deferred after it (``LayerCache._move``)
        self.write_epoch = 0
        # while a job's plan is recorded (``record``): where it started, its params
        # uploads, and whether it did anything a replay could not repeat
        self._recording: _Recording | None = None
        # whether the job planning now may record its plan (:meth:`record`): its
        # planner sets it, true for a batch's first job only, so the jobs after it
        # still share their dispatches (a recorded plan is flushed on its own)
        self.records = True

    # ── planning ────────────────────────────────────────────────────────────

    def _reserve(self, arena: str, nbytes: int) -> Seg:
        if nbytes <= 0:
            raise ValueError("a segment needs at least one byte")
        off = _round_up(self._sizes[arena], self.align)
        self._sizes[arena] = off + _round_up(nbytes, 4)
        return Seg(arena, off, nbytes)

    def upload(self, data: bytes | memoryview | np.ndarray) -> Seg:
        """Host bytes (a C-contiguous array, bytes or a byte view) into the input arena."""
        if self._recording is not None:  # data a replay would not have
            self._recording.replayable = False
        # ndarray.data: memoryview(array), typed as one (numpy's stubs make an array a
        # Buffer only from Python 3.12)
        return self._put(data.data.cast("B") if isinstance(data, np.ndarray) else memoryview(data))

    def upload_params(self, rows: np.ndarray) -> Seg:
        """A kernel's params blocks (a structured array, ``params.pack_array``) into
        the input arena: :meth:`upload`, kept by a recording as they are."""
        seg = self._put(rows.view(np.uint8).data.cast("B"))
        if self._recording is not None:
            self._recording.uploads.append((seg.offset, rows))
        return seg

    def _put(self, data: memoryview) -> Seg:
        seg = self._reserve("in", data.nbytes)
        self._uploads.add(seg.offset, data)
        return seg

    def upload_wire(self, data: memoryview) -> Seg:
        """Host bytes into the wire arena (for a kernel to convert into the input
        arena before any other reads them), padded to whole words."""
        if self._recording is not None:  # data a replay would not have
            self._recording.replayable = False
        if data.nbytes % 4:
            data = memoryview(bytes(data) + bytes(4 - data.nbytes % 4))
        seg = self._reserve("wire", data.nbytes)
        self._wire_uploads.add(seg.offset, data)
        return seg

    def reserve_items(self, count: int, nbytes: int) -> "Items":
        """``count`` aligned segments of ``nbytes`` in the input arena, written on
        the GPU (a kernel converts the batch's wire arena into them), not uploaded."""
        return self._reserve_items("in", count, nbytes)

    def answer(self, nbytes: int) -> Seg:
        """Space in the answer arena, read back after the output arena: what
        :meth:`read_back` gives holds it from byte ``answer_at + offset``."""
        return self._reserve("answer", nbytes)

    def upload_items(self, data: np.ndarray) -> "Items":
        """The items ``data[0], data[1], ...`` of a C-contiguous array into the input
        arena, each its own aligned segment, in one copy (a stacked step's queries
        or rows)."""
        items = self._reserve_items("in", data.shape[0], data[0].nbytes if data.shape[0] else 0)
        if self._recording is not None:
            self._recording.replayable = False
        flat = np.ascontiguousarray(data).view(np.uint8).reshape(items.count, items.nbytes)
        if items.stride != items.nbytes:
            padded = np.zeros((items.count, items.stride), np.uint8)
            padded[:, : items.nbytes] = flat
            flat = padded
        self._uploads.add(items.base, flat.data.cast("B"))
        return items

    def output_items(self, count: int, nbytes: int, read: bool = True) -> "Items":
        """``count`` output segments of ``nbytes`` each, evenly spaced (read back as
        one array with :meth:`Items.view`; ``read=False``: not read back, a kernel
        converts them into the answer arena)."""
        self._reads_out |= read
        return self._reserve_items("out", count, nbytes)

    def _reserve_items(self, arena: str, count: int, nbytes: int) -> "Items":
        if count <= 0 or nbytes <= 0:
            raise ValueError("items need at least one item of one byte")
        stride = _round_up(nbytes, self.align)
        base = self._reserve(arena, stride * count).offset
        return Items(arena, base, stride, nbytes, count)

    def attach(self, name: str, provider: Callable[[wgpu.GPUDevice], wgpu.GPUBuffer]) -> None:
        """Bind ``whole(name)`` (one of ``PERSISTENT``) to ``provider(device)``, called
        once as the batch is encoded, before its upload: a buffer that outlives
        batches and is brought up to date then (the page tables)."""
        self._persistent[name] = provider

    def upload_once(self, key: Hashable, data: bytes | np.ndarray) -> Seg:
        """``upload(data)`` once per batch for ``key`` (a layer's signs as they are
        now): later calls with the same key get the same segment."""
        return self.upload_once_each([key], lambda _: data)[0]

    def upload_once_each(self, keys: Sequence[Hashable], data: Callable[[Any], bytes | np.ndarray]) -> list[Seg]:
        """:meth:`upload_once` for each of ``keys`` (``data(key)``: its bytes), the ones
        not uploaded yet in one copy, each its own aligned segment (a stacked step's
        layer signs: one upload, not one per layer)."""
        memo = self._memo
        missing = list(dict.fromkeys(k for k in keys if k not in memo))
        if missing:
            # Buffer: bytes, or an ndarray (a Buffer to numpy's stubs only from Python 3.12)
            blobs = [memoryview(cast("Buffer", data(k))).cast("B") for k in missing]
            if len(blobs) > 1 and len({b.nbytes for b in blobs}) == 1:
                rows = np.frombuffer(b"".join(blobs), np.uint8).reshape(len(blobs), -1)
                items = self.upload_items(rows)
                segs = [items.seg(i) for i in range(len(missing))]
            else:
                segs = [self.upload(b) for b in blobs]
            memo.update(zip(missing, segs))
            self.on_rollback(lambda: [memo.pop(k, None) for k in missing])
        return [memo[k] for k in keys]

    def scratch(self, nbytes: int, arena: str = "scratch") -> Seg:
        """GPU-only space: ``arena`` is "scratch" or "partial" (split-KV partials)."""
        if arena not in ("scratch", "partial"):
            raise ValueError(arena)
        return self._reserve(arena, nbytes)

    def output(self, nbytes: int) -> Seg:
        self._reads_out = True
        return self._reserve("out", nbytes)

    def dispatch(
        self,
        kernel: str,
        bindings: dict[int, Resource],
        grid: tuple[int, int, int],
        constants: dict[str, int] | None = None,
    ) -> None:
        """Record one dispatch of ``kernel``; ``constants`` set its WGSL overrides."""
        self.ops.append(("dispatch", kernel, dict(bindings), tuple(grid), dict(constants or {})))
        self.n_dispatches += 1

    def defer(self, phase: int, key: object, item: object, flush: FlushFn, rows: int = 1) -> None:
        """Queue ``item`` for the group ``(phase, key)``: at :meth:`flush`,
        ``flush(batch, items)`` records the group's dispatches (``rows``: params
        blocks it will upload, counted in the input arena's size now)."""
        self._deferred.append((phase, key, item, flush))
        self._deferred_in += rows * DEFERRED_ROW_BYTES

    def flush(self) -> None:
        """Record every deferred group now, phase by phase, each group in the order
        its first item came (benchmarks call it to time one attend per dispatch)."""
        if not self._deferred:
            return
        groups: dict[tuple[int, object], tuple[FlushFn, list[object]]] = {}
        for phase, key, item, fn in sorted(self._deferred, key=lambda d: d[0]):
            groups.setdefault((phase, key), (fn, []))[1].append(item)
        self._deferred.clear()
        self._deferred_in = 0
        for fn, items in groups.values():
            fn(self, items)

    def layout(self) -> tuple[tuple[int, ...], int, tuple[int, int, bool] | None, int]:
        """Where a plan made now starts: the arenas' sizes, the input arena's runs
        (how many, where the last starts and its length) and the write epoch. A
        recorded plan is replayed only into a batch of the recording's layout."""
        runs = self._uploads.runs
        last = (runs[-1][0], len(runs[-1][1]), isinstance(runs[-1][1], bytearray)) if runs else None
        return tuple(self._sizes.values()), len(runs), last, self.write_epoch

    def record(self) -> bool:
        """Start recording what is planned from now, for :meth:`replay`; False (no
        recording) unless :attr:`records` and nothing deferred waits. A recorded plan
        is flushed on its own (:meth:`recorded`)."""
        if not self.records or self._deferred or self._recording is not None:
            return False
        self._recording = _Recording(self.mark(), [])
        return True

    def recorded(self, tables: np.ndarray, placeholders: tuple[int, ...] = ()) -> Recorded | None:
        """Flush what was planned since :meth:`record` and stop recording: the plan,
        or None when it did what a replay cannot repeat (uploaded data, changed host
        state, or named a page table offset twice in ``tables``, or one that is also
        a placeholder: a ``table_off`` value that stands for no table, kept as it is
        by :meth:`replay`)."""
        recording = self._recording
        assert recording is not None, "not recording"
        try:
            self.flush()
        finally:
            self._recording = None
        tables = np.array(tables, np.int64)
        if not recording.replayable or len(np.unique(tables)) != len(tables) or np.isin(placeholders, tables).any():
            return None
        uploads: list[tuple[int, np.ndarray, np.ndarray | None, np.ndarray | None]] = []
        order = np.argsort(tables)
        ordered = tables[order]
        for offset, rows in recording.uploads:
            if "table_off" not in rows.dtype.names:  # type: ignore[operator]
                uploads.append((offset, rows, None, None))
                continue
            col = rows["table_off"].astype(np.int64)
            pos = np.minimum(np.searchsorted(ordered, col), len(ordered) - 1)
            found = ordered[pos] == col
            if not (found | np.isin(col, placeholders)).all():  # an offset that is neither: no map back
                return None
            uploads.append((offset, rows, np.flatnonzero(found), order[pos[found]]))
        n_ops, n_disp = recording.mark[0], recording.mark[1]
        return Recorded(
            tuple(self.ops[n_ops:]), tuple(uploads), tuple(self._sizes.items()), self.n_dispatches - n_disp, tables
        )

    def abandon_recording(self) -> None:
        """Stop recording without a plan (the job failed; it is rolled back)."""
        self._recording = None

    def replay(self, plan: Recorded, tables: np.ndarray) -> None:
        """Plan again what ``plan`` recorded, into this batch in the state it was
        recorded in (the caller's key says so), for items whose page tables are now
        at ``tables[i]`` (each params field ``table_off`` that held ``plan.tables[i]``
        gets ``tables[i]``; the recorded offsets are distinct; a placeholder stays)."""
        assert not self._deferred, "a replay follows every deferred item"
        new = np.asarray(tables, np.int64)
        for offset, rows, at, which in plan.uploads:
            if at is not None and len(at):
                rows = rows.copy()
                rows["table_off"][at] = new[which]
            self._uploads.add(offset, rows.view(np.uint8).data.cast("B"))
        self.ops.extend(plan.ops)
        self.n_dispatches += plan.n_dispatches
        self._sizes = dict(plan.sizes)

    def copy(self, src: Resource, src_off: int, dst: Resource, dst_off: int, size: int) -> None:
        if size > 0:
            self.ops.append(("copy", src, src_off, dst, dst_off, size))

    def on_rollback(self, undo: Callable[[], object]) -> None:
        """Register ``undo()`` to run if the job planning now is rolled back:
        planning may change host state (a layer's length, its buffers) that the
        dropped commands would have matched."""
        if self._recording is not None:  # host state a replay would not change
            self._recording.replayable = False
        self._undo.append(undo)

    def mark(self) -> Mark:
        return (
            len(self.ops),
            self.n_dispatches,
            self._uploads.mark(),
            dict(self._sizes),
            len(self._undo),
            len(self._deferred),
            self._deferred_in,
            self._wire_uploads.mark(),
        )

    def rollback(self, mark: Mark) -> None:
        """Drop everything planned since ``mark`` and undo its host-state changes."""
        n_ops, n_disp, n_up, sizes, n_undo, n_deferred, deferred_in, n_wire = mark
        del self.ops[n_ops:]
        del self._deferred[n_deferred:]
        self._deferred_in = deferred_in
        self._uploads.rollback(n_up)
        self._wire_uploads.rollback(n_wire)
        self.n_dispatches = n_disp
        self._sizes = sizes
        while len(self._undo) > n_undo:
            self._undo.pop()()

    @property
    def empty(self) -> bool:
        return not self.ops and not self._deferred

    @property
    def deferring(self) -> bool:
        """Whether deferred items of earlier plans wait for :meth:`flush` (a plan is
        then neither recorded nor replayed: its commands would come before theirs)."""
        return bool(self._deferred)

    @property
    def largest_arena(self) -> int:
        """Bytes of the largest arena this batch needs (bounded by the binding limit)."""
        return max(max(self._sizes.values()), self._sizes["in"] + self._deferred_in)

    # ── execution ───────────────────────────────────────────────────────────

    def _resolve(self, res: Resource, bufs: dict[str, wgpu.GPUBuffer]) -> tuple[wgpu.GPUBuffer, int, int]:
        if isinstance(res, Seg):
            buf = bufs[res.arena]
            if res.size == _WHOLE:
                return buf, 0, buf.size
            return buf, res.offset, _round_up(res.size, 4)
        return res, 0, res.size

    def encode(self, slot: int = 0, timestamps: wgpu.GPUQuerySet | None = None, submit: bool = False) -> Encoded | None:
        """Write the upload arena and record every command, reading the output back
        through staging buffer ``slot``, in one compiled call (:mod:`.native`); with
        ``submit``, submit it in the same call (the worker) and return no command
        buffer, else return it for :meth:`queue_submit` (benchmarks time the parts).
        Returns what :meth:`read_back` takes. With ``timestamps`` (a timestamp query
        set of at least 2 per dispatch), each dispatch is a compute pass of its own
        whose GPU start and end land at query 2i and 2i + 1 (profiling:
        ``bench/worker_profile.py --gpu-phases``)."""
        self.flush()
        if not self.ops:
            return None
        bufs = {a: self.arenas.get(a, max(n, 4)) for a, n in self._sizes.items()}  # bound whole: all exist
        for name, provider in self._persistent.items():
            bufs[name] = provider(self.device)
        writes: native.Writes = []
        self._uploads.add_writes(writes, native.handle(bufs["in"]))
        self._wire_uploads.add_writes(writes, native.handle(bufs["wire"]))
        program: list[int] = []
        # the program's bind groups, held until it is recorded (native.run below; the
        # command buffer then holds what it binds): a batch of more bind groups than
        # the cache keeps drops its first ones from the cache before it is done
        groups: list[wgpu.GPUBindGroup] = []
        for op in self.ops:
            if op[0] == "dispatch":
                _, kernel, bindings, grid, constants = op
                pipe, bgl = self.pipelines.handle(kernel, constants)
                group, bg = self.arenas.bind_group(
                    bgl, tuple((b, *self._resolve(res, bufs)) for b, res in sorted(bindings.items()))
                )
                groups.append(group)
                program += (native.OP_DISPATCH, pipe, bg, *grid, *_GRID_PAD[len(grid) :])
            else:
                _, src, so, dst, do, size = op
                sbuf, soff, _ = self._resolve(src, bufs)
                dbuf, doff, _ = self._resolve(dst, bufs)
                program += (native.OP_COPY, native.handle(sbuf), soff + so, native.handle(dbuf), doff + do, size)
        # read back: the output arena (when a job reads it), then the answer arena
        n_out = _round_up(self._sizes["out"], 4) if self._reads_out else 0
        n_answer = _round_up(self._sizes["answer"], 4)
        self.answer_at = n_out
        staging = None
        if n_out + n_answer:
            staging = self.arenas.get_staging(n_out + n_answer, slot)
            to = native.handle(staging)
            if n_out:
                program += (native.OP_COPY, native.handle(bufs["out"]), 0, to, 0, n_out)
            if n_answer:
                program += (native.OP_COPY, native.handle(bufs["answer"]), 0, to, n_out, n_answer)
        commands = native.run(self.device, writes, array("Q", program), timestamps, submit)
        return commands, staging, n_out + n_answer

    def queue_submit(self, encoded: Encoded | None) -> None:
        """Submit what :meth:`encode` made without submitting; returns at once (the
        GPU runs it)."""
        if encoded is not None and encoded[0] is not None:
            self.device.queue.submit([encoded[0]])

    def read_back(self, encoded: Encoded | None) -> memoryview | None:
        """Wait for a submitted batch and read its output arena (None if it has none)."""
        if encoded is None:
            return None
        _, staging, n_out = encoded
        if staging is None:
            return None
        staging.map_sync(wgpu.MapMode.READ, 0, n_out)
        try:  # numpy copies large arrays without the GIL (bytes() holds it): the event loop runs meanwhile
            data = np.frombuffer(staging.read_mapped(0, n_out, copy=False), np.uint8).copy().data
        finally:
            staging.unmap()
        return data
