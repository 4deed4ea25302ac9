"""Restarts that lose nothing: every session written to a local directory on
shutdown, and read back on the next start before the server reports ready.

With ``ATTNSERVE_SNAPSHOT_DIR`` set, the app's lifespan calls
:meth:`SnapshotDir.restore_all` after the device opens (uvicorn binds its port only
after that, so neither ``/readyz`` nor any request sees a half-restored server),
and :meth:`SnapshotDir.save_all` on shutdown, after the requests in flight have
finished and before the device closes.

One file per session, ``<id>.snap`` (no API keys) or ``<key id>.<id>.snap`` (ids
are per tenant; ``.`` is not an id character). A file is a MessagePack map, the
header, followed by the snapshot::

    {"format": "attnserve-session-file", "version": 1, "session_id": str,
     "owner": key id or nil, "snapshot_bytes": int, "header_checksum": "sha256:<hex>"}
    <snapshot_bytes bytes: exactly the blob of GET /v1/sessions/{id}/snapshot>

The blob carries its own checksum over the caches, and ``header_checksum`` is
SHA-256 over the canonical JSON ``[format, version, session_id, owner,
snapshot_bytes]``, so a flipped bit anywhere is caught. (The blob follows the
header rather than sitting in it as a ``bin``, so no 4 GiB limit applies and
reading it needs no copy.)

Writes are atomic: a temporary file ``.<name>.<pid>.tmp`` in the same directory
(mode 0600), written, fsynced, renamed over the old file, and the directory
fsynced. Files are
kept after a restore (a crash before the next clean shutdown restores the same
state again) and deleted when their session is deleted or expires. At start a
file that cannot be parsed is renamed ``<name>.bad`` (and logged); one that is
valid but does not fit (memory budget, session limit) is kept for a later start.
A lock file (``.lock``: ``flock`` on POSIX, ``msvcrt.locking`` on Windows) keeps
two servers off one directory.

Between shutdowns, with ``sync_interval_s`` > 0, every session's full pages are
also appended to a journal (``<name>.journal``, ``journal.py``) every interval, so
a hard kill loses at most the rows acknowledged since the last sync started and
each layer's partly filled page. At start a session is restored from its
snapshot, its journal, or, layer by layer, whichever of the two holds more rows
(both are prefixes of the same append-only history); a clean shutdown writes the
snapshot and then deletes the journal it covers.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import shutil
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

try:  # POSIX
    import fcntl
except ImportError:  # Windows: no flock; msvcrt locks a byte range instead
    fcntl = None  # type: ignore[assignment]
    import msvcrt

from . import journal as J
from .errors import InvalidSnapshot, OutOfMemory, SessionExists
from .snapshot_format import Layers, build_blob, load, parse_blob, read_layers, restore_bytes
from .store import SESSION_ID_RE, Session

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine
    from .runtime import Runtime

__all__ = ["SnapshotDir", "FILE_FORMAT", "FILE_VERSION", "SUFFIX", "encode_file", "decode_file"]

# What a journal sync collects on the GPU thread: per session, (layer, first page, pages' K/V bytes)
_Found = list[tuple[Session, list[tuple[int, int, list[tuple[bytes, bytes]]]]]]


def _lock(fd: int) -> None:
    """Lock the open file ``fd`` for this process without waiting; OSError (EWOULDBLOCK,
    EACCES or EDEADLK) when another process holds it. Closing ``fd`` releases it."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)


log = logging.getLogger("attnserve.persistence")

FILE_FORMAT = "attnserve-session-file"
FILE_VERSION = 1
SUFFIX = ".snap"
_KEY_ID = re.compile(r"[0-9a-f]{24}")
_FILE_KEYS = frozenset({"format", "version", "session_id", "owner", "snapshot_bytes", "header_checksum"})
_MAX_HEADER = 4096


