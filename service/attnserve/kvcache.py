"""A session's layers as page tables over the paged KV pool (``pool.py``).

``LayerCache`` is one layer of one session: its length and the pages of its pool
slab that hold timesteps ``0 .. length-1`` (page ``i`` holds ``i*P .. i*P+P-1``).
An append takes pages as it needs them (nothing is copied to grow); the kernels
read through the page table (``gpu/kernels.py``). Every method that touches the
device (``plan_*``, ``read_words``, ``load_words``, ``release``) runs on the GPU
owner thread; the sizing methods (``bytes_for``, ``fork_bytes``) are pure and
safe anywhere, which is how the service checks capacity and memory budgets
*before* it queues any work.

Snapshots keep the contiguous layout of the first format (a cache of ``capacity``
rows, ``pool.PageLayout``): ``read_words`` gathers the pages into it and
``load_words`` scatters it into pages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union, cast

import numpy as np
import wgpu

from .gpu.batch import PHASE_WRITE, Batch, Items, Resource, Seg, whole
from .gpu import kernels as K
from .gpu.step_plan import PlanBasis, PlanEvent, StepPlan, StepPlans
from .pool import (
    DirectCopies, PageLayout, PagePool, PagePools, PoolFull, Slab, TableRegion, copy_host_rows, copy_rows,
)  # fmt: skip
from .formats import PLAIN_DTYPES, check_head_dim, is_plain
from .turboquant import layer_signs_bytes

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "LayerCache",
    "PlainLayerCache",
    "TurboQuantLayerCache",
    "WindowedLayerCache",
    "bytes_growth",
    "SessionConfig",
    "layer_formats",
    "SessionKV",
]


# What LayerCache.state gives and restore takes back: opaque to its callers (a
# windowed layer's holds its exact rows' caches' states too)
LayerState = tuple[Any, ...]
# A windowed layer's parameters, as columns (arrays) or one layer's (a scalar)
IntArray = Union[np.ndarray, np.int64]


class OutOfRange(ValueError):
    """An item's query rows fall outside its layer: refused before it is queued, so
    only an engine's own caller (a tool, a test) gets this far."""


def _no_event(event: str, reason: str, layer: int) -> None:
    """A :data:`PlanEvent` nobody hears (an engine's direct caller's steps)."""


