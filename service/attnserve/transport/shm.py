"""The shared-memory transport: the frame transport's operations over a Unix socket,
for a client on the server's host, with the arrays in a memory region both map.

Served on ``shm_socket`` (``ATTNSERVE_SHM_SOCKET``, a path; off when unset), in the
same process and event loop as the HTTP server. ``docs/api.md`` ("Shared-memory
transport") is the contract; in short:

* The socket file is made with mode 0600 and removed at shutdown; a peer whose
  user (``SO_PEERCRED``) is not the server's, or root, gets a ``403 forbidden``
  frame and is closed.
* The first frame is the frames hello (:func:`.frames.greet`: the version, the API
  key) with ``"region": nbytes``, sent with exactly one file descriptor
  (``SCM_RIGHTS``): a memfd sealed against shrinking, of at least ``region``
  bytes, at most ``shm_max_region_bytes``. The server maps it (shared, read and
  write), closes the descriptor, and unmaps it once the connection has ended and
  its operations have finished. Nothing is made in the file system: a region lives
  as long as a process maps it.
* After the hello the connection is a frames connection (``transport/frames.py``:
  its flow control, limits and replies), whose arrays may also be references into
  the region, ``{"dtype", "shape", "shm": [offset, nbytes]}``, viewed in place
  (read-only, no copy), and whose requests may name ``"reply_at": [offset,
  nbytes]``: the reply's arrays are written there (:mod:`attnserve_client.shm`),
  checked to fit before the operation runs.

The hello is read off the raw socket (asyncio's transports do not carry
descriptors), then the socket is handed to the event loop as a frames connection.
"""

from __future__ import annotations

import array
import asyncio
import logging
import mmap
import os
import socket
import stat
import sys
import time
from typing import Any

from attnserve_client.framing import MAX_HEAD_BYTES, PREFIX, frame_buffers, read_prefix
from attnserve_client.shm import ALIGN, aligned, peer_uid, place_arrays, reply_bytes

from ..codec import BODY_IDLE_TIMEOUT_S, wire
from ..contract import ShmHello
from ..errors import ApiError, Forbidden, InvalidRequest, MalformedBody, NotReady, PayloadTooLarge
from ..runtime import Runtime
from ..step.steps import reply_sizes
from ..store import Owner
from .frames import ConnectionServer, _Connection, _resolve_arrays, decode_head, greet, hello_result
from .ops import count_reply, error_document, request_id

__all__ = ["ShmServer", "SHM_INSTANCE"]

log = logging.getLogger("attnserve")

#: The ``instance`` of the transport's problems, and its label in the metrics.
SHM_INSTANCE = "/v1/shm"
METHOD = "UNIX"
#: Descriptors a hello is read with room for: one is the region, more are refused.
_MAX_FDS = 4
#: How long a refusal's frame may take to be written before the socket is closed.
_REFUSAL_TIMEOUT_S = 5.0
#: How often, and how many times, an unmap deferred by a live view of the region is tried again.
_UNMAP_RETRY_S, _UNMAP_RETRIES = 1.0, 30


def _peer_allowed(uid: int) -> bool:
    """Whether a peer of user ``uid`` may use the transport: the server's user, or root."""
    return uid in (os.getuid(), 0)


