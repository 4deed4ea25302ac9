"""Snapshots: a session as one self-describing MessagePack blob, and its restore.

The blob (``application/vnd.msgpack``)::

    {"format": "attnserve-snapshot", "version": 1,
     "config": {num_layers, num_qo_heads, num_kv_heads, head_dim, kv_format, max_tokens, seed},
     "layers": [{"length": int, "capacity": int, "k": bin, "v": bin}, ...],
     "checksum": "sha256:<hex>"}

``k``/``v`` are each layer's K and V buffers exactly as held on the GPU (the
whole capacity, in the format's layout), so a restored session attends
bit-identically. The checksum covers the format, version, configuration and
every layer (see :func:`digest`). A restore is validated completely before any
GPU work, and creates nothing unless it succeeds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response

from ..codec import read_body, respond, wire
from ..errors import ApiError, InvalidRequest, InvalidSnapshot, UnsupportedMediaType
from ..kvcache import SessionConfig, SessionKV
from .deps import EngineDep, OwnerDep, RuntimeDep, SessionDep, SessionIdPath, WireDep
from .schemas import ok, problems
from .sessions import SESSION_ID_RE, parse_create

__all__ = ["router", "FORMAT", "VERSION", "digest", "build_blob"]

router = APIRouter(prefix="/v1/sessions/{session_id}", tags=["snapshots"])

FORMAT = "attnserve-snapshot"
VERSION = 1
_CONFIG_KEYS = ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "kv_format", "max_tokens", "seed")
_LAYER_KEYS = frozenset({"length", "capacity", "k", "v"})
_TOP_KEYS = frozenset({"format", "version", "config", "layers", "checksum"})


def digest(fmt: str, version: int, config: dict[str, Any], layers: list[dict[str, Any]]) -> str:
    """``sha256:<hex>`` over the format, version, config (canonical JSON) and each
    layer's length, capacity and K/V bytes."""
    h = hashlib.sha256()
    h.update(json.dumps([fmt, version, config], sort_keys=True, separators=(",", ":")).encode())
    for layer in layers:
        k, v = layer["k"], layer["v"]
        h.update(struct.pack("<QQQQ", layer["length"], layer["capacity"], len(k), len(v)))
        h.update(k)
        h.update(v)
    return "sha256:" + h.hexdigest()


def build_blob(config: SessionConfig, layers: list[tuple[int, int, bytes, bytes]]) -> bytes:
    cfg = {k: getattr(config, k) for k in _CONFIG_KEYS}
    ls = [{"length": n, "capacity": c, "k": kb, "v": vb} for n, c, kb, vb in layers]
    return wire.packb(
        {"format": FORMAT, "version": VERSION, "config": cfg, "layers": ls,
         "checksum": digest(FORMAT, VERSION, cfg, ls)}
    )


@router.get(
    "/snapshot",
    summary="Snapshot a session",
    description="The session as one self-describing MessagePack blob: format name and version, the "
    "configuration with its seed, each layer's length and cache exactly as held on the GPU, and a checksum. "
    "Taken after every request already accepted for the session.",
    response_class=Response,
    responses={
        200: {"description": "The snapshot blob.",
              "content": {wire.MSGPACK: {"schema": {"type": "string", "format": "binary"}}}},
        **problems(404, 503, slugs={404: "session-not-found"}),
    },
)
async def get_snapshot(session: SessionDep, rt: RuntimeDep, engine: EngineDep) -> Response:
    kv = session.kv

    def read(ctx) -> list[tuple[int, int, bytes, bytes]]:
        out = []
        for layer in kv.layers:
            kb, vb = layer.read_words(ctx.device)
            out.append((layer.length, layer.capacity, kb, vb))
        return out

    layers = await asyncio.shield(asyncio.wrap_future(engine.call(read)))
    size = sum(len(kb) + len(vb) for _, _, kb, vb in layers)
    blob = await rt.offload(build_blob, session.config, layers, size=size)
    return Response(blob, media_type=wire.MSGPACK,
                    headers={"Content-Disposition": f'attachment; filename="{session.id}.attnsnap"'})


