"""All layers of one session (``SessionKV``), each a page table into the pool of its
layout, and what growing layers of many sessions costs (``bytes_growth``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import wgpu

from ..pool import PageLayout, PagePools
from ..formats import check_head_dim, is_plain
from .config import SessionConfig
from .kinds import PlainLayerCache, TurboQuantLayerCache
from .layer import LayerCache
from .windowed import WindowedLayerCache, exact_pages

__all__ = ["SessionKV", "bytes_growth"]


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
