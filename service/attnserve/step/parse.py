"""Stage 1 of a step: request documents into :class:`Step` columns.

Every append and attend is a step: one layer's operations for one or more
sessions, as columns (``q [B, n, H, d]``, ``k``, ``v [B, m, Hkv, d]``, one
offset and start position per item). A single attend or append is a step of one
(its arrays gain a leading dimension of 1, without a copy); the stacked form of
``POST /v1/batch/attend`` is one step; the items form is grouped into steps by
layer and shape (:func:`group_items`). A step never names one session twice:
an item that repeats a session goes into a later step, so items of one session
and layer apply in item order, each checked against the one before it.

What this stage refuses is malformed as a document (a whole body: it raises) or
as an item (kept in :attr:`Parsed.errors` at the item's position).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np

from ..codec import MediaKind, check_finite, decode_document, wire
from ..contract import Append, Attend, BatchItem, BatchItems, Fields, StackedBatch
from ..errors import ApiError, InvalidRequest

__all__ = [
    "AppendRequest",
    "AttendRequest",
    "Parsed",
    "Step",
    "append_fields",
    "attend_fields",
    "attend_scale",
    "check_count",
    "max_elements",
    "one_append",
    "one_attend",
    "parse_append",
    "parse_attend",
    "parse_batch",
    "parse_batch_document",
    "stacked_request",
]

F32_MAX = float(np.finfo(np.float32).max)

#: How a request was sent, which is how it is answered: one operation (a route,
#: a stream frame), the items form or the stacked form of a batched step.
Form = Literal["one", "items", "stacked"]


@dataclass(frozen=True)
class AppendRequest:
    k: np.ndarray
    v: np.ndarray
    offset: int | None


@dataclass(frozen=True)
class AttendRequest:
    q: np.ndarray
    k: np.ndarray | None
    v: np.ndarray | None
    offset: int | None
    start_pos: int | None
    causal: bool
    scale: float | None
    return_lse: bool = False  # answer the rows' log-sum-exp beside out
    out_dtype: np.dtype[Any] | None = None  # None: q's


@dataclass(frozen=True)
class Step:
    """One layer's operations on distinct sessions, as columns: row ``i`` is the
    operation of ``q[i]`` (None: an append, no attend), after the fused append of
    ``k[i]``, ``v[i]`` if given, on session ``session_ids[i]`` at ``offsets[i]`` and
    ``start_pos[i]`` (None: not given). ``items[i]`` is row ``i``'s position in its
    request. ``q``, ``k``, ``v`` are float32, float16 or bfloat16 (``k`` and ``v``
    alike); ``out_dtype`` is the outputs' (None: ``q``'s); ``lse``: an item asks for
    its log-sum-exp; ``via``: the handle of the open step whose layer call this is
    (None: an append, attend or batch of its own), which may name the step's
    sessions (``store.step_conflict``)."""

    session_ids: list[Any]
    layer: int
    q: np.ndarray | None
    k: np.ndarray | None
    v: np.ndarray | None
    offsets: list[int | None]
    start_pos: list[int | None]
    causal: bool
    scale: float | None
    items: list[int]
    out_dtype: np.dtype[Any] | None = None
    lse: bool = False
    via: int | None = None

    def __len__(self) -> int:
        return len(self.session_ids)

    @property
    def rows(self) -> int:
        """The rows each item appends (0: none)."""
        return 0 if self.k is None else int(self.k.shape[1])

    @property
    def queries(self) -> int:
        """The query rows of each item (0: an append)."""
        return 0 if self.q is None else int(self.q.shape[1])


@dataclass
class Parsed:
    """A parsed request: ``size`` items in ``steps`` (in the order they are checked)
    and ``errors`` (the items the parse refused: position -> problem). ``form`` says
    how it is answered; ``want_lse[i]``: item ``i`` asked for its log-sum-exp."""

    form: Form
    size: int
    steps: list[Step]
    errors: dict[int, ApiError] = field(default_factory=dict)
    want_lse: list[bool] = field(default_factory=list)
    out_shape: tuple[int, ...] = ()  # the stacked form's per-item output shape (n, H, d)
    out_dtype: np.dtype[Any] = np.dtype("<f4")  # the stacked form's output dtype
    squeeze: bool = False  # the stacked answer without its rows axis (a step's call of q [B, H, d])


# ── members ─────────────────────────────────────────────────────────────────


def max_elements(max_bytes: int) -> int:
    """The most array elements a body of ``max_bytes`` can carry (half precision)."""
    return max(1, max_bytes // 2)


def append_fields(f: Fields, max_bytes: int) -> AppendRequest:
    me = max_elements(max_bytes)
    k = f.array("k", max_elements=me)
    v = f.array("v", max_elements=me)
    _one_dtype(k, v)
    return AppendRequest(k, v, f.int("offset"))


def attend_fields(f: Fields, max_bytes: int) -> AttendRequest:
    me = max_elements(max_bytes)
    q = f.array("q", max_elements=me)
    k, v = _fused_kv(f, me)
    return AttendRequest(
        q,
        k,
        v,
        offset=f.int("offset"),
        start_pos=f.int("start_pos"),
        causal=f.bool("causal"),
        scale=attend_scale(f),
        return_lse=f.bool("return_lse"),
        out_dtype=_out_dtype(f),
    )


def _out_dtype(f: Fields) -> np.dtype[Any] | None:
    """The optional ``out_dtype`` of an attend: a wire dtype's name."""
    name: str | None = f.str("out_dtype")
    return None if name is None else wire.DTYPES[name]


