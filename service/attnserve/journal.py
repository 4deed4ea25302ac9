"""Incremental persistence: each session's full pages, appended to a journal as they fill.

With ``ATTNSERVE_SNAPSHOT_DIR`` set and ``ATTNSERVE_SYNC_INTERVAL_S`` > 0, the
snapshot directory (``persistence.SnapshotDir``) syncs every interval: one GPU
call reads back the pages that filled since the last sync (every session, every
layer), their records are appended to the sessions' journals and each touched
journal is fsynced once. A hard kill (SIGKILL, power loss) therefore loses at most
the rows acknowledged since the last sync started, plus each layer's partly
filled last page; the next start restores every layer to a whole number of pages
that are exactly the rows the client sent (a layer never has a torn row).

A journal, ``<name>.journal`` beside ``<name>.snap``, is a sequence of frames::

    u32 little-endian length | u32 CRC-32 of the payload | payload (MessagePack)

The first frame is the header ``{"format": "attnserve-journal", "version": 1,
"session_id", "owner", "config": {...}, "page_tokens": P}``; every other frame is one page
``{"layer", "page", "k", "v"}``, whose ``k``/``v`` are the page's ``P`` rows in the
contiguous layout of a cache of ``P`` rows (``pool.PageLayout``). A layer's pages
come in order from 0. Reading stops at the first frame that is short or fails its
CRC (or is not MessagePack). When that frame is the end of the file, it is a write
torn by a crash: only that frame is lost, and the file is cut back to its last good
frame before anything is appended to it again. When bytes follow it, the file is
corrupt (a crash only tears the last write): ``Journal.bytes_after_bad`` says how
many, ``Journal.frames_after_bad`` how many good frames follow it, and the snapshot
directory keeps a copy of the file before cutting it.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from .errors import ApiError, InvalidSnapshot
from .kv.config import SessionConfig
from .pool import PageLayout, copy_host_rows
from .session_spec import parse_create

__all__ = ["SUFFIX", "Journal", "header_frame", "page_frame", "parse_journal", "assemble"]

SUFFIX = ".journal"
FORMAT, VERSION = "attnserve-journal", 1
_FRAME = struct.Struct("<II")
_CONFIG_KEYS = ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "kv_format", "max_tokens", "seed")


def _frame(doc: dict[str, Any]) -> bytes:
    payload: bytes = msgpack.packb(doc, use_bin_type=True)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def header_frame(session_id: str, owner: str | None, config: SessionConfig, page_tokens: int) -> bytes:
    cfg = {k: getattr(config, k) for k in _CONFIG_KEYS}
    return _frame(
        {"format": FORMAT, "version": VERSION, "session_id": session_id, "owner": owner, "config": cfg,
         "page_tokens": page_tokens}
    )  # fmt: skip


def page_frame(layer: int, page: int, kb: bytes, vb: bytes) -> bytes:
    return _frame({"layer": layer, "page": page, "k": kb, "v": vb})


@dataclass
class Journal:
    """What a journal holds: its session, and each layer's pages in order."""

    session_id: str
    owner: str | None
    config: SessionConfig
    page_tokens: int
    pages: list[list[tuple[bytes, bytes]]] = field(default_factory=list)
    valid_bytes: int = 0  # where the last good frame ends (the file is cut back to it)
    bytes_after_bad: int = 0  # bytes past the end of the first bad frame: > 0 is corruption, not a torn tail
    frames_after_bad: int = 0  # good frames right after the first bad one (lost by the cut)

    @property
    def corrupt(self) -> bool:
        """A bad frame with more of the file after it (a torn write is the file's end)."""
        return self.bytes_after_bad > 0


def _read_frame(data: bytes, off: int) -> tuple[Any, int] | None:
    """The document of the frame at ``off`` and where the frame ends, or None when
    it is short, fails its CRC or is not MessagePack; the end is also returned for
    a bad frame whose declared length fits in ``data``, as ``(None, end)``."""
    if off + _FRAME.size > len(data):
        return None
    n, crc = _FRAME.unpack_from(data, off)
    end = off + _FRAME.size + n
    payload = data[off + _FRAME.size : end]
    if len(payload) != n:
        return None
    if zlib.crc32(payload) != crc:
        return None, end
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True), end
    except Exception:
        return None, end


