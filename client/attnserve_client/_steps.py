"""Batched steps: their requests and the decoding of their answers.

* :class:`AttendItem`: one attend of a batched step (``client.attend_batch``), for
  one session and layer; ``stacked_body`` / :class:`StackedStep`: the stacked form
  (``client.attend_stacked``);
* a step split over replicas: its parts, and their answers merged in item order.

Requests are built and answers decoded here once for both transports (HTTP, and
the streams of ``_streams.py``) and both drivers (sync and async).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, Union

import numpy as np

from . import tensors, wire
from .errors import (
    APIError,
    AttnServeError,
    InvalidInput,
    InvalidRequest,
    InvalidResponse,
    StepNotFound,
    parse_problem,
    refused,
)
from .merge import Attention

if TYPE_CHECKING:  # annotations only
    from typing_extensions import Unpack

__all__ = [
    "AttendItem",
    "CallSink",
    "Destination",
    "AttendOptions",
    "StackedOptions",
    "BatchError",
    "StackedStep",
    "StepOptions",
    "StepState",
]


@dataclass(frozen=True)
class AttendItem:
    """One attend of a batched step: ``q`` over ``layer`` of ``session`` (a session
    object or its id), with an optional fused append of ``k``, ``v`` (checked at
    ``offset`` when given) and the options of ``Session.attend`` (``out_dtype``:
    the dtype its output comes back in, default ``q``'s; see ``tensors.out_dtype_name``)."""

    session: Any
    layer: int
    q: Any
    k: Any = None
    v: Any = None
    offset: int | None = None
    start_pos: int | None = None
    causal: bool = True
    scale: float | None = None
    return_lse: bool = False
    out_dtype: Any = None

    @property
    def session_id(self) -> str:
        return session_id_of(self.session)


def session_id_of(session: Any) -> str:
    """The id of ``session``: a session, or its id."""
    sid = getattr(session, "session_id", session)
    if not isinstance(sid, str):
        raise InvalidInput(f"session: expected a session or its id, got {session!r}")
    return sid


ItemLike = Union[AttendItem, Mapping[str, Any]]


class AttendOptions(TypedDict, total=False):
    """The options of one attend: a fused append of ``k``, ``v`` (checked at ``offset``
    when given), ``start_pos``, ``causal``, ``scale``, ``return_lse`` and
    ``out_dtype`` (as ``Session.attend``)."""

    k: Any
    v: Any
    offset: int | None
    start_pos: int | None
    causal: bool
    scale: float | None
    return_lse: bool
    out_dtype: Any


class StackedOptions(TypedDict, total=False):
    """The options of a stacked step: one value per session in ``offsets`` and
    ``start_pos`` (None: none), and ``causal``, ``scale``, ``return_lse``,
    ``out_dtype`` for all."""

    offsets: Sequence[int | None] | None
    start_pos: Sequence[int | None] | None
    causal: bool
    scale: float | None
    return_lse: bool
    out_dtype: Any


class BatchError(AttnServeError):
    """Some items of a batched step failed. ``results`` holds, per item in order,
    its output (the item was applied) or its error: an :class:`APIError` (it changed
    nothing), or, for the items of a request to one replica that got no answer, the
    :class:`APIConnectionError` of that request; ``errors`` maps item index to error."""

    def __init__(self, results: list[Any]):
        self.results = results
        self.errors = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
        first = next(iter(self.errors.items()))
        super().__init__(f"{len(self.errors)} of {len(results)} batch items failed; item {first[0]}: {first[1]}")


def as_item(item: ItemLike) -> AttendItem:
    if isinstance(item, AttendItem):
        return item
    if isinstance(item, Mapping):
        try:
            return AttendItem(**item)
        except TypeError as exc:
            raise InvalidInput(f"batch item: {exc}") from None
    raise InvalidInput(f"batch item: expected an AttendItem or a mapping, got {type(item).__name__}")


def _array(a: Any, name: str) -> dict[str, Any]:
    try:
        return wire.encode_array(wire.check_finite(tensors.as_wire_array(a, name=name), name=name), name=name)
    except wire.WireError as exc:
        raise InvalidInput(str(exc)) from None


def _check_kv_dtypes(doc: Mapping[str, Any]) -> None:
    """A fused append's ``k`` and ``v`` (encoded, when there are) go in one dtype."""
    if "k" in doc and doc["k"]["dtype"] != doc["v"]["dtype"]:
        raise InvalidInput(f"v: expected the dtype of k ({doc['k']['dtype']}), got {doc['v']['dtype']}")


def _out_dtype(value: Any) -> str | None:
    """An attend's ``out_dtype`` as its wire name (``tensors.out_dtype_name``)."""
    try:
        return tensors.out_dtype_name(value)
    except wire.WireError as exc:
        raise InvalidInput(str(exc)) from None


def answer_dtype(sent: Mapping[str, Any]) -> str:
    """The dtype an attend's ``out`` comes back in, from its members as sent: its
    ``out_dtype``, else its ``q``'s."""
    dtype: str = sent.get("out_dtype") or sent["q"]["dtype"]
    return dtype


def attend_members(item: AttendItem) -> dict[str, Any]:
    """The wire members of one attend (arrays encoded once)."""
    if isinstance(item.layer, bool) or not isinstance(item.layer, (int, np.integer)) or item.layer < 0:
        raise InvalidInput(f"layer: expected an int >= 0, got {item.layer!r}")
    doc: dict[str, Any] = {
        "session_id": item.session_id,
        "layer": int(item.layer),
        "q": _array(item.q, "q"),
        "causal": bool(item.causal),
    }
    if (item.k is None) != (item.v is None):
        raise InvalidInput("k, v: expected both or neither")
    if item.k is not None:
        doc["k"], doc["v"] = _array(item.k, "k"), _array(item.v, "v")
        _check_kv_dtypes(doc)
    for name in ("offset", "start_pos"):
        value = getattr(item, name)
        if value is not None:
            doc[name] = int(value)
    if item.scale is not None:
        doc["scale"] = float(item.scale)
    if item.return_lse:
        doc["return_lse"] = True
    out_dtype = _out_dtype(item.out_dtype)
    if out_dtype is not None:
        doc["out_dtype"] = out_dtype
    return doc


def batch_body(items: Sequence[ItemLike]) -> tuple[list[AttendItem], dict[str, Any]]:
    checked = [as_item(i) for i in items]
    if not checked:
        raise InvalidInput("items: expected at least one item")
    return checked, {"items": [attend_members(i) for i in checked]}


def batch_idempotent(items: list[AttendItem]) -> bool:
    """A batch may be retried safely when no item appends without an offset."""
    return all(i.k is None or i.offset is not None for i in items)


def attend_out(doc: Any, sent: Mapping[str, Any], what: str) -> tuple[np.ndarray, int]:
    """The ``out`` (:func:`decode_out`) and ``length`` of an attend's answer ``doc``
    (``sent``: the attend's members as sent)."""
    if not isinstance(doc, Mapping) or type(doc.get("length")) is not int:
        raise InvalidResponse(f"{what}: expected {{out, length}}, got {doc!r:.200}")
    return decode_out(doc, answer_dtype(sent), 3, what), doc["length"]


def decode_out(doc: Mapping[str, Any], dtype: str, ndim: int, what: str) -> np.ndarray:
    """An answer's ``out`` of ``ndim`` dimensions, which comes in ``dtype`` (a wire
    name, :func:`answer_dtype`): a MessagePack array must have that dtype; JSON's
    numbers (float32, a half answer's values exactly) are taken into it."""
    try:
        out = wire.decode_array(doc.get("out"), name="out", ndim=ndim, finite=False)
    except wire.WireError as exc:
        raise InvalidResponse(f"{what}: {exc}") from None
    if isinstance(doc.get("out"), list):
        return tensors.to_wire_dtype(out, dtype)
    if wire.dtype_name(out) != dtype:
        raise InvalidResponse(f"{what}: expected out of dtype {dtype}, got {wire.dtype_name(out)}")
    return out


def lse_out(doc: Any, out: np.ndarray, what: str) -> np.ndarray:
    """The ``lse`` of an answer asked with ``return_lse``: ``out``'s shape without
    its last axis."""
    try:
        lse = wire.decode_array(doc.get("lse"), name="lse", ndim=out.ndim - 1, finite=False)
    except wire.WireError as exc:
        raise InvalidResponse(f"{what}: {exc}") from None
    if lse.shape != out.shape[:-1]:
        raise InvalidResponse(f"{what}: expected lse of shape {out.shape[:-1]}, got {lse.shape}")
    return lse


def as_given(out: np.ndarray, lse: np.ndarray | None, like: Any, out_dtype: str | None = None) -> Any:
    """``out`` as the queries ``like`` were given (``tensors.answer``; ``out_dtype``:
    the wire name the caller asked for, if any), or :class:`Attention` ``(out, lse)``
    of both when there is an ``lse``."""
    if lse is None:
        return tensors.answer(out, like, out_dtype)
    return Attention(tensors.answer(out, like, out_dtype), tensors.answer(lse, like, "<f4"))  # lse: always float32


def attend_answer(doc: Any, out: np.ndarray, like: Any, sent: Mapping[str, Any], what: str) -> Any:
    """An attend's answer as the caller asked for it (``sent``: its members as sent):
    ``out``, or :class:`Attention` ``(out, lse)`` with ``return_lse`` (:func:`as_given`)."""
    lse = lse_out(doc, out, what) if sent.get("return_lse") else None
    return as_given(out, lse, like, sent.get("out_dtype"))


def track_length(item: AttendItem, length: int) -> None:
    """Keep a session object's tracked length current (its next append's offset)."""
    lengths = getattr(item.session, "_lengths", None)
    if isinstance(lengths, list) and 0 <= item.layer < len(lengths):
        lengths[item.layer] = length


def batch_results(items: list[AttendItem], body: Mapping[str, Any], doc: Any) -> list[np.ndarray]:
    """Per item its output (``body``: the step as sent); raises :class:`BatchError`
    when any item failed."""
    return raise_failed(item_results(items, body, doc))


def raise_failed(results: list[Any]) -> list[Any]:
    """``results`` (per item an output or an error), or :class:`BatchError` when any
    item failed."""
    if any(isinstance(r, BaseException) for r in results):
        raise BatchError(results)
    return results


def item_results(items: list[AttendItem], body: Mapping[str, Any], doc: Any) -> list[Any]:
    """Per item its output, or the :class:`APIError` of an item that failed
    (``body``: the step as sent, ``{"items": [...]}``)."""
    results = doc.get("results") if isinstance(doc, Mapping) else None
    if not isinstance(results, list) or len(results) != len(items):
        raise InvalidResponse(f"attend_batch: expected {len(items)} results, got {results!r:.200}")
    out: list[Any] = []
    for i, (item, sent, r) in enumerate(zip(items, body["items"], results)):
        if isinstance(r, Mapping) and isinstance(r.get("error"), Mapping):
            err = r["error"]
            status = err.get("status") if type(err.get("status")) is int else 500
            out.append(parse_problem(status, err))
            continue
        what = f"attend_batch item {i}"
        arr, length = attend_out(r, sent, what)
        track_length(item, length)
        out.append(attend_answer(r, arr, item.q, sent, what))
    return out


# -- the stacked form -----------------------------------------------------------


@dataclass(frozen=True)
class StackedStep:
    """One stacked batched step (``attend_stacked``): the sessions in item order,
    the layer, and whether ``q`` came without its row axis (``[B, H, d]``: one query
    row per session, answered as ``[B, H, d]``)."""

    sessions: list[Any]
    layer: int
    squeeze: bool
    like: Any = None  # the queries as given: a tensor's output is a tensor (tensors.answer)
    return_lse: bool = False  # answer Attention(out, lse)
    out_dtype: str | None = None  # the wire name the caller asked the output in (None: q's)
    answered_in: str = wire.DTYPE  # the dtype out comes in: out_dtype, else q's (answer_dtype)
    # q, k, v as converted for the wire, in their given shapes (None: no k, v): a step
    # split over replicas slices these (``stacked_parts``) rather than converting again
    host: dict[str, np.ndarray | None] = field(default_factory=dict, repr=False, compare=False)
    # a layer call's ``out=`` (None: none): where its answer goes, and what it answers
    dest: Destination | None = field(default=None, repr=False, compare=False)

    def result(self, doc: Any) -> Any:
        """The stacked output (:class:`Attention` with ``return_lse``); raises
        :class:`BatchError` when any item failed."""
        out, lse, failed = self.outcome(doc)
        answer = self.answer(out, lse)
        if failed:
            raise BatchError([failed.get(i, _item(answer, i)) for i in range(len(out))])
        return answer

    def answer(self, out: np.ndarray, lse: np.ndarray | None) -> Any:
        """``out`` (and ``lse``) as the step's queries were given (:func:`as_given`)."""
        if self.return_lse and lse is None:
            raise InvalidResponse("attend_stacked: expected lse (return_lse)")
        if self.dest is not None:
            given = self.dest.fill(out)
            if lse is None or not self.return_lse:
                return given
            return Attention(given, tensors.answer(lse, self.like, "<f4"))  # lse: a new array, always float32
        return as_given(out, lse if self.return_lse else None, self.like, self.out_dtype)

    def outcome(self, doc: Any) -> tuple[np.ndarray, np.ndarray | None, dict[int, APIError]]:
        """The stacked output, its ``lse`` (None unless asked for) and the errors of
        the items that failed, by index."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("lengths"), list):
            raise InvalidResponse(f"attend_stacked: expected {{out, lengths, errors}}, got {doc!r:.200}")
        lengths, errors = doc["lengths"], doc.get("errors") or []
        out = decode_out(doc, self.answered_in, 4, "attend_stacked")
        b = len(self.sessions)
        if out.shape[0] != b or len(lengths) != b or not isinstance(errors, list):
            raise InvalidResponse(f"attend_stacked: expected {b} items, got out {list(out.shape)}")
        lse = lse_out(doc, out, "attend_stacked") if self.return_lse else None
        if self.squeeze:
            out = out[:, 0]
            lse = None if lse is None else lse[:, 0]
        failed: dict[int, APIError] = {}
        for err in errors:
            i = err.get("item") if isinstance(err, Mapping) else None
            if type(i) is not int or not 0 <= i < b:
                raise InvalidResponse(f"attend_stacked: expected errors with an item index, got {err!r:.200}")
            failed[i] = parse_problem(err.get("status") if type(err.get("status")) is int else 500, err)
        for i, (session, length) in enumerate(zip(self.sessions, lengths)):
            if i not in failed and type(length) is int:
                track_length(AttendItem(session, self.layer, None), length)
        return out, lse, failed


def _item(answer: Any, i: int) -> Any:
    """Item ``i`` of a stacked answer (an :class:`Attention`'s: both parts)."""
    return Attention(answer.out[i], answer.lse[i]) if isinstance(answer, Attention) else answer[i]


def _stacked_array(a: Any, name: str, b: int | None) -> tuple[dict[str, Any], np.ndarray]:
    """``a`` encoded as ``[B, rows, heads, head_dim]``, and as converted in its given shape."""
    try:
        given = arr = wire.check_finite(tensors.as_wire_array(a, name=name), name=name)
    except wire.WireError as exc:
        raise InvalidInput(str(exc)) from None
    if arr.ndim == 3:
        arr = arr[:, None]
    if arr.ndim != 4 or (b is not None and arr.shape[0] != b):
        want = f"[{b if b is not None else 'B'}, rows, heads, head_dim] or [B, heads, head_dim]"
        raise InvalidInput(f"{name}: expected shape {want}, got {list(np.shape(a))}")
    return wire.encode_array(arr, name=name), given


def stacked_arrays(q: Any, k: Any, v: Any, b: int | None) -> tuple[dict[str, Any], dict[str, np.ndarray | None]]:
    """The stacked form's ``q`` (and ``k``, ``v``) encoded as ``[B, rows, heads,
    head_dim]`` (``b``: B, None: any), and as converted in their given shapes
    (``StackedStep.host``)."""
    members: dict[str, Any] = {}
    members["q"], qa = _stacked_array(q, "q", b)
    host: dict[str, np.ndarray | None] = {"q": qa, "k": None, "v": None}
    if (k is None) != (v is None):
        raise InvalidInput("k, v: expected both or neither")
    if k is not None:
        members["k"], host["k"] = _stacked_array(k, "k", b)
        members["v"], host["v"] = _stacked_array(v, "v", b)
        _check_kv_dtypes(members)
    return members, host


def _per_session(values: Sequence[Any] | None, name: str, b: int) -> list[int | None] | None:
    if values is None:
        return None
    out = [None if x is None else int(x) for x in values]
    if len(out) != b:
        raise InvalidInput(f"{name}: expected {b} values (one per session, None for none), got {len(out)}")
    return out


def stacked_body(
    sessions: Sequence[Any], layer: int, q: Any, k: Any = None, v: Any = None, **options: Unpack[StackedOptions]
) -> tuple[StackedStep, dict[str, Any], bool]:
    """The body of a stacked step, what decodes its answer, and whether it is safe
    to retry (no append, or every session's append checked at its offset)."""
    offsets, start_pos = options.get("offsets"), options.get("start_pos")
    causal, scale, return_lse = options.get("causal", True), options.get("scale"), options.get("return_lse", False)
    sessions = list(sessions)
    if not sessions:
        raise InvalidInput("sessions: expected at least one session")
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
        raise InvalidInput(f"layer: expected an int >= 0, got {layer!r}")
    b = len(sessions)
    ids = [session_id_of(s) for s in sessions]
    body: dict[str, Any] = {"session_ids": ids, "layer": int(layer), "causal": bool(causal)}
    arrays, host = stacked_arrays(q, k, v, b)
    body.update(arrays)
    qa = host["q"]
    assert qa is not None
    for name, values in (("offsets", offsets), ("start_pos", start_pos)):
        checked = _per_session(values, name, b)
        if checked is not None:
            body[name] = checked
    if scale is not None:
        body["scale"] = float(scale)
    if return_lse:
        body["return_lse"] = True
    out_dtype = _out_dtype(options.get("out_dtype"))
    if out_dtype is not None:
        body["out_dtype"] = out_dtype
    idempotent = k is None or (offsets is not None and None not in body["offsets"])
    step = StackedStep(sessions, int(layer), qa.ndim == 3, q, bool(return_lse), out_dtype, answer_dtype(body), host)
    return step, body, idempotent


# -- a batched step split over replicas -----------------------------------------


def item_parts(
    checked: list[AttendItem], body: Mapping[str, Any], groups: list[list[int]]
) -> list[tuple[list[AttendItem], dict[str, Any], bool]]:
    """The parts of an items-form step, one per replica group: ``(items, body, idempotent)``."""
    parts = []
    for idx in groups:
        sub = [checked[i] for i in idx]
        parts.append((sub, {"items": [body["items"][i] for i in idx]}, batch_idempotent(sub)))
    return parts


def merge_items(n: int, groups: list[list[int]], parts: list[Any]) -> list[Any]:
    """Per item, in order, its part's result (``item_results``) or the exception the
    whole part raised; :class:`BatchError` when any item failed."""
    results: list[Any] = [None] * n
    for idx, got in zip(groups, parts):
        for j, i in enumerate(idx):
            results[i] = got if isinstance(got, BaseException) else got[j]
    return raise_failed(results)


def stacked_parts(
    step: StackedStep, body: Mapping[str, Any], options: StackedOptions, groups: list[list[int]]
) -> list[tuple[StackedStep, dict[str, Any], bool]]:
    """The parts of a stacked step, one per replica group: ``(step, body, idempotent)``."""
    arrays = step.host
    offsets, start_pos = body.get("offsets"), body.get("start_pos")  # checked, one per item
    parts = []
    for idx in groups:
        sub = {name: None if a is None else a[idx] for name, a in arrays.items()}
        opts: StackedOptions = {
            **options,
            "offsets": None if offsets is None else [offsets[i] for i in idx],
            "start_pos": None if start_pos is None else [start_pos[i] for i in idx],
        }
        parts.append(stacked_body([step.sessions[i] for i in idx], step.layer, sub["q"], sub["k"], sub["v"], **opts))
    return parts


def merge_stacked(step: StackedStep, groups: list[list[int]], parts: list[Any]) -> Any:
    """The stacked output of ``step`` from each part's ``StackedStep.outcome`` (or the
    exception the whole part raised), as ``step.answer`` gives it; :class:`BatchError`
    when any item failed."""
    n = len(step.sessions)
    out: np.ndarray | None = None
    lse: np.ndarray | None = None
    results: list[Any] = [None] * n
    for idx, got in zip(groups, parts):
        if isinstance(got, BaseException):
            for i in idx:
                results[i] = got
            continue
        sub_out, sub_lse, failed = got
        if out is None:
            out = np.zeros((n, *sub_out.shape[1:]), dtype=sub_out.dtype)  # every part's: step.answered_in
            lse = None if sub_lse is None else np.zeros((n, *sub_lse.shape[1:]), dtype=np.float32)
        out[idx] = sub_out
        if lse is not None:
            lse[idx] = sub_lse
        for j, i in enumerate(idx):
            results[i] = failed.get(j)
    if out is None:
        raise BatchError(results)
    answer = step.answer(out, lse)
    if any(isinstance(r, BaseException) for r in results):
        raise BatchError([r if isinstance(r, BaseException) else _item(answer, i) for i, r in enumerate(results)])
    return answer


# -- an open step ---------------------------------------------------------------


class StepOptions(TypedDict, total=False):
    """What a step fixes at its opening (``open_step``): the rows each session
    appends per layer call (``rows``; 0: none), its query rows (``queries``; default
    ``rows``, or 1 when ``rows`` is 0), the ``layers`` it calls (default: all), the
    ``dtype`` of ``q``, ``k``, ``v`` (default ``"<f4"``), and ``causal``, ``scale``,
    ``return_lse``, ``out_dtype`` for every call."""

    rows: int
    queries: int | None
    layers: Sequence[int] | None
    dtype: Any
    causal: bool
    scale: float | None
    return_lse: bool
    out_dtype: Any


def _count_arg(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise refused(InvalidRequest, f"{name}: expected an int >= {least}, got {value!r}")
    return int(value)


def _step_dtype(value: Any) -> str:
    """A step's ``dtype`` as its wire name (the names ``out_dtype`` takes; None: ``"<f4"``)."""
    try:
        name = tensors.out_dtype_name(value)
    except wire.WireError as exc:
        raise refused(InvalidRequest, str(exc).replace("out_dtype", "dtype", 1)) from None
    return wire.DTYPE if name is None else name


def _no_sharded(session: Any) -> None:
    from .sharded import _ShardedBase  # (sharded imports the client, which imports this module)

    if isinstance(session, _ShardedBase):
        raise InvalidInput(
            "open_step: a ShardedSession spreads over several servers and a step runs on one; "
            "give its shards' sessions, or use its attend"
        )


def step_open_body(sessions: Sequence[Any], **options: Unpack[StepOptions]) -> tuple[list[Any], dict[str, Any]]:
    """The sessions of a step and the body of its opening, checked as the server
    checks it (a mistake raises what the server would answer, also an :class:`InvalidInput`)."""
    sessions = list(sessions)
    for s in sessions:
        _no_sharded(s)
    if not sessions:
        raise refused(InvalidRequest, "session_ids: expected at least one session")
    ids = [session_id_of(s) for s in sessions]
    if len(set(ids)) != len(ids):
        twice = next(sid for sid in ids if ids.count(sid) > 1)
        raise refused(InvalidRequest, f"session_ids: expected distinct sessions, got {twice!r} more than once")
    rows = _count_arg("rows", options.get("rows", 1), 0)
    body: dict[str, Any] = {"session_ids": ids, "rows": rows}
    queries = options.get("queries")
    body["queries"] = (rows or 1) if queries is None else _count_arg("queries", queries, 1)
    layers = options.get("layers")
    if layers is not None:
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
            raise refused(InvalidRequest, f"layers: expected a non-empty sequence of layer indexes, got {layers!r}")
        checked = [_count_arg(f"layers[{i}]", x, 0) for i, x in enumerate(layers)]
        if len(set(checked)) != len(checked):
            raise refused(InvalidRequest, f"layers: expected distinct layer indexes, got {checked}")
        body["layers"] = checked
    body["dtype"] = _step_dtype(options.get("dtype"))
    causal = options.get("causal", True)
    if not isinstance(causal, (bool, np.bool_)):
        raise refused(InvalidRequest, f"causal: expected a bool, got {causal!r}")
    body["causal"] = bool(causal)
    scale = options.get("scale")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.number)) or not np.isfinite(scale):
            raise refused(InvalidRequest, f"scale: expected a finite float, got {scale!r}")
        body["scale"] = float(scale)
    if options.get("return_lse", False):
        body["return_lse"] = True
    out_dtype = _out_dtype(options.get("out_dtype"))
    if out_dtype is not None:
        body["out_dtype"] = out_dtype
    return sessions, body


def one_replica(replicas: int) -> InvalidInput:
    """The refusal of a step whose sessions live on several replicas (behind a router)."""
    return InvalidInput(
        f"open_step: the sessions live on {replicas} replicas; a step runs on one server, so its sessions must "
        "all live on one replica (open one step per replica, or use attend_stacked, which splits the batch)"
    )


def _config_of(session: Any) -> tuple[int, int, int] | None:
    """``(num_qo_heads, num_kv_heads, head_dim)`` of a session object (None: an id)."""
    config = getattr(session, "_config", None)
    shape = tuple(getattr(config, name, None) for name in ("num_qo_heads", "num_kv_heads", "head_dim"))
    return shape if all(type(x) is int for x in shape) else None  # type: ignore[return-value]


def call_arrays(members: Mapping[str, Any]) -> list[memoryview]:
    """The bytes of a layer call's encoded arrays, q then k and v (a call frame's
    body), as they are: no copy."""
    return [memoryview(members[name]["data"]).cast("B") for name in ("q", "k", "v") if name in members]


class CallSink:
    """Where a layer call's reply body is received (a frames call reply, read off
    the socket into it; a shared-memory reply, copied from the region into it): the
    bytes of the call's ``out=`` destination, then, with ``return_lse``, a fresh
    float32 ``lse``. Registered by the call's id before the call is sent."""

    __slots__ = ("out", "lse", "nbytes", "filled")

    def __init__(self, out: memoryview, lse: np.ndarray | None):
        self.out = out
        self.lse = lse
        self.nbytes = out.nbytes + (0 if lse is None else lse.nbytes)
        self.filled = False  # set by the channel that received the whole reply into it

    def views(self) -> list[memoryview]:
        """The body's parts, in the order they come: ``out``, then ``lse``."""
        return [self.out] if self.lse is None else [self.out, self.lse.reshape(-1).view(np.uint8).data]


#: A CUDA destination's pinned host buffers, by shape and torch dtype: each with the
#: event its last copy to the device recorded (None: none yet)
PinnedPool = dict[tuple[tuple[int, ...], Any], list[tuple[Any, Any]]]


class Destination:
    """A layer call's ``out=``: the caller's array or tensor (``given``) and the host
    array the answer's bytes go to (``host``: ``given`` itself, a view of a CPU
    tensor's memory, or a pinned host buffer of the step's for a CUDA tensor, copied
    to it on the stream that was current at the call, without blocking)."""

    __slots__ = ("given", "host", "_bytes", "_lse_shape", "_sink", "_pinned", "_pool", "_stream")

    def __init__(self, given: Any, host: np.ndarray, lse_shape: tuple[int, ...] | None):
        self.given = given
        self.host = host
        self._bytes = host.reshape(-1).view(np.uint8).data
        self._lse_shape = lse_shape
        self._sink: CallSink | None = None
        self._pinned: Any = None  # (a CUDA destination) the pinned buffer the host array views
        self._pool: list[tuple[Any, Any]] | None = None
        self._stream: Any = None

    def sink(self) -> CallSink:
        """Where the call reply's body is received (a fresh ``lse`` with ``return_lse``)."""
        lse = None if self._lse_shape is None else np.empty(self._lse_shape, np.float32)
        self._sink = CallSink(self._bytes, lse)
        return self._sink

    def fill(self, out: np.ndarray) -> Any:
        """``given``, holding the answer ``out`` (copied into it unless it was
        received there; for a CUDA tensor, its copy to the device enqueued)."""
        if self._sink is None or not self._sink.filled:  # not received in place: decoded from a document
            np.copyto(self.host, out.reshape(self.host.shape))
        pinned = self._pinned
        if pinned is not None:
            torch = tensors._torch()
            with torch.cuda.stream(self._stream):
                self.given.copy_(pinned, non_blocking=bool(pinned.is_pinned()))
                event = torch.cuda.Event()
                event.record(self._stream)
            assert self._pool is not None
            self._pool.append((pinned, event))  # reused once this copy is done (event)
            self._pinned = None
        return self.given


def _refuse_out(out: Any, shape: tuple[int, ...], dtype: str, why: str) -> APIError:
    got = f"{type(out).__name__} of shape {list(getattr(out, 'shape', ()))}, dtype {getattr(out, 'dtype', None)}"
    return refused(
        InvalidRequest,
        f"out: expected a C-contiguous writable numpy array or torch tensor (CPU or CUDA) of this call's answer, "
        f"shape {list(shape)} and dtype {dtype}: {why}; got a {got}",
    )


def destination(
    out: Any,
    shape: tuple[int, ...],
    dtype: str,
    lse_shape: tuple[int, ...] | None,
    pools: PinnedPool,
) -> Destination:
    """A layer call's ``out=``, checked against its answer's ``shape`` and ``dtype`` (a
    wire name); ``lse_shape``: the 4-D ``lse``'s with ``return_lse`` (None: none);
    ``pools``: the step's pinned host buffers (CUDA destinations).

    Raises:
        InvalidRequest: (also an ``InvalidInput``) not such an array or tensor.
    """
    if type(out) is not np.ndarray and tensors.is_tensor(out):
        torch = tensors._torch()
        if out.dtype != tensors._torch_dtypes()[dtype] or tuple(out.shape) != shape:
            raise _refuse_out(out, shape, dtype, "another shape or dtype")
        if not out.is_contiguous():
            raise _refuse_out(out, shape, dtype, "not contiguous")
        if out.device.type == "cpu":
            return Destination(out, tensors.host_view(out.detach()), lse_shape)
        if out.device.type != "cuda":
            raise _refuse_out(out, shape, dtype, f"a tensor on {out.device}")
        pool = pools.setdefault((shape, out.dtype), [])
        if pool:
            pinned, event = pool.pop()
            if event is not None:
                event.synchronize()  # its last copy to the device is done: it may be written again
        else:
            pinned = torch.empty(shape, dtype=out.dtype, pin_memory=True)
        dest = Destination(out, tensors.host_view(pinned), lse_shape)
        dest._pinned, dest._pool, dest._stream = pinned, pool, torch.cuda.current_stream(out.device)
        return dest
    if not isinstance(out, np.ndarray):
        raise _refuse_out(out, shape, dtype, "not an array")
    if out.dtype != wire.DTYPES[dtype] or out.shape != shape:
        raise _refuse_out(out, shape, dtype, "another shape or dtype")
    flags = out.flags
    if not flags.c_contiguous or not flags.writeable:
        raise _refuse_out(out, shape, dtype, "not C-contiguous" if flags.writeable else "read-only")
    return Destination(out, out, lse_shape)


class StepState:
    """An open step as the client holds it: what its opening fixed, the token it is
    at and the layers called in it (kept from the answers, as the server keeps them),
    and the checks and requests of its layer calls, written once for every driver
    (HTTP, the streams; sync and async).

    A call's arrays are converted as ``attend_stacked`` converts them (no copy when
    they are C-contiguous in a wire dtype). Buffers kept for the step's shapes, into
    which strided views and device tensors would be copied, were measured and
    left out: no gain at decoding's sizes (client time per call 30 against 32 us at
    32 x 9 heads of 64, 51 against 54 us at 32 x 32 of 128), mixed at a prefill's
    (slower at 24 MB, 23 % faster at 96 MB): the Python around a call, not its
    copies, is what costs there (issue 53's binary call frame)."""

    def __init__(self, sessions: list[Any], sent: Mapping[str, Any], doc: Any):
        what = "open_step"
        if not isinstance(doc, Mapping):
            raise InvalidResponse(f"{what}: expected {{step, layers, ...}}, got {doc!r:.200}")
        handle, layers, token = doc.get("step"), doc.get("layers"), doc.get("token", 0)
        if type(handle) is not int or type(token) is not int:
            raise InvalidResponse(f"{what}: expected the step's handle and token as ints, got {doc!r:.200}")
        if not isinstance(layers, list) or not layers or not all(type(x) is int for x in layers):
            raise InvalidResponse(f"{what}: expected the step's layers, got {layers!r:.200}")
        if doc.get("session_ids", sent["session_ids"]) != sent["session_ids"]:
            raise InvalidResponse(f"{what}: the step's sessions are not the ones asked for: {doc!r:.200}")
        self.handle = handle
        self.sessions = sessions
        self.session_ids: list[str] = list(sent["session_ids"])
        self.layers: list[int] = list(layers)
        self.rows: int = doc["rows"] if type(doc.get("rows")) is int else sent["rows"]
        self.queries: int = doc["queries"] if type(doc.get("queries")) is int else sent["queries"]
        self.dtype: str = doc["dtype"] if doc.get("dtype") in wire.DTYPES else sent["dtype"]
        self.return_lse = bool(sent.get("return_lse", False))
        self.out_dtype: str | None = sent.get("out_dtype")
        self.lengths = doc.get("lengths")
        # each layer's sessions' lengths, as the answers leave them (a call reply
        # carries none: its every item appended ``rows``)
        self._layer_lengths: dict[int, list[int]] | None = None
        if isinstance(self.lengths, list) and len(self.lengths) == len(self.session_ids):
            per_session = [x for x in self.lengths if isinstance(x, list) and len(x) == len(self.layers)]
            if len(per_session) == len(self.lengths) and all(type(n) is int for x in per_session for n in x):
                self._layer_lengths = {layer: [x[j] for x in per_session] for j, layer in enumerate(self.layers)}
        configs = {_config_of(s) for s in sessions}
        self.shape = configs.pop() if len(configs) == 1 else None  # (heads, kv heads, head dim) when known
        self.token = token
        self.called: set[int] = set()
        self.broken: Any = None
        self.closed = False
        self._layer_set = frozenset(self.layers)
        self._lock = threading.Lock()
        self._pinned: PinnedPool = {}  # the pinned host buffers of its calls' CUDA destinations (out=)

    @property
    def route(self) -> str:
        """The session a router sends the step's requests by (its first)."""
        return self.session_ids[0]

    # -- a layer call -------------------------------------------------------------

    def call(self, layer: Any, q: Any, k: Any, v: Any, out: Any = None) -> tuple[StackedStep, dict[str, Any]]:
        """A layer call's arrays (``{q, k, v}``, encoded), checked against the step
        before anything is sent, and what decodes its answer (:meth:`finish`);
        ``out``: where the answer goes (:func:`destination`; its sink:
        ``step.dest.sink()``), None: a new array."""
        if self.closed:
            raise refused(StepNotFound, f"step {self.handle}: closed")
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or int(layer) not in self._layer_set:
            raise refused(InvalidRequest, f"layer {layer!r} is not one of this step's layers {self.layers}")
        if self.rows and (k is None or v is None):
            raise refused(InvalidRequest, f"k, v: this step appends {self.rows} rows a call: expected both")
        if not self.rows and (k is not None or v is not None):
            raise refused(InvalidRequest, "k, v: this step appends no rows (rows=0): expected neither")
        given = q
        try:
            members, host = stacked_arrays(q, k, v, None)  # B: checked with the rest of the shape (_check)
        except InvalidInput as exc:
            raise refused(InvalidRequest, str(exc)) from None
        heads = (None, None, None) if self.shape is None else self.shape
        self._check(members["q"], host["q"], "q", self.queries, heads[0], heads[2], "queries")
        if k is not None:
            self._check(members["k"], host["k"], "k", self.rows, heads[1], heads[2], "rows")
            self._check(members["v"], host["v"], "v", self.rows, heads[1], heads[2], "rows")
        qa = host["q"]
        assert qa is not None
        answered_in = self.out_dtype or self.dtype
        dest = None
        if out is not None:
            lse_shape = (qa.shape[0], self.queries, qa.shape[-2]) if self.return_lse else None
            with self._lock:
                dest = destination(out, qa.shape, answered_in, lse_shape, self._pinned)
        step = StackedStep(
            self.sessions, int(layer), qa.ndim == 3, given, self.return_lse, self.out_dtype, answered_in, host, dest
        )
        return step, members

    def _check(
        self, sent: Mapping[str, Any], given: Any, name: str, rows: int, heads: int | None, d: int | None, what: str
    ) -> None:
        if sent["dtype"] != self.dtype:
            raise refused(
                InvalidRequest,
                f"{name}: expected this step's dtype {self.dtype}, got {sent['dtype']} (convert it first)",
            )
        b, n, h, dim = sent["shape"]
        want = [len(self.session_ids), rows, heads if heads is not None else h, d if d is not None else dim]
        squeezed = given.ndim == 3
        if [b, n, h, dim] != want or (squeezed and rows != 1):
            shape = f"[{want[0]}, {rows}, {want[2]}, {want[3]}]" + (
                f" or [{want[0]}, {want[2]}, {want[3]}]" if rows == 1 else ""
            )
            raise refused(
                InvalidRequest,
                f"{name}: expected shape {shape} (this step's sessions, {what} {rows}), got {list(given.shape)}",
            )

    def finish(self, step: StackedStep, doc: Any) -> Any:
        """The answer of a layer call (as ``attend_stacked``'s, :meth:`StackedStep.result`),
        after its bookkeeping: a call that applied to any item marks its layer called
        (one that failed for some items breaks the step, as the server counts it), and
        the token advances once every layer of the step has been called."""
        if isinstance(doc, Mapping) and "call_reply" in doc:
            doc = self._call_reply_document(step, doc["call_reply"])
        self._track_lengths(step.layer, doc)
        errors = doc.get("errors") if isinstance(doc, Mapping) else None
        failed = len({e.get("item") for e in errors if isinstance(e, Mapping)}) if isinstance(errors, list) else 0
        token = doc.get("token") if isinstance(doc, Mapping) else None
        with self._lock:
            if type(token) is int:
                if token != self.token:
                    self.token, self.called = token, set()
            if failed < len(self.session_ids):
                self.called.add(step.layer)
                if failed and self.broken is None:
                    self.broken = {"layer": step.layer, "token": self.token, "errors": errors}
                if self.called >= self._layer_set:
                    self.token += 1
                    self.called = set()
        return step.result(doc)

    def _track_lengths(self, layer: int, doc: Any) -> None:
        """Keep each session's length of ``layer`` from an answer's ``lengths``."""
        lengths = doc.get("lengths") if isinstance(doc, Mapping) else None
        with self._lock:
            held = None if self._layer_lengths is None else self._layer_lengths.get(layer)
            if held is None or not isinstance(lengths, list) or len(lengths) != len(held):
                return
            for i, n in enumerate(lengths):
                if type(n) is int:
                    held[i] = n

    def _call_reply_document(self, step: StackedStep, body: memoryview | CallSink) -> dict[str, Any]:
        """The answer document a call reply stands for: every item applied, ``out``
        (and ``lse``) the reply's bytes (or the :class:`CallSink` they were received
        into), in the shapes the call's q gave."""
        qa = step.host["q"]
        assert qa is not None
        b = len(self.session_ids)
        shape = [b, self.queries, *qa.shape[-2:]]
        n_out = int(np.prod(shape)) * wire.DTYPES[step.answered_in].itemsize
        want = n_out + (int(np.prod(shape[:3])) * 4 if self.return_lse else 0)
        if body.nbytes != want:
            raise InvalidResponse(f"step call: a call reply of {body.nbytes} bytes, expected {want}")
        if isinstance(body, CallSink):  # (its size is the destination's: checked when it was made)
            out_bytes: memoryview = body.out
            lse_bytes: Any = body.lse
        else:
            out_bytes, lse_bytes = body[:n_out], body[n_out:]
        with self._lock:
            held = None if self._layer_lengths is None else self._layer_lengths.get(step.layer)
            lengths: list[int | None] = [None] * b if held is None else [n + self.rows for n in held]
        doc: dict[str, Any] = {
            "out": {"dtype": step.answered_in, "shape": shape, "data": out_bytes},
            "lengths": lengths,
            "errors": [],
        }
        if self.return_lse:
            doc["lse"] = {"dtype": wire.DTYPE, "shape": shape[:3], "data": memoryview(lse_bytes).cast("B")}
        return doc

    def update(self, doc: Any) -> dict[str, Any]:
        """Take the token of ``GET /v1/steps/{step}``'s answer; the answer itself."""
        if not isinstance(doc, Mapping) or type(doc.get("token")) is not int:
            raise InvalidResponse(f"step info: expected {{step, token, ...}}, got {doc!r:.200}")
        with self._lock:
            if doc["token"] != self.token:
                self.token, self.called = doc["token"], set()
            if doc.get("broken") is not None:
                self.broken = doc["broken"]
        return dict(doc)
