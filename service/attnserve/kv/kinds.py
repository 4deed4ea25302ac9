"""The layers of one format each: plain K/V (``PlainLayerCache``) and TurboQuant
words (``TurboQuantLayerCache``), each a :class:`~attnserve.kv.layer.LayerCache` with
its format's appends and attends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from ..gpu.batch import Batch, Resource, Seg
from ..gpu import kernels as K
from ..pool import PagePool
from ..formats import PLAIN_DTYPES
from ..turboquant import layer_signs_bytes
from .layer import LayerCache

__all__ = ["PlainLayerCache", "TurboQuantLayerCache"]


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
