"""The paged KV pool: every session's layers in fixed-size pages of shared buffers.

This module is the one owner of where a timestep lives on the GPU (the design is
in docs/architecture.md, "The paged KV pool"):

* A :class:`PageLayout` says, for a kv format and head shape, how the rows of a
  cache of ``cap`` timesteps are laid out in its K and V buffers (plain f32 / f16 / bf16:
  row-major ``[cap, kv_dim]``; TurboQuant: the region-major words of shaders/tqx.wgsl,
  ``slot = head * cap + row``).
* A :class:`PagePool` (one per layout, see :class:`PagePools`) holds that format's
  pages in *slabs*: a slab is one K and one V buffer laid out as a cache of
  ``pages * P`` rows, so page ``p`` is rows ``p*P .. p*P+P-1``. A layer is a page
  table (``kv.layer.LayerCache``): its timestep ``t`` lives at slab row
  ``pages[t // P] * P + t % P``, which every kernel computes through the table it
  is given (``shaders/include/paging.wgsl``).
* Appends take free pages; nothing is copied to grow a layer. A slab grows by
  doubling (one copy of the slab, amortized) up to the adapter's binding limit;
  past it a new slab starts, and a layer whose slab is full moves its pages to a
  slab with room (the only copy of a layer, and only then).
* Every layer's page table lives on the GPU in one buffer, :class:`PageTables`,
  kept between batches and written by differences: a layer's region of it gets
  the entries of its new pages as they come; a table that changes otherwise (a
  move, a restore) is written whole into a new region. Every kernel reads the
  tables from that buffer (``whole("tables")``); a batch uploads none.
* Every page knows the layers that hold it (a fork shares pages) and the one that
  *pays* for it: the layer that took it, then, when the payer lets it go, the
  next holder. A session is charged for the pages it pays for, so budgets and
  quotas count a shared page once. A page nobody holds is freed only after the
  batch that dropped it has run, so an attend planned earlier in that batch still
  reads what it was planned against.

Everything here runs on the GPU owner thread, except the pure sizing methods.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import wgpu

from . import formats

__all__ = [
    "PageLayout",
    "Slab",
    "PagePool",
    "PagePools",
    "PageTables",
    "TableRegion",
    "DirectCopies",
    "Copier",
    "Holder",
    "copy_rows",
    "copy_host_rows",
    "check_page_tokens",
]

_CACHE_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
FIRST_SLAB_PAGES = 16


def check_page_tokens(page_tokens: int) -> int:
    """P must be a power of two in 16..1024 (the shaders shift by log2 P)."""
    if page_tokens < 16 or page_tokens > 1024 or page_tokens & (page_tokens - 1):
        raise ValueError(f"page_tokens must be a power of two from 16 to 1024, got {page_tokens}")
    return page_tokens


class Holder(Protocol):
    """What holds pages (``kv.layer.LayerCache``): it counts the pages it pays for."""

    paid_pages: int


#: A batch's ``on_rollback``: registers a callable run if the job planning now is rolled back.
Undo = Callable[[Callable[[], object]], None]


class Copier(Protocol):
    """Where copies are recorded: a ``gpu.batch.Batch`` or :class:`DirectCopies`."""

    device: wgpu.GPUDevice

    def copy(self, src: wgpu.GPUBuffer, src_off: int, dst: wgpu.GPUBuffer, dst_off: int, size: int) -> None: ...


class DirectCopies:
    """Copies recorded into one command encoder and submitted by :meth:`run` (for
    work outside a batch: snapshot reads and restores, run alone on the GPU thread)."""

    def __init__(self, device: wgpu.GPUDevice):
        self.device = device
        self._ops: list[tuple[wgpu.GPUBuffer, int, wgpu.GPUBuffer, int, int]] = []

    def copy(self, src: wgpu.GPUBuffer, src_off: int, dst: wgpu.GPUBuffer, dst_off: int, size: int) -> None:
        if size > 0:
            self._ops.append((src, src_off, dst, dst_off, size))

    def run(self) -> None:
        if not self._ops:
            return
        enc = self.device.create_command_encoder()
        for op in self._ops:
            enc.copy_buffer_to_buffer(*op)
        self.device.queue.submit([enc.finish()])
        self._ops.clear()


@dataclass(frozen=True)
class PageLayout:
    """Where the rows of a cache of ``cap`` timesteps live in its K and V buffers."""

    kv_format: str
    n_kv_heads: int
    head_dim: int

    @property
    def key_regions(self) -> tuple[int, ...]:
        """Words per slot of each region of the K buffer (TurboQuant), or per row (plain)."""
        return formats.key_words(self.kv_format, self.n_kv_heads, self.head_dim)

    @property
    def value_regions(self) -> tuple[int, ...]:
        return formats.value_words(self.kv_format, self.n_kv_heads, self.head_dim)

    def buffer_bytes(self, cap: int) -> tuple[int, int]:
        """Bytes of the K and V buffers of a cache of ``cap`` rows."""
        heads = formats.slot_heads(self.kv_format, self.n_kv_heads)
        return cap * heads * sum(self.key_regions) * 4, cap * heads * sum(self.value_regions) * 4

    @property
    def bytes_per_token(self) -> int:
        return sum(self.buffer_bytes(1))

    def _ranges(self, regions: tuple[int, ...], cap: int, row0: int, n: int) -> list[tuple[int, int]]:
        if formats.is_plain(self.kv_format):
            w = regions[0] * 4
            return [(row0 * w, n * w)]
        out, base = [], 0
        for w in regions:
            for h in range(self.n_kv_heads):
                out.append(((base + (h * cap + row0) * w) * 4, n * w * 4))
            base += self.n_kv_heads * cap * w
        return out

    def row_ranges(self, cap: int, row0: int, n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(offset, size) byte ranges of rows ``row0 .. row0+n-1`` in K and in V; the
        ranges of two caches pair up one to one (copies between layouts)."""
        return self._ranges(self.key_regions, cap, row0, n), self._ranges(self.value_regions, cap, row0, n)


