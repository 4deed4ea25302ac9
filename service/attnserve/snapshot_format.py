"""The snapshot format: a session as one self-describing MessagePack blob.

The blob (``application/vnd.msgpack``)::

    {"format": "attnserve-snapshot", "version": 1,
     "config": {num_layers, num_qo_heads, num_kv_heads, head_dim, kv_format, max_tokens, seed},
     "layers": [{"length": int, "capacity": int, "k": bin, "v": bin}, ...],
     "checksum": "sha256:<hex>"}

``k``/``v`` are each layer's K and V buffers exactly as held on the GPU (the
whole capacity, in the format's layout), so a restored session attends
bit-identically. A session with exact sinks or a window (issue 27) adds ``sinks``
and ``window`` to the config, and to each compressed layer ``"exact": {"sinks":
rows | nil, "recent": rows | nil, "recent_base": int, "held_from": int}``, each rows
``{"length", "capacity", "k", "v"}`` in the float32 layout (``recent``'s row 0 is
timestep ``recent_base``); a session without them is written as before. The
checksum covers the format, version, configuration and every layer (see
:func:`digest`). :func:`parse_blob` validates a blob completely before any GPU
work; :func:`load` is the one restore path (``PUT .../snapshot`` and the snapshot
directory at start both use it).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Callable

import numpy as np

from .codec import wire
from .errors import ApiError, InvalidSnapshot
from .formats import PLAIN_DTYPES, TQ_SPECS, key_words, norm_region, outlier_region, value_words
from .kv.config import SessionConfig
from .kv.session import SessionKV
from .pool import PageLayout
from .session_spec import parse_create

__all__ = [
    "FORMAT", "VERSION", "Layers", "LayerWords", "digest", "build_blob", "parse_blob", "read_layers",
    "restore_bytes", "load",
]  # fmt: skip


class LayerWords(tuple[int, int, bytes, bytes]):
    """A layer as a snapshot holds it: ``(length, capacity, K bytes, V bytes)``, and a
    windowed layer's exact rows in ``exact`` (the blob's ``exact`` member; None: none)."""

    exact: dict[str, Any] | None

    def __new__(cls, length: int, capacity: int, k: bytes, v: bytes, exact: dict[str, Any] | None = None) -> LayerWords:
        self = super().__new__(cls, (length, capacity, k, v))
        self.exact = exact
        return self


#: Per layer: (length, capacity, K bytes, V bytes), a LayerWords where a layer has exact rows.
Layers = list[tuple[int, int, bytes, bytes]]

FORMAT = "attnserve-snapshot"
VERSION = 1
_CONFIG_KEYS = ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "kv_format", "max_tokens", "seed")
_WINDOW_KEYS = ("sinks", "window")  # in the config only where a session has them
_LAYER_KEYS = frozenset({"length", "capacity", "k", "v"})
_EXACT_KEYS = frozenset({"sinks", "recent", "recent_base", "held_from"})
_TOP_KEYS = frozenset({"format", "version", "config", "layers", "checksum"})


def digest(fmt: str, version: int, config: dict[str, Any], layers: list[dict[str, Any]]) -> str:
    """``sha256:<hex>`` over the format, version, config (canonical JSON) and each
    layer's length, capacity and K/V bytes."""
    h = hashlib.sha256()
    h.update(json.dumps([fmt, version, config], sort_keys=True, separators=(",", ":")).encode())
    for layer in layers:
        _digest_rows(h, layer)
        exact = layer.get("exact")
        if isinstance(exact, dict):
            h.update(struct.pack("<qq", exact.get("recent_base", -1), exact.get("held_from", -1)))
            for part in (exact.get("sinks"), exact.get("recent")):
                if isinstance(part, dict):
                    _digest_rows(h, part)
    return "sha256:" + h.hexdigest()


def _digest_rows(h: Any, rows: dict[str, Any]) -> None:
    k, v = rows["k"], rows["v"]
    h.update(struct.pack("<QQQQ", rows["length"], rows["capacity"], len(k), len(v)))
    h.update(k)
    h.update(v)


def build_blob(config: SessionConfig, layers: Layers) -> bytes:
    cfg = {k: getattr(config, k) for k in _CONFIG_KEYS}
    if config.windowed:
        cfg.update({k: getattr(config, k) for k in _WINDOW_KEYS})
    ls = [{"length": n, "capacity": c, "k": kb, "v": vb} for n, c, kb, vb in layers]
    for entry, layer in zip(ls, layers):
        if getattr(layer, "exact", None) is not None:
            entry["exact"] = layer.exact  # type: ignore[attr-defined]
    blob: bytes = wire.packb(
        {
            "format": FORMAT,
            "version": VERSION,
            "config": cfg,
            "layers": ls,
            "checksum": digest(FORMAT, VERSION, cfg, ls),
        }
    )
    return blob


