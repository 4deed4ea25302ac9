"""Append K/V to a layer, and attend (with an optional fused append).

Each request goes: negotiate (415, declared 413) -> session and layer (404) ->
read the body (streamed 413) -> decode (400) and check fields (422), off the
event loop when large -> check against the session's reserved state (422, 409,
507) -> queue one GPU job -> await it. Everything up to the queueing runs
without an ``await`` after the body is decoded, so a request is either refused
with every cache untouched, or queued in order.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Request, Response

from ..codec import Fields, MediaKind, array_out, decode_document, encode, read_body, respond
from ..engine import Engine
from ..errors import InvalidRequest, LayerNotFound
from ..gpu.kernels import rotated_q_bytes
from ..store import Session
from .deps import EngineDep, LayerPath, OwnerDep, Runtime, RuntimeDep, SessionDep, WireDep
from .schemas import ok, problems, request_body

__all__ = ["router"]

router = APIRouter(prefix="/v1/sessions/{session_id}/layers/{layer}", tags=["kv"])

_APPEND_FIELDS = ("k", "v", "offset")
F32_MAX = float(np.finfo(np.float32).max)
_ATTEND_FIELDS = ("q", "k", "v", "offset", "start_pos", "causal", "scale")


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


def _max_elements(max_bytes: int) -> int:
    return max(1, max_bytes // 4)


def parse_append(raw: bytes, kind: MediaKind | None, max_bytes: int) -> AppendRequest:
    f = Fields(decode_document(raw, kind, max_bytes), _APPEND_FIELDS, "append")
    me = _max_elements(max_bytes)
    k = f.array("k", max_elements=me)
    v = f.array("v", max_elements=me)
    return AppendRequest(k, v, f.int("offset", None, lo=0))


def parse_attend(raw: bytes, kind: MediaKind | None, max_bytes: int) -> AttendRequest:
    f = Fields(decode_document(raw, kind, max_bytes), _ATTEND_FIELDS, "attend")
    me = _max_elements(max_bytes)
    q = f.array("q", max_elements=me)
    k = f.array("k", None, max_elements=me)
    v = f.array("v", None, max_elements=me)
    if (k is None) != (v is None):
        raise InvalidRequest("k, v: a fused append needs both k and v (or neither)")
    scale = f.number("scale", None)
    if scale is not None:
        with np.errstate(over="ignore"):
            if not np.isfinite(np.float32(scale)):  # the kernels take it as float32
                raise InvalidRequest(f"scale: expected a finite float32 (|scale| <= {F32_MAX:.7g}), got {scale!r}")
    return AttendRequest(
        q, k, v,
        offset=f.int("offset", None, lo=0),
        start_pos=f.int("start_pos", None, lo=0),
        causal=f.bool("causal", True),
        scale=scale,
    )


def _layer(session: Session, layer_path: str) -> int:
    layer = int(layer_path)  # the path pattern allows 1 to 10 digits only
    if not 0 <= layer < session.config.num_layers:
        raise LayerNotFound(
            f"layer {layer} is outside 0..{session.config.num_layers - 1} of session {session.id!r}",
            num_layers=session.config.num_layers,
        )
    return layer


F16_MAX = 65504.0  # the largest finite float16


def _check_kv(session: Session, engine: Engine, k: np.ndarray, v: np.ndarray) -> int:
    c = session.config
    want = (c.num_kv_heads, c.head_dim)
    if k.shape[0] < 1 or k.shape[1:] != want:
        raise InvalidRequest(f"k: expected shape [n >= 1, {want[0]}, {want[1]}], got {list(k.shape)}")
    if v.shape != k.shape:
        raise InvalidRequest(f"v: expected the shape of k {list(k.shape)}, got {list(v.shape)}")
    if c.kv_format == "turboquant":
        # TurboQuant keeps each row's norm as float16: a larger one would be stored
        # as inf and turn that layer's answers into NaN.
        for name, a in (("k", k), ("v", v)):
            # float32 is enough: rows under the limit cannot overflow it, and an
            # overflow is inf, which the check refuses (no float64 copy of the body)
            norms = np.sqrt(np.einsum("nhd,nhd->nh", a, a))
            if norms.max() > F16_MAX:
                i, h = np.unravel_index(int(norms.argmax()), norms.shape)
                raise InvalidRequest(
                    f"{name}[{i}, {h}]: norm {norms[i, h]:.6g} is over {F16_MAX:g}, the largest norm "
                    "turboquant stores (float16); scale the rows down"
                )
    limit = engine.ctx.max_binding
    if k.nbytes > limit:
        rows = limit // (k.nbytes // k.shape[0])
        raise InvalidRequest(
            f"k, v: {k.shape[0]} rows are more than this adapter takes in one request (at most {rows}); "
            "split the append"
        )
    return k.shape[0]


def _check_q(session: Session, engine: Engine, q: np.ndarray) -> int:
    c = session.config
    want = (c.num_qo_heads, c.head_dim)
    if q.shape[0] < 1 or q.shape[1:] != want:
        raise InvalidRequest(f"q: expected shape [n >= 1, {want[0]}, {want[1]}], got {list(q.shape)}")
    n = q.shape[0]
    need = max(q.nbytes, rotated_q_bytes(n, *want) if c.kv_format == "turboquant" else 0)
    limit = engine.ctx.max_binding
    if need > limit:
        rows = limit // (need // n)
        raise InvalidRequest(
            f"q: {n} rows are more than this adapter takes in one request (at most {rows}); split the attend"
        )
    return n


def _fresh(rt: Runtime, session: Session, owner: str | None) -> Session:
    """The session again after an ``await``: it may have been deleted (or even
    deleted and created anew under the same id) meanwhile."""
    return rt.store.get(session.id, owner)


@router.post(
    "/kv",
    summary="Append K/V rows to a layer",
    description="Appends n >= 1 timesteps to the layer and answers its new length. With `offset`, the "
    "append happens only if the layer's length is `offset` (409 offset-mismatch with `length` otherwise): "
    "a retried append is safe.",
    response_class=Response,
    openapi_extra=request_body("AppendJson", "AppendMsgpack"),
    responses={
        **ok(200, "The layer's new length", "AppendResult"),
        **problems(400, 404, 408, 409, 413, 415, 422, 500, 503, 507,
                   slugs={408: "body-timeout", 409: "offset-mismatch, capacity-exceeded"}),
    },
)
async def append_kv(request: Request, layer: LayerPath, rt: RuntimeDep, wire: WireDep, engine: EngineDep,
                    session: SessionDep, owner: OwnerDep) -> Response:
    li = _layer(session, layer)
    max_bytes = rt.settings.max_body_bytes
    raw = await read_body(request, max_bytes)
    req: AppendRequest = await rt.offload(parse_append, raw, wire.request, max_bytes, size=len(raw))
    # From here to the queueing: no await, so the check and the queue order agree.
    session = _fresh(rt, session, owner)
    li = _layer(session, layer)
    rows = _check_kv(session, engine, req.k, req.v)
    res = rt.store.plan_append(session, li, rows, req.offset)
    rt.store.check_budget(res)
    fut = engine.append(session.kv.layers[li], req.k, req.v)
    rt.track(fut, res)
    length = await asyncio.shield(asyncio.wrap_future(fut))
    rt.metrics.rows.inc("append", session.kv_format, amount=rows)
    return respond({"length": length}, wire)


def _attend_body(out: np.ndarray, length: int, kind: MediaKind) -> bytes:
    return encode({"out": array_out(out, kind), "length": length}, kind)


@router.post(
    "/attend",
    summary="Attend (with an optional fused append)",
    description="Appends `k`, `v` first when given (checked with `offset` before), then attends the query rows "
    "`q`: row i sits at position start_pos + i and, with `causal`, attends to timesteps 0..start_pos + i. "
    "A decode step is one call with one row of q, k and v.",
    response_class=Response,
    openapi_extra=request_body("AttendJson", "AttendMsgpack"),
    responses={
        **ok(200, "The attention output and the layer's length", "AttendResultJson", "AttendResultMsgpack"),
        **problems(400, 404, 408, 409, 413, 415, 422, 500, 503, 507,
                   slugs={408: "body-timeout", 409: "offset-mismatch, capacity-exceeded (fused append)"}),
    },
)
async def attend(request: Request, layer: LayerPath, rt: RuntimeDep, wire: WireDep, engine: EngineDep,
                 session: SessionDep, owner: OwnerDep) -> Response:
    li = _layer(session, layer)
    max_bytes = rt.settings.max_body_bytes
    raw = await read_body(request, max_bytes)
    req: AttendRequest = await rt.offload(parse_attend, raw, wire.request, max_bytes, size=len(raw))
    session = _fresh(rt, session, owner)
    li = _layer(session, layer)
    n = _check_q(session, engine, req.q)
    rows = 0
    if req.k is not None:
        rows = _check_kv(session, engine, req.k, req.v)
        res = rt.store.plan_append(session, li, rows, req.offset)
    else:
        res = rt.store.plan_read(session, li, req.offset)
    length = res.new_length
    start_pos = length - n if req.start_pos is None else req.start_pos
    if start_pos < 0 or start_pos + n > length:
        if req.start_pos is None:
            detail = (f"start_pos: q has {n} rows but the layer holds {length} timesteps (the default "
                      f"start_pos, length - n, would be {start_pos}); give start_pos or fewer rows")
        else:
            detail = (f"start_pos: {n} query rows from start_pos {start_pos} pass the layer's length "
                      f"{length} (start_pos + n <= length is required)")
        raise InvalidRequest(detail, length=length)
    rt.store.check_budget(res)
    fut = engine.attend(
        session.kv.layers[li], req.q, k=req.k, v=req.v, start_pos=start_pos, causal=req.causal, scale=req.scale
    )
    rt.track(fut, res)
    out, got_length = await asyncio.shield(asyncio.wrap_future(fut))
    fmt = session.kv_format
    if rows:
        rt.metrics.rows.inc("append", fmt, amount=rows)
    rt.metrics.rows.inc("query", fmt, amount=n)
    size = out.nbytes * (1 if wire.response == "msgpack" else 6)  # JSON text is ~6x the float32 bytes
    body = await rt.offload(_attend_body, out, got_length, wire.response, size=size)
    return respond(None, wire, body=body)
