"""A ``/v1/stream`` connection over a plain socket whose reading the caller
controls: WebSocket framing by the ``websockets`` library's sans-I/O protocol,
no reader thread. For the backpressure checks (a peer that sends frames and does
not read its replies): tests/service/test_stream.py and bench/probes/unread_stream.py."""

from __future__ import annotations

import select
import socket
import time
from typing import Any

from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from attnserve_client import wire

__all__ = ["RawStream"]


class RawStream:
    """One WebSocket to ``ws://127.0.0.1:port/v1/stream`` with a small receive
    window (``rcvbuf`` bytes), so unread replies back up into the server soon."""

    def __init__(self, port: int, *, rcvbuf: int = 64 * 1024, timeout: float = 60.0, key: str | None = None):
        self.timeout = timeout
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
            self.sock.settimeout(timeout)
            self.sock.connect(("127.0.0.1", port))
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

    def frames(self, docs: list[dict[str, Any]]) -> list[bytes]:
        """The bytes of each of ``docs`` as a binary (MessagePack) frame, to send."""
        out = []
        for doc in docs:
            self.ws.send_binary(wire.packb(doc))
            out.append(b"".join(self.ws.data_to_send()))
        return out

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
        answering the server's pings between frames); returns the replies by ``id``."""
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
                    raise ConnectionError(f"the server closed the stream after {len(replies)} replies")
                self.ws.receive_data(data)
                for event in self.ws.events_received():
                    if event.opcode is Opcode.BINARY:
                        doc = wire.unpackb(event.data, max_bytes=1 << 31)
                        replies[doc["id"]] = doc
                control = b"".join(self.ws.data_to_send())  # pongs: after the frame being sent
                if control:
                    pending.insert(1 if pending and pending[0] else 0, memoryview(control))
                deadline = time.monotonic() + self.timeout
            return replies
        finally:
            self.sock.settimeout(self.timeout)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RawStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