class LayerCache:
    """One layer of one session: a page table into its format's pool."""

    def __init__(self, *, pool: PagePool, max_tokens: int, layer: int = 0):
        layout = pool.layout
        check_head_dim(layout.kv_format, layout.head_dim)
        self.kv_format = layout.kv_format
        self.pool = pool
        self.n_kv_heads = layout.n_kv_heads
        self.head_dim = layout.head_dim
        self.max_tokens = max_tokens
        self.layer = layer
        # whether a later layer of its session has its format: a stacked step's plan
        # recorded on it may be replayed there (SessionKV sets it; plan_stacked)
        self.format_follows = False
        self.length = 0
        self.slab: Slab | None = None
        self.pages: list[int] = []
        self.paid_pages = 0  # of its pages, those it pays for (the pool keeps it: pool.Holder)
        # where its page table is on the GPU (pool.PageTables) and the page list whose
        # entries are there (every change assigns a new list: never changed in place)
        self._region: TableRegion | None = None
        self._synced: list[int] = self.pages

    # ── sizing (pure) ───────────────────────────────────────────────────────

    @property
    def page_tokens(self) -> int:
        return self.pool.page_tokens

    @property
    def capacity(self) -> int:
        """Timesteps the layer's pages hold."""
        return len(self.pages) * self.pool.page_tokens

    def bytes_for(self, capacity: int) -> int:
        """GPU bytes of the pages holding ``capacity`` timesteps."""
        return self.pool.pages_for(capacity) * self.pool.page_bytes

    def fork_bytes(self, length: int) -> int:
        """GPU bytes a fork of this layer's first ``length`` timesteps is charged
        beyond what it shares: its partly filled last page, copied."""
        return self.bytes_for(length % self.pool.page_tokens)

    def buffer_bytes(self, capacity: int) -> tuple[int, int]:
        """K and V bytes of ``capacity`` rows in the contiguous (snapshot) layout."""
        return self.pool.layout.buffer_bytes(capacity)

    @property
    def nbytes(self) -> int:
        """GPU bytes this layer is charged for: the pages it pays for (a page shared
        with a fork is paid by one of its holders: the one that took it, then the
        next when that one lets it go)."""
        return self.paid_pages * self.pool.page_bytes

    # ── device work (GPU owner thread) ──────────────────────────────────────

    def state(self) -> LayerState:
        """What planning may change: restore it with :meth:`restore` when a job
        that already planned into this layer fails (its ops are rolled back; the
        pool takes its pages back through the batch's own undo). ``pages`` is kept
        by reference: the layer only ever replaces its list, never changes it."""
        return (self.length, self.slab, self.pages)

    def restore(self, state: LayerState) -> None:
        self.length, self.slab, self.pages = state

    def _ensure_pages(self, batch: Batch, new_length: int) -> None:
        if new_length > self.max_tokens:
            from .errors import CapacityExceeded

            raise CapacityExceeded(
                f"appending to length {new_length} passes max_tokens {self.max_tokens}",
                length=self.length,
                max_tokens=self.max_tokens,
            )
        need = self.pool.pages_for(new_length) - len(self.pages)
        if need <= 0:
            return
        try:
            slab, pages = self.pool.take(batch, batch.device, self.slab, need, self)
        except PoolFull:
            self._move(batch, need)
            return
        batch.on_rollback(lambda: self.pool.untake(slab, pages))
        self.slab = slab
        self.pages = self.pages + pages

    def _move(self, batch: Batch, more: int) -> None:
        """The layer's slab is full and at its largest: move every page to a slab
        with room for ``more`` besides (the one copy of a layer's rows)."""
        pool, old_slab, old = self.pool, self.slab, self.pages
        assert old_slab is not None  # pool.take raises PoolFull only for a layer's own slab
        slab, pages = pool.take(batch, batch.device, None, len(old) + more, self, exclude=old_slab)
        batch.on_rollback(lambda: pool.untake(slab, pages))
        # its appends earlier in this batch are deferred writes into the old slab: the
        # copy runs after them and before the writes deferred from now on
        batch.defer(PHASE_WRITE, object(), None, lambda b, _: pool.copy_pages(b, old_slab, old, slab, pages))
        batch.write_epoch += 1
        pool.drop(old_slab, old, self)
        batch.on_rollback(lambda: pool.share(old_slab, old, self))
        self.slab, self.pages = slab, pages

    def table_offset(self, batch: Batch) -> int:
        """The word offset of the layer's page table, as it is now, in the page tables
        the batch binds (``whole("tables")``). Only what changed since the table was
        last written goes to the GPU: the entries of new pages, into the layer's
        region; a table changed otherwise (a move, a restore, a fork) is written whole
        into a new region, and the old one stays as it was for the attends planned
        before (``pool.PageTables``)."""
        tables = self.pool.tables
        batch.attach("tables", tables.sync)
        pages, old, region = self.pages, self._synced, self._region
        if pages is old and region is not None:
            return region.offset
        batch.on_rollback(functools.partial(self._restore_table, region, old))
        n_old = len(old)
        if region is not None and n_old <= len(pages) <= region.size and pages[:n_old] == old:
            tables.write(region.offset + n_old, pages[n_old:])
        else:
            new = tables.take(len(pages), batch.on_rollback)
            tables.write(new.offset, pages)
            if region is not None:
                tables.drop(region, batch.on_rollback)
            self._region = region = new
        self._synced = pages
        return region.offset

    def _restore_table(self, region: "TableRegion | None", synced: list[int]) -> None:
        self._region, self._synced = region, synced

    #: The dtype of the rows an append uploads (the k, v arrays are converted to it).
    row_dtype = "<f4"

    def upload_rows(self, batch: Batch, k: np.ndarray, v: np.ndarray) -> tuple[Seg, Seg]:
        """Rows ``k, v [n, Hkv, d]`` uploaded as an append of this layer takes them
        (``row_dtype``)."""
        ks, vs = (batch.upload(np.ascontiguousarray(a, self.row_dtype)) for a in (k, v))
        return ks, vs

    def plan_append(self, batch: Batch, k: np.ndarray, v: np.ndarray) -> int:
        """Record the append of rows ``[n, Hkv, d]``; returns the new length."""
        return self.plan_append_rows(batch, *self.upload_rows(batch, k, v), k.shape[0])

    def plan_append_rows(self, batch: Batch, k: Seg, v: Seg, n: int) -> int:
        """Record the append of ``n`` uploaded rows (``row_dtype``, ``[n, Hkv, d]``);
        returns the new length."""
        raise NotImplementedError

    def _call_done(self, batch: Batch) -> None:
        """The layer's call (an append, or an attend after its fused append) is
        planned (a windowed layer lets its older exact rows go)."""

    def _append(
        self, batch: Batch, n_rows: K.IntColumn, t0: K.IntColumn, k_off: K.IntColumn, v_off: K.IntColumn
    ) -> K.Append:
        """This layer's append of uploaded rows (word offsets in the input arena), as
        the one entry of an :class:`~attnserve.gpu.kernels.Append`."""
        table = (self.table_offset(batch),)
        slab = self.slab
        assert slab is not None  # _ensure_pages took the pages of its rows (n >= 1)
        return K.Append(
            self.kv_format, slab, self.pool.page_shift, self.n_kv_heads, self.head_dim,
            n_rows, t0, k_off, v_off, table, self.sign_words(batch, [self]),
        )  # fmt: skip

    @staticmethod
    def sign_words(batch: Batch, layers: Sequence["LayerCache"]) -> Sequence[int]:
        """Where each of ``layers``' rotation signs are in the batch's input arena
        (word offsets; plain layers have none)."""
        return ()

    @staticmethod
    def plan_split_attends(batch: Batch, a: K.Attends, kv_format: str) -> None:
        """Queue split-KV attends over layers of this kind (``a``: plain queries)."""
        K.plan_split(batch, a, kv_format)

    @staticmethod
    def plan_stacked(
        batch: Batch,
        layers: Sequence["LayerCache"],
        items: np.ndarray,
        q: Items | None,
        out: Items | None,
        rows: tuple[Items, Items, int] | None,
        shape: tuple[int, ...],
        start_pos: np.ndarray,
        causal: bool,
        scale: float,
        plans: StepPlans | None = None,
        plan_event: PlanEvent = _no_event,
    ) -> np.ndarray:
        """Plan the attends of a stacked step's items ``items`` on ``layers`` (one
        each: distinct layers of one pool and kind, every attend on the split path) as
        columns, after their fused appends of ``rows`` ``(k, v, m)`` if any: item
        ``i``'s queries ``q.seg(i)`` ``[n, H, d]`` (``shape``) into ``out.seg(i)``, from
        ``start_pos[i]`` (-1: ``length - n``). The group's pages are taken and its page
        tables brought up to date on the GPU (each layer's new entries only: the
        tables stay there between batches, ``pool.PageTables``); its writes and
        attends join the batch's deferred kernels as one entry each per slab; or,
        where ``plans`` (its sessions' plans) holds its step's plan made on an
        earlier layer from the same basis, that plan is run with these layers' page
        tables (``gpu/step_plan.py``; ``plan_event`` hears what became of it). Returns
        the length each item attends over (``q`` None: appends alone, planned as
        columns; the new lengths). Raises (ValueError, CapacityExceeded) where
        one item alone would; the caller then plans the items one by one, so the
        columns never decide an item's problem. Atomic: on rollback every layer is
        put back."""
        kind = type(layers[0])  # the methods of the layers' own kind
        saved = [layer.state() for layer in layers]

        def restore_all() -> None:
            for layer, st in zip(layers, saved):
                layer.restore(st)

        batch.on_rollback(restore_all)
        if q is None:  # appends alone: each layer's call is its append
            assert rows is not None
            after, where = kind._take_columns(batch, layers, items, rows)
            kind._write_columns(batch, layers, where, items, rows, after - rows[2])
            kind._columns_done(batch, layers)
            return after
        assert out is not None  # an attend's queries come with its outputs
        # the layers' state first (pages, page tables, signs, lengths, what their
        # attends read); then the commands
        if rows is None:
            after, where = (
                np.fromiter((layer.length for layer in layers), np.int64, len(layers)),
                _Where.of(batch, layers),
            )
        else:
            after, where = kind._take_columns(batch, layers, items, rows)
        sp = _start_positions(start_pos, after, shape[0])
        where = kind._attend_state(batch, layers, where, sp)
        # the step's plan run where an earlier layer of its sessions made it; else the
        # commands planned, and recorded as the plan where a later layer of its
        # sessions may run it (not a session's last layer of the format)
        recorded, basis, follows = None, None, any(layer.format_follows for layer in layers)
        group, layer_no = (id(layers[0].pool), kind), layers[0].layer
        if plans is not None:
            if not batch.deferring:  # (deferred kernels come first: nothing to run or record)
                basis = where.basis(batch, layers, items, q, out, rows, shape, after, sp, causal, scale)
            recorded = plans.find(group, layer_no, basis, plan_event)
        if recorded is not None:
            batch.replay(recorded, where.tables())
        else:
            recording = basis is not None and follows and batch.record()
            try:
                if rows is not None:
                    kind._write_columns(batch, layers, where, items, rows, after - rows[2])
                kind._attend_columns(batch, layers, where, items, q, out, shape, after, sp, causal, scale)
            except BaseException:
                if recording:
                    batch.abandon_recording()
                raise
            if plans is not None and follows:
                made = batch.recorded(where.tables(), where.placeholders()) if recording else None
                why = "" if made else "unrecordable" if recording else "deferred" if basis is None else "shared_batch"
                plans.keep(group, StepPlan(layer_no, basis, made, why), plan_event)
        kind._columns_done(batch, layers)
        return after

    @classmethod
    def _take_columns(
        cls, batch: Batch, layers: Sequence[Self], items: np.ndarray, rows: tuple[Items, Items, int]
    ) -> tuple[np.ndarray, _Where]:
        """The state of an append of ``rows`` ``(k, v, m)``' item ``items[i]`` (``m``
        rows) to ``layers[i]`` (distinct layers of one pool and kind): the pages they
        need taken, where they are then (:class:`_Where`), their new lengths (set,
        and returned). Its writes are :meth:`_write_columns`."""
        pool, m = layers[0].pool, rows[2]
        before = np.fromiter((layer.length for layer in layers), np.int64, len(layers))
        after = before + m
        past = after > np.fromiter((layer.max_tokens for layer in layers), np.int64, len(layers))
        if past.any():  # refused before it was queued; here only an engine's caller can get this far
            i = int(np.flatnonzero(past)[0])
            layers[i]._ensure_pages(batch, int(after[i]))  # raises CapacityExceeded
        held = np.fromiter((len(layer.pages) for layer in layers), np.int64, len(layers))
        for i in np.flatnonzero((after + pool.page_tokens - 1) >> pool.page_shift > held).tolist():
            layers[i]._ensure_pages(batch, int(after[i]))
        where = _Where.of(batch, layers)
        for layer, length in zip(layers, after.tolist()):
            layer.length = length
        return after, where

    @classmethod
    def _write_columns(
        cls,
        batch: Batch,
        layers: Sequence[Self],
        where: _Where,
        items: np.ndarray,
        rows: tuple[Items, Items, int],
        before: np.ndarray,
    ) -> None:
        """The writes of :meth:`_take_columns`' append: ``rows`` ``(k, v, m)``' item
        ``items[i]`` at timestep ``before[i]`` of ``layers[i]``, one deferred entry
        per slab."""
        first, (k, v, m) = layers[0], rows
        for idx in where.parts:
            K.plan_append(batch, K.Append(
                first.kv_format, where.slabs[idx[0]], first.pool.page_shift, first.n_kv_heads, first.head_dim,
                np.full(len(idx), m), before[idx], _words(k, items[idx]), _words(v, items[idx]),
                where.table_off[idx], where.signs_of(idx),
            ))  # fmt: skip

    @classmethod
    def _attend_state(cls, batch: Batch, layers: Sequence[Self], where: _Where, start_pos: np.ndarray) -> _Where:
        """Where the attends of :meth:`plan_stacked` (from ``start_pos``) read besides
        ``where`` says (a windowed layer's exact rows), brought up to date."""
        return where

    @classmethod
    def _columns_done(cls, batch: Batch, layers: Sequence[Self]) -> None:
        """:meth:`plan_stacked`'s commands are planned (a windowed layer's call is done)."""

    @classmethod
    def _attend_columns(
        cls,
        batch: Batch,
        layers: Sequence[Self],
        where: _Where,
        items: np.ndarray,
        q: Items,
        out: Items,
        shape: tuple[int, ...],
        length: np.ndarray,
        start_pos: np.ndarray,
        causal: bool,
        scale: float,
    ) -> None:
        """The split attends of :meth:`plan_stacked` (``start_pos`` resolved), one
        entry per slab."""
        first = layers[0]
        for idx in where.parts:
            cls.plan_split_attends(batch, K.Attends(
                whole("in"), whole("out"), where.slabs[idx[0]], first.pool.page_shift, shape[0], shape[1],
                first.n_kv_heads, first.head_dim, causal, scale, length[idx], start_pos[idx],
                _words(q, items[idx]), _words(out, items[idx]), where.table_off[idx], where.signs_of(idx),
            ), first.kv_format)  # fmt: skip

    def attends_split(self, policy: K.KernelPolicy, n_queries: int, n_heads: int) -> bool:
        """Whether an attend of ``n_queries`` rows of ``n_heads`` heads on this layer
        takes the split kernels (what :meth:`plan_stacked` plans as columns)."""
        return policy.path(self.kv_format, n_queries, n_heads, self.n_kv_heads, self.head_dim) == "split"

    def _attend(
        self,
        batch: Batch,
        q: Resource,
        shape: tuple[int, ...],
        out: Resource,
        length: int,
        start_pos: int,
        causal: bool,
        scale: float,
    ) -> K.Attend:
        n, h, d = shape
        if self.slab is None or length > self.capacity:
            raise OutOfRange(f"attend over {length} timesteps of a layer holding {self.length}")
        return K.Attend(
            q, out, self.slab, self.table_offset(batch), self.pool.page_shift,
            n, h, self.n_kv_heads, d, length, start_pos, causal, scale,
        )  # fmt: skip

    def plan_attend_rows(
        self,
        batch: Batch,
        q: Seg,
        shape: tuple[int, ...],
        *,
        out: Resource,
        length: int,
        start_pos: int,
        causal: bool,
        scale: float,
    ) -> None:
        """Attention for uploaded queries ``q`` of ``shape = (n, H, d)`` over the
        first ``length`` timesteps, into ``out`` (a segment or a buffer); the
        kernel family is chosen by the batch's ``policy`` (``gpu.kernels.KernelPolicy``)."""
        raise NotImplementedError

    def _read_rows(self, device: wgpu.GPUDevice, first: int, counts: list[int]) -> tuple[memoryview, memoryview]:
        """Rows of pages ``first, first+1, ...`` (``counts[i]`` rows of each, from its
        start) read back in the contiguous layout of ``len(counts) * P`` rows; the
        rows not read are zero."""
        P, layout, slab = self.pool.page_tokens, self.pool.layout, self.slab
        assert slab is not None  # the layer holds the pages read
        cap = len(counts) * P
        usage = wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        k, v = (device.create_buffer(size=n, usage=usage) for n in layout.buffer_bytes(cap))
        copies = DirectCopies(device)
        for i, n in enumerate(counts):
            if n > 0:
                src = (slab.k, slab.v, slab.rows, self.pages[first + i] * P)
                copy_rows(copies, layout, src, (k, v, cap, i * P), n)
        copies.run()
        try:
            return device.queue.read_buffer(k), device.queue.read_buffer(v)
        finally:
            k.destroy()
            v.destroy()

    def read_words(self, device: wgpu.GPUDevice) -> tuple[bytes, bytes]:
        """The layer's K and V in the contiguous layout of ``capacity`` rows (snapshots);
        the rows past ``length`` are zero (a reused page may still hold a deleted
        session's rows past them)."""
        if not self.pages:
            return b"", b""
        P = self.pool.page_tokens
        kb, vb = self._read_rows(device, 0, [min(P, self.length - i * P) for i in range(len(self.pages))])
        return bytes(kb), bytes(vb)

    def read_pages(self, device: wgpu.GPUDevice, first: int, count: int) -> list[tuple[bytes, bytes]]:
        """Pages ``first .. first+count-1`` of the layer, each as ``(k, v)`` bytes in the
        contiguous layout of ``P`` rows (the journal's page records)."""
        P, layout = self.pool.page_tokens, self.pool.layout
        kall, vall = self._read_rows(device, first, [P] * count)
        # copy_host_rows only slices its sources: memoryviews read as bytes do
        ksrc, vsrc = cast(bytes, kall), cast(bytes, vall)
        out = []
        for i in range(count):
            kb, vb = (bytearray(n) for n in layout.buffer_bytes(P))
            copy_host_rows(layout, (ksrc, vsrc, count * P, i * P), (kb, vb, P, 0), P)
            out.append((bytes(kb), bytes(vb)))
        return out

    def load_words(self, device: wgpu.GPUDevice, length: int, capacity: int, kb: bytes, vb: bytes) -> None:
        """Restore what :meth:`read_words` gave (any ``capacity >= length``) into pages."""
        self.release()
        if capacity:
            want = self.pool.layout.buffer_bytes(capacity)
            if (len(kb), len(vb)) != want:
                raise ValueError(f"cache bytes {len(kb)}/{len(vb)} do not match capacity {capacity}")
        if not length:
            return
        pool, P = self.pool, self.pool.page_tokens
        copies = DirectCopies(device)
        slab, pages = pool.take(copies, device, None, pool.pages_for(length), self)
        copies.run()  # a slab's growth copy lands before the writes below
        self.slab, self.pages = slab, pages
        rows = slab.rows
        for i, page in enumerate(pages):
            n = min(P, length - i * P)
            (sk, sv), (dk, dv) = pool.layout.row_ranges(capacity, i * P, n), pool.layout.row_ranges(rows, page * P, n)
            for src, buf, dst_ranges, src_ranges in ((kb, slab.k, dk, sk), (vb, slab.v, dv, sv)):
                for (so, size), (do, _) in zip(src_ranges, dst_ranges):
                    device.queue.write_buffer(buf, do, memoryview(src)[so : so + size])
        self.length = length

    def fork_from(self, device: wgpu.GPUDevice, src: "LayerCache", length: int) -> None:
        """Become ``src``'s first ``length`` timesteps (run alone on the GPU thread):
        share its full pages (rows are append-only, so a full page is never written
        again and no shared page is ever copied later) and copy the rows of a partial
        last page into a page of its own. If ``src``'s slab has no page left, the
        fork takes its pages in another slab and copies them all."""
        if length > src.length:
            from .errors import OffsetMismatch

            raise OffsetMismatch(
                f"cannot fork layer {src.layer} at length {length}: it holds {src.length}", length=src.length
            )
        self.release()
        if not length:
            return
        pool, P = self.pool, self.pool.page_tokens
        full, part = divmod(length, P)
        copies = DirectCopies(device)
        src_slab = src.slab
        assert src_slab is not None  # src holds length >= 1 timesteps
        slab, pages = src_slab, list(src.pages[:full])
        if part:
            try:
                _, own = pool.take(copies, device, slab, 1, self)
            except PoolFull:
                slab, own = pool.take(copies, device, None, full + 1, self, exclude=src_slab)
                pages, own = own[:full], own[full:]
                pool.copy_pages(copies, src_slab, src.pages[:full], slab, pages)  # no room to share: its own copy
            copy_rows(copies, pool.layout, (src_slab.k, src_slab.v, src_slab.rows, src.pages[full] * P),
                      (slab.k, slab.v, slab.rows, own[0] * P), part)  # fmt: skip
            if slab is src_slab:
                pool.share(slab, pages, self)
            pages += own
        else:
            pool.share(slab, pages, self)
        copies.run()
        self.slab, self.pages, self.length = slab, pages, length

    def read_exact(self, device: wgpu.GPUDevice) -> dict[str, Any] | None:
        """The rows a layer keeps exactly beside its cache, as a snapshot keeps them
        (``snapshot_format``'s ``exact`` member); None: it keeps none."""
        return None

    def load_exact(self, device: wgpu.GPUDevice, exact: dict[str, Any] | None) -> None:
        """Restore what :meth:`read_exact` gave (after :meth:`load_words`)."""

    def drop_front(self, batch: Batch, pages: int) -> None:
        """Let the layer's first ``pages`` pages go (their timesteps are read no more):
        its timestep 0 becomes what was timestep ``pages * P`` (the caller keeps that
        offset). The pages are freed after the batch (``PagePool.drop``): an attend
        planned before in the same batch still reads them."""
        if pages <= 0:
            return
        slab, gone = self.slab, self.pages[:pages]
        assert slab is not None
        self.pool.drop(slab, gone, self)
        batch.on_rollback(lambda: self.pool.share(slab, gone, self))
        self.pages = self.pages[pages:]
        self.length -= pages * self.pool.page_tokens

    def release(self) -> None:
        if self.pages:
            assert self.slab is not None  # its pages are in it
            self.pool.drop(self.slab, self.pages, self)
        if self._region is not None:
            self.pool.tables.drop(self._region)
        self.slab, self.pages, self.length = None, [], 0
        self._region, self._synced = None, self.pages