def copy_rows(
    copier: Copier,
    layout: PageLayout,
    src: tuple[wgpu.GPUBuffer, wgpu.GPUBuffer, int, int],
    dst: tuple[wgpu.GPUBuffer, wgpu.GPUBuffer, int, int],
    n: int,
) -> None:
    """Copy ``n`` rows: ``src``/``dst`` are (K buffer, V buffer, cap, first row).
    Within one buffer (a page copied inside its slab) the rows go through a
    temporary buffer: WebGPU copies never share a source and a destination."""
    sk, sv, scap, srow = src
    dk, dv, dcap, drow = dst
    (sks, svs), (dks, dvs) = layout.row_ranges(scap, srow, n), layout.row_ranges(dcap, drow, n)
    for sbuf, dbuf, sranges, dranges in ((sk, dk, sks, dks), (sv, dv, svs, dvs)):
        if sbuf is not dbuf:
            for (so, size), (do, _) in zip(sranges, dranges):
                copier.copy(sbuf, so, dbuf, do, size)
            continue
        tmp = copier.device.create_buffer(label="page-copy", size=sum(size for _, size in sranges), usage=_CACHE_USAGE)
        off = 0
        for so, size in sranges:
            copier.copy(sbuf, so, tmp, off, size)
            off += size
        off = 0
        for do, size in dranges:
            copier.copy(tmp, off, dbuf, do, size)
            off += size


def copy_host_rows(
    layout: PageLayout,
    src: tuple[bytes, bytes, int, int],
    dst: tuple[bytearray, bytearray, int, int],
    n: int,
) -> None:
    """:func:`copy_rows` between host copies of caches: ``src``/``dst`` are (K bytes,
    V bytes, cap, first row)."""
    sk, sv, scap, srow = src
    dk, dv, dcap, drow = dst
    (sks, svs), (dks, dvs) = layout.row_ranges(scap, srow, n), layout.row_ranges(dcap, drow, n)
    for sbuf, dbuf, sranges, dranges in ((sk, dk, sks, dks), (sv, dv, svs, dvs)):
        for (so, size), (do, _) in zip(sranges, dranges):
            dbuf[do : do + size] = sbuf[so : so + size]


@dataclass(eq=False)
class Slab:
    """One K and one V buffer holding ``pages`` pages (``pages * P`` rows)."""

    index: int
    page_tokens: int
    pages: int = 0
    k: wgpu.GPUBuffer | None = None
    v: wgpu.GPUBuffer | None = None
    free: list[int] = field(default_factory=list)
    holders: list[list[Holder]] = field(default_factory=list)  # the layers holding each page
    payer: list[Holder | None] = field(default_factory=list)  # the holder charged for each page

    @property
    def free_pages(self) -> int:
        return len(self.free)

    @property
    def rows(self) -> int:
        """The slab's capacity in rows: the ``cache_cap`` the TurboQuant kernels take."""
        return self.pages * self.page_tokens


