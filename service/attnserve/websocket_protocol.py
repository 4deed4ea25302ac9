"""The WebSocket protocol ``/v1/stream`` runs on: uvicorn's (websockets' sans-I/O
protocol) with a keepalive that never drops a live peer the server itself holds
back, and a send timeout that drops a peer that reads nothing.

uvicorn pings every ``ws_ping_interval`` and closes the connection (1011
keepalive ping timeout) when no pong comes within ``ws_ping_timeout``. But a pong
is a frame like any other: it arrives behind the data frames the peer sent before
it, and the stream stops reading data frames while its in-flight operations are
running (backpressure). With GPU work in flight for longer than the timeout, a
peer that reads every reply and answers every ping was dropped with all its queued
replies. Here the pong's deadline does not run out while the server is not reading
(the app has not taken the last data frame): it is moved on, and judged again once
the server reads, so only a peer that is read and still does not answer is dropped.

A peer that died while the server was not reading is found either way: once its
operations finish, the server reads again (the pong deadline runs), or, if its
replies cannot be written, by the send timeout: while the socket's write buffer is
full (the peer reads nothing), the connection is aborted when the buffer has not
shrunk for ``send_timeout_s`` (nginx's ``send_timeout``). Its operations still
complete; only their replies are lost.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

__all__ = ["StreamWebSocketProtocol", "stream_websocket_protocol"]

log = logging.getLogger("attnserve")


class StreamWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol with a backpressure-aware keepalive and a send
    timeout (:data:`send_timeout_s` seconds without progress; 0: none)."""

    send_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # the write buffer's size when the send timer was last set

    # -- keepalive ---------------------------------------------------------------

    def keepalive_timeout(self) -> None:
        if self.read_paused and not self.transport.is_closing():
            # The server is not reading (the app has not taken the last data frame):
            # the pong may be queued behind frames not read yet. Judge it once the
            # server reads again.
            assert self.ping_timeout is not None
            self.pong_timer = self.loop.call_later(self.ping_timeout, self.keepalive_timeout)
            return
        super().keepalive_timeout()

    # -- send timeout ------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_timeout_s > 0 and self._send_timer is None:
            self._arm_send_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_send_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_send_timer()
        super().connection_lost(exc)

    def _arm_send_timer(self) -> None:
        self._unsent = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_timed_out)

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size() < self._unsent:  # the peer read some: it lives
            self._arm_send_timer()
            return
        log.warning(
            f"a /v1/stream peer read nothing for {self.send_timeout_s:g} s: its connection is closed "
            "(its operations complete; their replies are lost)",
            extra={"client": "%s:%d" % self.client if self.client else None, "unsent_bytes": self._unsent},
        )
        self.transport.abort()


def stream_websocket_protocol(send_timeout_s: float) -> type[StreamWebSocketProtocol]:
    """The protocol class for uvicorn's ``ws`` option with this send timeout."""
    return type(StreamWebSocketProtocol.__name__, (StreamWebSocketProtocol,), {"send_timeout_s": send_timeout_s})