def _fused_kv(f: Fields, elements: int, finite: bool = True) -> tuple[Any, Any]:
    """The optional ``k``, ``v`` of an attend (a fused append): both or neither."""
    k = f.array("k", max_elements=elements, finite=finite)
    v = f.array("v", max_elements=elements, finite=finite)
    if (k is None) != (v is None):
        raise InvalidRequest("k, v: a fused append needs both k and v (or neither)")
    if k is not None:
        _one_dtype(k, v)
    return k, v


def _one_dtype(k: np.ndarray, v: np.ndarray) -> None:
    """Rows ``k`` and ``v`` go in one dtype (an engine's K and V share its model's)."""
    if k.dtype != v.dtype:
        raise InvalidRequest(f"k, v: expected one dtype for both, got {wire.dtype_name(k)} and {wire.dtype_name(v)}")


def attend_scale(f: Fields) -> float | None:
    """The optional ``scale`` of an attend: a finite float32 (the kernels take it so)."""
    scale: float | None = f.number("scale")
    if scale is not None:
        with np.errstate(over="ignore"):
            if not np.isfinite(np.float32(scale)):
                raise InvalidRequest(f"scale: expected a finite float32 (|scale| <= {F32_MAX:.7g}), got {scale!r}")
    return scale


def parse_append(raw: bytes, kind: MediaKind | None, max_bytes: int) -> AppendRequest:
    return append_fields(Fields(decode_document(raw, kind, max_bytes), Append, "append"), max_bytes)


def parse_attend(raw: bytes, kind: MediaKind | None, max_bytes: int) -> AttendRequest:
    return attend_fields(Fields(decode_document(raw, kind, max_bytes), Attend, "attend"), max_bytes)


# ── one operation: a step of one ────────────────────────────────────────────


def one_attend(session_id: str, layer: int, req: AttendRequest) -> Parsed:
    """An attend (with its fused append) as a step of one."""
    step = Step(
        [session_id], layer, req.q[None], None if req.k is None else req.k[None],
        None if req.v is None else req.v[None], [req.offset], [req.start_pos], req.causal, req.scale, [0],
        req.out_dtype, req.return_lse,
    )  # fmt: skip
    return Parsed("one", 1, [step], want_lse=[req.return_lse])


def one_append(session_id: str, layer: int, req: AppendRequest) -> Parsed:
    """An append as a step of one."""
    step = Step([session_id], layer, None, req.k[None], req.v[None], [req.offset], [None], True, None, [0])
    return Parsed("one", 1, [step], want_lse=[False])


# ── the batched step ────────────────────────────────────────────────────────


def parse_batch(raw: bytes, kind: MediaKind | None, max_bytes: int, max_items: int) -> Parsed:
    """The items of a batch body, in either form. A body that is malformed as a
    whole (not a map, no ``items`` list or ``session_ids``, too many items, stacked
    arrays of the wrong shape) raises; a malformed item is kept with its problem."""
    return parse_batch_document(decode_document(raw, kind, max_bytes), (), "batch", max_bytes, max_items)