class PoolFull(Exception):
    """The layer's slab has no free page and cannot grow (the layer must move)."""


class PagePool:
    """The pages of one layout, in slabs of at most ``max_slab_pages`` pages."""

    def __init__(self, layout: PageLayout, page_tokens: int, max_slab_bytes: int, tables: "PageTables"):
        self.layout = layout
        self.tables = tables  # where its layers' page tables live (every pool's: PagePools')
        self.page_tokens = check_page_tokens(page_tokens)
        self.page_shift = page_tokens.bit_length() - 1
        self.page_bytes = layout.bytes_per_token * page_tokens
        k1, v1 = layout.buffer_bytes(page_tokens)
        self.max_slab_pages = max(1, max_slab_bytes // max(k1, v1))
        self.slabs: list[Slab] = []
        self._limbo: list[tuple[Slab, int]] = []  # dropped during a batch, freed after it

    # ── sizing (pure) ───────────────────────────────────────────────────────

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_tokens)

    @property
    def held_bytes(self) -> int:
        """GPU bytes of every slab (pages in use and free)."""
        return sum(sum(self.layout.buffer_bytes(s.rows)) for s in self.slabs if s.k is not None)

    @property
    def used_pages(self) -> int:
        return sum(s.pages - s.free_pages for s in self.slabs) - len(set(self._limbo))

    # ── pages (GPU owner thread) ────────────────────────────────────────────

    def _grow(self, copier: Copier, device: wgpu.GPUDevice, slab: Slab, want_free: int) -> bool:
        """Grow ``slab`` (doubling, up to the limit) until it has ``want_free`` free pages."""
        new_pages = slab.pages
        while new_pages - slab.pages + slab.free_pages < want_free and new_pages < self.max_slab_pages:
            new_pages = min(self.max_slab_pages, max(2 * new_pages, FIRST_SLAB_PAGES))
        if new_pages - slab.pages + slab.free_pages < want_free:
            return False
        from .errors import OutOfMemory

        kb, vb = self.layout.buffer_bytes(new_pages * self.page_tokens)
        try:
            k = device.create_buffer(label=f"pool-{slab.index}-k", size=kb, usage=_CACHE_USAGE)
            v = device.create_buffer(label=f"pool-{slab.index}-v", size=vb, usage=_CACHE_USAGE)
        except Exception as e:  # wgpu raises on allocation failure
            raise OutOfMemory(f"cannot allocate a {kb}-byte GPU buffer for the KV pool: {e}") from e
        undo = getattr(copier, "on_rollback", None)
        if undo is not None:  # a rolled-back job's copy is dropped: so is its growth
            state = (slab.pages, slab.k, slab.v, list(slab.free), list(slab.holders), list(slab.payer))
            undo(functools.partial(self._restore, slab, state))
        if slab.k is not None and slab.pages:
            rows = slab.rows
            copy_rows(copier, self.layout, (slab.k, slab.v, rows, 0), (k, v, new_pages * self.page_tokens, 0), rows)
        slab.free.extend(range(new_pages - 1, slab.pages - 1, -1))
        slab.holders.extend([] for _ in range(new_pages - slab.pages))
        slab.payer.extend([None] * (new_pages - slab.pages))
        slab.k, slab.v, slab.pages = k, v, new_pages
        return True

    @staticmethod
    def _restore(
        slab: Slab,
        state: tuple[
            int, wgpu.GPUBuffer | None, wgpu.GPUBuffer | None, list[int], list[list[Holder]], list[Holder | None]
        ],
    ) -> None:
        slab.pages, slab.k, slab.v, slab.free, slab.holders, slab.payer = state

    def take(
        self,
        copier: Copier,
        device: wgpu.GPUDevice,
        slab: Slab | None,
        n: int,
        holder: Holder,
        exclude: Slab | None = None,
    ) -> tuple[Slab, list[int]]:
        """``n`` free pages, held and paid for by ``holder``, from ``slab``, or, with
        no slab yet, from the slab with the most room other than ``exclude`` (a new
        one if none has room). Raises :class:`PoolFull` when ``slab`` cannot give
        them (the caller moves the layer)."""
        if slab is None:
            slab = self._roomiest(copier, device, n, exclude)
        elif slab.free_pages < n and not self._grow(copier, device, slab, n):
            raise PoolFull(f"slab {slab.index} is full")
        pages = [slab.free.pop() for _ in range(n)]
        for p in pages:
            slab.holders[p] = [holder]
            slab.payer[p] = holder
        holder.paid_pages += n
        return slab, pages

    def _roomiest(self, copier: Copier, device: wgpu.GPUDevice, n: int, exclude: Slab | None) -> Slab:
        slabs = [s for s in self.slabs if s is not exclude]
        for slab in sorted(slabs, key=lambda s: -s.free_pages):
            if slab.free_pages >= n:
                return slab
        for slab in sorted(slabs, key=lambda s: s.pages):
            if self._grow(copier, device, slab, n):
                return slab
        if n > self.max_slab_pages:
            from .errors import CapacityExceeded

            raise CapacityExceeded(f"{n} pages pass the largest slab this adapter binds ({self.max_slab_pages})")
        slab = Slab(len(self.slabs), self.page_tokens)
        self.slabs.append(slab)
        self._grow(copier, device, slab, n)
        return slab

    def copy_pages(self, copier: Copier, src: Slab, src_pages: list[int], dst: Slab, dst_pages: list[int]) -> None:
        """Copy whole pages, ``src_pages[i]`` of ``src`` to ``dst_pages[i]`` of ``dst``."""
        P = self.page_tokens
        for s, d in zip(src_pages, dst_pages):
            copy_rows(copier, self.layout, (src.k, src.v, src.rows, s * P), (dst.k, dst.v, dst.rows, d * P), P)

    def untake(self, slab: Slab, pages: list[int]) -> None:
        """Give back pages taken during a job that is rolled back (never written)."""
        for p in reversed(pages):
            payer = slab.payer[p]
            if payer is not None:
                payer.paid_pages -= 1
            slab.holders[p] = []
            slab.payer[p] = None
            slab.free.append(p)

    def share(self, slab: Slab, pages: list[int], holder: Holder) -> None:
        """``holder`` holds ``pages`` too (their payer stays)."""
        for p in pages:
            slab.holders[p].append(holder)
            if slab.payer[p] is None:
                slab.payer[p] = holder
                holder.paid_pages += 1

    def drop(self, slab: Slab, pages: list[int], holder: Holder) -> None:
        """``holder`` lets ``pages`` go: the next holder pays for a page its payer
        dropped; a page nobody holds is freed after the current batch."""
        for p in pages:
            held = slab.holders[p]
            held.remove(holder)
            if slab.payer[p] is holder:
                holder.paid_pages -= 1
                slab.payer[p] = held[0] if held else None
                if held:
                    held[0].paid_pages += 1
            if not held:
                self._limbo.append((slab, p))

    def settle(self) -> None:
        """After a batch ran: the pages dropped while it was planned are free."""
        for slab, p in dict.fromkeys(self._limbo):  # a page dropped, shared back, dropped again: once
            if not slab.holders[p]:
                slab.free.append(p)
        self._limbo.clear()


