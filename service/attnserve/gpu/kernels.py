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

from dataclasses import dataclass

import wgpu

from ..turboquant import Codebook, qjl_scale
from . import params as P
from .batch import Batch, Resource, Seg

__all__ = [
    "Attend",
    "TqLayer",
    "plan_attention_f32",
    "plan_rotate_q",
    "plan_attention_tq",
    "plan_tq_encode",
    "rotated_q_bytes",
    "KernelPolicy",
    "plan_attend_f32",
    "plan_attend_turboquant",
    "split_eligible",
    "choose_split",
    "plan_attention_split_f32",
    "plan_attention_split_tq",
    "plan_attention_prefill_tiled",
    "plan_attention_tq_tiled",
]


def _chunks(n: int, limit: int):
    base = 0
    while base < n:
        rows = min(limit, n - base)
        yield base, rows
        base += rows


def _limit(batch: Batch) -> int:
    return int(batch.device.limits.get("max-compute-workgroups-per-dimension", 65535))


@dataclass(frozen=True)
class Attend:
    """One attend, as every attention plan takes it: queries ``q [n, H, d]`` (for
    TurboQuant: rotated, ``[q_rot | q_jl]``) over the first ``length`` timesteps of
    ``k_cache``/``v_cache``, into ``out [n, H, d]``; row ``i`` at ``start_pos + i``."""

    q: Resource
    out: Resource
    k_cache: wgpu.GPUBuffer
    v_cache: wgpu.GPUBuffer
    n_queries: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    length: int
    start_pos: int
    causal: bool
    scale: float

    @property
    def flags(self) -> int:
        return 0 if self.causal else P.FLAG_NON_CAUSAL

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def shape_params(self) -> dict[str, float | int]:
        """The fields every attention params block starts from (f32 blocks add ``kv_dim``)."""
        return dict(
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            max_seq=self.length,
            start_pos=self.start_pos,
            scale=self.scale,
            flags=self.flags,
        )


@dataclass(frozen=True)
class TqLayer:
    """What a TurboQuant attend needs of its layer besides the caches."""

    signs: wgpu.GPUBuffer
    codebook: Codebook
    cache_cap: int
    sign_off: int


def _prefill_params(batch: Batch, a: Attend, q_base: int, n_queries: int) -> Seg:
    stride = a.n_heads * a.head_dim
    return batch.upload(
        P.pack(
            P.PREFILL_PARAMS,
            **a.shape_params(),
            kv_dim=a.n_kv_heads * a.head_dim,
            n_queries=n_queries,
            q_stride=stride,
            out_stride=stride,
            q_base=q_base,
        )
    )


def _tq_attention_params(batch: Batch, a: Attend, tq: TqLayer, q_base: int) -> Seg:
    c = tq.codebook.centroids
    return batch.upload(
        P.pack(
            P.TQ_ATTENTION_PARAMS,
            **a.shape_params(),
            q_cap=a.n_queries,
            out_stride=a.n_heads * a.head_dim,
            qjl_scale=qjl_scale(a.head_dim),
            sign_off=tq.sign_off,
            c0=c[0],
            c1=c[1],
            c2=c[2],
            c3=c[3],
            q_base=q_base,
            cache_cap=tq.cache_cap,
        )
    )