def _check_tq_norms(i: int, fmt: str, config: SessionConfig, n: int, cap: int, kb: bytes, vb: bytes) -> None:
    """The f16 norm halves of the used slots must be finite (appends never store others);
    the norms are the last region of a slab, after ``sum(others) * vecs`` words."""
    d, hkv = config.head_dim, config.num_kv_heads
    vecs = hkv * cap
    kr, vr = key_words(fmt, hkv, d), value_words(fmt, hkv, d)
    kn, vn = norm_region(fmt, True), norm_region(fmt, False)
    for name, buf, words_before in (("k", kb, vecs * sum(kr[:kn])), ("v", vb, vecs * sum(vr[:vn]))):
        words = np.frombuffer(buf, "<u4", count=vecs, offset=4 * words_before).reshape(hkv, cap)[:, :n]
        halves = np.stack([words & 0xFFFF, words >> 16]).astype(np.uint16).view(np.float16)
        if not np.isfinite(halves).all():
            raise InvalidSnapshot(f"layers[{i}].{name}: non-finite norms")


def _check_tq_outliers(i: int, fmt: str, config: SessionConfig, n: int, cap: int, kb: bytes, vb: bytes) -> None:
    """Formats with outlier channels: the outliers of the used slots must have channels
    under head_dim (the kernels index the query and the rotation by them) and finite
    halves (outlier 0's is in the norm word, checked with the norms); the outlier region
    is the one after the norms."""
    d, hkv, spec = config.head_dim, config.num_kv_heads, TQ_SPECS[fmt]
    vecs = hkv * cap
    for name, buf, regions, count in (
        ("k", kb, key_words(fmt, hkv, d), spec.key_outliers),
        ("v", vb, value_words(fmt, hkv, d), spec.value_outliers),
    ):
        if not count:
            continue
        hw, cw = outlier_region(count)
        words = np.frombuffer(buf, "<u4", count=vecs * (hw + cw), offset=4 * vecs * sum(regions[:-1]))
        words = words.reshape(hkv, cap, hw + cw)[:, :n]
        halves = np.stack([words[..., :hw] & 0xFFFF, words[..., :hw] >> 16], axis=-1).reshape(hkv, n, 2 * hw)
        if not np.isfinite(halves[..., : count - 1].astype(np.uint16).view(np.float16)).all():
            raise InvalidSnapshot(f"layers[{i}].{name}: non-finite outlier values")
        channels = np.stack([(words[..., hw:] >> (8 * b)) & 0xFF for b in range(4)], axis=-1)
        channels = channels.reshape(hkv, n, 4 * cw)[..., :count]
        if (channels >= d).any():
            h, t, j = (int(x) for x in np.argwhere(channels >= d)[0])
            raise InvalidSnapshot(
                f"layers[{i}].{name}: outlier {j} of head {h} at timestep {t} names channel {int(channels[h, t, j])}, "
                f"past head_dim {d}"
            )


def parse_blob(
    raw: bytes | memoryview, max_bytes: int, limit_for: Callable[[tuple[str, ...], int, int], int]
) -> tuple[SessionConfig, Layers]:
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
    if not isinstance(cfg, dict) or not set(_CONFIG_KEYS) <= set(cfg) <= {*_CONFIG_KEYS, *_WINDOW_KEYS}:
        raise InvalidSnapshot(f"config: expected the keys {list(_CONFIG_KEYS)} (and {list(_WINDOW_KEYS)} if any)")
    try:
        req = parse_create(cfg)
    except ApiError as e:
        raise InvalidSnapshot(f"config: {e.detail}") from None
    if req.max_tokens is None or req.seed is None:
        raise InvalidSnapshot("config: max_tokens and seed are required")
    limit = limit_for(req.layer_formats, req.num_kv_heads, req.head_dim)
    if req.max_tokens > limit:
        raise InvalidSnapshot(f"config: max_tokens {req.max_tokens} passes this adapter's limit {limit}")
    config = SessionConfig(
        req.num_layers, req.num_qo_heads, req.num_kv_heads, req.head_dim, req.kv_format, req.max_tokens, req.seed,
        req.sinks, req.window,
    )  # fmt: skip
    layers = doc["layers"]
    if not isinstance(layers, list) or len(layers) != config.num_layers:
        raise InvalidSnapshot(f"layers: expected a list of {config.num_layers} layers")
    out: Layers = []
    for i, layer in enumerate(layers):
        layout, fmt = config.layer_layout(i), config.layer_formats[i]  # the contiguous layout snapshots keep
        keys = _LAYER_KEYS | ({"exact"} if config.windowed and fmt in TQ_SPECS else set())
        if not isinstance(layer, dict) or set(layer) != keys:
            raise InvalidSnapshot(f"layers[{i}]: expected exactly the keys {sorted(keys)}")
        n, cap, kb, vb = layer["length"], layer["capacity"], layer["k"], layer["v"]
        if type(n) is not int or type(cap) is not int or not 0 <= n <= cap <= config.max_tokens:
            raise InvalidSnapshot(
                f"layers[{i}]: expected 0 <= length <= capacity <= max_tokens {config.max_tokens}, "
                f"got length {n!r}, capacity {cap!r}"
            )
        if not isinstance(kb, bytes) or not isinstance(vb, bytes):
            raise InvalidSnapshot(f"layers[{i}]: k and v must be binary")
        want = layout.buffer_bytes(cap) if cap else (0, 0)
        if (len(kb), len(vb)) != want:
            raise InvalidSnapshot(
                f"layers[{i}]: expected {want[0]} and {want[1]} bytes of K and V for capacity {cap}, "
                f"got {len(kb)} and {len(vb)}"
            )
        if fmt in PLAIN_DTYPES and n:
            used = n * config.num_kv_heads * config.head_dim
            for name, b in (("k", kb), ("v", vb)):
                if wire.nonfinite(np.frombuffer(b, PLAIN_DTYPES[fmt], count=used)).any():
                    raise InvalidSnapshot(f"layers[{i}].{name}: non-finite values")
        if fmt in TQ_SPECS and n:
            _check_tq_norms(i, fmt, config, n, cap, kb, vb)
            _check_tq_outliers(i, fmt, config, n, cap, kb, vb)
        exact = _parse_exact(i, config, n, layer["exact"]) if "exact" in keys else None
        out.append(LayerWords(n, cap, kb, vb, exact))
    if doc["checksum"] != digest(doc["format"], doc["version"], cfg, layers):
        raise InvalidSnapshot("checksum: the blob does not match its checksum (corrupted or truncated)")
    return config, out


