"""A TurboQuant layer that also keeps rows exactly (issue 27):
:class:`WindowedLayerCache`, its stacked steps as columns, and its sizing as columns
(``exact_from``, ``exact_pages``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import wgpu

from ..gpu.batch import Batch, Items, Resource, Seg, whole
from ..gpu import kernels as K
from ..pool import PagePool
from .columns import _by_value, _Exact, _Recent, _Where, _words
from .kinds import PlainLayerCache, TurboQuantLayerCache
from .layer import LayerCache, LayerState

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["WindowedLayerCache", "exact_from", "exact_pages"]


# A windowed layer's parameters, as columns (arrays) or one layer's (a scalar)
IntArray = Union[np.ndarray, np.int64]


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