@dataclass(frozen=True)
class TableRegion:
    """``size`` words of :class:`PageTables` from word ``offset``: one layer's table."""

    offset: int
    size: int


class PageTables:
    """Every layer's page table in one GPU buffer that persists across batches.

    The host keeps a mirror of the buffer's words; a layer writes entries into its
    region of the mirror as it plans (:meth:`write`), and :meth:`sync`, called as a
    batch is encoded, uploads the words written since the last batch (one
    ``queue.write_buffer`` per run of them) before the batch's commands. Queue order
    makes that safe beside batches still running: a write lands after every batch
    submitted before it. A layer only ever appends entries to its region while the
    entries it has stay the same; any other change takes a new region
    (:meth:`take`) and the old one is freed only after the batch that let it go was
    submitted (:meth:`drop`, :meth:`settle`), so an attend planned earlier still
    reads the table it was planned with. Regions come in power-of-two sizes of at
    least ``MIN_WORDS`` words, reused by size; the buffer grows by doubling (a new
    buffer written whole from the mirror; batches in flight keep the old one).

    Runs on the GPU owner thread.
    """

    MIN_WORDS = 16

    def __init__(self, max_bytes: int = 1 << 27):
        self.max_words = int(max_bytes) // 4
        self.words = np.zeros(1 << 12, dtype="<u4")  # the mirror
        self.top = 0  # words below it belong to a region (in use, free or in limbo)
        self.free: dict[int, list[int]] = {}  # region size -> free offsets
        self.buffer: wgpu.GPUBuffer | None = None
        self._dirty: list[tuple[int, int]] = []  # [start, end) written since the last sync
        self._limbo: list[TableRegion] = []
        self.written_words = 0  # words uploaded by sync (differences, or the whole mirror on growth)
        self.in_use_words = 0

    @staticmethod
    def size_for(entries: int) -> int:
        return max(PageTables.MIN_WORDS, 1 << max(0, entries - 1).bit_length())

    def take(self, entries: int, undo: Undo | None = None) -> TableRegion:
        """A region for a table of ``entries`` pages (``undo``: a batch's
        ``on_rollback``; a rolled-back job's region is free again at once)."""
        size = self.size_for(entries)
        free = self.free.get(size)
        if free:
            off = free.pop()
        else:
            off = self.top
            if off + size > self.max_words:
                from .errors import OutOfMemory

                raise OutOfMemory(
                    f"the page tables need more than the {4 * self.max_words} bytes one GPU binding covers"
                )
            self.top = off + size
            if self.top > len(self.words):
                grown = np.zeros(max(2 * len(self.words), self.top), dtype="<u4")
                grown[: len(self.words)] = self.words
                self.words = grown
        region = TableRegion(off, size)
        self.in_use_words += size
        if undo is not None:
            undo(functools.partial(self._give_back, region))
        return region

    def _give_back(self, region: TableRegion) -> None:
        self.free.setdefault(region.size, []).append(region.offset)
        self.in_use_words -= region.size

    def write(self, offset: int, entries: list[int]) -> None:
        """Entries into the mirror at word ``offset``, uploaded at the next :meth:`sync`."""
        if entries:
            self.words[offset : offset + len(entries)] = entries
            self._dirty.append((offset, offset + len(entries)))

    def drop(self, region: TableRegion, undo: Undo | None = None) -> None:
        """A layer lets ``region`` go: free after the current batch is submitted."""
        self._limbo.append(region)
        if undo is not None:
            undo(lambda: self._limbo.remove(region))

    def settle(self) -> None:
        """After a batch was submitted: the regions let go while it was planned are free."""
        for region in self._limbo:
            self._give_back(region)
        self._limbo.clear()

    def sync(self, device: wgpu.GPUDevice) -> wgpu.GPUBuffer:
        """The buffer, with every word written since the last call uploaded."""
        nbytes = 4 * len(self.words)
        if self.buffer is None or self.buffer.size < nbytes:
            usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
            self.buffer = device.create_buffer(label="page-tables", size=nbytes, usage=usage)
            self._dirty = [(0, self.top)] if self.top else []
        if self._dirty:
            queue = device.queue
            for start, end in _runs(self._dirty):
                queue.write_buffer(self.buffer, 4 * start, self.words[start:end].data.cast("B"))
                self.written_words += end - start
            self._dirty = []
        return self.buffer

    @property
    def held_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.size