def _parse_exact(i: int, config: SessionConfig, n: int, exact: Any) -> dict[str, Any]:
    """A windowed layer's ``exact`` member, checked against its length ``n``."""
    where = f"layers[{i}].exact"
    if not isinstance(exact, dict) or set(exact) != _EXACT_KEYS:
        raise InvalidSnapshot(f"{where}: expected exactly the keys {sorted(_EXACT_KEYS)}")
    base, held = exact["recent_base"], exact["held_from"]
    if type(base) is not int or type(held) is not int or not 0 <= base <= n or not base <= held <= n:
        raise InvalidSnapshot(f"{where}: expected 0 <= recent_base <= held_from <= length {n}, got {base!r}, {held!r}")
    layout = PageLayout("f32", config.num_kv_heads, config.head_dim)
    want = {"sinks": min(config.sinks, n) if config.sinks else None, "recent": n - base if config.window else None}
    for name, length in want.items():
        rows = exact[name]
        if length is None:
            if rows is not None:
                raise InvalidSnapshot(f"{where}.{name}: this session keeps none, got some")
            continue
        if not isinstance(rows, dict) or set(rows) != _LAYER_KEYS:
            raise InvalidSnapshot(f"{where}.{name}: expected exactly the keys {sorted(_LAYER_KEYS)}")
        cap, kb, vb = rows["capacity"], rows["k"], rows["v"]
        if rows["length"] != length or type(cap) is not int or not length <= cap <= config.max_tokens:
            raise InvalidSnapshot(
                f"{where}.{name}: expected length {length} within its capacity, got {rows['length']!r}"
            )
        if (
            not isinstance(kb, bytes)
            or not isinstance(vb, bytes)
            or (len(kb), len(vb)) != (layout.buffer_bytes(cap) if cap else (0, 0))
        ):
            raise InvalidSnapshot(f"{where}.{name}: k and v must be the float32 rows of capacity {cap}")
        used = length * config.num_kv_heads * config.head_dim
        if not all(np.isfinite(np.frombuffer(b, "<f4", count=used)).all() for b in (kb, vb)):
            raise InvalidSnapshot(f"{where}.{name}: non-finite values")
    return exact


def read_layers(kv: SessionKV) -> Callable[[Any], Layers]:
    """A GPU-thread call (``Engine.call``) that reads every layer of ``kv`` back."""

    def read(ctx: Any) -> Layers:
        out: Layers = []
        for layer in kv.layers:
            kb, vb = layer.read_words(ctx.device)
            out.append(LayerWords(layer.length, layer.capacity, kb, vb, layer.read_exact(ctx.device)))
        return out

    return read


def restore_bytes(kv: SessionKV, layers: Layers) -> int:
    """GPU bytes a restore of ``layers`` into ``kv`` will hold (what the budget counts)."""
    return sum(kv.layers[i].bytes_for(n) for i, (n, _, _, _) in enumerate(layers))


def load(ctx: Any, kv: SessionKV, layers: Layers) -> None:
    """On the GPU thread: upload a parsed snapshot's caches into ``kv`` (released
    again if anything fails)."""
    try:
        for layer, words in zip(kv.layers, layers):
            layer.load_words(ctx.device, *words)
            layer.load_exact(ctx.device, getattr(words, "exact", None))
    except BaseException:
        kv.release()
        raise