def _check_tq_norms(i: int, config: SessionConfig, n: int, cap: int, kb: bytes, vb: bytes) -> None:
    """The f16 norm halves of the used slots must be finite (appends never store others)."""
    d, hkv = config.head_dim, config.num_kv_heads
    vecs = hkv * cap
    for name, buf, words_before in (("k", kb, vecs * (d // 16 + d // 32)), ("v", vb, vecs * (d // 16))):
        words = np.frombuffer(buf, "<u4", count=vecs, offset=4 * words_before).reshape(hkv, cap)[:, :n]
        halves = np.stack([words & 0xFFFF, words >> 16]).astype(np.uint16).view(np.float16)
        if not np.isfinite(halves).all():
            raise InvalidSnapshot(f"layers[{i}].{name}: non-finite norms")


def _parse_blob(raw: bytes, max_bytes: int, limit_for) -> tuple[SessionConfig, list[tuple[int, int, bytes, bytes]]]:
    """Check everything about a blob (InvalidSnapshot otherwise); ``limit_for(fmt, hkv, d)``
    is the adapter's max_tokens limit."""
    try:
        doc = wire.unpackb(raw, max_bytes=max_bytes)
    except wire.WireError as e:
        raise InvalidSnapshot(f"not a MessagePack snapshot: {e}") from None
    if not isinstance(doc, dict) or set(doc) != _TOP_KEYS:
        got = sorted(map(str, doc)) if isinstance(doc, dict) else type(doc).__name__
        raise InvalidSnapshot(f"expected a map with the keys {sorted(_TOP_KEYS)}, got {got}")
    if doc["format"] != FORMAT:
        raise InvalidSnapshot(f"format: expected {FORMAT!r}, got {doc['format']!r}")
    if type(doc["version"]) is not int or doc["version"] != VERSION:
        raise InvalidSnapshot(f"version: this server reads version {VERSION}, got {doc['version']!r}")
    cfg = doc["config"]
    if not isinstance(cfg, dict) or set(cfg) != set(_CONFIG_KEYS):
        raise InvalidSnapshot(f"config: expected exactly the keys {list(_CONFIG_KEYS)}")
    try:
        req = parse_create(cfg)
    except ApiError as e:
        raise InvalidSnapshot(f"config: {e.detail}") from None
    if req.max_tokens is None or req.seed is None:
        raise InvalidSnapshot("config: max_tokens and seed are required")
    limit = limit_for(req.kv_format, req.num_kv_heads, req.head_dim)
    if req.max_tokens > limit:
        raise InvalidSnapshot(f"config: max_tokens {req.max_tokens} passes this adapter's limit {limit}")
    config = SessionConfig(req.num_layers, req.num_qo_heads, req.num_kv_heads, req.head_dim, req.kv_format,
                           req.max_tokens, req.seed)
    layers = doc["layers"]
    if not isinstance(layers, list) or len(layers) != config.num_layers:
        raise InvalidSnapshot(f"layers: expected a list of {config.num_layers} layers")
    probe = SessionKV(config).layers[0]  # sizing only; no GPU memory
    out = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or set(layer) != _LAYER_KEYS:
            raise InvalidSnapshot(f"layers[{i}]: expected exactly the keys {sorted(_LAYER_KEYS)}")
        n, cap, kb, vb = layer["length"], layer["capacity"], layer["k"], layer["v"]
        if type(n) is not int or type(cap) is not int or not 0 <= n <= cap <= config.max_tokens:
            raise InvalidSnapshot(
                f"layers[{i}]: expected 0 <= length <= capacity <= max_tokens {config.max_tokens}, "
                f"got length {n!r}, capacity {cap!r}"
            )
        if not isinstance(kb, bytes) or not isinstance(vb, bytes):
            raise InvalidSnapshot(f"layers[{i}]: k and v must be binary")
        want = probe.buffer_bytes(cap) if cap else (0, 0)
        if (len(kb), len(vb)) != want:
            raise InvalidSnapshot(
                f"layers[{i}]: expected {want[0]} and {want[1]} bytes of K and V for capacity {cap}, "
                f"got {len(kb)} and {len(vb)}"
            )
        if config.kv_format == "f32" and n:
            used = n * config.num_kv_heads * config.head_dim
            for name, b in (("k", kb), ("v", vb)):
                if not np.isfinite(np.frombuffer(b, "<f4", count=used)).all():
                    raise InvalidSnapshot(f"layers[{i}].{name}: non-finite values")
        if config.kv_format == "turboquant" and n:
            _check_tq_norms(i, config, n, cap, kb, vb)
        out.append((n, cap, kb, vb))
    if doc["checksum"] != digest(doc["format"], doc["version"], cfg, layers):
        raise InvalidSnapshot("checksum: the blob does not match its checksum (corrupted or truncated)")
    return config, out


@router.put(
    "/snapshot",
    summary="Restore a snapshot",
    description="Restores a snapshot blob under the id in the path (409 session-exists if taken; 422 "
    "invalid-snapshot for a truncated, corrupted, wrong-version or oversized blob, and nothing is created). "
    "Attends on the restored session give bit-identical results.",
    status_code=201,
    response_class=Response,
    openapi_extra={"requestBody": {"required": True, "content": {
        wire.MSGPACK: {"schema": {"type": "string", "format": "binary"}}}}},
    responses={
        **ok(201, "The restored session's info", "SessionInfo"),
        **problems(408, 409, 413, 415, 422, 503, 507,
                   slugs={408: "body-timeout", 409: "session-exists", 422: "invalid-snapshot"}),
    },
)
async def put_snapshot(session_id: SessionIdPath, request: Request, rt: RuntimeDep, wire_: WireDep,
                       engine: EngineDep, owner: OwnerDep) -> Response:
    if wire_.request == "json":
        raise UnsupportedMediaType("a snapshot is a MessagePack blob: send Content-Type application/vnd.msgpack")
    if not SESSION_ID_RE.fullmatch(session_id):
        raise InvalidRequest(f"session_id: expected 1 to 64 of [A-Za-z0-9_-], got {session_id!r}")
    store = rt.store
    store.check_room(session_id, owner)  # the restored session is the caller's (ids are per tenant)
    raw = await read_body(request, rt.settings.max_body_bytes)
    config, layers = await rt.offload(_parse_blob, raw, rt.settings.max_body_bytes, engine.max_tokens_limit,
                                      size=len(raw))
    # From here to the queueing: no await, so the id and budget checks hold.
    kv = SessionKV(config)
    need = sum(kv.layers[i].bytes_for(cap) for i, (_, cap, _, _) in enumerate(layers) if cap)
    if any(n for n, _, _, _ in layers):
        need += kv.signs_bytes()
    hold = store.hold(session_id, need, owner)  # 409 / 507 now; the id and bytes stay taken while restoring

    def restore(ctx) -> None:
        try:
            for layer, (n, cap, kb, vb) in zip(kv.layers, layers):
                layer.load_words(ctx.device, n, cap, kb, vb)
            if kv.signs_bytes() and any(n for n, _, _, _ in layers):
                kv.signs_buffer(ctx.device)
        except BaseException:
            kv.release()
            raise

    try:
        fut = engine.call(restore)
        try:
            await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:  # the request is gone: free what the restore loads
            fut.add_done_callback(lambda f: f.exception() is None and engine.release(kv))
            raise
    finally:
        store.unhold(hold)
    session = store.adopt(kv, owner=owner, session_id=session_id)
    return respond(session.info(), wire_, 201, headers={"Location": f"/v1/sessions/{session.id}"})