def plan_attention_f32(batch: Batch, a: Attend) -> None:
    """``attention_prefill`` (single pass): ``out[n, H, d]`` from ``q[n, H, d]`` over ``length`` rows."""
    for q_base, rows in _chunks(a.n_queries, _limit(batch)):
        prm = _prefill_params(batch, a, q_base, a.n_queries)
        batch.dispatch(
            "attention_prefill", {0: a.q, 1: a.k_cache, 2: a.v_cache, 3: a.out, 4: prm}, (a.n_heads, rows, 1)
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


def plan_attention_tq(batch: Batch, a: Attend, tq: TqLayer) -> None:
    """``flash_attention_tq`` (single pass) over a compressed layer of capacity ``tq.cache_cap``."""
    for q_base, rows in _chunks(a.n_queries, _limit(batch)):
        prm = _tq_attention_params(batch, a, tq, q_base)
        batch.dispatch(
            "flash_attention_tq",
            {0: a.q, 1: a.k_cache, 2: a.v_cache, 3: a.out, 4: prm, 5: tq.signs},
            (a.n_heads, rows, 1),
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


# ── split-KV (flash-decoding) path ──────────────────────────────────────────

SPLIT_TILE = 32  # the shortest split choose_split makes
SPLIT_MAX_SCORES = 2048  # MAX_SCORES: group * split_len
TQ_MAX_SPLIT = 512  # MAX_SPLIT in flash_attention_tq_split.wgsl


@dataclass(frozen=True)
class KernelPolicy:
    """Which attention kernel an attend uses.

    ``force``: None (choose by shape), "split", "tiled" or "single" (the
    seed-derived one-workgroup-per-(head, query) kernels). By default an attend
    of up to ``split_max_queries`` query rows takes the split-KV kernels and a
    larger one the query-block tiled kernels, where the shape allows them (GQA
    group of 1, 2, 4 or 8; f32 head_dim a multiple of 4); anything else takes
    the single-pass kernels. ``target_workgroups`` sizes the splits so a decode step fills the GPU.
    """

    force: str | None = None
    split_max_queries: int = 16
    # Measured on the H200 (bench/decode_sweep.py, docs/benchmarks.md): the longest
    # splits win; 128 gives 512-key splits from 8k context on with 8 KV heads.
    target_workgroups: int = 128
    # The subgroup variants of the split kernels (one subgroup per key) measured
    # slower than the plain ones (one thread per key) on the H200 at every
    # context, so they run only when asked for (and the device has the feature).
    subgroups: bool = False
    # The f32 query-block prefill kernel behind the "tiled" path: "tiled"
    # (attention_prefill_tiled, 64 rows x 32 keys per tile) or "rb"
    # (attention_prefill_rb, 64 rows x 64 keys, outer-product register blocks).
    # "rb" measured faster on the H200 (bench/prefill_sweep.py, docs/benchmarks.md).
    prefill_f32: str = "rb"
    # attention_prefill_rb: hold the next Q/K chunk in registers during the
    # scores (more registers, the loads' latency hidden) or load it at staging
    # (measured faster on the H200: fewer registers, more workgroups per SM).
    prefill_rb_prefetch: bool = False
    # attention_prefill_rb: specialize the pipeline on G and head_dim (override
    # constants GROUP, HEAD_DIM; one pipeline per shape) or run the generic one.
    prefill_rb_specialize: bool = True

    def use_subgroups(self, device) -> bool:
        return bool(self.subgroups) and "subgroup" in device.features

    def path(self, kv_format: str, n_queries: int, n_heads: int, n_kv_heads: int, head_dim: int) -> str:
        """ "split", "tiled" or "single" for this attend."""
        ok = split_eligible(kv_format, n_heads, n_kv_heads, head_dim)
        if self.force == "single" or not ok:
            return "single"
        if self.force in ("split", "tiled"):
            return self.force
        return "split" if n_queries <= self.split_max_queries else "tiled"


def split_eligible(kv_format: str, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    if n_heads // n_kv_heads not in (1, 2, 4, 8):
        return False
    if kv_format == "f32":
        return head_dim % 4 == 0 and head_dim <= 128
    return head_dim in (32, 64, 128)


def choose_split(
    kv_format: str,
    max_seq: int,
    n_kv_heads: int,
    n_queries: int,
    group: int,
    target_workgroups: int = KernelPolicy.target_workgroups,
) -> tuple[int, int]:
    """(split_len, n_splits): a power-of-two split so that about
    ``target_workgroups`` workgroups run, within the kernels' workgroup memory."""
    target = target_workgroups
    cap = SPLIT_MAX_SCORES // group
    if kv_format == "turboquant":
        cap = min(cap, TQ_MAX_SPLIT)
    want = -(-max_seq * n_kv_heads * n_queries // target)
    s = SPLIT_TILE
    while s < want and s < cap:
        s *= 2
    s = min(s, cap)
    return s, -(-max_seq // s)


def partial_bytes(n_queries: int, n_heads: int, n_splits: int, head_dim: int) -> int:
    """[acc | m | l] of every (query, head, split), rounded up to whole vec4s
    (the merge kernel binds it as ``array<vec4<f32>>``)."""
    n = n_queries * n_heads * n_splits * (head_dim + 2) * 4
    return -(-n // 16) * 16


def _plan_merge(batch: Batch, a: Attend, partial: Seg, n_splits: int, tq: TqLayer | None = None) -> None:
    """``attention_merge``; with ``tq`` it also applies TurboQuant's inverse rotation."""
    for q_base, rows in _chunks(a.n_queries, _limit(batch)):
        prm = batch.upload(
            P.pack(
                P.MERGE_PARAMS,
                n_heads=a.n_heads,
                head_dim=a.head_dim,
                n_splits=n_splits,
                q_total=a.n_queries,
                q_base=q_base,
                out_stride=a.n_heads * a.head_dim,
                sign_off=tq.sign_off if tq is not None else 0,
                flags=0 if tq is None else P.FLAG_ROTATE,
            )
        )
        # f32 merges bind the partials again as the (unread) signs: both read-only
        batch.dispatch(
            "attention_merge",
            {0: partial, 1: a.out, 2: prm, 3: tq.signs if tq is not None else partial},
            (a.n_heads, rows, 1),
        )


def _split(batch: Batch, a: Attend, kv_format: str) -> tuple[int, int, Seg]:
    """(split_len, n_splits, the partials' scratch) of a split-KV attend."""
    if not split_eligible(kv_format, a.n_heads, a.n_kv_heads, a.head_dim):
        raise ValueError("shape not eligible for the split kernel")
    split_len, n_splits = choose_split(
        kv_format, a.length, a.n_kv_heads, a.n_queries, a.group, batch.policy.target_workgroups
    )
    if n_splits > _limit(batch):
        raise ValueError(f"{n_splits} splits pass the dispatch limit")
    part = batch.scratch(partial_bytes(a.n_queries, a.n_heads, n_splits, a.head_dim), arena="partial")
    return split_len, n_splits, part


def plan_attention_split_f32(batch: Batch, a: Attend) -> None:
    """Split-KV f32 attention: split kernel, then merge, into ``out[n, H, d]``."""
    split_len, n_splits, part = _split(batch, a, "f32")
    kernel = "attention_split_f32_sg" if batch.policy.use_subgroups(batch.device) else "attention_split_f32"
    for q_base, rows in _chunks(a.n_queries, _limit(batch)):
        prm = batch.upload(
            P.pack(
                P.SPLIT_PARAMS,
                **a.shape_params(),
                kv_dim=a.n_kv_heads * a.head_dim,
                split_len=split_len,
                q_stride=a.n_heads * a.head_dim,
                n_splits=n_splits,
                q_base=q_base,
                q_total=a.n_queries,
            )
        )
        batch.dispatch(kernel, {0: a.q, 1: a.k_cache, 2: a.v_cache, 3: part, 4: prm}, (n_splits, a.n_kv_heads, rows))
    _plan_merge(batch, a, part, n_splits)


def plan_attention_split_tq(batch: Batch, a: Attend, tq: TqLayer) -> None:
    """Split-KV TurboQuant attention from rotated queries: split kernel, then merge + inverse RHT."""
    split_len, n_splits, part = _split(batch, a, "turboquant")
    kernel = "attention_split_tq_sg" if batch.policy.use_subgroups(batch.device) else "attention_split_tq"
    c = tq.codebook.centroids
    for q_base, rows in _chunks(a.n_queries, _limit(batch)):
        prm = batch.upload(
            P.pack(
                P.TQ_SPLIT_PARAMS,
                **a.shape_params(),
                q_cap=a.n_queries,
                split_len=split_len,
                qjl_scale=qjl_scale(a.head_dim),
                n_splits=n_splits,
                c0=c[0],
                c1=c[1],
                c2=c[2],
                c3=c[3],
                q_base=q_base,
                cache_cap=tq.cache_cap,
            )
        )
        batch.dispatch(
            kernel,
            {0: a.q, 1: a.k_cache, 2: a.v_cache, 3: part, 4: prm},
            (n_splits, a.n_kv_heads, rows),
            constants={"GROUP": a.group, "HEAD_DIM": a.head_dim},
        )
    _plan_merge(batch, a, part, n_splits, tq)


# ── query-block tiled prefill (f32) ─────────────────────────────────────────

TILED_ROWS = 64  # R in attention_prefill_tiled.wgsl
RB_ROWS = 64  # R in attention_prefill_rb.wgsl


def plan_attention_prefill_tiled(batch: Batch, a: Attend) -> None:
    """The f32 query-block prefill: blocks of R / G query rows x the G heads of a
    KV head, with ``attention_prefill_rb`` (64-key tiles, outer-product register
    blocks; its pipeline specialized on G and head_dim unless the policy says
    otherwise) or ``attention_prefill_tiled``, as ``batch.policy.prefill_f32`` says."""
    if not split_eligible("f32", a.n_heads, a.n_kv_heads, a.head_dim):
        raise ValueError("shape not eligible for the tiled prefill kernel")
    constants: dict[str, int] | None
    if batch.policy.prefill_f32 == "rb":
        kernel, bq = "attention_prefill_rb", RB_ROWS // a.group
        constants = {"PREFETCH": int(bool(batch.policy.prefill_rb_prefetch))}
        if batch.policy.prefill_rb_specialize:
            constants.update(GROUP=a.group, HEAD_DIM=a.head_dim)
    else:
        kernel, bq, constants = "attention_prefill_tiled", TILED_ROWS // a.group, None
    for q_base, rows in _chunks(a.n_queries, _limit(batch) * bq):
        prm = _prefill_params(batch, a, q_base, q_base + rows)
        batch.dispatch(
            kernel,
            {0: a.q, 1: a.k_cache, 2: a.v_cache, 3: a.out, 4: prm},
            (-(-rows // bq), a.n_kv_heads, 1),
            constants=constants,
        )


TQ_TILED_ROWS = 64  # R in flash_attention_tq_tiled.wgsl


def plan_attention_tq_tiled(batch: Batch, a: Attend, tq: TqLayer) -> None:
    """``attention_tq_tiled``: blocks of R / G query rows x the G heads of a KV head, from rotated queries."""
    if not split_eligible("turboquant", a.n_heads, a.n_kv_heads, a.head_dim):
        raise ValueError("shape not eligible for the tiled TurboQuant kernel")
    bq = TQ_TILED_ROWS // a.group
    for q_base, rows in _chunks(a.n_queries, _limit(batch) * bq):
        prm = _tq_attention_params(batch, a, tq, q_base)
        batch.dispatch(
            "attention_tq_tiled",
            {0: a.q, 1: a.k_cache, 2: a.v_cache, 3: a.out, 4: prm, 5: tq.signs},
            (-(-rows // bq), a.n_kv_heads, 1),
        )


# ── one planning entry point per kv format ──────────────────────────────────


def plan_attend_f32(batch: Batch, a: Attend) -> None:
    """f32 attention with the kernel family ``batch.policy`` picks for the shape:
    split-KV, the query-block tiled prefill, or the single-pass kernel."""
    plan = {
        "split": plan_attention_split_f32,
        "tiled": plan_attention_prefill_tiled,
        "single": plan_attention_f32,
    }[batch.policy.path("f32", a.n_queries, a.n_heads, a.n_kv_heads, a.head_dim)]
    plan(batch, a)


def plan_attend_turboquant(batch: Batch, a: Attend, tq: TqLayer) -> None:
    """TurboQuant attention from rotated queries (``a.q``) with the kernel family
    ``batch.policy`` picks."""
    plan = {
        "split": plan_attention_split_tq,
        "tiled": plan_attention_tq_tiled,
        "single": plan_attention_tq,
    }[batch.policy.path("turboquant", a.n_queries, a.n_heads, a.n_kv_heads, a.head_dim)]
    plan(batch, a, tq)
