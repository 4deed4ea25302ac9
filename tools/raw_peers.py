"""Peers of the pipelined transports over plain sockets whose reading the caller
controls, no reader thread: the ``/v1/stream`` WebSocket (framing by the
``websockets`` library's sans-I/O protocol), the frame transport (TCP) and the
shared-memory transport (a Unix socket and a memfd region). For the backpressure
checks (a peer that sends frames and does not read its replies):
tests/service/test_stream.py, tests/service/test_flood.py and bench/probes/flood.py."""

from __future__ import annotations

import os
import select
import socket
import time
from typing import Any

import numpy as np
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from attnserve_client import framing, wire
from attnserve_client.shm import create_region

__all__ = ["RawPeer", "RawStream", "RawFrames", "RawShm", "open_peer", "flood"]


class RawPeer:
    """One connection: the frames of documents to send (:meth:`frames`), sent
    without reading (:meth:`send_until_stalled`), then the replies read
    (:meth:`read_replies`). A subclass says how a document becomes bytes
    (:meth:`_encode`), how received bytes become replies (:meth:`_received`) and
    what it must send back meanwhile (:meth:`_control`: a WebSocket's pongs)."""

    def __init__(self, sock: socket.socket, timeout: float):
        self.sock, self.timeout = sock, timeout

    def _encode(self, doc: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def _received(self, data: bytes) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _control(self) -> bytes:
        return b""

    def frames(self, docs: list[dict[str, Any]]) -> list[bytes]:
        """The bytes of each of ``docs`` as a frame, to send."""
        return [self._encode(doc) for doc in docs]

    def send_until_stalled(self, frames: list[bytes], stall_s: float = 3.0) -> tuple[int, memoryview]:
        """Send ``frames`` reading nothing, until all are sent or the server has
        taken no byte for ``stall_s`` seconds; returns how many frames were sent
        whole and the unsent rest of the frame it stopped in (empty if none)."""
        self.sock.setblocking(False)
        try:
            done, part, since = 0, memoryview(b""), time.monotonic()
            while (part or done < len(frames)) and time.monotonic() - since < stall_s:
                if not part:
                    part, done = memoryview(frames[done]), done + 1
                try:
                    part = part[self.sock.send(part) :]
                    since = time.monotonic()
                except BlockingIOError:
                    select.select([], [self.sock], [], 0.2)
            return done - (1 if part else 0), part
        finally:
            self.sock.settimeout(self.timeout)

    def read_replies(self, count: int, part: memoryview, frames: list[bytes]) -> dict[Any, dict[str, Any]]:
        """Send ``part`` and then ``frames`` while reading ``count`` replies (and
        sending what the protocol answers between frames); returns the replies by ``id``."""
        self.sock.setblocking(False)
        pending = [part, *map(memoryview, frames)]
        replies: dict[Any, dict[str, Any]] = {}
        deadline = time.monotonic() + self.timeout
        try:
            while len(replies) < count:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(replies)} of {count} replies in {self.timeout:g} s")
                while pending and not pending[0]:
                    pending.pop(0)
                readable, writable, _ = select.select([self.sock], [self.sock] if pending else [], [], 0.2)
                if writable:
                    try:
                        pending[0] = pending[0][self.sock.send(pending[0]) :]
                    except BlockingIOError:
                        pass
                if not readable:
                    continue
                data = self.sock.recv(1 << 20)
                if not data:
                    raise ConnectionError(f"the server closed the connection after {len(replies)} replies")
                for doc in self._received(data):
                    replies[doc["id"]] = doc
                control = self._control()  # after the frame being sent
                if control:
                    pending.insert(1 if pending and pending[0] else 0, memoryview(control))
                deadline = time.monotonic() + self.timeout
            return replies
        finally:
            self.sock.settimeout(self.timeout)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RawPeer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tcp(port: int, rcvbuf: int, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


class RawStream(RawPeer):
    """One WebSocket to ``ws://127.0.0.1:port/v1/stream`` with a small receive
    window (``rcvbuf`` bytes), so unread replies back up into the server soon."""

    def __init__(self, port: int, *, rcvbuf: int = 64 * 1024, timeout: float = 60.0, key: str | None = None):
        super().__init__(_tcp(port, rcvbuf, timeout), timeout)
        try:
            self.ws = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/v1/stream"), max_size=None)
            request = self.ws.connect()
            if key:
                request.headers["Authorization"] = f"Bearer {key}"
            self.ws.send_request(request)
            self.sock.sendall(b"".join(self.ws.data_to_send()))
            while self.ws.state is State.CONNECTING:
                self.ws.receive_data(self.sock.recv(65536))
            if self.ws.state is not State.OPEN:
                raise ConnectionError(f"the stream's handshake failed: {self.ws.handshake_exc}")
            self.ws.events_received()  # the handshake's response
        except BaseException:
            self.sock.close()
            raise

    def _encode(self, doc: dict[str, Any]) -> bytes:
        self.ws.send_binary(wire.packb(doc))
        return b"".join(self.ws.data_to_send())

    def _received(self, data: bytes) -> list[dict[str, Any]]:
        self.ws.receive_data(data)
        return [
            wire.unpackb(event.data, max_bytes=1 << 31)
            for event in self.ws.events_received()
            if event.opcode is Opcode.BINARY
        ]

    def _control(self) -> bytes:
        return b"".join(self.ws.data_to_send())  # pongs


class RawFrames(RawPeer):
    """One frame-transport connection (docs/api.md, Frame transport) to
    ``127.0.0.1:port``, its hello answered, with a small receive window."""

    def __init__(self, port: int, *, rcvbuf: int = 64 * 1024, timeout: float = 60.0, key: str | None = None):
        super().__init__(_tcp(port, rcvbuf, timeout), timeout)
        self._greet(key, {})

    def _greet(self, key: str | None, extra: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        self._buf = bytearray()
        try:
            keyed = {"key": key} if key else {}
            hello = self._encode({"op": "hello", "id": "hello", "version": framing.VERSION, **keyed, **extra})
            sent = socket.send_fds(self.sock, [hello], list(fds)) if fds else 0
            self.sock.sendall(hello[sent:])
            replies: list[dict[str, Any]] = []
            while not replies:
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection before its hello's reply")
                replies = self._received(data)
            if replies[0].get("status") != 200:
                raise ConnectionError(f"the hello was refused: {replies[0]}")
        except BaseException:
            self.sock.close()
            raise

    def _encode(self, doc: dict[str, Any]) -> bytes:
        return b"".join(bytes(b) for b in framing.frame_buffers(doc, wire.packb))

    def call_frame(self, step: int, layer: int, seq: int, arrays: list[np.ndarray]) -> bytes:
        """A call frame (docs/api.md, "Call frames: a step's layer call with no
        MessagePack"): the arrays' bytes back to back."""
        body = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        return framing.CALL_HEAD.pack(framing.CALL_MAGIC, step, layer, seq, len(body)) + body

    def _received(self, data: bytes) -> list[dict[str, Any]]:
        """The whole frames in what was received so far: each reply document, and
        each call reply as ``{"id": seq, "status", "call_reply": its body}``."""
        self._buf += data
        docs: list[dict[str, Any]] = []
        while len(self._buf) >= framing.PREFIX.size:
            if self._buf[:4] == framing.REPLY_MAGIC:
                if len(self._buf) < framing.REPLY_HEAD.size:
                    break
                _, seq, status, body_len = framing.REPLY_HEAD.unpack(self._buf[: framing.REPLY_HEAD.size])
                end = framing.REPLY_HEAD.size + body_len
                if len(self._buf) < end:
                    break
                docs.append(
                    {"id": seq, "status": status, "call_reply": bytes(self._buf[framing.REPLY_HEAD.size : end])}
                )
                del self._buf[:end]
                continue
            head_len, body_len = framing.read_prefix(self._buf[: framing.PREFIX.size])
            end = framing.PREFIX.size + head_len + body_len
            if len(self._buf) < end:
                break
            frame = memoryview(bytes(self._buf[framing.PREFIX.size : end]))
            del self._buf[:end]
            doc = wire.unpackb(frame[:head_len], max_bytes=framing.MAX_HEAD_BYTES)
            framing.resolve_arrays(doc, frame[head_len:])
            docs.append(doc)
        return docs


class RawShm(RawFrames):
    """One shared-memory connection (docs/api.md, Shared-memory transport) to the
    Unix socket at ``path``: a region of ``region`` bytes shared in its hello, and
    its frames carrying their arrays in their bodies as the frame transport's do."""

    def __init__(self, path: str, *, region: int = 1 << 20, rcvbuf: int = 64 * 1024, timeout: float = 60.0,
                 key: str | None = None):  # fmt: skip
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.settimeout(timeout)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        super(RawFrames, self).__init__(sock, timeout)
        fd, self.region = create_region(region)
        try:
            self._greet(key, {"region": region}, (fd,))
        finally:
            os.close(fd)

    def close(self) -> None:
        super().close()
        self.region.close()


def open_peer(transport: str, server: Any, **kw: Any) -> RawPeer:
    """A raw peer of ``transport`` (``stream``, ``frames`` or ``shm``) of a server
    with ``port``, ``frames_port`` and ``shm_socket`` attributes."""
    if transport == "stream":
        return RawStream(server.port, **kw)
    if transport == "frames":
        return RawFrames(server.frames_port, **kw)
    if transport == "shm":
        return RawShm(server.shm_socket, **kw)
    raise ValueError(f"transport: expected stream, frames or shm, got {transport!r}")


def flood(head: dict[str, Any], rng: Any, *, frames: int, every: int, queries: int, h: int, hkv: int, d: int):
    """The frames of a flood: ``frames`` attends of ``queries`` rows (``causal``
    false), every ``every``-th frame a one-row append instead; ``head`` holds
    ``session_id`` and ``layer``. Yields ``(doc, arrays)``: arrays ``(k, v)`` of an
    append, ``(q,)`` of an attend (float32)."""
    for i in range(frames):
        if i % every == 0:
            k = rng.standard_normal((1, hkv, d)).astype("<f4")
            v = rng.standard_normal((1, hkv, d)).astype("<f4")
            arrays = {"k": wire.encode_array(k), "v": wire.encode_array(v)}
            yield {"id": i, "op": "append", **head, **arrays}, (k, v)
        else:
            q = rng.standard_normal((queries, h, d)).astype("<f4")
            yield {"id": i, "op": "attend", **head, "q": wire.encode_array(q), "causal": False}, (q,)