class PlainLayerCache(LayerCache):
    """Plain K/V (``f32``; ``f16`` or ``bf16``: the rows rounded to the layer's
    dtype, ``row_dtype``, as numpy and ``wire.to_bfloat16`` round, by the convert
    kernel before they are written, or uploaded as sent when they come in it): slab
    row ``r`` at ``r * kv_dim`` elements (``kv_dim = Hkv * d``)."""

    def __init__(self, *, pool: PagePool, max_tokens: int, layer: int = 0):
        super().__init__(pool=pool, max_tokens=max_tokens, layer=layer)
        self.row_dtype = PLAIN_DTYPES[self.kv_format]  # the format's own (its kv_format never changes)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def plan_append_rows(self, batch: Batch, ks: Seg, vs: Seg, n: int) -> int:
        self._ensure_pages(batch, self.length + n)
        K.plan_append(batch, self._append(batch, (n,), (self.length,), (ks.offset // 4,), (vs.offset // 4,)))
        self.length += n
        return self.length

    def plan_attend_rows(
        self,
        batch: Batch,
        q: Seg,
        shape: tuple[int, ...],
        *,
        out: Resource,
        length: int,
        start_pos: int,
        causal: bool,
        scale: float,
    ) -> None:
        a = self._attend(batch, q, shape, out, length, start_pos, causal, scale)
        K.plan_attend_plain(batch, a, self.kv_format)


class TurboQuantLayerCache(LayerCache):
    """TurboQuant K/V words (``turboquant`` and its variants, ``formats.TQ_SPECS``) in
    the layout of ``shaders/tqx.wgsl``, in pool slabs."""

    def __init__(self, *, seed: int, **kw: Any):
        super().__init__(**kw)
        self.seed = seed

    @property
    def _signs_key(self) -> tuple[str, int, int, int]:
        return ("signs", self.seed, self.layer, self.head_dim)

    def signs(self, batch: Batch) -> Seg:
        """This layer's rotation signs, uploaded once per batch."""
        return batch.upload_once(self._signs_key, layer_signs_bytes(self.seed, self.layer, self.head_dim))

    @staticmethod
    def sign_words(batch: Batch, layers: Sequence[LayerCache]) -> Sequence[int]:
        keys = [layer._signs_key for layer in cast("Sequence[TurboQuantLayerCache]", layers)]
        segs = batch.upload_once_each(keys, lambda key: layer_signs_bytes(*key[1:]))
        return [seg.offset // 4 for seg in segs]

    @staticmethod
    def plan_split_attends(batch: Batch, a: K.Attends, kv_format: str) -> None:
        K.plan_split_turboquant(batch, a, kv_format)

    def plan_append_rows(self, batch: Batch, ks: Seg, vs: Seg, n: int) -> int:
        self._ensure_pages(batch, self.length + n)
        K.plan_append(batch, self._append(batch, (n,), (self.length,), (ks.offset // 4,), (vs.offset // 4,)))
        self.length += n
        return self.length

    def plan_attend_rows(
        self,
        batch: Batch,
        q: Seg,
        shape: tuple[int, ...],
        *,
        out: Resource,
        length: int,
        start_pos: int,
        causal: bool,
        scale: float,
    ) -> None:
        a = self._attend(batch, q, shape, out, length, start_pos, causal, scale)
        K.plan_attend_turboquant(batch, a, K.TqLayer(self.signs(batch), self.kv_format))


class WindowedLayerCache(TurboQuantLayerCache):
    """A TurboQuant layer that also keeps rows exactly (issue 27): its first
    ``sinks`` timesteps, and a recent ``window``. Every row is encoded into the
    codes as it arrives and also written as sent (float32, plain pages of
    ``exact_pool``): the first ``sinks`` into ``head``, every row into ``recent``.
    An attend whose first query row sits at ``p`` reads timesteps ``[0, sinks)`` and
    ``[exact_from(p), length)`` exactly and the band between them from the codes
    (``reference.windowed_attention``), with ``exact_from(p) = max(sinks, p + 1 -
    window, held_from)`` (``reference.exact_from``): its window, and all the rows
    appended in its own call. When a call is done, the layer holds its last
    ``window`` rows (``held_from = length - window``) and lets the older pages of
    ``recent`` go: between calls the exact rows are the sinks and at most ``window``
    plus a page. Always the split path (``kernels.plan_split_windowed``)."""

    def __init__(self, *, sinks: int, window: int, exact_pool: PagePool, **kw: Any):
        super().__init__(**kw)
        self.sinks, self.window = sinks, window
        self.head = PlainLayerCache(pool=exact_pool, max_tokens=sinks, layer=self.layer) if sinks else None
        self.recent = PlainLayerCache(pool=exact_pool, max_tokens=self.max_tokens, layer=self.layer)
        self.recent_base = 0  # the timestep of recent's row 0 (its dropped pages' rows before it)
        self.held_from = 0  # exact rows older than this are read from the codes

    def attends_split(self, policy: K.KernelPolicy, n_queries: int, n_heads: int) -> bool:
        return True  # always (kernels.plan_split_windowed)

    def exact_from(self, start_pos: int) -> int:
        """The first timestep past the sinks an attend from ``start_pos`` reads exactly
        (``reference.exact_from``; ``max_tokens``: none)."""
        return int(exact_from(*map(np.int64, (self.sinks, self.window, self.held_from, self.max_tokens, start_pos))))

    def _exact_pages(self, capacity: int) -> int:
        return int(exact_pages(np.int64(self.sinks), np.int64(self.window), np.int64(capacity), self.page_tokens))

    @property
    def nbytes(self) -> int:
        """The codes' pages and the most exact rows' pages the layer holds between calls
        (what it is charged; a call's own rows are held exactly only while it runs)."""
        return super().nbytes + self._exact_pages(self.capacity) * self.recent.pool.page_bytes

    def bytes_for(self, capacity: int) -> int:
        return super().bytes_for(capacity) + self._exact_pages(capacity) * self.recent.pool.page_bytes

    def fork_bytes(self, length: int) -> int:
        """The codes' copied page, and the exact rows' pages as the fork is charged for
        them (:attr:`nbytes`: at its capacity)."""
        copied = LayerCache.bytes_for(self, length % self.pool.page_tokens)  # the codes' alone
        capacity = self.pool.pages_for(length) * self.pool.page_tokens
        return copied + self._exact_pages(capacity) * self.recent.pool.page_bytes

    def state(self) -> LayerState:
        return (
            super().state(), self.head.state() if self.head else None, self.recent.state(),
            self.recent_base, self.held_from,
        )  # fmt: skip

    def restore(self, state: LayerState) -> None:
        own, head, recent, self.recent_base, self.held_from = state
        super().restore(own)
        if self.head:
            self.head.restore(head)
        self.recent.restore(recent)

    def plan_append(self, batch: Batch, k: np.ndarray, v: np.ndarray) -> int:
        length = super().plan_append(batch, k, v)
        self._call_done(batch)  # an append alone is a call
        return length

    def plan_append_rows(self, batch: Batch, ks: Seg, vs: Seg, n: int) -> int:
        before = self.length
        super().plan_append_rows(batch, ks, vs, n)
        row = self.n_kv_heads * self.head_dim * 4  # bytes of one float32 row as uploaded
        if self.head and before < self.sinks:
            m = min(self.sinks, before + n) - before
            self.head.plan_append_rows(batch, Seg(ks.arena, ks.offset, m * row), Seg(vs.arena, vs.offset, m * row), m)
        if self.window:
            self.recent.plan_append_rows(batch, ks, vs, n)
        return self.length

    def plan_attend_rows(
        self,
        batch: Batch,
        q: Seg,
        shape: tuple[int, ...],
        *,
        out: Resource,
        length: int,
        start_pos: int,
        causal: bool,
        scale: float,
    ) -> None:
        a = K.Attends.of(
            self._attend(batch, q, shape, out, length, start_pos, causal, scale), self.sign_words(batch, [self])
        )
        head, recent = self.head, self.recent
        head_slab = head.slab if head is not None else None
        has_head, has_recent = head_slab is not None, recent.slab is not None
        x = K.ExactRows(
            recent.kv_format,
            head_slab,
            recent.slab if has_recent else None,
            (self.sinks if has_head else 0,),
            (head.table_offset(batch) if head is not None and has_head else 0,),
            (self.exact_from(start_pos),),
            (self.recent_base,),
            (recent.table_offset(batch) if has_recent else 0,),
        )
        K.plan_split_windowed(batch, a, self.kv_format, x)
        self._call_done(batch)

    @classmethod
    def _take_columns(
        cls, batch: Batch, layers: Sequence[Self], items: np.ndarray, rows: tuple[Items, Items, int]
    ) -> tuple[np.ndarray, _Where]:
        """The codes' append (as any TurboQuant layer's), the sinks' (written one by
        one: only the first ``sinks`` timesteps of a layer write them) and the recent
        rows' (every layer with a window, one plain append of their own: in
        ``where.recent``)."""
        after, where = super()._take_columns(batch, layers, items, rows)
        k, v, m = rows
        before = after - m
        sinking = np.flatnonzero(before < np.fromiter((layer.sinks for layer in layers), np.int64, len(layers)))
        for i in sinking.tolist():
            layer = layers[i]
            head = layer.head
            assert head is not None  # a layer with sinks has their cache
            n = min(layer.sinks, int(after[i])) - int(before[i])
            ks, vs = k.seg(int(items[i])), v.seg(int(items[i]))
            row = ks.size // m  # bytes of one row as uploaded
            head.plan_append_rows(batch, Seg(ks.arena, ks.offset, n * row), Seg(vs.arena, vs.offset, n * row), n)
        windowed = np.asarray([i for i, layer in enumerate(layers) if layer.window], np.int64)
        if len(windowed):
            recents = [layers[i].recent for i in windowed.tolist()]
            r_after, r_where = type(recents[0])._take_columns(batch, recents, items[windowed], rows)
            where = dataclasses.replace(where, recent=_Recent(windowed, recents, r_after, r_where))
        return after, where

    @classmethod
    def _write_columns(
        cls,
        batch: Batch,
        layers: Sequence[Self],
        where: _Where,
        items: np.ndarray,
        rows: tuple[Items, Items, int],
        before: np.ndarray,
    ) -> None:
        super()._write_columns(batch, layers, where, items, rows, before)
        r = where.recent
        if r is not None:
            type(r.caches[0])._write_columns(batch, r.caches, r.where, items[r.index], rows, r.after - rows[2])

    @classmethod
    def _attend_state(cls, batch: Batch, layers: Sequence[Self], where: _Where, start_pos: np.ndarray) -> _Where:
        """Each layer's sinks and recent rows (``where.exact``): their slabs and page
        tables (brought up to date), and from which timestep on its attend reads
        exactly (:meth:`exact_from`, as columns)."""
        count = len(layers)
        heads = [layer.head if layer.head is not None and layer.head.slab is not None else None for layer in layers]
        recents = [layer.recent if layer.recent.slab is not None else None for layer in layers]
        sinks, window, held_from, max_tokens = (
            np.fromiter((getattr(layer, name) for layer in layers), np.int64, count)
            for name in ("sinks", "window", "held_from", "max_tokens")
        )
        exact = _Exact(
            heads,
            recents,
            np.where([head is not None for head in heads], sinks, 0),
            exact_from(sinks, window, held_from, max_tokens, start_pos),
            np.fromiter((layer.recent_base for layer in layers), np.int64, count),
            np.fromiter((h.table_offset(batch) if h else 0 for h in heads), np.int64, count),
            np.fromiter((r.table_offset(batch) if r else 0 for r in recents), np.int64, count),
            _by_value(
                [
                    (id(where.slabs[i]), id(h and h.slab), id(r and r.slab))
                    for i, (h, r) in enumerate(zip(heads, recents))
                ]
            ),
        )
        return dataclasses.replace(where, exact=exact)

    @classmethod
    def _attend_columns(
        cls,
        batch: Batch,
        layers: Sequence[Self],
        where: _Where,
        items: np.ndarray,
        q: Items,
        out: Items,
        shape: tuple[int, ...],
        length: np.ndarray,
        start_pos: np.ndarray,
        causal: bool,
        scale: float,
    ) -> None:
        """:func:`kernels.plan_split_windowed` of every layer at once: one entry per
        slab of the codes, of the sinks and of the recent rows (``where.exact``)."""
        first, x = layers[0], where.exact
        assert x is not None
        for idx in x.groups:
            i0 = int(idx[0])
            a = K.Attends(
                whole("in"), whole("out"), where.slabs[i0], first.pool.page_shift, shape[0], shape[1],
                first.n_kv_heads, first.head_dim, causal, scale, length[idx], start_pos[idx],
                _words(q, items[idx]), _words(out, items[idx]), where.table_off[idx], where.signs_of(idx),
            )  # fmt: skip
            head, recent = x.heads[i0], x.recents[i0]
            rows = K.ExactRows(
                first.recent.kv_format, head.slab if head else None, recent.slab if recent else None,
                x.sinks[idx], x.head_table[idx], x.exact_from[idx], x.recent_base[idx], x.recent_table[idx],
            )  # fmt: skip
            K.plan_split_windowed(batch, a, first.kv_format, rows)

    @classmethod
    def _columns_done(cls, batch: Batch, layers: Sequence[Self]) -> None:
        for layer in layers:
            layer._call_done(batch)

    def _call_done(self, batch: Batch) -> None:
        """The layer's call is planned: it holds its last ``window`` rows from now on,
        and lets the pages of ``recent`` older than them go (an attend planned before
        in this batch still reads them: freed after the batch, ``PagePool.drop``)."""
        if not self.window:
            return
        self.held_from = max(self.held_from, self.length - self.window)
        gone = (self.held_from - self.recent_base) // self.recent.page_tokens
        if gone > 0:
            self.recent.drop_front(batch, gone)
            self.recent_base += gone * self.recent.page_tokens

    def read_exact(self, device: wgpu.GPUDevice) -> dict[str, Any]:
        """The exact rows as a snapshot keeps them (``snapshot_format``: the layer's
        ``exact`` member): the sinks' and the recent rows' words, where they start."""

        def rows(cache: PlainLayerCache) -> dict[str, Any]:
            kb, vb = cache.read_words(device)
            return {"length": cache.length, "capacity": cache.capacity, "k": kb, "v": vb}

        return {
            "sinks": rows(self.head) if self.head else None,
            "recent": rows(self.recent) if self.window else None,
            "recent_base": self.recent_base,
            "held_from": self.held_from,
        }

    def load_exact(self, device: wgpu.GPUDevice, exact: dict[str, Any] | None) -> None:
        """Restore what :meth:`read_exact` gave (after the codes' ``load_words``); None:
        a layer of no exact rows yet."""
        if exact is None:
            return
        for cache, rows in ((self.head, exact["sinks"]), (self.recent, exact["recent"])):
            if cache is not None and rows is not None:
                cache.load_words(device, rows["length"], rows["capacity"], rows["k"], rows["v"])
        self.recent_base, self.held_from = exact["recent_base"], exact["held_from"]

    def fork_from(self, device: wgpu.GPUDevice, src: "LayerCache", length: int) -> None:
        """``src``'s first ``length`` timesteps, codes and exact rows alike (pages
        shared as :meth:`LayerCache.fork_from` shares them): a fork at ``src``'s
        length attends as ``src`` does. A fork from before ``src``'s oldest exact
        recent row holds no window until rows are appended to it."""
        assert isinstance(src, WindowedLayerCache) and (src.sinks, src.window) == (self.sinks, self.window)
        super().fork_from(device, src, length)
        try:
            if self.head and src.head:
                self.head.fork_from(device, src.head, min(length, src.head.length))
            if self.window:
                if length >= max(src.recent_base, src.held_from):
                    self.recent.fork_from(device, src.recent, length - src.recent_base)
                    self.recent_base, self.held_from = src.recent_base, src.held_from
                else:  # recent holds nothing (released above, with the layer)
                    self.recent_base = self.held_from = length
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        super().release()
        if self.head:
            self.head.release()
        self.recent.release()


def exact_from(
    sinks: IntArray, window: IntArray, held_from: IntArray, max_tokens: IntArray, start_pos: IntArray
) -> np.ndarray:
    """The first timestep past the sinks a windowed layer's attend from ``start_pos``
    reads exactly (``reference.exact_from``; a layer without a window: ``max_tokens``,
    none), as columns."""
    return np.where(window > 0, np.maximum(np.maximum(sinks, start_pos + 1 - window), held_from), max_tokens)


def exact_pages(sinks: IntArray, window: IntArray, capacity: IntArray, page_tokens: int) -> np.ndarray:
    """Pages of exact rows a windowed layer (:class:`WindowedLayerCache`) of
    ``capacity`` timesteps holds at most between calls, as columns: the sinks', and
    the window's plus one (it starts inside a page)."""
    recent = np.where(window > 0, np.minimum(-(-window // page_tokens) + 1, capacity // page_tokens), 0)
    return recent + np.where(sinks > 0, -(-np.minimum(sinks, capacity) // page_tokens), 0)


def bytes_growth(caches: Sequence[LayerCache], capacity: np.ndarray, new_capacity: np.ndarray) -> np.ndarray:
    """``caches[i].bytes_for(new_capacity[i]) - caches[i].bytes_for(capacity[i])`` for
    every ``i``, as columns (capacities of whole pages; one page size for every pool
    of an engine)."""
    count, page = len(caches), caches[0].page_tokens
    page_bytes = np.fromiter((c.pool.page_bytes for c in caches), np.int64, count)
    growth: np.ndarray = (new_capacity - capacity) // page * page_bytes
    windowed = [i for i, c in enumerate(caches) if isinstance(c, WindowedLayerCache)]
    if windowed:
        w = cast("list[WindowedLayerCache]", [caches[i] for i in windowed])
        sinks, window = (np.fromiter((getattr(c, name) for c in w), np.int64, len(w)) for name in ("sinks", "window"))
        exact_bytes = np.fromiter((c.recent.pool.page_bytes for c in w), np.int64, len(w))
        more = exact_pages(sinks, window, new_capacity[windowed], page) - exact_pages(
            sinks, window, capacity[windowed], page
        )
        growth[windowed] += more * exact_bytes
    return growth


def _start_positions(start_pos: np.ndarray, after: np.ndarray, n: int) -> np.ndarray:
    """Each item's first query row's timestep (``-1``: its last ``n`` rows), checked
    against its layer's length."""
    sp = np.where(start_pos < 0, after - n, start_pos)
    if (sp < 0).any() or (sp + n > after).any():
        raise OutOfRange("start_pos + n rows exceeds a layer's length")
    return sp


def _by_value(keys: Sequence[object]) -> list[np.ndarray]:
    """The indices of ``keys`` grouped by value, in order of first appearance."""
    groups: dict[object, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return [np.asarray(g) for g in groups.values()]


def _words(items: Items, idx: np.ndarray) -> np.ndarray:
    """Word offsets of items ``idx`` of ``items`` in its arena."""
    return (items.base + idx * items.stride) // 4


@dataclass(frozen=True)
class _Where:
    """Where a stacked step's layers are, as columns: each one's slab, page table
    (word offset in the page tables, brought up to date) and rotation signs (word
    offset in the input arena; none for plain layers), and the layers grouped by
    slab (``parts``: indices, one array per slab); windowed layers' recent rows'
    append (``recent``) and exact rows (``exact``)."""

    slabs: list[Slab]
    table_off: np.ndarray
    signs: np.ndarray
    parts: list[np.ndarray]
    recent: "_Recent | None" = None
    exact: "_Exact | None" = None

    @classmethod
    def of(cls, batch: Batch, layers: Sequence[LayerCache]) -> "_Where":
        slabs = [layer.slab for layer in layers]
        if any(slab is None for slab in slabs):
            raise OutOfRange("attend over a layer that holds no timestep")
        table_off = np.fromiter((layer.table_offset(batch) for layer in layers), np.int64, len(layers))
        signs = np.asarray(type(layers[0]).sign_words(batch, layers), dtype=np.int64)
        ids = [id(slab) for slab in slabs]
        parts = [np.arange(len(ids))] if ids.count(ids[0]) == len(ids) else _by_value(ids)
        return cls(cast("list[Slab]", slabs), table_off, signs, parts)  # none is None (checked above)

    def signs_of(self, idx: np.ndarray) -> Sequence[int]:
        return self.signs[idx] if len(self.signs) else ()

    def tables(self) -> np.ndarray:
        """The page tables' word offsets the step's commands name, one per table (a
        replay puts each layer's own in: ``Batch.replay``)."""
        x = self.exact
        if x is None:  # (a windowed step's recent rows' appends name the tables x.recent_table does)
            return self.table_off
        heads = x.head_table[[h is not None for h in x.heads]]
        return np.concatenate([self.table_off, heads, x.recent_table[[r is not None for r in x.recents]]])

    def placeholders(self) -> tuple[int, ...]:
        """The table offset that stands for "no table" in the commands (a windowed
        layer without sinks or without recent rows: 0), if any."""
        x = self.exact
        if x is None or (all(h is not None for h in x.heads) and all(r is not None for r in x.recents)):
            return ()
        return (0,)

    def basis(
        self,
        batch: Batch,
        layers: Sequence[LayerCache],
        items: np.ndarray,
        q: Items,
        out: Items,
        rows: tuple[Items, Items, int] | None,
        shape: tuple[int, ...],
        after: np.ndarray,
        start_pos: np.ndarray,
        causal: bool,
        scale: float,
    ) -> PlanBasis:
        """What the commands of a stacked step over ``layers`` (placed here) are made
        from, but the page tables' offsets (a run of its plan puts each layer's own
        in): the layers' kind, format and pool, the step's shape, arrays and
        lengths, the kernel policy (by value: an engine's policy may be replaced),
        the slabs, signs and exact rows, and the batch's layout."""
        first = layers[0]
        slabs = [self.slabs[int(idx[0])] for idx in self.parts]
        parts: list[object] = [tuple(idx.tobytes() for idx in self.parts)]
        if self.recent is not None:
            r = self.recent
            slabs += [r.where.slabs[int(idx[0])] for idx in r.where.parts]
            parts += [r.index.tobytes(), r.after.tobytes(), tuple(idx.tobytes() for idx in r.where.parts)]
        if self.exact is not None:
            x = self.exact
            for idx in x.groups:
                i0 = int(idx[0])
                # the caches _attend_state kept hold a slab each
                slabs += cast("list[Slab]", [c.slab for c in (x.heads[i0], x.recents[i0]) if c is not None])
                parts.append((idx.tobytes(), x.heads[i0] is not None, x.recents[i0] is not None))
            parts += [x.sinks.tobytes(), x.exact_from.tobytes(), x.recent_base.tobytes()]
        return PlanBasis(
            kind=(type(first), first.kv_format, id(first.pool)),
            options=(shape, causal, scale, batch.policy),
            arrays=(
                q.base, q.stride, out.base, out.stride,
                None if rows is None else (rows[0].base, rows[0].stride, rows[1].base, rows[1].stride, rows[2]),
            ),
            items=items.tobytes(),
            lengths=after.tobytes(),
            start_pos=start_pos.tobytes(),
            placement=(self.signs.tobytes(), tuple(parts), tuple(slab.rows for slab in slabs)),
            layout=batch.layout(),
            bound=tuple(o for slab in slabs for o in (slab, slab.k, slab.v)),
        )  # fmt: skip


@dataclass(frozen=True)
class _Recent:
    """The recent rows' append of a stacked step's windowed layers (those with a
    window: ``index`` into the step's layers): their caches, new lengths and
    where they are."""

    index: np.ndarray
    caches: list[PlainLayerCache]
    after: np.ndarray
    where: _Where


@dataclass(frozen=True)
class _Exact:
    """What a stacked step's windowed layers' attends read exactly, as columns: each
    one's sinks cache and recent cache (None: none, or no timestep yet), sinks read,
    first timestep read from the recent rows, the recent rows' first timestep, both
    page tables' offsets (0: no table), and the layers grouped by their three slabs."""

    heads: list[PlainLayerCache | None]
    recents: list[PlainLayerCache | None]
    sinks: np.ndarray
    exact_from: np.ndarray
    recent_base: np.ndarray
    head_table: np.ndarray
    recent_table: np.ndarray
    groups: list[np.ndarray]


def layer_formats(kv_format: str | Sequence[str], num_layers: int) -> tuple[str, ...]:
    """Each layer's kv format: ``kv_format`` is one for every layer, or one per layer."""
    if isinstance(kv_format, str):
        return (kv_format,) * num_layers
    return tuple(kv_format)


@dataclass
class SessionConfig:
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    kv_format: str | tuple[str, ...]  # one for every layer, or one per layer
    max_tokens: int
    seed: int
    # the compressed layers' exact rows (issue 27): their first ``sinks`` timesteps and
    # a recent ``window`` (WindowedLayerCache); 0 and 0: none
    sinks: int = 0
    window: int = 0

    @property
    def layer_formats(self) -> tuple[str, ...]:
        return layer_formats(self.kv_format, self.num_layers)

    @property
    def windowed(self) -> bool:
        """Its compressed layers keep exact sinks or a window (WindowedLayerCache)."""
        return bool(self.sinks or self.window)

    def layer_layout(self, layer: int) -> PageLayout:
        """How layer ``layer`` lays out its rows."""
        return PageLayout(self.layer_formats[layer], self.num_kv_heads, self.head_dim)


class SessionKV:
    """All layers of one session, each a page table into the pool of its layout."""

    def __init__(self, config: SessionConfig, pools: PagePools):
        c = config
        formats = c.layer_formats
        if len(formats) != c.num_layers:
            raise ValueError(f"{len(formats)} kv formats for {c.num_layers} layers")
        for fmt in set(formats):
            check_head_dim(fmt, c.head_dim)
        if c.num_kv_heads < 1 or c.num_qo_heads % c.num_kv_heads:
            raise ValueError("num_kv_heads must divide num_qo_heads")
        self.config = c
        self.layers: list[LayerCache] = []
        for layer, fmt in enumerate(formats):
            pool = pools.get(c.layer_layout(layer))
            if is_plain(fmt):
                self.layers.append(PlainLayerCache(pool=pool, max_tokens=c.max_tokens, layer=layer))
            elif c.windowed:
                exact = pools.get(PageLayout("f32", c.num_kv_heads, c.head_dim))
                self.layers.append(WindowedLayerCache(
                    pool=pool, max_tokens=c.max_tokens, layer=layer, seed=c.seed, sinks=c.sinks, window=c.window,
                    exact_pool=exact,
                ))  # fmt: skip
            else:
                self.layers.append(TurboQuantLayerCache(pool=pool, max_tokens=c.max_tokens, layer=layer, seed=c.seed))
            self.layers[-1].format_follows = fmt in formats[layer + 1 :]

    @property
    def nbytes(self) -> int:
        """GPU bytes the session is charged for (each shared page is charged to one holder)."""
        return sum(l.nbytes for l in self.layers)

    def fork_from(self, device: wgpu.GPUDevice, src: "SessionKV", lengths: list[int]) -> None:
        """Every layer becomes ``src``'s layer at ``lengths[i]`` (GPU thread, alone);
        on failure nothing is held."""
        try:
            for layer, source, length in zip(self.layers, src.layers, lengths):
                layer.fork_from(device, source, length)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for l in self.layers:
            l.release()