def _header_checksum(session_id: str, owner: str | None, nbytes: int) -> str:
    text = json.dumps([FILE_FORMAT, FILE_VERSION, session_id, owner, nbytes], separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def file_name(owner: str | None, session_id: str) -> str:
    return f"{session_id}{SUFFIX}" if owner is None else f"{owner}.{session_id}{SUFFIX}"


def encode_file(session_id: str, owner: str | None, blob: bytes) -> list[bytes]:
    """The file's bytes in two pieces, header and blob (the blob is not copied)."""
    n = len(blob)
    header = {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "session_id": session_id,
        "owner": owner,
        "snapshot_bytes": n,
        "header_checksum": _header_checksum(session_id, owner, n),
    }
    return [msgpack.packb(header, use_bin_type=True), blob]


def decode_file(data: bytes | memoryview) -> tuple[str, str | None, memoryview]:
    """``(session_id, owner, snapshot blob)`` of a file's bytes. Raises InvalidSnapshot."""
    data = memoryview(data)
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        max_buffer_size=_MAX_HEADER,
        max_str_len=_MAX_HEADER,
        max_bin_len=0,
        max_array_len=16,
        max_map_len=16,
        max_ext_len=0,
    )
    unpacker.feed(data[:_MAX_HEADER])
    try:
        doc = unpacker.unpack()
    except (msgpack.OutOfData, ValueError, TypeError, msgpack.UnpackException) as e:
        raise InvalidSnapshot(f"not a session file: {type(e).__name__}") from None
    offset = unpacker.tell()
    if not isinstance(doc, dict) or set(doc) != _FILE_KEYS:
        raise InvalidSnapshot("not a session file: wrong header members")
    if doc["format"] != FILE_FORMAT or type(doc["version"]) is not int or doc["version"] != FILE_VERSION:
        raise InvalidSnapshot(f"unknown file format {doc['format']!r} version {doc['version']!r}")
    sid, owner, n = doc["session_id"], doc["owner"], doc["snapshot_bytes"]
    if not isinstance(sid, str) or not SESSION_ID_RE.fullmatch(sid):
        raise InvalidSnapshot("session_id: not a session id")
    if owner is not None and not (isinstance(owner, str) and _KEY_ID.fullmatch(owner)):
        raise InvalidSnapshot("owner: not a key id")
    if type(n) is not int or doc["header_checksum"] != _header_checksum(sid, owner, n):
        raise InvalidSnapshot("header_checksum: the file's header does not match its checksum")
    if data.nbytes - offset != n:
        raise InvalidSnapshot(
            f"expected {n} snapshot bytes after the header, got {data.nbytes - offset} (truncated or extended)"
        )
    return sid, owner, data[offset:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotDir:
    """The snapshot directory of one server."""

    def __init__(self, path: str | os.PathLike[str], runtime: "Runtime", sync_interval_s: float = 0.0):
        self.path = Path(path)
        self.rt = runtime
        self._lock_fd: int | None = None
        self.sync_interval_s = float(sync_interval_s)  # 0: no journals
        # session -> pages of each layer in its journal (written and fsynced)
        self.journaled: dict[Session, list[int]] = {}
        self.last_sync: dict[str, float] | None = None
        self._sync_task: asyncio.Task[None] | None = None

    # ── lifecycle ───────────────────────────────────────────────────────────

    def open(self) -> None:
        """Create the directory, take its lock, remove temporary files a crash left.

        Raises:
            RuntimeError: not a writable directory, or another server holds it.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise RuntimeError(f"snapshot_dir {str(self.path)!r} is not a writable directory: {e}") from None
        try:
            _lock(fd)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, errno.EDEADLK):
                raise RuntimeError(f"snapshot_dir {str(self.path)!r} is in use by another server") from None
            raise
        self._lock_fd = fd
        for tmp in self.path.glob(".*.tmp"):
            try:
                tmp.unlink()
                log.warning("removed a partly written snapshot", extra={"file": tmp.name})
            except OSError:  # pragma: no cover
                pass

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    def file_for(self, session: Session) -> Path:
        return self.path / file_name(session.owner, session.id)

    def journal_for(self, session: Session) -> Path:
        return self.path / (file_name(session.owner, session.id)[: -len(SUFFIX)] + J.SUFFIX)

    def forget(self, session: Session) -> None:
        """The session is gone (deleted or expired): so are its files."""
        self.journaled.pop(session, None)
        for path in (self.file_for(session), self.journal_for(session)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:  # pragma: no cover - permissions changed under us
                log.error("cannot delete a snapshot file", extra={"session_id": session.id, "error": str(e)})

    # ── journals (while serving) ────────────────────────────────────────────

    def start_sync(self, engine: "Engine") -> None:
        """Start the journal syncs (with ``sync_interval_s`` > 0)."""
        if self.sync_interval_s > 0 and self._sync_task is None:
            self._sync_task = asyncio.create_task(self._sync_loop(engine), name="attnserve-journal")

    async def stop_sync(self) -> None:
        task, self._sync_task = self._sync_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _sync_loop(self, engine: "Engine") -> None:
        while True:
            await asyncio.sleep(self.sync_interval_s)
            try:
                await self.sync_once(engine)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("journal sync failed; the next one retries")

    def journal_info(self) -> dict[str, Any]:
        last = self.last_sync or {}
        return {
            "sync_interval_s": self.sync_interval_s,
            "last_sync_started": last.get("started"),
            "last_sync_finished": last.get("finished"),
            "last_sync_pages": last.get("pages"),
        }

    async def sync_once(self, engine: "Engine") -> int:
        """Append every page that filled since the last sync to its session's journal
        and fsync each journal touched; returns the pages written."""
        started = time.time()
        todo = [(s, list(self.journaled.get(s) or [0] * s.config.num_layers)) for s in self.rt.store.sessions.values()]

        def collect(ctx: Any) -> _Found:
            found: _Found = []
            for s, done in todo:  # on the GPU thread, between batches: the lengths are the GPU's
                if s.closed:
                    continue
                recs = []
                for i, layer in enumerate(s.kv.layers):
                    full = layer.length // layer.page_tokens
                    if full > done[i]:
                        recs.append((i, done[i], layer.read_pages(ctx.device, done[i], full - done[i])))
                if recs:
                    found.append((s, recs))
            return found

        found = await asyncio.wrap_future(engine.call(collect)) if todo else []
        page_tokens = engine.pools.page_tokens
        # a session's first journal write starts its file afresh: a file under its name
        # is another session's (one kept at start because it did not fit, say)
        fresh = {s for s, _ in found if s not in self.journaled}
        written = await asyncio.to_thread(self._append_journals, found, page_tokens, fresh) if found else 0
        for s, recs in found:
            if s.closed:  # deleted while its pages were written: its journal goes too
                self.forget(s)
                continue
            counts = self.journaled.setdefault(s, [0] * s.config.num_layers)
            for layer, first, pages in recs:
                counts[layer] = first + len(pages)
        self.last_sync = {"started": started, "finished": time.time(), "pages": written}
        return written

    def _append_journals(self, found: _Found, page_tokens: int, fresh: set[Session]) -> int:
        written, created = 0, False
        for s, recs in found:
            if s.closed:
                continue
            path = self.journal_for(s)
            flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if s in fresh else os.O_APPEND)
            with open(os.open(path, flags, 0o600), "ab") as f:
                if f.tell() == 0:
                    f.write(J.header_frame(s.id, s.owner, s.config, page_tokens))
                    created = True
                for layer, first, pages in recs:
                    for j, (kb, vb) in enumerate(pages):
                        f.write(J.page_frame(layer, first + j, kb, vb))
                        written += 1
                f.flush()
                os.fsync(f.fileno())
        if created:
            _fsync_dir(self.path)
        return written

    # ── restore (at start) ──────────────────────────────────────────────────

    async def restore_all(self, engine: "Engine") -> dict[str, int]:
        """Restore every session of the ``*.snap`` and ``*.journal`` files; returns
        counts by result (ok, invalid, skipped)."""
        counts = {"ok": 0, "invalid": 0, "skipped": 0}
        stems: dict[str, dict[str, Path]] = {}
        for suffix in (SUFFIX, J.SUFFIX):
            for p in self.path.glob("*" + suffix):
                if p.is_file() and not p.name.startswith("."):
                    stems.setdefault(p.name[: -len(suffix)], {})[suffix] = p
        names = sorted(stems)
        sizes = [sum(_size(p) for p in stems[n].values()) for n in names]
        progress = _Progress("restore", len(names), sum(sizes))
        for name, size in zip(names, sizes):
            result = await self._restore_one(stems[name].get(SUFFIX), engine, stems[name].get(J.SUFFIX))
            counts[result] += 1
            self.rt.metrics.snapshot_restores.labels(result).inc()
            progress.step(size)
        dt = progress.elapsed()
        self.rt.metrics.snapshot_seconds.labels("restore").observe(dt)
        log.info("snapshots restored", extra={"dir": str(self.path), **counts, **progress.fields()})
        return counts

    async def _read_journal(self, path: Path, engine: "Engine") -> "J.Journal | None":
        """The journal at ``path`` (cut back to its last good frame), or None if it is
        unreadable (moved aside)."""
        try:
            data = await asyncio.to_thread(path.read_bytes)
            journal = await asyncio.to_thread(J.parse_journal, data, engine.max_tokens_limit)
        except InvalidSnapshot as e:
            self._move_aside(path, e.detail)
            return None
        if journal.corrupt:
            # a crash tears only the last write: what follows a bad frame was written after it
            bad = self._bad_path(path)
            await asyncio.to_thread(shutil.copyfile, path, bad)
            log.error(
                "a journal is corrupt: a frame in its middle fails its check; the file is kept aside and "
                "the session restored from the frames before it (the frames after it are lost)",
                extra={
                    "file": path.name,
                    "copied_to": bad.name,
                    "bytes": len(data),
                    "kept": journal.valid_bytes,
                    "bytes_after_bad_frame": journal.bytes_after_bad,
                    "good_frames_after_bad_frame": journal.frames_after_bad,
                },
            )
            os.truncate(path, journal.valid_bytes)
        elif journal.valid_bytes < len(data):
            log.warning(
                "a journal ends in a torn frame (a crash mid-write): cut back to its last good frame",
                extra={"file": path.name, "bytes": len(data), "kept": journal.valid_bytes},
            )
            os.truncate(path, journal.valid_bytes)
        return journal

    @staticmethod
    def _with_journal(
        layers: Layers, journal: "J.Journal", journal_path: Path, page_tokens: int
    ) -> tuple[Layers, list[int]]:
        """A snapshot's ``layers`` (none: empty) with each layer the journal holds more
        rows of taken from the journal (both are prefixes of one append-only history),
        and the pages of each layer already in the journal (all 0 if it was written
        with another page size: it is deleted and starts again)."""
        cfg = journal.config
        layers = list(layers) or [(0, 0, b"", b"") for _ in range(cfg.num_layers)]
        for i, pages in enumerate(journal.pages):
            if len(pages) * journal.page_tokens > layers[i][0]:
                layers[i] = J.assemble(cfg.layer_layout(i), journal.page_tokens, pages)
        if journal.page_tokens == page_tokens:
            return layers, [len(p) for p in journal.pages]
        journal_path.unlink()
        return layers, [0] * cfg.num_layers

    async def _restore_one(self, path: Path | None, engine: "Engine", journal_path: Path | None = None) -> str:
        store = self.rt.store
        journal = await self._read_journal(journal_path, engine) if journal_path is not None else None
        if path is None and journal is None:
            return "invalid"
        try:
            if path is not None:
                data = await asyncio.to_thread(path.read_bytes)
                sid, owner, blob = await asyncio.to_thread(decode_file, data)
                del data
                config, layers = await asyncio.to_thread(parse_blob, blob, max(blob.nbytes, 1), engine.max_tokens_limit)
                del blob
            else:
                assert journal is not None
                sid, owner, config, layers = journal.session_id, journal.owner, journal.config, []
        except InvalidSnapshot as e:
            assert path is not None
            self._move_aside(path, e.detail)
            if journal is None:
                return "invalid"
            sid, owner, config, layers, path = journal.session_id, journal.owner, journal.config, [], None
        except OSError as e:
            assert path is not None  # only reading the snapshot file raises OSError
            log.error("cannot read a snapshot file; kept", extra={"file": path.name, "error": str(e)})
            return "skipped"
        label = (path or journal_path).name  # type: ignore[union-attr]
        journaled = [0] * config.num_layers
        if journal is not None:
            assert journal_path is not None
            if (journal.session_id, journal.owner, journal.config) != (sid, owner, config):
                self._move_aside(journal_path, "the journal is of another session than its snapshot")
            else:
                layers, journaled = self._with_journal(layers, journal, journal_path, engine.pools.page_tokens)
        kv = engine.session_kv(config)
        need = restore_bytes(kv, layers)
        try:
            # a session that lived here may exceed a quota lowered since: it is kept (no data is lost)
            hold = store.hold(sid, need, owner, quotas=False)
        except (SessionExists, OutOfMemory) as e:
            log.error(
                "a snapshot does not fit; kept for a later start",
                extra={"file": label, "session_id": sid, "error": e.detail},
            )
            return "skipped"
        try:
            await asyncio.wrap_future(engine.call(lambda ctx: load(ctx, kv, layers)))
        except Exception:
            log.exception("cannot load a snapshot onto the GPU; kept", extra={"file": label, "session_id": sid})
            return "skipped"
        finally:
            store.unhold(hold)
        session = store.adopt(kv, owner=owner, session_id=sid)
        self.journaled[session] = journaled
        keys = self.rt.keys
        if (owner is None) == keys.enabled or (owner is not None and owner not in keys.key_ids):
            log.warning(
                "restored a session whose API key is not configured: no request can reach it "
                "(it expires with the session TTL, or delete its file)",
                extra={"file": label, "session_id": sid, "tenant": owner},
            )
        canonical = self.file_for(session)
        if path is not None and path != canonical:  # renamed by hand: keep one file per session
            os.replace(path, canonical)
        if journal_path is not None and journal_path.exists() and journal_path != self.journal_for(session):
            os.replace(journal_path, self.journal_for(session))
        return "ok"

    @staticmethod
    def _bad_path(path: Path) -> Path:
        """``<name>.bad``, or ``<name>.<n>.bad`` with the first ``n`` not taken."""
        bad = path.with_name(path.name + ".bad")
        n = 1
        while bad.exists():
            bad = path.with_name(f"{path.name}.{n}.bad")
            n += 1
        return bad

    def _move_aside(self, path: Path, why: str) -> None:
        bad = self._bad_path(path)
        try:
            os.replace(path, bad)
        except OSError as e:  # pragma: no cover
            log.error("cannot move an invalid snapshot aside", extra={"file": path.name, "error": str(e)})
            return
        log.error("invalid snapshot file moved aside", extra={"file": path.name, "moved_to": bad.name, "error": why})

    # ── save (at shutdown) ──────────────────────────────────────────────────

    async def save_all(self, engine: "Engine") -> dict[str, int]:
        """Write every session's snapshot (one at a time, so memory stays bounded by
        the largest session); returns counts by result (ok, error)."""
        counts = {"ok": 0, "error": 0}
        sessions = list(self.rt.store.sessions.values())
        progress = _Progress("save", len(sessions), None, gpu_bytes=sum(s.nbytes for s in sessions))
        for session in sessions:
            written = 0
            try:
                written = _size(await self.save(session, engine))
            except Exception as e:
                counts["error"] += 1
                self.rt.metrics.snapshot_writes.labels("error").inc()
                log.error(
                    "cannot write a session's snapshot",
                    extra={"session_id": session.id, "error": f"{type(e).__name__}: {e}"},
                )
            else:
                counts["ok"] += 1
                self.rt.metrics.snapshot_writes.labels("ok").inc()
            progress.step(written)
        dt = progress.elapsed()
        self.rt.metrics.snapshot_seconds.labels("save").observe(dt)
        log.info("snapshots written", extra={"dir": str(self.path), **counts, **progress.fields()})
        return counts

    async def save(self, session: Session, engine: "Engine") -> Path:
        layers = await asyncio.wrap_future(engine.call(read_layers(session.kv)))  # after every job queued for it
        blob = await asyncio.to_thread(build_blob, session.config, layers)
        del layers
        path = self.file_for(session)
        await asyncio.to_thread(self._write_atomic, path, encode_file(session.id, session.owner, blob))
        # the snapshot holds every row: its journal is covered
        self.journaled.pop(session, None)
        try:
            self.journal_for(session).unlink()
        except FileNotFoundError:
            pass
        return path

    def _write_atomic(self, path: Path, pieces: list[bytes]) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            # owner-only: a snapshot holds a tenant's data
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                for piece in pieces:
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        _fsync_dir(self.path)


# How often a save or restore in progress logs how far it is (seconds).
PROGRESS_INTERVAL_S = 1.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class _Progress:
    """How far a save or restore of every session is: a line when it starts, then
    one every :data:`PROGRESS_INTERVAL_S` while it runs (sessions and file bytes
    done, the rate, and for a restore the time left); the caller logs the last."""

    def __init__(self, phase: str, sessions: int, nbytes: int | None, **start: int):
        self.phase, self.sessions, self.nbytes = phase, sessions, nbytes
        self.done = self.bytes_done = 0
        self.t0 = self.last = time.perf_counter()
        total = {} if nbytes is None else {"bytes": nbytes}
        log.info(f"snapshot {phase} started", extra={"sessions": sessions, **total, **start})

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def step(self, nbytes: int) -> None:
        self.done += 1
        self.bytes_done += nbytes
        now = time.perf_counter()
        if self.done < self.sessions and now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            log.info(f"snapshot {self.phase} progress", extra=self.fields())

    def fields(self) -> dict[str, Any]:
        dt = self.elapsed()
        rate = self.bytes_done / dt if dt > 0 else 0.0
        out: dict[str, Any] = {"sessions_done": self.done, "sessions": self.sessions, "bytes_done": self.bytes_done}
        if self.nbytes is not None:
            out["bytes"] = self.nbytes
            if rate > 0 and self.done < self.sessions:
                out["eta_seconds"] = round((self.nbytes - self.bytes_done) / rate, 1)
        out.update(seconds=round(dt, 3), bytes_per_second=round(rate))
        return out