def _runs(spans: list[tuple[int, int]], gap: int = 64) -> list[tuple[int, int]]:
    """``spans`` merged into sorted runs (spans less than ``gap`` words apart join:
    one write of a few unchanged words costs less than another write call)."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


class PagePools:
    """Every layout's pool on one device (owned by the engine), and the page
    tables of all their layers (``tables``; at most ``max_table_bytes``, the
    adapter's binding limit, since every kernel binds them whole)."""

    def __init__(self, page_tokens: int, max_slab_bytes: int, max_table_bytes: int | None = None):
        self.page_tokens = check_page_tokens(page_tokens)
        self.max_slab_bytes = int(max_slab_bytes)
        self.tables = PageTables(max_table_bytes or max_slab_bytes)
        self._pools: dict[PageLayout, PagePool] = {}

    def get(self, layout: PageLayout) -> PagePool:
        pool = self._pools.get(layout)
        if pool is None:
            pool = self._pools[layout] = PagePool(layout, self.page_tokens, self.max_slab_bytes, self.tables)
        return pool

    def settle(self) -> None:
        for pool in self._pools.values():
            pool.settle()
        self.tables.settle()

    @property
    def held_bytes(self) -> int:
        return sum(p.held_bytes for p in self._pools.values()) + self.tables.held_bytes

    def describe(self) -> dict[str, Any]:
        return {
            "page_tokens": self.page_tokens,
            "page_table_bytes": self.tables.held_bytes,
            "pools": [
                {
                    "kv_format": l.kv_format,
                    "num_kv_heads": l.n_kv_heads,
                    "head_dim": l.head_dim,
                    "slabs": len(p.slabs),
                    "pages": sum(s.pages for s in p.slabs),
                    "used_pages": p.used_pages,
                    "bytes": p.held_bytes,
                }
                for l, p in list(self._pools.items())  # read from the event loop: a copy
            ],
        }