def parse_batch_document(doc: Any, head: tuple[str, ...], what: str, max_bytes: int, max_items: int) -> Parsed:
    """:func:`parse_batch` of a decoded document whose members may also include
    ``head`` (a stream frame's ``id`` and ``op``)."""
    if isinstance(doc, dict) and "session_ids" in doc:
        return _parse_stacked(Fields(doc, StackedBatch, what, head=head), max_bytes, max_items)
    return _parse_items(Fields(doc, BatchItems, what, head=head), max_bytes, max_items)


def check_count(n: int, max_items: int, name: str) -> None:
    if not n:
        raise InvalidRequest(f"{name}: expected a non-empty array")
    if n > max_items:
        raise InvalidRequest(
            f"{name}: {n} items are more than this server takes in one batch ({max_items}); split it",
            max_batch_items=max_items,
        )


@dataclass(frozen=True)
class _Item:
    session_id: str
    layer: int
    attend: AttendRequest


def _parse_items(f: Fields, max_bytes: int, max_items: int) -> Parsed:
    docs = f.list("items")
    check_count(len(docs), max_items, "items")
    errors: dict[int, ApiError] = {}
    items: dict[int, _Item] = {}
    for i, doc in enumerate(docs):
        try:
            g = Fields(doc, BatchItem, f"items[{i}]")
            session_id = g.str("session_id")
            layer = g.int("layer")
            items[i] = _Item(session_id, layer, attend_fields(g, max_bytes))
        except ApiError as e:
            errors[i] = e
    want_lse = [i in items and items[i].attend.return_lse for i in range(len(docs))]
    return Parsed("items", len(docs), group_items(items), errors, want_lse)


def group_items(items: dict[int, _Item]) -> list[Step]:
    """The items (by position) grouped into steps: one per layer, query and row
    shape and dtype, ``causal``, ``scale`` and ``out_dtype``, in order of first
    appearance. An item goes into
    the latest step of its kind unless that step already names its session, or an
    earlier item of its session and layer went into a later step: then it opens a
    new one. So checking the steps in order checks the items of one session and
    layer in item order."""
    groups: list[list[int]] = []
    open_by_key: dict[tuple[object, ...], int] = {}
    named: list[set[str]] = []
    last: dict[tuple[str, int], int] = {}  # (session, layer) -> the step its last item went into
    for i, it in items.items():
        a = it.attend
        kv = None if a.k is None or a.v is None else (a.k.shape, a.v.shape, a.k.dtype)
        key = (it.layer, a.q.shape, a.q.dtype, kv, a.causal, a.scale, a.out_dtype)
        g = open_by_key.get(key)
        mine = (it.session_id, it.layer)
        if g is None or it.session_id in named[g] or g < last.get(mine, -1):
            g = open_by_key[key] = len(groups)
            groups.append([])
            named.append(set())
        groups[g].append(i)
        named[g].add(it.session_id)
        last[mine] = g
    return [_stack([items[i] for i in idx], idx) for idx in groups]


def _stack(items: list[_Item], positions: list[int]) -> Step:
    """Items of one layer and shape as a step's columns (one copy per array)."""
    first = items[0].attend
    q = np.stack([it.attend.q for it in items])
    k = v = None
    if first.k is not None:  # then every item's (group_items' key), v too (_fused_kv)
        k = np.stack(cast("list[np.ndarray]", [it.attend.k for it in items]))
        v = np.stack(cast("list[np.ndarray]", [it.attend.v for it in items]))
    return Step(
        [it.session_id for it in items], items[0].layer, q, k, v,
        [it.attend.offset for it in items], [it.attend.start_pos for it in items],
        first.causal, first.scale, positions, first.out_dtype, any(it.attend.return_lse for it in items),
    )  # fmt: skip


def _parse_stacked(f: Fields, max_bytes: int, max_items: int) -> Parsed:
    """The stacked form: ``session_ids`` (B), one ``layer``, ``q [B, n, H, d]``,
    optional ``k``, ``v [B, m, Hkv, d]``, optional per-item ``offsets`` and
    ``start_pos`` (arrays of B integers or nulls), and ``causal``, ``scale`` for all.
    Item ``i`` is the attend of ``q[i]`` (and ``k[i]``, ``v[i]``) on session
    ``session_ids[i]``, checked as an item of the other form."""
    ids = f.list("session_ids")
    check_count(len(ids), max_items, "session_ids")
    b = len(ids)
    layer = f.int("layer")
    me = max_elements(max_bytes)
    q = f.array("q", max_elements=me, finite=False)
    k, v = _fused_kv(f, me, finite=False)
    arrays = [(name, a) for name, a in (("q", q), ("k", k), ("v", v)) if a is not None]
    for name, a in arrays:
        if a.shape[0] != b:
            raise InvalidRequest(
                f"{name}: expected {b} stacked items (one per session id) in dimension 0, got shape {list(a.shape)}"
            )
    per_item = {name: _per_item(f, name, b) for name in ("offsets", "start_pos")}
    causal, scale, return_lse = f.bool("causal"), attend_scale(f), f.bool("return_lse")
    return stacked_request(ids, layer, q, k, v, per_item, causal, scale, return_lse, _out_dtype(f))