class ShmServer(ConnectionServer):
    """The listening Unix socket, the hellos being read, and the connections."""

    def __init__(self, rt: Runtime):
        super().__init__(rt)
        self.path: str | None = None
        self.handshakes: set[asyncio.Task[None]] = set()
        self._sock: socket.socket | None = None
        self._made: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file this server made
        self._accepting: asyncio.Task[None] | None = None

    async def start(self, path: str) -> None:
        """Listen on ``path`` (a stale socket there is replaced).

        Raises:
            RuntimeError: not Linux, or the path holds something else, or a server listens there.
            OSError: the socket cannot be made there.
        """
        if sys.platform != "linux":
            raise RuntimeError("shm_socket: the shared-memory transport needs Linux (SO_PEERCRED, memfd)")
        _clear_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.fchmod(sock.fileno(), 0o600)  # the file bind() makes gets no wider mode, even for a moment
            sock.bind(path)
            os.chmod(path, 0o600)
            st = os.stat(path)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock, self.path, self._made = sock, path, (st.st_dev, st.st_ino)
        self._accepting = asyncio.get_running_loop().create_task(self._accept(sock), name="attnserve-shm-accept")
        log.info("shared-memory transport listening", extra={"socket": path})

    def stop_listening(self) -> None:
        """Stop taking connections, drop the hellos being read, and remove the socket file."""
        sock, self._sock = self._sock, None
        if self._accepting is not None:  # the socket is closed once the accept is cancelled (its reader gone)
            self._accepting.cancel()
            if sock is not None:
                self._accepting.add_done_callback(lambda _: sock.close())
            self._accepting = None
        elif sock is not None:
            sock.close()
        for task in list(self.handshakes):
            task.cancel()
        if self.path is not None and self._made is not None:
            try:
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._made:  # ours still (not one a later server made)
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("cannot remove the shared-memory socket", extra={"socket": self.path, "error": str(e)})
            self._made = None

    async def wait_closed(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until every connection closed is let go and its region unmapped."""
        deadline = time.monotonic() + timeout
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # ── a connection's first frame ──────────────────────────────────────────

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as e:  # out of descriptors, say: keep listening
                if listener.fileno() < 0:
                    return
                log.warning("shared-memory transport: accept failed", extra={"error": str(e)})
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._handshake(sock))
            self.handshakes.add(task)
            task.add_done_callback(self.handshakes.discard)

    async def _handshake(self, sock: socket.socket) -> None:
        """Check the peer, read its hello and its region, and hand the socket to a
        connection; any failure is answered with its problem and closes the socket."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        fds: list[int] = []
        region: mmap.mmap | None = None
        owned: socket.socket | None = sock
        rid: Any = None
        try:
            sock.setblocking(False)
            try:
                if len(self.connections) + len(self.handshakes) > self.rt.settings.frames_max_connections:
                    raise NotReady("too many shared-memory connections; try again later")
                uid = peer_uid(sock)
                if not _peer_allowed(uid):
                    self.rt.metrics.shm_events.labels("peer_refused").inc()
                    log.warning("shared-memory transport: refused a peer of another user", extra={"uid": uid})
                    raise Forbidden(
                        f"the shared-memory transport serves the server's user (uid {os.getuid()}) and root, "
                        f"not uid {uid}"
                    )
                try:
                    head, truncated = await asyncio.wait_for(_read_hello(loop, sock, fds), BODY_IDLE_TIMEOUT_S)
                except asyncio.TimeoutError:
                    log.info("shared-memory connection closed: no hello", extra={"seconds": BODY_IDLE_TIMEOUT_S})
                    return
                except ConnectionError:  # the peer left before its hello
                    return
                doc = decode_head(head)
                rid = request_id(doc)
                owner, f = greet(self.rt, doc, ShmHello)
                region = self._map(f.int("region"), fds, truncated)
            except ApiError as e:
                await self._refuse(sock, rid, e, t0)
                return
            conn = _ShmConnection(self, region, owner, rid, t0)
            region = None  # the connection's now: it unmaps it
            try:
                await loop.connect_accepted_socket(lambda: conn, sock)
            except BaseException:
                conn._unmap()
                raise
            owned = None
        finally:
            for fd in fds:
                os.close(fd)
            if region is not None:
                region.close()
                self.rt.metrics.shm_events.labels("unmapped").inc()
            if owned is not None:
                owned.close()

    def _map(self, size: int, fds: list[int], truncated: bool) -> mmap.mmap:
        """The region of a hello: its one descriptor checked and mapped.

        Raises:
            ApiError: the region is too large, or the descriptor is missing, one of
                several, or no sealed memfd of ``size`` bytes that maps.
        """
        import fcntl

        most = self.rt.settings.shm_max_region_bytes
        if size > most:
            raise PayloadTooLarge(
                f"region: expected at most {most} bytes (the server's shm_max_region_bytes), got {size}",
                max_region_bytes=most,
            )
        if truncated or len(fds) > 1:
            got = f"more than {_MAX_FDS}" if truncated else str(len(fds))
            raise InvalidRequest(f"hello: expected one file descriptor (the region's memfd), got {got}")
        if not fds:
            raise InvalidRequest(
                "hello: expected one file descriptor, the region's memfd, sent with the hello's bytes "
                "(SCM_RIGHTS), got none"
            )
        fd = fds[0]
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise InvalidRequest(
                "region: expected a memfd (memfd_create with MFD_ALLOW_SEALING), got a descriptor of another kind"
            ) from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise InvalidRequest(
                "region: expected a memfd sealed against shrinking (F_SEAL_SHRINK): the server maps it, and a "
                "region that shrank under the mapping would fault the server"
            )
        have = os.fstat(fd).st_size
        if have < size:
            raise InvalidRequest(f"region: the memfd holds {have} bytes, fewer than the {size} the hello names")
        try:
            region = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise InvalidRequest(f"region: cannot be mapped for reading and writing ({e.strerror})") from None
        self.rt.metrics.shm_events.labels("mapped").inc()
        return region

    async def _refuse(self, sock: socket.socket, rid: Any, err: ApiError, t0: float) -> None:
        """Answer ``err`` on the raw socket (the caller closes it)."""
        doc = error_document(rid, err, SHM_INSTANCE)
        count_reply(self.rt, doc, SHM_INSTANCE, METHOD, time.perf_counter() - t0)
        frame = b"".join(frame_buffers(doc, wire.packb))
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(sock, frame), _REFUSAL_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            pass


def _clear_stale(path: str) -> None:
    """Remove a socket left at ``path`` by a server that is gone.

    Raises:
        RuntimeError: ``path`` is something else, or a server listens there.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeError(f"shm_socket: {path} exists and is no socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        log.info("removed a stale shared-memory socket", extra={"socket": path})
        return
    except OSError as e:
        raise RuntimeError(f"shm_socket: cannot tell whether {path} is in use ({e}); remove it") from None
    finally:
        probe.close()
    raise RuntimeError(f"shm_socket: another process listens on {path}; stop it or choose another path")


async def _read_hello(loop: asyncio.AbstractEventLoop, sock: socket.socket, fds: list[int]) -> tuple[memoryview, bool]:
    """The head of the first frame, and whether descriptors were lost for want of
    room (more than :data:`_MAX_FDS`); the descriptors that came are added to ``fds``.
    Reads exactly the frame: what the peer sent after it is the connection's.

    Raises:
        ApiError: the frame is not one, or too large for a hello.
        ConnectionError: the peer closed first.
    """
    truncated = [False]
    prefix = await _recv_exactly(loop, sock, PREFIX.size, fds, truncated)
    try:
        head_len, body_len = read_prefix(prefix)
    except wire.WireError as e:
        raise MalformedBody(str(e)) from None
    if head_len > MAX_HEAD_BYTES:
        raise PayloadTooLarge(f"frame head: expected at most {MAX_HEAD_BYTES} bytes, got {head_len}")
    if body_len > MAX_HEAD_BYTES:
        raise PayloadTooLarge(f"hello: its body: expected at most {MAX_HEAD_BYTES} bytes, got {body_len}")
    frame = await _recv_exactly(loop, sock, head_len + body_len, fds, truncated)
    return memoryview(frame)[:head_len], truncated[0]


async def _recv_exactly(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, fds: list[int], truncated: list[bool]
) -> bytes:
    buf = bytearray()
    room = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
    while len(buf) < n:
        try:
            data, ancillary, flags, _ = sock.recvmsg(min(n - len(buf), 1 << 16), room)
        except (BlockingIOError, InterruptedError):
            await _readable(loop, sock)
            continue
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            truncated[0] = True
        if not data:
            raise ConnectionError("the peer closed the connection before its hello")
        buf += data
    return bytes(buf)


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class _ShmConnection(_Connection):
    """A frames connection whose arrays may lie in its region, and whose replies may
    be written there (``reply_at``)."""

    INSTANCE = SHM_INSTANCE
    METHOD = METHOD

    def __init__(self, server: ShmServer, region: mmap.mmap, owner: Owner, rid: Any, t0: float):
        super().__init__(server)
        self.owner, self.greeted = owner, True
        self.region: mmap.mmap | None = region
        self.size = len(region)
        self.region_view = memoryview(region)
        self.readonly = self.region_view.toreadonly()
        result = {**hello_result(server.rt), "region": self.size}
        self._greeting: tuple[dict[str, Any], float] = ({"id": rid, "status": 200, "result": result}, t0)
        self._unmap_tries = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._connected(transport)
        self.server.connections.add(self)
        self.send(*self._greeting)
        self._arm_watchdog()

    def _prepare(self, doc: Any, body: memoryview) -> tuple[int, int] | None:
        """Resolve the frame's references (``at`` into its body, ``shm`` into the
        region), and take its ``reply_at``: checked to hold the reply's arrays now,
        before the operation runs (an attend may append)."""
        reply_to = None
        if isinstance(doc, dict) and "reply_at" in doc:
            reply_to = self._reply_range(doc.pop("reply_at"))
        _resolve_arrays(doc, body, self.readonly)
        if reply_to is not None:
            need = self._reply_bytes(doc)
            if need > reply_to[1]:
                raise InvalidRequest(
                    f"reply_at: the reply's arrays need {need} bytes of the region (each rounded up to {ALIGN}), "
                    f"got a range of {reply_to[1]}; nothing was done",
                    reply_bytes=need,
                )
        return reply_to

    def _reply_bytes(self, doc: Any) -> int:
        """The bytes the reply's arrays take in the region at most (a step's layer
        call: the step's shapes, which its document does not carry)."""
        if isinstance(doc, dict) and doc.get("op") == "step_call":
            sizes = reply_sizes(self.rt, self.owner, doc)
            return 0 if sizes is None else sum(aligned(n) for n in sizes)
        return reply_bytes(doc)

    def _reply_range(self, value: Any) -> tuple[int, int]:
        if not (isinstance(value, list) and len(value) == 2 and all(type(x) is int and x >= 0 for x in value)):
            raise InvalidRequest(f"reply_at: expected [offset, nbytes], two integers >= 0, got {value!r:.60}")
        offset, nbytes = value
        if offset % ALIGN or offset + nbytes > self.size:
            raise InvalidRequest(
                f"reply_at: expected a range of the region's {self.size} bytes starting at a multiple of {ALIGN}, "
                f"got [{offset}, {nbytes}]"
            )
        return offset, nbytes

    def _outgoing(self, doc: dict[str, Any], reply_to: Any) -> dict[str, Any]:
        """The reply with its arrays written to its ``reply_at``, referred to there."""
        if reply_to is None or self.region is None:
            return doc
        offset, nbytes = reply_to
        try:
            placed, _ = place_arrays(doc, self.region_view, offset, offset + nbytes)
        except wire.WireError as e:  # reply_bytes is an upper bound: a bug if it comes here
            self.rt.metrics.shm_events.labels("reply_in_frame").inc()
            log.error(
                "shared-memory transport: a reply's arrays did not fit its reply_at; sent in the frame",
                extra={"request_id": doc.get("id"), "error": str(e)},
            )
            return doc
        result: dict[str, Any] = placed
        return result

    def _released(self) -> None:
        super()._released()
        self._unmap()

    def _unmap(self) -> None:
        """Unmap the region, or, while an array still views it (the last of an
        operation being freed), try again later; past the tries, the mapping goes
        with its last view."""
        region = self.region
        if region is None:
            return
        try:
            self.readonly.release()
            self.region_view.release()
            region.close()
        except BufferError:
            if not self._unmap_tries:
                self.rt.metrics.shm_events.labels("unmap_deferred").inc()
                log.debug("shared-memory region still viewed; unmapping later")
            self._unmap_tries += 1
            if self._unmap_tries <= _UNMAP_RETRIES:
                asyncio.get_running_loop().call_later(_UNMAP_RETRY_S, self._unmap)
            else:
                self.region = None  # unmapped when its last view is freed
            return
        self.region = None
        self.rt.metrics.shm_events.labels("unmapped").inc()
