"""One planning function per kernel family: params, bindings and dispatch grids.

Each function records dispatches into a :class:`~.batch.Batch`; none touches
the device. Query dispatches are split along Y by ``q_base`` so that no grid
dimension passes the adapter's ``max-compute-workgroups-per-dimension``.

Array layouts (all float32, row-major):

* queries ``[n, n_heads, head_dim]`` (``q_stride = out_stride = n_heads * head_dim``)
* f32 caches ``[cap, n_kv_heads * head_dim]`` (row ``t`` at ``t * kv_dim``)
* TurboQuant caches as in ``shaders/turboquant.wgsl``
* new K/V rows ``[n, n_kv_heads, head_dim]``
"""

from __future__ import annotations

import math

import wgpu

from ..turboquant import Codebook, qjl_scale
from . import params as P
from .batch import Batch, Resource, Seg

__all__ = [
    "plan_attention_f32",
    "plan_rotate_q",
    "plan_attention_tq",
    "plan_tq_encode",
    "rotated_q_bytes",
]


def _chunks(n: int, limit: int):
    base = 0
    while base < n:
        rows = min(limit, n - base)
        yield base, rows
        base += rows


def _limit(batch: Batch) -> int:
    return int(batch.device.limits.get("max-compute-workgroups-per-dimension", 65535))


def plan_attention_f32(
    batch: Batch,
    *,
    q: Seg,
    k_cache: wgpu.GPUBuffer,
    v_cache: wgpu.GPUBuffer,
    out: Seg,
    n_queries: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    length: int,
    start_pos: int,
    causal: bool,
    scale: float,
) -> None:
    """``attention_prefill``: ``out[n, H, d]`` from ``q[n, H, d]`` over ``length`` rows."""
    stride = n_heads * head_dim
    for q_base, rows in _chunks(n_queries, _limit(batch)):
        prm = batch.upload(
            P.pack(
                P.PREFILL_PARAMS,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                kv_dim=n_kv_heads * head_dim,
                max_seq=length,
                scale=scale,
                start_pos=start_pos,
                n_queries=n_queries,
                q_stride=stride,
                out_stride=stride,
                q_base=q_base,
                flags=0 if causal else P.FLAG_NON_CAUSAL,
            )
        )
        batch.dispatch(
            "attention_prefill", {0: q, 1: k_cache, 2: v_cache, 3: out, 4: prm}, (n_heads, rows, 1)
        )


def rotated_q_bytes(n_queries: int, n_heads: int, head_dim: int) -> int:
    """Size of ``[q_rot | q_jl | sums]`` for ``n_queries`` rows."""
    return (2 * n_queries * n_heads * head_dim + n_queries * n_heads) * 4


def plan_rotate_q(
    batch: Batch,
    *,
    q: Resource,
    q_out: Resource,
    signs: wgpu.GPUBuffer,
    n_queries: int,
    n_heads: int,
    head_dim: int,
    sign_off: int,
) -> None:
    """``tq_rotate_q``: ``[q_rot | q_jl | sums]`` with ``q_cap = n_queries``."""
    for q_base, rows in _chunks(n_queries, _limit(batch)):
        prm = batch.upload(
            P.pack(
                P.TQ_ROTATE_PARAMS,
                n_heads=n_heads,
                head_dim=head_dim,
                q_cap=n_queries,
                sign_off=sign_off,
                q_base=q_base,
                q_stride=n_heads * head_dim,
            )
        )
        batch.dispatch("tq_rotate_q", {3: signs, 4: q, 5: q_out, 6: prm}, (n_heads, rows, 1))


def plan_attention_tq(
    batch: Batch,
    *,
    q_rot: Resource,
    k_cache: wgpu.GPUBuffer,
    v_cache: wgpu.GPUBuffer,
    out: Seg,
    signs: wgpu.GPUBuffer,
    codebook: Codebook,
    n_queries: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    length: int,
    cache_cap: int,
    start_pos: int,
    causal: bool,
    scale: float,
    sign_off: int,
) -> None:
    """``flash_attention_tq`` over a compressed layer of capacity ``cache_cap``."""
    c = codebook.centroids
    for q_base, rows in _chunks(n_queries, _limit(batch)):
        prm = batch.upload(
            P.pack(
                P.TQ_ATTENTION_PARAMS,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                max_seq=length,
                start_pos=start_pos,
                scale=scale,
                q_cap=n_queries,
                out_stride=n_heads * head_dim,
                qjl_scale=qjl_scale(head_dim),
                sign_off=sign_off,
                c0=c[0],
                c1=c[1],
                c2=c[2],
                c3=c[3],
                q_base=q_base,
                cache_cap=cache_cap,
                flags=0 if causal else P.FLAG_NON_CAUSAL,
            )
        )
        batch.dispatch(
            "flash_attention_tq",
            {0: q_rot, 1: k_cache, 2: v_cache, 3: out, 4: prm, 5: signs},
            (n_heads, rows, 1),
        )


def plan_tq_encode(
    batch: Batch,
    kernel: str,
    *,
    src: Resource,
    cache: wgpu.GPUBuffer,
    signs: wgpu.GPUBuffer,
    codebook: Codebook,
    n_rows: int,
    n_kv_heads: int,
    head_dim: int,
    cache_cap: int,
    t0: int,
    sign_off: int,
) -> None:
    """``tq_encode_keys`` / ``tq_encode_values``: rows ``[n, Hkv, d]`` into timesteps ``t0..``."""
    if kernel not in ("tq_encode_keys", "tq_encode_values"):
        raise ValueError(kernel)
    c, b = codebook.centroids, codebook.boundaries
    for row_base, rows in _chunks(n_rows, _limit(batch)):
        prm = batch.upload(
            P.pack(
                P.TQ_ENCODE_PARAMS,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                cache_cap=cache_cap,
                t0=t0,
                row_base=row_base,
                sign_off=sign_off,
                n_rows=n_rows,
                c0=c[0],
                c1=c[1],
                c2=c[2],
                c3=c[3],
                b0=b[0],
                b1=b[1],
                b2=b[2],
            )
        )
        batch.dispatch(kernel, {0: src, 1: cache, 2: prm, 3: signs}, (n_kv_heads, rows, 1))


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
