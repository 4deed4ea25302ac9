"""One layer's GPU buffers for each kv format, and a session's set of layers.

This is the one host class per format that knows the cache addressing (where
timestep ``t`` of KV head ``h`` lives), so a paged pool can replace it later in
one place. Every method that touches the device (``plan_*``, ``read_words``,
``load_words``, ``release``) runs on the GPU owner thread; the sizing methods
(``capacity_for``, ``bytes_for``) are pure and safe anywhere, which is how the
service checks capacity and memory budgets *before* it queues any work.

Growth: a layer starts at a small capacity and, when an append does not fit,
gets a larger buffer (doubling, capped at ``max_tokens``) with the old contents
copied over in the same command stream, region by region so that TurboQuant's
``cap``-strided layout is preserved.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import wgpu

from .gpu.batch import Batch, Seg
from .gpu import kernels as K
from .gpu.kernels import plan_rotate_q, plan_tq_encode, rotated_q_bytes
from .turboquant import SUPPORTED_HEAD_DIMS, codebook, session_signs

__all__ = [
    "KV_FORMATS",
    "MIN_CAPACITY",
    "LayerCache",
    "F32LayerCache",
    "TurboQuantLayerCache",
    "SessionKV",
    "grow_capacity",
    "check_head_dim",
]

KV_FORMATS = ("f32", "turboquant")
MIN_CAPACITY = 64
_CACHE_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST


def grow_capacity(capacity: int, needed: int, max_tokens: int) -> int:
    """Capacity after making room for ``needed`` timesteps (unchanged if it fits)."""
    if needed <= capacity:
        return capacity
    cap = max(needed, 2 * capacity, MIN_CAPACITY)
    cap = (cap + MIN_CAPACITY - 1) // MIN_CAPACITY * MIN_CAPACITY
    return max(needed, min(cap, max_tokens))


def check_head_dim(kv_format: str, head_dim: int) -> None:
    if kv_format == "f32":
        if not 1 <= head_dim <= 128:
            raise ValueError(f"f32 supports head_dim 1..128, got {head_dim}")
    elif kv_format == "turboquant":
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"turboquant supports head_dim 32, 64 or 128, got {head_dim}")
    else:
        raise ValueError(f"unknown kv_format {kv_format!r}; expected one of {KV_FORMATS}")


def _create(device: wgpu.GPUDevice, label: str, size: int) -> wgpu.GPUBuffer:
    from .errors import OutOfMemory

    try:
        return device.create_buffer(label=label, size=size, usage=_CACHE_USAGE)
    except Exception as e:  # wgpu raises on allocation failure / over-limit sizes
        raise OutOfMemory(f"cannot allocate a {size}-byte GPU buffer: {e}") from e


class LayerCache:
    """One layer of one session: a K buffer and a V buffer of ``capacity`` timesteps.

    Subclasses define the per-timestep layout through ``_regions`` (words per
    slot for each region of the K and V buffers) or override the copy plan.
    """

    kv_format = ""

    def __init__(self, *, n_kv_heads: int, head_dim: int, max_tokens: int, layer: int = 0):
        check_head_dim(self.kv_format, head_dim)
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.max_tokens = max_tokens
        self.layer = layer
        self.length = 0
        self.capacity = 0
        self.k: wgpu.GPUBuffer | None = None
        self.v: wgpu.GPUBuffer | None = None

    # ── sizing (pure) ───────────────────────────────────────────────────────

    def bytes_for(self, capacity: int) -> int:
        """GPU bytes of this layer's K and V buffers at ``capacity`` timesteps."""
        return sum(self.buffer_bytes(capacity))

    def buffer_bytes(self, capacity: int) -> tuple[int, int]:
        raise NotImplementedError

    def capacity_for(self, new_length: int) -> int:
        return grow_capacity(self.capacity, new_length, self.max_tokens)

    @property
    def nbytes(self) -> int:
        return (self.k.size if self.k is not None else 0) + (self.v.size if self.v is not None else 0)

    # ── device work (GPU owner thread) ──────────────────────────────────────

    def state(self) -> tuple:
        """What planning may change: restore it with :meth:`restore` when a job
        that already planned into this layer fails (its ops are rolled back)."""
        return (self.length, self.capacity, self.k, self.v)

    def restore(self, state: tuple) -> None:
        self.length, self.capacity, self.k, self.v = state

    def _copy_plan(self, old_cap: int, new_cap: int) -> tuple[list, list]:
        """(src_off, dst_off, size) byte ranges to carry K and V into a larger buffer."""
        raise NotImplementedError

    def plan_reserve(self, batch: Batch, capacity: int) -> None:
        """Preallocate ``capacity`` timesteps now (never shrinks; capped at max_tokens)."""
        self._ensure_capacity(batch, self.length, capacity=min(capacity, self.max_tokens))

    def _ensure_capacity(self, batch: Batch, new_length: int, capacity: int | None = None) -> None:
        if new_length > self.max_tokens:
            from .errors import CapacityExceeded

            raise CapacityExceeded(
                f"appending to length {new_length} passes max_tokens {self.max_tokens}",
                length=self.length,
                max_tokens=self.max_tokens,
            )
        new_cap = self.capacity_for(new_length)
        if capacity is not None:
            new_cap = max(new_cap, capacity)
        if new_cap == self.capacity:
            return
        kb, vb = self.buffer_bytes(new_cap)
        k_new = _create(batch.device, f"L{self.layer}-k", kb)
        v_new = _create(batch.device, f"L{self.layer}-v", vb)
        if self.k is not None and self.length > 0:
            kplan, vplan = self._copy_plan(self.capacity, new_cap)
            for s, d, n in kplan:
                batch.copy(self.k, s, k_new, d, n)
            for s, d, n in vplan:
                batch.copy(self.v, s, v_new, d, n)
        self.k, self.v, self.capacity = k_new, v_new, new_cap

    def plan_append(self, batch: Batch, k: np.ndarray, v: np.ndarray) -> int:
        """Record the append of rows ``[n, Hkv, d]``; returns the new length."""
        raise NotImplementedError

    def plan_attend(self, batch: Batch, q: np.ndarray, *, start_pos: int, causal: bool, scale: float) -> Seg:
        """Record attention for ``q[n, H, d]``; returns the output segment ``[n, H, d]``."""
        out = batch.output(q.nbytes)
        self.plan_attend_rows(
            batch,
            batch.upload(q),
            q.shape,
            out=out,
            length=self.length,
            start_pos=start_pos,
            causal=causal,
            scale=scale,
        )
        return out

    def plan_attend_rows(
        self, batch: Batch, q: Seg, shape: tuple, *, out, length: int, start_pos: int, causal: bool, scale: float
    ) -> None:
        """Attention for uploaded queries ``q`` of ``shape = (n, H, d)`` over the
        first ``length`` timesteps, into ``out`` (a segment or a buffer); the
        kernel family is chosen by the batch's ``policy`` (``gpu.kernels.KernelPolicy``)."""
        raise NotImplementedError

    def read_words(self, device: wgpu.GPUDevice) -> tuple[bytes, bytes]:
        """The K and V buffers' bytes (the whole capacity), as held on the GPU."""
        if self.k is None:
            return b"", b""
        return bytes(device.queue.read_buffer(self.k)), bytes(device.queue.read_buffer(self.v))

    def load_words(self, device: wgpu.GPUDevice, length: int, capacity: int, kb: bytes, vb: bytes) -> None:
        """Restore buffers read by :meth:`read_words` (snapshots)."""
        self.release()
        if capacity:
            ksz, vsz = self.buffer_bytes(capacity)
            if (len(kb), len(vb)) != (ksz, vsz):
                raise ValueError(f"cache bytes {len(kb)}/{len(vb)} do not match capacity {capacity}")
            self.k = _create(device, f"L{self.layer}-k", ksz)
            self.v = _create(device, f"L{self.layer}-v", vsz)
            device.queue.write_buffer(self.k, 0, kb)
            device.queue.write_buffer(self.v, 0, vb)
        self.length, self.capacity = length, capacity

    def release(self) -> None:
        for buf in (self.k, self.v):
            if buf is not None:
                buf.destroy()
        self.k = self.v = None
        self.capacity = 0
        self.length = 0