def parse_journal(data: bytes, limit_for: Callable[[tuple[str, ...], int, int], int]) -> Journal:
    """The journal in ``data``, read up to its first torn frame. Raises InvalidSnapshot
    when the header itself is missing or wrong (nothing can be restored from it)."""
    frames, off = [], 0
    bad_end: int | None = None  # where the first bad frame ends, when its length fits in the file
    while off < len(data):
        read = _read_frame(data, off)
        if read is None or read[0] is None:
            bad_end = None if read is None else read[1]
            break
        frames.append(read[0])
        off = read[1]
    after, bytes_after = 0, 0
    if off < len(data):
        # a frame short of the file's end is a torn write; one with bytes after it is not
        bytes_after = len(data) - bad_end if bad_end is not None else 0
        at = bad_end
        while at is not None and (read := _read_frame(data, at)) is not None and read[0] is not None:
            after, at = after + 1, read[1]
    if not frames:
        raise InvalidSnapshot("not a journal: no header frame")
    head = frames[0]
    if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("version") != VERSION:
        raise InvalidSnapshot("not a journal of this version")
    sid, owner, cfg, page_tokens = (head.get(k) for k in ("session_id", "owner", "config", "page_tokens"))
    if not isinstance(sid, str) or not (owner is None or isinstance(owner, str)) or not isinstance(cfg, dict):
        raise InvalidSnapshot("journal header: session_id, owner or config missing")
    if type(page_tokens) is not int or not 1 <= page_tokens <= 1024:
        raise InvalidSnapshot("journal header: page_tokens missing")
    try:
        req = parse_create(cfg)
    except ApiError as e:
        raise InvalidSnapshot(f"journal config: {e.detail}") from None
    if (
        req.max_tokens is None
        or req.seed is None
        or req.max_tokens > limit_for(req.layer_formats, req.num_kv_heads, req.head_dim)
    ):
        raise InvalidSnapshot("journal config: max_tokens and seed are required, within this adapter's limit")
    config = SessionConfig(
        req.num_layers, req.num_qo_heads, req.num_kv_heads, req.head_dim, req.kv_format, req.max_tokens, req.seed
    )
    want = [config.layer_layout(i).buffer_bytes(page_tokens) for i in range(config.num_layers)]
    journal = Journal(sid, owner, config, page_tokens, [[] for _ in range(config.num_layers)], off, bytes_after, after)
    for doc in frames[1:]:
        if not isinstance(doc, dict) or set(doc) != {"layer", "page", "k", "v"}:
            raise InvalidSnapshot("journal: a page record with the wrong members")
        layer, page, kb, vb = doc["layer"], doc["page"], doc["k"], doc["v"]
        if type(layer) is not int or not 0 <= layer < config.num_layers or type(page) is not int:
            raise InvalidSnapshot("journal: a page record of no layer")
        pages = journal.pages[layer]
        if page < len(pages):
            continue  # written again by a sync that did not know it had landed: the same rows
        if page != len(pages) or (len(kb), len(vb)) != want[layer]:
            raise InvalidSnapshot(f"journal: layer {layer} page {page} out of order or of the wrong size")
        if (len(pages) + 1) * page_tokens > config.max_tokens + page_tokens - 1:
            raise InvalidSnapshot(f"journal: layer {layer} passes max_tokens")
        pages.append((kb, vb))
    return journal


def assemble(layout: PageLayout, page_tokens: int, pages: list[tuple[bytes, bytes]]) -> tuple[int, int, bytes, bytes]:
    """A layer's journaled pages as a snapshot layer ``(length, capacity, k, v)`` in the
    contiguous layout of ``capacity = len(pages) * P`` rows."""
    P = page_tokens
    cap = len(pages) * P
    kout, vout = (bytearray(n) for n in layout.buffer_bytes(cap))
    for i, (kb, vb) in enumerate(pages):
        copy_host_rows(layout, (kb, vb, P, 0), (kout, vout, cap, i * P), P)
    return cap, cap, bytes(kout), bytes(vout)