def stacked_request(
    ids: list[Any],
    layer: int,
    q: np.ndarray,
    k: np.ndarray | None,
    v: np.ndarray | None,
    per_item: dict[str, list[Any] | None],
    causal: bool,
    scale: float | None,
    return_lse: bool,
    out_dtype: np.dtype[Any] | None,
    via: int | None = None,
) -> Parsed:
    """The stacked form's request from its members (arrays ``[B, ...]`` of ``B =
    len(ids)`` items, ``per_item``'s ``offsets`` and ``start_pos`` lists or None):
    each item's own problems (a non-finite value, an id that is not a string, a
    bad offset) kept at its position. A step's layer call (``via``: its handle) is
    this request too."""
    b = len(ids)
    arrays = [(name, a) for name, a in (("q", q), ("k", k), ("v", v)) if a is not None]
    errors: dict[int, ApiError] = {}
    for name, a in arrays:  # finiteness of every item at once; the first bad value of a bad item named
        if wire.all_finite(a):
            continue
        bad = wire.nonfinite(a)
        for i in np.flatnonzero(bad.reshape(b, -1).any(axis=1)).tolist():
            try:
                check_finite(a[i], name)
            except ApiError as e:
                errors.setdefault(i, e)
    for i, sid in enumerate(ids):
        if not isinstance(sid, str):
            errors[i] = InvalidRequest(f"session_ids[{i}]: expected a string, got {type(sid).__name__}")
    ints: dict[str, list[int | None]] = {}
    for name in ("offsets", "start_pos"):
        values = per_item[name]
        ints[name] = [None] * b if values is None else values
        if values is None:
            continue
        for i, value in enumerate(values):
            if value is not None and (type(value) is not int or value < 0):
                errors.setdefault(
                    i, InvalidRequest(f"{name}[{i}]: expected an integer >= 0 or null, got {value!r:.40}")
                )
    whole = Step(
        ids, layer, q, k, v, ints["offsets"], ints["start_pos"], causal, scale, list(range(b)), out_dtype, return_lse,
        via,
    )  # fmt: skip
    return Parsed(
        "stacked", b, _without_repeats(whole, errors), errors, [return_lse] * b, tuple(q.shape[1:]),
        q.dtype if out_dtype is None else out_dtype,
    )  # fmt: skip


def _per_item(f: Fields, name: str, b: int) -> list[Any] | None:
    values: list[Any] | None = f.list(name)
    if values is not None and len(values) != b:
        raise InvalidRequest(f"{name}: expected {b} values (one per session id, null for none), got {len(values)}")
    return values


def _without_repeats(step: Step, errors: dict[int, ApiError]) -> list[Step]:
    """The stacked form's items that parsed, as steps that name each session once:
    the step itself (no copy) when every item parsed and no session repeats, else
    the k-th naming of each session in the k-th step."""
    ids = step.session_ids
    if not errors and len(set(ids)) == len(ids):
        return [step]
    rounds: list[list[int]] = []
    seen: dict[str, int] = {}
    for i, sid in enumerate(ids):
        if i in errors:
            continue
        r = seen.get(sid, 0)
        seen[sid] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(i)
    return [_rows(step, idx) for idx in rounds]


def _rows(step: Step, idx: list[int]) -> Step:
    """The step of ``step``'s rows ``idx``."""
    take = np.asarray(idx)

    def pick(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[take]

    return Step(
        [step.session_ids[i] for i in idx], step.layer, pick(step.q), pick(step.k), pick(step.v),
        [step.offsets[i] for i in idx], [step.start_pos[i] for i in idx], step.causal, step.scale,
        [step.items[i] for i in idx], step.out_dtype, step.lse, step.via,
    )  # fmt: skip