class F32LayerCache(LayerCache):
    """Plain float32 K/V: row ``t`` at ``t * kv_dim`` floats (``kv_dim = Hkv * d``)."""

    kv_format = "f32"

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def buffer_bytes(self, capacity: int) -> tuple[int, int]:
        n = capacity * self.kv_dim * 4
        return n, n

    def _copy_plan(self, old_cap, new_cap):
        n = self.length * self.kv_dim * 4
        return [(0, 0, n)], [(0, 0, n)]

    def plan_append(self, batch, k, v):
        n = k.shape[0]
        self._ensure_capacity(batch, self.length + n)
        ks, vs = batch.upload(k), batch.upload(v)
        dst = self.length * self.kv_dim * 4
        batch.copy(ks, 0, self.k, dst, ks.size)
        batch.copy(vs, 0, self.v, dst, vs.size)
        self.length += n
        return self.length

    def plan_attend_rows(self, batch, q, shape, *, out, length, start_pos, causal, scale):
        n, h, d = shape
        K.plan_attend_f32(
            batch, K.Attend(q, out, self.k, self.v, n, h, self.n_kv_heads, d, length, start_pos, causal, scale)
        )


class TurboQuantLayerCache(LayerCache):
    """TurboQuant K/V words in the layout of ``shaders/turboquant.wgsl``.

    Keys: ``[polar d/16 | jl d/32 | norms 1]`` words per slot, regions of
    ``vecs = Hkv * cap`` slots each; values: ``[polar d/16 | norms 1]``.
    """

    kv_format = "turboquant"

    def __init__(self, *, session: "SessionKV", **kw):
        super().__init__(**kw)
        self.session = session
        self.codebook = codebook(self.head_dim)

    @property
    def key_regions(self) -> tuple[int, ...]:
        return (self.head_dim // 16, self.head_dim // 32, 1)

    @property
    def value_regions(self) -> tuple[int, ...]:
        return (self.head_dim // 16, 1)

    @property
    def sign_off(self) -> int:
        return self.layer * 2 * self.head_dim

    def buffer_bytes(self, capacity):
        vecs = self.n_kv_heads * capacity
        return vecs * sum(self.key_regions) * 4, vecs * sum(self.value_regions) * 4

    def _region_copies(self, regions, old_cap, new_cap):
        out = []
        old_base = new_base = 0
        for w in regions:
            for h in range(self.n_kv_heads):
                out.append(((old_base + h * old_cap * w) * 4, (new_base + h * new_cap * w) * 4, self.length * w * 4))
            old_base += self.n_kv_heads * old_cap * w
            new_base += self.n_kv_heads * new_cap * w
        return out

    def _copy_plan(self, old_cap, new_cap):
        return (
            self._region_copies(self.key_regions, old_cap, new_cap),
            self._region_copies(self.value_regions, old_cap, new_cap),
        )

    def plan_append(self, batch, k, v):
        n = k.shape[0]
        signs = self.session.signs_buffer(batch.device)
        self._ensure_capacity(batch, self.length + n)
        common = dict(
            signs=signs,
            codebook=self.codebook,
            n_rows=n,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            cache_cap=self.capacity,
            t0=self.length,
            sign_off=self.sign_off,
        )
        plan_tq_encode(batch, "tq_encode_keys", src=batch.upload(k), cache=self.k, **common)
        plan_tq_encode(batch, "tq_encode_values", src=batch.upload(v), cache=self.v, **common)
        self.length += n
        return self.length

    def plan_attend_rows(self, batch, q, shape, *, out, length, start_pos, causal, scale):
        n, h, d = shape
        signs = self.session.signs_buffer(batch.device)
        qrot = batch.scratch(rotated_q_bytes(n, h, d))
        plan_rotate_q(batch, q=q, q_out=qrot, signs=signs, n_queries=n, n_heads=h, head_dim=d, sign_off=self.sign_off)
        K.plan_attend_turboquant(
            batch,
            K.Attend(qrot, out, self.k, self.v, n, h, self.n_kv_heads, d, length, start_pos, causal, scale),
            K.TqLayer(signs, self.codebook, self.capacity, self.sign_off),
        )


@dataclass
class SessionConfig:
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    kv_format: str
    max_tokens: int
    seed: int


class SessionKV:
    """All layers of one session, plus the session-level TurboQuant signs buffer."""

    def __init__(self, config: SessionConfig):
        c = config
        check_head_dim(c.kv_format, c.head_dim)
        if c.num_kv_heads < 1 or c.num_qo_heads % c.num_kv_heads:
            raise ValueError("num_kv_heads must divide num_qo_heads")
        self.config = c
        self._signs: wgpu.GPUBuffer | None = None
        self.layers: list[LayerCache] = []
        for layer in range(c.num_layers):
            kw = dict(n_kv_heads=c.num_kv_heads, head_dim=c.head_dim, max_tokens=c.max_tokens, layer=layer)
            if c.kv_format == "f32":
                self.layers.append(F32LayerCache(**kw))
            else:
                self.layers.append(TurboQuantLayerCache(session=self, **kw))

    def signs_array(self) -> np.ndarray:
        c = self.config
        return session_signs(c.seed, c.num_layers, c.head_dim)

    def signs_bytes(self) -> int:
        """GPU bytes of the signs buffer (TurboQuant only)."""
        c = self.config
        return c.num_layers * 2 * c.head_dim * 4 if c.kv_format == "turboquant" else 0

    def signs_buffer(self, device: wgpu.GPUDevice) -> wgpu.GPUBuffer:
        if self._signs is None:
            self._signs = device.create_buffer_with_data(
                label="tq-signs", data=self.signs_array().tobytes(), usage=wgpu.BufferUsage.STORAGE
            )
        return self._signs

    @property
    def nbytes(self) -> int:
        """GPU bytes held now (caches, plus the signs buffer once created)."""
        return sum(l.nbytes for l in self.layers) + (self._signs.size if self._signs is not None else 0)

    def release(self) -> None:
        for l in self.layers:
            l.release()
        if self._signs is not None:
            self._signs.destroy()
            self._signs = None
