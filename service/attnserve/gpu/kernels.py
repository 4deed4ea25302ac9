"""One planning function per kernel family: params, bindings and dispatch grids.

Each function records into a :class:`~.batch.Batch`; none touches the device.
Every cache is a pool slab read through the layer's page table
(``shaders/include/paging.wgsl``, ``pool.py``); every kernel binds the page tables
as ``TABLES``, the buffer that keeps them between batches (``pool.PageTables``).

The kernels are *batched*: ``tqx_encode_*``, ``tq_rotate_q``, the split-KV
kernels and ``attention_merge`` take one params block per row, so the
plans queue their work with ``Batch.defer`` and the batch records one dispatch
per kernel, slab and shape for all its items, in phases (writes, rotations,
attention, merges); a single attend is the batch of one. The query-block prefill
kernels are batched the same way (one params block per block of query rows); only
the single-pass kernels run one attend per dispatch, in the attention phase. Row
dispatches are cut so that no grid dimension passes the adapter's
``max-compute-workgroups-per-dimension``.

Array layouts (all float32, row-major):

* queries ``[n, n_heads, head_dim]`` (``q_stride = out_stride = n_heads * head_dim``)
* plain slabs ``[rows, n_kv_heads * head_dim]`` (slab row ``r`` at ``r * kv_dim``
  elements), float32 (kv format ``f32``), IEEE half (``f16``) or bfloat16 (``bf16``)
* TurboQuant slabs (``turboquant`` and the variants, ``formats.TQ_SPECS``) as in
  ``shaders/tqx.wgsl``
* new K/V rows ``[n, n_kv_heads, head_dim]``
* an attend's output segment (LSE): its outputs ``[n, n_heads, head_dim]``, then
  the log-sum-exp of each (query, head), ``[n, n_heads]``: the natural log of the
  sum of ``exp`` of the row's scaled scores over the keys it attended (``m +
  log(l)`` of the online softmax; the merge's ``M + log(L)``). Every kernel that
  writes an attend's final output writes its log-sum-exp at word ``out_off +
  n * out_stride + row * n_heads + head`` (:func:`attend_output_bytes`), always:
  a few bytes more per row, and one layout for every path
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable, Protocol, Union, cast

import numpy as np
import wgpu
from attnserve_client.wire import BFLOAT16

from ..errors import InvalidRequest
from ..turboquant import qjl_scale
from . import params as P
from ..formats import HALF_FORMATS, PLAIN_ELEMENT_BYTES, TQ_SPECS
from .shaders import plain_kernel, tqx_kernel
from .batch import (
    PHASE_ANSWER, PHASE_ATTEND, PHASE_MERGE, PHASE_ROTATE, PHASE_WRITE, Batch, Items, Resource, Seg, whole,
)  # fmt: skip

if TYPE_CHECKING:  # annotations only (numpy.typing is not imported at run time)
    import numpy.typing as npt

TABLES = whole("tables")  # every layer's page table (pool.PageTables), bound whole

# A column of a batched plan, one int per attend (or layer): a sequence or an int array.
IntColumn = Union[Sequence[int], np.ndarray]

__all__ = [
    "Attend",
    "Cache",
    "TqLayer",
    "Rotate",
    "Append",
    "Attends",
    "plan_attention_plain",
    "plan_rotate_q",
    "plan_attention_tq",
    "plan_append",
    "plan_split",
    "plan_split_turboquant",
    "plan_split_windowed",
    "ExactRows",
    "rotated_q_bytes",
    "KernelPolicy",
    "plan_attend_plain",
    "plan_attend_turboquant",
    "split_eligible",
    "split_sizes",
    "attend_output_bytes",
    "ELEMENT_KINDS",
    "plan_uploads_as",
    "plan_answer",
]

#: The dtypes an array may come in and an answer go out in, by the convert kernel's
#: kind (``shaders/convert.wgsl``): float32, IEEE float16, bfloat16 (``wire.BFLOAT16``).
ELEMENT_KINDS: dict[np.dtype[Any], int] = {np.dtype("<f4"): 0, np.dtype("<f2"): 1, BFLOAT16: 2}
_CONVERT_GROUP = 256  # convert.wgsl's workgroup size


def _convert(batch: Batch, src: Seg, dst: Seg, params: Seg, blocks: np.ndarray) -> None:
    """One ``convert`` dispatch over the arrays of ``blocks`` (CONVERT_PARAMS rows,
    uploaded at ``params``): a row of workgroups each."""
    pairs = int(((blocks["total"].astype(np.int64) + 1) // 2).max())
    groups = max(1, min(-(-pairs // _CONVERT_GROUP), _limit(batch)))
    batch.dispatch("convert", {0: src, 1: dst, 2: params}, (groups, len(blocks), 1))


def plan_uploads_as(batch: Batch, arrays: Sequence[tuple[np.ndarray, str]]) -> list[Items]:
    """Each array ``(data, dtype)``'s items ``data[0], data[1], ...`` in the input
    arena as ``dtype`` (a row dtype: ``<f4`` or ``<f2``): uploaded as they are when
    ``data`` has that dtype, else uploaded as they came (the wire arena) and
    converted on the GPU, all of them by one dispatch recorded now, before any
    kernel of the batch reads them (``shaders/convert.wgsl``, bit-exact)."""
    out: list[Items] = []
    blocks = []
    for data, dtype in arrays:
        want = np.dtype(dtype)
        if data.dtype == want:
            out.append(batch.upload_items(data))
            continue
        count, per_item = int(data.shape[0]), int(data[0].size)
        if want.itemsize == 2 and per_item % 2 and count > 1:  # (a plain half layer's rows are whole words)
            raise ValueError(f"half-precision items of an odd size ({per_item}) cannot be converted in place")
        items = batch.reserve_items(count, per_item * want.itemsize)
        src = batch.upload_wire(np.ascontiguousarray(data).view(np.uint8).reshape(-1).data)
        blocks.append(
            dict(
                total=count * per_item, per_item=per_item, src_base=src.offset // 4, src_stride=0,
                dst_base=items.base // 4, dst_stride=0 if count == 1 else items.stride // 4,
                src_kind=ELEMENT_KINDS[data.dtype], dst_kind=ELEMENT_KINDS[want],
            )
        )  # fmt: skip
        out.append(items)
    if blocks:
        rows = P.pack_array(P.CONVERT_PARAMS, len(blocks), **{k: [b[k] for b in blocks] for k in blocks[0]})
        params = batch.upload_wire(rows.view(np.uint8).data)
        _convert(batch, whole("wire"), whole("in"), params, rows)
    return out


@dataclass(frozen=True)
class _Answer:
    outs: Items
    per_item: int  # output elements of an item
    lse_rows: int  # log-sum-exp values of an item (0: not answered)
    dtype: np.dtype[Any]
    out: Seg  # where the outputs go in the answer arena
    lse: Seg | None


def plan_answer(
    batch: Batch, outs: Items, shape: tuple[int, ...], dtype: np.dtype[Any], lse: bool
) -> tuple[Seg, Seg | None]:
    """The outputs ``[count, *shape]`` of a step (float32 items ``outs``, each its
    outputs then its log-sum-exp: :func:`attend_output_bytes`) converted to ``dtype``
    into the answer arena, all items back to back, after every kernel of the batch
    (and with ``lse``, the log-sum-exp ``[count, *shape[:2]]``, float32, after
    them): the segments, read back at :attr:`Batch.answer_at` plus their offset.
    Every answer of a batch is converted by one dispatch."""
    per_item = int(np.prod(shape))
    count = outs.count
    out = batch.answer(count * per_item * dtype.itemsize)
    lse_rows = int(np.prod(shape[:2])) if lse else 0
    lse_seg = batch.answer(count * lse_rows * 4) if lse else None
    item = _Answer(outs, per_item, lse_rows, dtype, out, lse_seg)
    batch.defer(PHASE_ANSWER, "answer", item, _flush_answers, rows=2)
    return out, lse_seg


def _flush_answers(batch: Batch, items: list[_Answer]) -> None:
    f32 = np.dtype("<f4")
    parts: list[tuple[_Answer, Seg, np.dtype[Any], int, int]] = [(a, a.out, a.dtype, a.per_item, 0) for a in items]
    parts += [(a, a.lse, f32, a.lse_rows, a.per_item) for a in items if a.lse is not None]
    rows = P.pack_array(
        P.CONVERT_PARAMS, len(parts),
        total=[a.outs.count * n for a, _, _, n, _ in parts], per_item=[n for *_, n, _ in parts],
        src_base=[a.outs.base // 4 + skip for a, *_, skip in parts], src_stride=[a.outs.stride // 4 for a, *_ in parts],
        dst_base=[dst.offset // 4 for _, dst, *_ in parts], dst_stride=0,
        src_kind=ELEMENT_KINDS[f32], dst_kind=[ELEMENT_KINDS[dt] for _, _, dt, *_ in parts],
    )  # fmt: skip
    _convert(batch, whole("out"), whole("answer"), batch.upload_params(rows), rows)


def attend_output_bytes(n_queries: int, n_heads: int, head_dim: int) -> int:
    """Bytes of an attend's output segment: ``out [n, H, d]`` then ``lse [n, H]``
    (float32; the module's "LSE")."""
    return n_queries * n_heads * (head_dim + 1) * 4


def _chunks(n: int, limit: int) -> Iterator[tuple[int, int]]:
    base = 0
    while base < n:
        rows = min(limit, n - base)
        yield base, rows
        base += rows


def _limit(batch: Batch) -> int:
    limit = batch.__dict__.get("_workgroups_limit")
    if limit is None:  # the device's limits are a new dict on every read: once per batch
        limit = batch.__dict__["_workgroups_limit"] = int(
            batch.device.limits.get("max-compute-workgroups-per-dimension", 65535)
        )
    return limit


class Cache(Protocol):
    """Where an attend's layer lives: a pool slab (``pool.Slab``), read when the
    dispatch is recorded (a slab may grow while the batch is planned)."""

    k: wgpu.GPUBuffer
    v: wgpu.GPUBuffer

    @property
    def rows(self) -> int: ...


# (params field, Attend attribute) of the fields every attention params block starts from
_SHAPE_FIELDS = (
    ("n_heads", "n_heads"),
    ("n_kv_heads", "n_kv_heads"),
    ("head_dim", "head_dim"),
    ("max_seq", "length"),
    ("start_pos", "start_pos"),
    ("scale", "scale"),
    ("flags", "flags"),
)


def _shape_columns(attends: list["Attend"]) -> dict[str, list[Any]]:
    """:meth:`Attend.shape_params` of each of ``attends``, as columns."""
    return {field: [getattr(a, attr) for a in attends] for field, attr in _SHAPE_FIELDS}


def _word(res: Resource) -> int:
    """The word offset of ``res`` in what :func:`_bind` binds."""
    return res.offset // 4 if isinstance(res, Seg) else 0


@dataclass(frozen=True)
class Attend:
    """One attend, as every attention plan takes it: queries ``q [n, H, d]`` (for
    TurboQuant: rotated, ``[q_rot | q_jl | sums]``) over the first ``length``
    timesteps of a layer, into ``out [n, H, d]``; row ``i`` at ``start_pos + i``.
    The layer's timestep ``t`` is row ``pages[t >> page_shift] << page_shift | t % P``
    of ``cache`` (``pages``: its page table, u32 words from word ``table_off`` of the
    page tables, ``whole("tables")``)."""

    q: Resource
    out: Resource
    cache: Cache
    table_off: int
    page_shift: int
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
        """The fields every attention params block starts from (plain blocks add ``kv_dim``)."""
        return {field: getattr(self, attr) for field, attr in _SHAPE_FIELDS}

    def with_q(self, q: Resource) -> "Attend":
        """This attend reading its queries from ``q`` (TurboQuant: the rotated ones)."""
        return Attend(q, self.out, self.cache, self.table_off, self.page_shift, self.n_queries, self.n_heads,
                      self.n_kv_heads, self.head_dim, self.length, self.start_pos, self.causal, self.scale)  # fmt: skip

    def paging_params(self) -> dict[str, int]:
        """The page table fields of a single-attend block."""
        return dict(table_off=self.table_off, page_shift=self.page_shift)


@dataclass(frozen=True)
class TqLayer:
    """What a TurboQuant attend needs of its layer besides the cache: its signs
    (the layer's ``2 * head_dim`` values, uploaded with the batch) and its format
    (one of ``formats.TQ_SPECS``, whose tqx kernels carry its codebooks)."""

    signs: Seg
    kv_format: str

    def kernel(self, base: str) -> str:
        """The tqx kernel ``base`` of this layer's format."""
        return tqx_kernel(base, self.kv_format)


def _bind(res: Resource) -> tuple[Resource, int]:
    """(what to bind, the word offset of ``res`` in it): a segment's whole arena, so
    that one dispatch reaches every item of a batch; a buffer as it is."""
    return (whole(res.arena) if isinstance(res, Seg) else res), _word(res)


def _prefill_params(batch: Batch, a: Attend, q_base: int, n_queries: int) -> Seg:
    stride = a.n_heads * a.head_dim
    return batch.upload(
        P.pack(
            P.PREFILL_PARAMS,
            **a.shape_params(),
            **a.paging_params(),
            kv_dim=a.n_kv_heads * a.head_dim,
            n_queries=n_queries,
            q_stride=stride,
            out_stride=stride,
            q_base=q_base,
            q_off=0,  # the queries and outputs are bound as their own segments
            out_off=0,
        )
    )


def _tq_attention_params(batch: Batch, a: Attend, tq: TqLayer, q_base: int) -> Seg:
    return batch.upload(
        P.pack(
            P.TQ_ATTENTION_PARAMS,
            **a.shape_params(),
            **a.paging_params(),
            **_tq_common(a),
            q_cap=a.n_queries,
            out_stride=a.n_heads * a.head_dim,
            sign_off=0,
            q_base=q_base,
        )
    )


def plan_attention_plain(batch: Batch, a: Attend, kv_format: str) -> None:
    """``attention_prefill`` (single pass) over a plain ``kv_format`` slab:
    ``out[n, H, d]`` from ``q[n, H, d]`` over ``length`` rows."""
    for q_base, rows in _chunks(a.n_queries, _limit(batch)):
        prm = _prefill_params(batch, a, q_base, a.n_queries)
        batch.dispatch(
            plain_kernel("attention_prefill", kv_format),
            {0: a.q, 1: a.cache.k, 2: a.cache.v, 3: a.out, 4: prm, 5: TABLES},
            (a.n_heads, rows, 1),
        )


def rotated_q_bytes(n_queries: int, n_heads: int, head_dim: int) -> int:
    """Size of ``[q_rot | q_jl | sums]`` for ``n_queries`` rows."""
    return (2 * n_queries * n_heads * head_dim + n_queries * n_heads) * 4


@dataclass(frozen=True)
class Rotate:
    """``tq_rotate_q`` of the queries of one or more attends of one shape, as
    columns (one entry per attend): attend ``i``'s ``n_queries`` rows ``[n, H, d]``
    at word ``q_off[i]`` of ``q`` into ``[q_rot | q_jl | sums]`` at word
    ``out_off[i]`` of ``q_out``, with its layer's signs at word ``sign_off[i]`` of
    ``signs`` (``q``, ``q_out``, ``signs``: what is bound, an arena whole or a buffer)."""

    q: Resource
    q_out: Resource
    signs: Resource
    q_off: IntColumn
    out_off: IntColumn
    sign_off: IntColumn
    n_queries: int
    n_heads: int
    head_dim: int
    # [q_rot | q * polar signs | sums] in place of [q_rot | q_jl | sums]: the formats
    # with key outlier channels (tq_rotate.wgsl SIGNED)
    signed: bool = False

    @classmethod
    def one(
        cls,
        q: Resource,
        q_out: Resource,
        signs: Resource,
        n_queries: int,
        n_heads: int,
        head_dim: int,
        signed: bool = False,
    ) -> "Rotate":
        """The rotation of one attend's queries ``q`` into ``q_out`` (segments or buffers)."""
        (qb, qo), (ob, oo), (sb, so) = _bind(q), _bind(q_out), _bind(signs)
        return cls(qb, ob, sb, (qo,), (oo,), (so,), n_queries, n_heads, head_dim, signed)  # fmt: skip


def plan_rotate_q(batch: Batch, r: Rotate) -> None:
    """Queue ``tq_rotate_q`` of ``r``: the batch's rotations run in one dispatch
    (one params block per query row, per ``signed``), before its attention kernels."""
    flush = functools.partial(_flush_rotate, {"SIGNED": int(r.signed)})
    key = ("tq_rotate_q", r.signed, r.q, r.q_out, r.signs)
    batch.defer(PHASE_ROTATE, key, r, flush, rows=r.n_queries * len(r.q_off))


def _flush_rotate(constants: dict[str, int], batch: Batch, items: list[Rotate]) -> None:
    first = items[0]
    rows = _Rows.of(
        _per_entry(items, lambda r: r.n_queries, "q_off"),
        dict(
            n_heads=_per_entry(items, lambda r: r.n_heads, "q_off"),
            head_dim=_per_entry(items, lambda r: r.head_dim, "q_off"),
            q_cap=_per_entry(items, lambda r: r.n_queries, "q_off"),
            q_stride=_per_entry(items, lambda r: r.n_heads * r.head_dim, "q_off"),
            sign_off=_cat(items, "sign_off"), q_in_off=_cat(items, "q_off"), q_out_off=_cat(items, "out_off"),
        ),
        dict(q_row=(0, 1)),
    )  # fmt: skip
    _dispatch_rows(
        batch,
        "tq_rotate_q",
        P.TQ_ROTATE_PARAMS,
        rows,
        {},
        {3: first.signs, 4: first.q, 5: first.q_out},
        6,
        lambda rows: (max(r.n_heads for r in items), rows, 1),
        constants,
    )


def _cat(items: Sequence[Any], column: str) -> np.ndarray:
    """Column ``column`` of every item (each a sequence, one entry per attend or
    layer), joined: one entry per attend of the group."""
    if len(items) == 1:
        return np.asarray(getattr(items[0], column), dtype=np.int64)
    return np.concatenate([np.asarray(getattr(it, column), dtype=np.int64) for it in items])


def _per_entry(items: Sequence[Any], value: Callable[[Any], Any], like: str) -> np.ndarray:
    """``value(item)`` (the same for all of an item's entries) once per entry of
    column ``like``: one entry per attend or layer of the group."""
    if len(items) == 1:
        return np.full(len(getattr(items[0], like)), value(items[0]))
    return np.concatenate([np.full(len(getattr(it, like)), value(it)) for it in items])


class _Rows:
    """The params columns of a batched dispatch, one entry per row (or block)."""

    def __init__(self) -> None:
        self.cols: dict[str, Any] = {}
        self.n = 0

    @classmethod
    def of(
        cls, counts: IntColumn, per_item: dict[str, Any], ramps: dict[str, tuple[Any, Any]] | None = None
    ) -> "_Rows":
        """The rows of items of ``counts[i]`` rows each, built as arrays: a
        ``per_item`` field holds one value per item (the same in its rows); a ramp
        ``(first, step)`` gives row ``j`` of item ``i`` ``first[i] + j * step[i]``
        (``first``, ``step``: one per item, or one for all)."""
        rows = cls()
        n = np.asarray(counts, dtype=np.int64)
        rows.n = int(n.sum())
        if rows.n == len(n):  # one row per item (every count is 1): a ramp is its first value
            rows.cols = dict(per_item)
            for name, (first, _) in (ramps or {}).items():
                rows.cols[name] = first
            return rows
        j = np.arange(rows.n) - np.repeat(np.cumsum(n) - n, n)  # each row's index in its item
        rows.cols = {name: np.repeat(np.asarray(values), n) for name, values in per_item.items()}
        for name, (first, step) in (ramps or {}).items():
            base: Any  # first and step per row, each a scalar or an array
            inc: Any
            base, inc = (x if np.isscalar(x) else np.repeat(np.asarray(x, dtype=np.int64), n) for x in (first, step))
            rows.cols[name] = base + j * inc
        return rows


def _tq_common(a: Attend) -> dict[str, Any]:
    """The fields every row of a TurboQuant attention dispatch shares: the QJL
    scale and the slab's rows (the codebooks are constants of the format's kernels)."""
    return dict(qjl_scale=qjl_scale(a.head_dim), cache_cap=a.cache.rows)


def _dispatch_rows(
    batch: Batch,
    kernel: str,
    block: np.dtype,
    rows: _Rows,
    common: dict[str, Any],
    bindings: dict[int, Resource],
    params_binding: int,
    grid: Callable[[int], tuple[int, int, int]],
    constants: dict[str, int] | None = None,
) -> None:
    """One dispatch per chunk of rows (the grid's row dimension is limited): each
    row's params block (its ``rows`` columns and the ``common`` fields) in an array
    bound at ``params_binding``."""
    for base, n in _chunks(rows.n, _limit(batch)):
        part = {k: v if np.isscalar(v) else v[base : base + n] for k, v in rows.cols.items()}
        prm = batch.upload_params(P.pack_array(block, n, **part, **common))
        batch.dispatch(kernel, {**bindings, params_binding: prm}, grid(n), constants=constants)


def plan_attention_tq(batch: Batch, a: Attend, tq: TqLayer) -> None:
    """``flash_attention_tqx`` (single pass) from rotated queries."""
    for q_base, rows in _chunks(a.n_queries, _limit(batch)):
        prm = _tq_attention_params(batch, a, tq, q_base)
        batch.dispatch(
            tq.kernel("flash_attention_tqx"),
            {0: a.q, 1: a.cache.k, 2: a.cache.v, 3: a.out, 4: prm, 5: tq.signs, 6: TABLES},
            (a.n_heads, rows, 1),
        )


@dataclass(frozen=True)
class Append:
    """Rows appended to layers of one slab and kv format, as columns (one entry per
    layer): layer ``i``'s ``n_rows[i]`` rows (``[n, Hkv, d]`` of the layer's row
    dtype), keys at word ``k_off[i]`` and values at word ``v_off[i]`` of the input
    arena, into its timesteps ``t0[i]..`` through its page table at word
    ``table_off[i]`` of the page tables; a TurboQuant layer's signs at word
    ``sign_off[i]``."""

    kv_format: str
    cache: Cache
    page_shift: int
    n_kv_heads: int
    head_dim: int
    n_rows: IntColumn
    t0: IntColumn
    k_off: IntColumn
    v_off: IntColumn
    table_off: IntColumn
    sign_off: IntColumn = ()

    @property
    def row_words(self) -> int:
        """Words of one timestep's keys (or values) as uploaded."""
        if self.kv_format in TQ_SPECS:
            return self.n_kv_heads * self.head_dim  # float32 rows, encoded on the GPU
        return self.n_kv_heads * self.head_dim * PLAIN_ELEMENT_BYTES[self.kv_format] // 4


def plan_append(batch: Batch, a: Append) -> None:
    """Queue the writes of ``a``'s rows: a plain format's ``kv_write_rows``, a
    TurboQuant format's ``tqx_encode_keys`` and ``tqx_encode_values``. The batch's
    writes into one slab run as one dispatch per kernel, before any attention kernel
    of the batch (and, within a write epoch, in no particular order: they write
    disjoint rows)."""
    rows = int(np.sum(a.n_rows))
    if a.kv_format not in TQ_SPECS:
        key = ("kv_write_rows", id(a.cache), batch.write_epoch)
        batch.defer(PHASE_WRITE, key, a, _flush_write, rows=rows)
        return
    for base in ("tqx_encode_keys", "tqx_encode_values"):
        kernel = tqx_kernel(base, a.kv_format)
        flush = functools.partial(_flush_encode, kernel, base == "tqx_encode_keys")
        batch.defer(PHASE_WRITE, (kernel, id(a.cache), a.n_kv_heads, batch.write_epoch), a, flush, rows=rows)


def _flush_write(batch: Batch, items: list[Append]) -> None:
    first = items[0]
    words = first.row_words
    rows = _Rows.of(
        _cat(items, "n_rows"),
        dict(table_off=_cat(items, "table_off")),
        dict(t=(_cat(items, "t0"), 1), src_off=(_cat(items, "k_off"), words), v_off=(_cat(items, "v_off"), words)),
    )
    ins = whole("in")
    _dispatch_rows(
        batch,
        "kv_write_rows",
        P.KV_WRITE_PARAMS,
        rows,
        dict(row_words=words, page_shift=first.page_shift),
        {0: ins, 1: first.cache.k, 2: first.cache.v, 4: TABLES},
        3,
        lambda rows: (1, rows, 1),
    )


def _flush_encode(kernel: str, keys: bool, batch: Batch, items: list[Append]) -> None:
    first = items[0]
    rows = _Rows.of(
        _cat(items, "n_rows"),
        dict(sign_off=_cat(items, "sign_off"), table_off=_cat(items, "table_off")),
        dict(t=(_cat(items, "t0"), 1), src_off=(_cat(items, "k_off" if keys else "v_off"), first.row_words)),
    )
    common: dict[str, Any] = dict(
        n_kv_heads=first.n_kv_heads, head_dim=first.head_dim, cache_cap=first.cache.rows, page_shift=first.page_shift
    )
    ins = whole("in")
    _dispatch_rows(
        batch,
        kernel,
        P.TQX_ENCODE_PARAMS,
        rows,
        common,
        {0: ins, 1: first.cache.k if keys else first.cache.v, 3: ins, 7: TABLES},
        2,
        lambda rows: (first.n_kv_heads, rows, 1),
    )


# ── split-KV (flash-decoding) path ──────────────────────────────────────────

SPLIT_TILE = 32  # the shortest split split_sizes makes
SPLIT_GROUPS = (1, 2, 4, 8)  # the GQA groups a split workgroup serves whole
# group * split_len, the scores a split kernel holds in workgroup memory (MAX_SCORES
# in shaders/include/split_plain_decls.wgsl and split_tqx_decls.wgsl): the plain
# kernels' 4096 (1024-key splits at G = 4) measured 8-10% faster at 32k-128k than
# 2048 and than 8192 on the H200 (docs/benchmarks.md)
PLAIN_MAX_SCORES = 4096
TQ_MAX_SCORES = 2048
TQ_MAX_SPLIT = 512  # MAX_SPLIT in include/split_tqx_decls.wgsl


@dataclass(frozen=True)
class KernelPolicy:
    """Which attention kernel an attend uses.

    ``force``: None (choose by shape), "split", "tiled" or "single" (the
    seed-derived one-workgroup-per-(head, query) kernels). By default an attend
    of up to ``split_max_queries`` query rows takes the split-KV kernels and a
    larger one the query-block tiled kernels, where the shape allows them (GQA
    group of 1, 2, 4 or 8 for the tiled ones, any for the split ones; plain head_dim
    a multiple of 4); anything else takes the single-pass kernels.
    ``target_workgroups`` sizes the splits so a decode step fills the GPU.
    """

    force: str | None = None
    split_max_queries: int = 16
    # Measured on the H200 (bench/probes/decode_sweep.py, docs/benchmarks.md): the longest
    # splits win; 128 gives 512-key splits from 8k context on with 8 KV heads.
    target_workgroups: int = 128
    # The plain (f32, f16, bf16) query-block prefill kernel behind the "tiled" path: "tiled"
    # (attention_prefill_tiled, 64 rows x 32 keys per tile) or "rb"
    # (attention_prefill_rb, 64 rows x 64 keys, outer-product register blocks).
    # "rb" measured faster on the H200 (bench/prefill_sweep.py, docs/benchmarks.md).
    prefill_f32: str = "rb"
    # The same choice for the half formats (f16, bf16: the same slab bytes): "tiled"
    # measured faster for f16 on the H200 (2.40 against 2.75 ms at 2048 x 2048, 5.01
    # against 5.48 at 512 x 8192; docs/benchmarks.md); bf16 takes f16's until measured.
    prefill_f16: str = "tiled"
    # attention_prefill_rb: specialize the pipeline on G and head_dim (override
    # constants GROUP, HEAD_DIM; one pipeline per shape) or run the generic one.
    prefill_rb_specialize: bool = True

    def plain_prefill(self, kv_format: str) -> str:
        """The query-block prefill kernel ("rb" or "tiled") of a plain format."""
        return self.prefill_f16 if kv_format in HALF_FORMATS else self.prefill_f32

    def path(self, kv_format: str, n_queries: int, n_heads: int, n_kv_heads: int, head_dim: int) -> str:
        """ "split", "tiled" or "single" for this attend. The split kernels take any
        GQA group (a workgroup serves one query head where the group is not 1, 2, 4
        or 8), the tiled ones only those: a larger attend of another group is single."""
        if self.force == "single" or not split_eligible(kv_format, n_heads, n_kv_heads, head_dim, any_group=True):
            return "single"
        if self.force == "split" or (self.force is None and n_queries <= self.split_max_queries):
            return "split"
        return "tiled" if split_eligible(kv_format, n_heads, n_kv_heads, head_dim) else "single"


def split_eligible(kv_format: str, n_heads: int, n_kv_heads: int, head_dim: int, any_group: bool = False) -> bool:
    """Whether the split kernels take this shape: by default a GQA group they serve
    whole in one workgroup (the policy's rule, also the tiled kernels'); with
    ``any_group``, any (one query head per workgroup otherwise)."""
    if n_heads % n_kv_heads or (not any_group and n_heads // n_kv_heads not in SPLIT_GROUPS):
        return False
    if kv_format in TQ_SPECS:
        return head_dim in (32, 64, 128)
    return head_dim % 4 == 0 and head_dim <= 128  # plain: vec4 columns


def wide_split(kv_format: str, head_dim: int) -> bool:
    """Whether a plain split attend reads its slab in 16-byte pieces
    (``attention_split_wide``: a half format whose rows and heads start on a piece,
    head_dim % 8 == 0); else ``attention_split``, a vec4 column at a time."""
    return kv_format in HALF_FORMATS and head_dim % 8 == 0


def split_sizes(
    kv_format: str,
    max_seq: np.ndarray,
    n_kv_heads: int,
    n_queries: int,
    group: int,
    target_workgroups: int = KernelPolicy.target_workgroups,
) -> tuple[np.ndarray, np.ndarray]:
    """(split_len, n_splits) per attend over ``max_seq[i]`` timesteps: a power-of-two
    split so that about ``target_workgroups`` workgroups run, within the kernels'
    workgroup memory (the shortest SPLIT_TILE)."""
    if kv_format in TQ_SPECS:
        cap = min(TQ_MAX_SCORES // group, TQ_MAX_SPLIT)
    else:
        cap = PLAIN_MAX_SCORES // group
    max_seq = np.asarray(max_seq, dtype=np.int64)
    want = -(-max_seq * (n_kv_heads * n_queries) // target_workgroups)
    # the least power of two >= want (log2 of an integer below 2**52 rounds the right
    # way at a power of two), at least SPLIT_TILE, at most cap (a power of two)
    s = np.left_shift(1, np.ceil(np.log2(np.maximum(want, 1))).astype(np.int64))
    s = np.minimum(np.maximum(s, SPLIT_TILE), cap)
    return s, -(-max_seq // s)


def partial_bytes(n_queries: int, n_heads: int, n_splits: Any, head_dim: int) -> Any:
    """[acc | m | l] of every (query, head, split), rounded up to whole vec4s
    (the merge kernel binds it as ``array<vec4<f32>>``); ``n_splits`` may be an array."""
    n = n_queries * n_heads * n_splits * (head_dim + 2) * 4
    return -(-n // 16) * 16


@dataclass(frozen=True)
class Attends:
    """Split-KV attends of one shape over one slab, as columns (one entry per
    attend): attend ``i``'s ``n_queries`` query rows at word ``q_off[i]`` of ``q``
    (TurboQuant: rotated, ``[q_rot | q_jl | sums]``), its output ``[n, H, d]`` at word
    ``out_off[i]`` of ``out``, over the first ``length[i]`` timesteps of its layer with
    row ``j`` at ``start_pos[i] + j``, through its page table at word ``table_off[i]``
    of the page tables; a TurboQuant attend's layer signs at word ``sign_off[i]``
    (``q``, ``out``: what is bound, an arena whole or a buffer)."""

    q: Resource
    out: Resource
    cache: Cache
    page_shift: int
    n_queries: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    causal: bool
    scale: float
    length: IntColumn
    start_pos: IntColumn
    q_off: IntColumn
    out_off: IntColumn
    table_off: IntColumn
    sign_off: IntColumn = ()

    @classmethod
    def of(cls, a: Attend, sign_off: IntColumn = ()) -> "Attends":
        """The one attend ``a``."""
        (q, q_off), (out, out_off) = _bind(a.q), _bind(a.out)
        return cls(q, out, a.cache, a.page_shift, a.n_queries, a.n_heads, a.n_kv_heads, a.head_dim, a.causal,
                   a.scale, (a.length,), (a.start_pos,), (q_off,), (out_off,), (a.table_off,), sign_off)  # fmt: skip

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def wg_group(self) -> int:
        """Query heads one split workgroup serves: the GQA group where the split
        kernels take it whole (1, 2, 4, 8), else one (any other group: each head
        reads its KV head alone)."""
        return self.group if self.group in SPLIT_GROUPS else 1

    @property
    def flags(self) -> int:
        return 0 if self.causal else P.FLAG_NON_CAUSAL


@dataclass(frozen=True)
class _SplitItem:
    """Split attends of one slab and shape: their splits, their partials' word
    offsets, and whether they read a TurboQuant slab. A part of windowed attends
    (:func:`plan_split_windowed`) reads timesteps from ``t_lo`` (cache row 0 holding
    timestep ``row_base``) and writes splits ``split_base ..`` of its attends'
    ``split_total``; a whole attend reads from 0 and writes all its splits."""

    a: Attends
    split_len: np.ndarray
    n_splits: np.ndarray
    part_off: np.ndarray
    tq: bool
    t_lo: IntColumn | int = 0
    row_base: IntColumn | int = 0
    split_base: IntColumn | int = 0
    split_total: np.ndarray | None = None
    # the merge of windowed attends: splits [0, n_rotated) are the codes' (rotated)
    n_rotated: np.ndarray | None = None

    @property
    def total(self) -> np.ndarray:
        """Every attend's splits in its partials."""
        return self.n_splits if self.split_total is None else self.split_total

    @property
    def rotated(self) -> np.ndarray:
        """Every attend's splits whose accumulators the merge rotates (with ROTATE)."""
        return self.total if self.n_rotated is None else self.n_rotated

    def column(self, name: str) -> np.ndarray:
        """A part field as one entry per attend."""
        value = getattr(self, name)
        return np.full(len(self.n_splits), value, np.int64) if np.isscalar(value) else np.asarray(value, np.int64)


def plan_split(batch: Batch, a: Attends, kv_format: str) -> None:
    """Queue split-KV attends: their split kernel and their merge join the batch's
    (one dispatch each per slab and shape for the whole batch). TurboQuant attends
    read rotated queries (:func:`plan_split_turboquant` rotates them first)."""
    if not split_eligible(kv_format, a.n_heads, a.n_kv_heads, a.head_dim, any_group=True):
        raise ValueError("shape not eligible for the split kernel")
    split_len, n_splits = _splits(batch, kv_format, a, np.asarray(a.length, np.int64))
    item = _SplitItem(a, split_len, n_splits, _partials(batch, a, n_splits), kv_format in TQ_SPECS)
    _defer_split(batch, item, kv_format)
    batch.defer(
        PHASE_MERGE, ("attention_merge", a.out, a.head_dim), item, _flush_merge, rows=item.a.n_queries * len(a.length)
    )


def _splits(batch: Batch, kv_format: str, a: Attends, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(split_len, n_splits) of attends reading ``keys[i]`` timesteps each."""
    split_len, n_splits = split_sizes(
        kv_format, keys, a.n_kv_heads, a.n_queries, a.wg_group, batch.policy.target_workgroups
    )
    if len(n_splits) and int(n_splits.max()) > _limit(batch):
        raise ValueError(f"{int(n_splits.max())} splits pass the dispatch limit")
    return split_len, n_splits


def _partials(batch: Batch, a: Attends, n_splits: np.ndarray) -> np.ndarray:
    """Word offsets of each attend's partials of ``n_splits[i]`` splits, in scratch."""
    nbytes: npt.NDArray[np.int64] = partial_bytes(a.n_queries, a.n_heads, n_splits, a.head_dim)
    first = batch.scratch(int(nbytes.sum()), arena="partial").offset
    return (first + np.cumsum(nbytes) - nbytes) // 4


def _defer_split(batch: Batch, item: _SplitItem, kv_format: str) -> None:
    """Queue ``item``'s split kernel (one dispatch per kernel, slab and shape for the batch)."""
    a = item.a
    if not item.tq:
        base = "attention_split_wide" if wide_split(kv_format, a.head_dim) else "attention_split"
        kernel, constants = plain_kernel(base, kv_format), None
    else:
        kernel = tqx_kernel("attention_split_tqx", kv_format)
        constants = {"GROUP": a.wg_group, "HEAD_DIM": a.head_dim}
    rows = a.n_queries * len(a.length)
    key = (kernel, tuple(sorted((constants or {}).items())), id(a.cache), a.q, a.n_kv_heads, a.group)
    batch.defer(PHASE_ATTEND, key, item, functools.partial(_flush_split, kernel, constants), rows=rows)


def plan_split_turboquant(batch: Batch, a: Attends, kv_format: str) -> None:
    """TurboQuant split attends of plain queries ``a.q``: rotated by ``tq_rotate_q``
    into scratch (each attend's ``[q_rot | q_jl | sums]``), then :func:`plan_split`."""
    plan_split(batch, _rotated(batch, a, kv_format), kv_format)


@dataclass(frozen=True)
class ExactRows:
    """Where windowed TurboQuant attends (:func:`plan_split_windowed`) read rows
    exactly, as columns (one entry per attend): their first ``sinks[i]`` timesteps
    from ``sinks_cache`` (page table at word ``sinks_table[i]``), and the timesteps
    from ``exact_from[i]`` on from ``recent_cache``, whose row 0 holds timestep
    ``recent_base[i]`` (page table at word ``recent_table[i]``): plain slabs of
    ``kv_format`` holding the rows as they were sent."""

    kv_format: str
    sinks_cache: Cache | None  # None: no sinks
    recent_cache: Cache | None  # None: no window
    sinks: IntColumn
    sinks_table: IntColumn
    exact_from: IntColumn
    recent_base: IntColumn
    recent_table: IntColumn


def plan_split_windowed(batch: Batch, a: Attends, kv_format: str, x: ExactRows) -> None:
    """Windowed TurboQuant attends (``reference.windowed_attention``): attend ``i``
    reads its timesteps ``[0, sinks)`` and ``[exact_from, length)`` exactly (``x``)
    and the band between them from the codes of ``a.cache``. Three parts per attend,
    each a split kernel writing its own splits of the attend's partials: the band
    (the format's tqx kernel, rotated queries), the sinks and the recent rows (the
    plain kernel of ``x.kv_format``, plain queries); one merge takes them all under
    one softmax, the band's accumulator rotated back and the exact rows' added in
    the original basis. Any GQA group (a workgroup serves one query head where the
    group is not 1, 2, 4 or 8)."""
    if not split_eligible(kv_format, a.n_heads, a.n_kv_heads, a.head_dim, any_group=True):
        raise ValueError("shape not eligible for the split kernel")
    if not split_eligible(x.kv_format, a.n_heads, a.n_kv_heads, a.head_dim, any_group=True):
        raise ValueError("exact rows' shape not eligible for the split kernel")
    length = np.asarray(a.length, np.int64)
    sinks = np.minimum(np.asarray(x.sinks, np.int64), length)
    exact_from = np.clip(np.asarray(x.exact_from, np.int64), sinks, length)
    rotated = _rotated(batch, a, kv_format)
    band = dataclasses.replace(rotated, length=exact_from)
    # a part's cache is None only where no attend has rows in it: its split is never dispatched
    head = dataclasses.replace(a, cache=cast(Cache, x.sinks_cache), length=sinks, table_off=x.sinks_table, sign_off=())
    tail = dataclasses.replace(a, cache=cast(Cache, x.recent_cache), table_off=x.recent_table, sign_off=())
    len_c, n_c = _splits(batch, kv_format, band, exact_from - sinks)
    len_s, n_s = _splits(batch, x.kv_format, head, sinks)
    len_r, n_r = _splits(batch, x.kv_format, tail, length - exact_from)
    total = n_c + n_s + n_r
    need = int(partial_bytes(a.n_queries, a.n_heads, total, a.head_dim).max())
    if need > batch.arenas.max_binding:  # more than one binding of the partials, alone: never fits
        raise InvalidRequest(
            f"this attend needs {need} bytes of GPU working memory in one buffer (its {a.n_queries} query rows' "
            f"partials over {int(total.max())} splits), more than the adapter binds ({batch.arenas.max_binding}); "
            "nothing was applied: send fewer query rows per call"
        )
    part_off = _partials(batch, a, total)
    parts = (
        (kv_format, _SplitItem(band, len_c, n_c, part_off, True, sinks, 0, 0, total)),
        (x.kv_format, _SplitItem(head, len_s, n_s, part_off, False, 0, 0, n_c, total)),
        (x.kv_format, _SplitItem(tail, len_r, n_r, part_off, False, exact_from, x.recent_base, n_c + n_s, total)),
    )  # fmt: skip
    for fmt, item in parts:
        if item.n_splits.any():
            _defer_split(batch, item, fmt)
    merge = _SplitItem(rotated, len_c, n_c, part_off, True, split_total=total, n_rotated=n_c)
    batch.defer(
        PHASE_MERGE, ("attention_merge", a.out, a.head_dim), merge, _flush_merge, rows=a.n_queries * len(length)
    )


def _rotated(batch: Batch, a: Attends, kv_format: str) -> Attends:
    """``a`` reading its queries rotated: ``tq_rotate_q`` of them into scratch
    (each attend's ``[q_rot | q_jl | sums]``), queued before the attention kernels."""
    each = -(-rotated_q_bytes(a.n_queries, a.n_heads, a.head_dim) // 16) * 16
    count = len(a.q_off)
    first = batch.scratch(each * count).offset
    rot_off = (first + each * np.arange(count, dtype=np.int64)) // 4
    signed = bool(TQ_SPECS[kv_format].key_outliers)
    plan_rotate_q(
        batch,
        Rotate(a.q, whole("scratch"), whole("in"), a.q_off, rot_off, a.sign_off, a.n_queries, a.n_heads,
               a.head_dim, signed),
    )  # fmt: skip
    return Attends(
        whole("scratch"), a.out, a.cache, a.page_shift, a.n_queries, a.n_heads, a.n_kv_heads, a.head_dim,
        a.causal, a.scale, a.length, a.start_pos, rot_off, a.out_off, a.table_off, a.sign_off,
    )  # fmt: skip


def _flush_split(kernel: str, constants: dict[str, int] | None, batch: Batch, items: list[_SplitItem]) -> None:
    first = items[0].a
    attends = [it.a for it in items]
    counts = _per_entry(attends, lambda a: a.n_queries, "length")
    cols: dict[str, Any] = dict(
        n_heads=_per_entry(attends, lambda a: a.n_heads, "length"),
        n_kv_heads=_per_entry(attends, lambda a: a.n_kv_heads, "length"),
        head_dim=_per_entry(attends, lambda a: a.head_dim, "length"),
        max_seq=_cat(attends, "length"),
        start_pos=_cat(attends, "start_pos"),
        scale=_per_entry(attends, lambda a: a.scale, "length"),
        flags=_per_entry(attends, lambda a: a.flags, "length"),
        split_len=_cat(items, "split_len"),
        n_splits=_cat(items, "n_splits"),
        q_off=_cat(attends, "q_off"),
        part_off=_cat(items, "part_off"),
        table_off=_cat(attends, "table_off"),
        kv_group=_per_entry(attends, lambda a: a.group, "length"),
        **{name: np.concatenate([it.column(name) for it in items]) for name in ("t_lo", "row_base", "split_base")},
        split_total=_cat(items, "total"),
    )
    # the item's rows in its partials: q_total (plain block), q_cap (TurboQuant block)
    if not items[0].tq:  # the plain kernel's n_kv_heads: its head groups (a workgroup serves n_heads / it)
        cols.update(
            q_total=counts, q_stride=_per_entry(attends, lambda a: a.n_heads * a.head_dim, "length"),
            n_kv_heads=_per_entry(attends, lambda a: a.n_heads // a.wg_group, "length"),
        )  # fmt: skip
        block = P.SPLIT_PARAMS
        common: dict[str, Any] = dict(page_shift=first.page_shift, kv_dim=first.n_kv_heads * first.head_dim)
    else:
        cols.update(q_cap=counts)
        block = P.TQ_SPLIT_PARAMS
        common = dict(page_shift=first.page_shift, qjl_scale=qjl_scale(first.head_dim), cache_cap=first.cache.rows)
    rows = _Rows.of(counts, cols, dict(q_row=(0, 1)))
    max_splits = max(int(it.n_splits.max()) for it in items)
    _dispatch_rows(
        batch,
        kernel,
        block,
        rows,
        common,
        {0: first.q, 1: first.cache.k, 2: first.cache.v, 3: whole("partial"), 5: TABLES},
        4,
        lambda rows: (max_splits, first.n_heads // first.wg_group, rows),
        constants,
    )


def _flush_merge(batch: Batch, items: list[_SplitItem]) -> None:
    """``attention_merge`` of the batch's split attends; a TurboQuant item's merge also
    applies the inverse rotation with its layer's signs."""
    first = items[0].a
    attends = [it.a for it in items]
    counts = _per_entry(attends, lambda a: a.n_queries, "length")
    rows = _Rows.of(
        counts,
        dict(
            n_heads=_per_entry(attends, lambda a: a.n_heads, "length"),
            n_splits=_cat(items, "total"),
            q_total=counts, out_stride=_per_entry(attends, lambda a: a.n_heads * a.head_dim, "length"),
            sign_off=np.concatenate([it.a.sign_off if it.tq else np.zeros(len(it.a.length), np.int64) for it in items]),
            flags=_per_entry(items, lambda it: P.FLAG_ROTATE if it.tq else 0, "part_off"),
            part_off=_cat(items, "part_off"), out_off=_cat(attends, "out_off"),
            n_rotated=_cat(items, "rotated"),
        ),
        dict(q_row=(0, 1)),
    )  # fmt: skip
    max_heads = max(a.n_heads for a in attends)
    _dispatch_rows(
        batch,
        "attention_merge",
        P.MERGE_PARAMS,
        rows,
        {"head_dim": first.head_dim},
        # plain merges read no signs: the input arena is bound as them (read-only)
        {0: whole("partial"), 1: first.out, 3: whole("in")},
        2,
        lambda rows: (max_heads, rows, 1),
    )


# ── query-block tiled prefill (plain and TurboQuant), batched ──────────────────

TILED_ROWS = 64  # R in attention_prefill_tiled.wgsl
RB_ROWS = 64  # R in attention_prefill_rb.wgsl
TQ_TILED_ROWS = 64  # R in flash_attention_tqx_tiled.wgsl


@dataclass(frozen=True)
class _TiledItem:
    a: Attend
    bq: int  # query rows per block
    tq: TqLayer | None


def _tiled_kernel(
    batch: Batch, a: Attend, kv_format: str, tq: TqLayer | None
) -> tuple[str, int, dict[str, int] | None]:
    """(kernel, query rows per block, override constants) of a query-block attend."""
    if tq is not None:
        return tq.kernel("attention_tqx_tiled"), TQ_TILED_ROWS // a.group, None
    if batch.policy.plain_prefill(kv_format) == "rb":
        constants = {"GROUP": a.group, "HEAD_DIM": a.head_dim} if batch.policy.prefill_rb_specialize else {}
        return plain_kernel("attention_prefill_rb", kv_format), RB_ROWS // a.group, constants
    return plain_kernel("attention_prefill_tiled", kv_format), TILED_ROWS // a.group, None


def _plan_tiled(batch: Batch, a: Attend, kv_format: str, tq: TqLayer | None) -> None:
    """Queue a query-block attend: blocks of R / G query rows x the G heads of a KV
    head; the batch's blocks over one slab and shape run as one dispatch (one params
    block per workgroup), the blocks with the longest causal windows first.

    A plain slab takes ``attention_prefill_rb`` (64-key tiles, outer-product register
    blocks; specialized on G and head_dim unless the policy says otherwise) or
    ``attention_prefill_tiled``, as ``batch.policy.plain_prefill`` says; TurboQuant
    ``attention_tqx_tiled`` (of the layer's format) from rotated queries."""
    if not split_eligible(kv_format, a.n_heads, a.n_kv_heads, a.head_dim):
        raise ValueError(f"shape not eligible for the tiled {kv_format} kernel")
    kernel, bq, constants = _tiled_kernel(batch, a, kv_format, tq)
    (q, _), (out, _) = _bind(a.q), _bind(a.out)
    key = (kernel, tuple(sorted((constants or {}).items())), id(a.cache), q, out, a.n_kv_heads)
    flush = functools.partial(_flush_tiled, kernel, constants)
    batch.defer(PHASE_ATTEND, key, _TiledItem(a, bq, tq), flush, rows=-(-a.n_queries // bq))


def _flush_tiled(kernel: str, constants: dict[str, int] | None, batch: Batch, items: list[_TiledItem]) -> None:
    first = items[0].a
    blocks = []  # (window end, item, first row)
    for it in items:
        a = it.a
        for q_first in range(0, a.n_queries, it.bq):
            last = min(q_first + it.bq, a.n_queries) - 1
            blocks.append((a.length if not a.causal else min(a.start_pos + last + 1, a.length), it, q_first))
    blocks.sort(key=lambda b: -b[0])  # longest windows first: the tail of the dispatch is short blocks
    attends = [it.a for _, it, _ in blocks]
    # the item's query rows: n_queries (plain block), q_cap (TurboQuant block)
    if items[0].tq is None:
        per_item = dict(n_queries=[a.n_queries for a in attends], q_stride=[a.n_heads * a.head_dim for a in attends])
    else:
        # every item of a TurboQuant group has its layer (TqLayer): one kernel
        sign_off = [_word(cast(TqLayer, it.tq).signs) for _, it, _ in blocks]
        per_item = dict(q_cap=[a.n_queries for a in attends], sign_off=sign_off)
    rows = _Rows.of(
        [1] * len(blocks),
        dict(
            **_shape_columns(attends), **per_item, q_base=[q_first for _, _, q_first in blocks],
            q_off=[_word(a.q) for a in attends], out_off=[_word(a.out) for a in attends],
            table_off=[a.table_off for a in attends], out_stride=[a.n_heads * a.head_dim for a in attends],
        ),
    )  # fmt: skip
    q, _ = _bind(first.q)
    out, _ = _bind(first.out)
    ins = whole("in")
    common: dict[str, Any] = dict(page_shift=first.page_shift)
    bindings: dict[int, Resource] = {0: q, 1: first.cache.k, 2: first.cache.v, 3: out}
    if items[0].tq is None:
        block = P.PREFILL_PARAMS
        common.update(kv_dim=first.n_kv_heads * first.head_dim)
        bindings[5] = TABLES
    else:
        block = P.TQ_ATTENTION_PARAMS
        common.update(_tq_common(first))
        bindings.update({5: ins, 6: TABLES})
    _dispatch_rows(
        batch,
        kernel,
        block,
        rows,
        common,
        bindings,
        4,
        lambda rows: (rows, first.n_kv_heads, 1),
        constants,
    )


# ── one planning entry point per kv format ──────────────────────────────────


def _plan_one(batch: Batch, plan: Callable[..., None], *args: Any) -> None:
    """Queue a single-attend plan (tiled, single-pass) to be recorded with the
    batch's attention kernels, after every write and rotation of the batch."""
    batch.defer(PHASE_ATTEND, object(), args, lambda b, items: plan(b, *items[0]))


def plan_attend_plain(batch: Batch, a: Attend, kv_format: str) -> None:
    """Attention over a plain slab (``f32``, ``f16`` or ``bf16``) with the kernel family
    ``batch.policy`` picks for the shape: split-KV (batched with the batch's other
    split attends), the query-block tiled prefill, or the single-pass kernel."""
    path = batch.policy.path(kv_format, a.n_queries, a.n_heads, a.n_kv_heads, a.head_dim)
    if path == "split":
        plan_split(batch, Attends.of(a), kv_format)
    elif path == "tiled":
        _plan_tiled(batch, a, kv_format, None)
    else:
        _plan_one(batch, plan_attention_plain, a, kv_format)


def plan_attend_turboquant(batch: Batch, a: Attend, tq: TqLayer) -> None:
    """TurboQuant attention of ``a.q`` (plain queries) over a layer of any
    ``formats.TQ_SPECS`` format: rotated by ``tq_rotate_q`` into scratch, then the
    format's tqx kernel family ``batch.policy`` picks."""
    fmt = tq.kv_format
    path = batch.policy.path(fmt, a.n_queries, a.n_heads, a.n_kv_heads, a.head_dim)
    if path == "split":
        plan_split_turboquant(batch, Attends.of(a, (_word(tq.signs),)), fmt)
        return
    qrot = batch.scratch(rotated_q_bytes(a.n_queries, a.n_heads, a.head_dim))
    signed = bool(TQ_SPECS[fmt].key_outliers)
    plan_rotate_q(batch, Rotate.one(a.q, qrot, tq.signs, a.n_queries, a.n_heads, a.head_dim, signed))
    a = a.with_q(qrot)
    _plan_tiled(batch, a, fmt, tq) if path == "tiled" else _plan_one(batch, plan_attention_tq, a, tq)
