"""A session's layer as a page table over the paged KV pool (``pool.py``).

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

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import wgpu

from ..gpu.batch import PHASE_WRITE, Batch, Items, Resource, Seg, whole
from ..gpu import kernels as K
from ..gpu.step_plan import PlanEvent, StepPlan, StepPlans
from ..pool import DirectCopies, PagePool, PoolFull, Slab, TableRegion, copy_host_rows, copy_rows
from ..formats import check_head_dim
from .columns import _start_positions, _Where, _words

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["LayerCache", "LayerState"]


# What LayerCache.state gives and restore takes back: opaque to its callers (a
# windowed layer's holds its exact rows' caches' states too)
LayerState = tuple[Any, ...]


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
            from ..errors import CapacityExceeded

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

    def plan_append_rows(self, batch: Batch, ks: Seg, vs: Seg, n: int) -> int:
        """Record the append of ``n`` uploaded rows (``row_dtype``, ``[n, Hkv, d]``):
        the pages they need, then one write of them (:meth:`_append`, each kind's
        kernel); returns the new length."""
        self._ensure_pages(batch, self.length + n)
        K.plan_append(batch, self._append(batch, (n,), (self.length,), (ks.offset // 4,), (vs.offset // 4,)))
        self.length += n
        return self.length

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
        if rows is None:  # the start_pos rule before where the layers are (an empty layer breaks it)
            after = np.fromiter((layer.length for layer in layers), np.int64, len(layers))
            sp = _start_positions(start_pos, after, shape[0])
            where = _Where.of(batch, layers)
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
        # an invariant, not a rule: the caller passed the start_pos rule (n >= 1 rows inside
        # ``length``, the layer's own length), so the layer holds pages for all of it
        assert self.slab is not None and length <= self.capacity, f"attend over {length} of {self.capacity} held"
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
            from ..errors import OffsetMismatch

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
