"""The frame transport (plain TCP, arrays as raw bytes beside a MessagePack head),
through the client library and through a raw socket, against a real server: bit-
identical to the same operations over the WebSocket stream and one by one over
HTTP, right against the float64 oracle, per-frame problems, refusals that close
the connection, authentication, backpressure, stalls, draining and shutdown."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import pytest

from attnserve.transport import frames as frames_module
from attnserve.config import Settings
from attnserve_client import (
    AsyncClient,
    Client,
    InvalidInput,
    wire,
)
from attnserve_client.errors import APIConnectionError
from attnserve_client.framing import PREFIX, frame_buffers
from svc_helpers import (
    F32_TOL, LiveServer, Model, RawFrames, busy_and_draining_are_503, drive_twins, errors_stay_per_operation,
    keys_and_tenants_hold, rel_err, rows,
)  # fmt: skip


@pytest.fixture(scope="module")
def fserver(engine):
    srv = LiveServer(Settings(frames_port=0), engine=engine).start()
    yield srv
    srv.stop()


def test_frames_are_bit_identical_to_the_stream_and_to_single_calls(fserver, rng):
    """Three twins of each shape and format: one driven over the frames (single,
    batched items and stacked steps, with appends across page borders), one over the
    WebSocket stream, one by one over HTTP: every output bit-identical, f32 within
    the oracle's tolerance."""
    with Client(fserver.url) as client, client.stream(transport="frames") as fs, client.stream() as ws:
        drive_twins(client, fs, ws, rng)


def test_frames_errors_are_per_operation_and_change_nothing(fserver, rng):
    with Client(fserver.url) as client, client.stream(transport="frames") as fs:
        errors_stay_per_operation(client, fs, rng).delete()


def test_malformed_frames_get_problems_and_the_connection_stays(fserver, rng):
    with Client(fserver.url) as client:
        s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
    raw = RawFrames(fserver.runtime.frames_port)
    try:
        q = wire.encode_array(rows(rng, 1, 2, 8))
        for doc, status, slug, said in [
            ({"id": 1, "op": "fly"}, 422, "invalid-request", "op"),
            ({"id": 2, "op": "attend", "session_id": s.session_id, "layer": 0}, 422, "invalid-request", "q"),
            ({"id": 3, "op": "attend", "session_id": s.session_id, "layer": 9, "q": q}, 404, "layer-not-found", ""),
            ({"id": [1], "op": "ping"}, 422, "invalid-request", "id"),
            ({"id": 5, "op": "ping", "extra": 1}, 422, "invalid-request", "extra"),
            # references outside the body, misaligned, or with other keys
            (
                {"id": 6, "op": "attend", "session_id": s.session_id, "layer": 0,
                 "q": {"dtype": "<f4", "shape": [1, 2, 8], "at": [0, 64]}},
                422, "invalid-request", "range of the body's 0 bytes",
            ),
            (
                {"id": 7, "op": "attend", "session_id": s.session_id, "layer": 0,
                 "q": {"dtype": "<f4", "shape": [1, 2, 8], "at": [2, 64]}},
                422, "invalid-request", "multiple of 4",
            ),
            (
                {"id": 8, "op": "attend", "session_id": s.session_id, "layer": 0,
                 "q": {"dtype": "<f4", "shape": [1, 2, 8], "at": [0, 64], "data": b""}},
                422, "invalid-request", "exactly the keys",
            ),
        ]:  # fmt: skip
            r = raw.call(doc)
            assert r["status"] == status and r["error"]["type"] == f"/problems/{slug}", r
            assert said in r["error"]["detail"]
            assert r["id"] == (doc["id"] if isinstance(doc["id"], int) else None)
            assert r["error"]["instance"] == "/v1/frames"
        # a head that is not MessagePack: 400, and the connection still serves
        raw.sock.sendall(PREFIX.pack(b"ATF1", 3, 0) + b"\xc1\x00\x00")
        r = raw.recv()
        assert r["status"] == 400 and r["error"]["type"] == "/problems/malformed-body", r
        # an array's bytes in the body and inline: both are taken
        k = rows(rng, 2, 1, 8)
        inline = {"dtype": "<f4", "shape": [2, 1, 8], "data": k.tobytes()}
        r = raw.call(
            {"id": 9, "op": "append", "session_id": s.session_id, "layer": 0, "k": wire.encode_array(k), "v": inline}
        )
        assert r == {"id": 9, "status": 200, "result": {"length": 2}}
    finally:
        raw.close()
    with Client(fserver.url) as client:
        assert client.get_session(s.session_id).info().lengths == (2,)
        client.delete_session(s.session_id)


@pytest.mark.parametrize(
    "greet, first, status, slug",
    [
        (False, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed-body"),  # not this port's protocol
        (False, b"".join(frame_buffers({"id": 1, "op": "ping"}, wire.packb)), 422, "invalid-request"),  # no hello
        (False, b"".join(frame_buffers({"id": 1, "op": "hello", "version": 2}, wire.packb)), 422, "invalid-request"),
        (True, PREFIX.pack(b"ATF1", (1 << 20) + 1, 0), 413, "payload-too-large"),  # head past its limit
        (True, PREFIX.pack(b"ATF1", 16, (64 << 20) + 1), 413, "payload-too-large"),  # body past max_body_bytes
    ],
)
def test_refusals_that_close_the_connection(fserver, greet, first, status, slug):
    raw = RawFrames(fserver.runtime.frames_port, hello=greet)
    try:
        raw.sock.sendall(first)
        r = raw.recv()
        assert r["status"] == status and r["error"]["type"] == f"/problems/{slug}", r
        assert raw.closed()
    finally:
        raw.close()


def test_frames_need_a_key_and_see_only_the_tenants_sessions(engine, rng):
    srv = LiveServer(Settings(api_keys="key-a,key-b", frames_port=0), engine=engine).start()
    try:
        keys_and_tenants_hold(srv.url, "frames", rng, frames_address=("127.0.0.1", srv.runtime.frames_port))
    finally:
        srv.stop()


def test_a_peer_that_does_not_read_its_replies_stops_being_read(engine, rng):
    """A raw peer sends attend after attend (each reply 128 KiB) and reads nothing:
    the server stops reading once the unread replies fill the socket and the slots,
    and the peer's sends block; then every reply comes, right against the oracle."""
    h, hkv, d, queries = 8, 2, 64, 64
    srv = LiveServer(Settings(stream_max_in_flight=4, frames_port=0), engine=engine).start()
    try:
        with Client(srv.url) as client:
            s = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)
            k, v = rows(rng, queries, hkv, d), rows(rng, queries, hkv, d)
            s.append(0, k, v)
        model = Model(h, hkv, d)
        model.add(0, k, v)
        q = rows(rng, queries, h, d)
        want = model.attention(0, q, causal=False)
        frame = b"".join(
            frame_buffers(
                {"id": 1, "op": "attend", "session_id": s.session_id, "layer": 0,
                 "q": wire.encode_array(q), "causal": False},
                wire.packb,
            )
        )  # fmt: skip
        raw = RawFrames(srv.runtime.frames_port)
        raw.sock.setblocking(False)
        sent, total, part = 0, 4000, 0  # frames sent whole; bytes of the next one sent
        stalled_since = None
        while sent < total:
            try:
                part += raw.sock.send(memoryview(frame)[part:])
                stalled_since = None
                if part == len(frame):
                    sent, part = sent + 1, 0
            except BlockingIOError:
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > 2:
                    break
                time.sleep(0.01)
        assert sent < total, "the server read every frame of a peer that reads nothing"
        assert srv.runtime.in_flight <= 4  # the slots: no more operations held than that
        raw.sock.setblocking(True)
        raw.close()  # what it took completes; nothing is kept for a peer that left
        deadline = time.monotonic() + 30
        while srv.runtime.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.runtime.in_flight == 0
        raw = RawFrames(srv.runtime.frames_port)
        for i in range(8):  # pipelined, read afterwards
            raw.send({"id": i, "op": "attend", "session_id": s.session_id, "layer": 0,
                      "q": wire.encode_array(q), "causal": False})  # fmt: skip
        for i in range(8):
            r = raw.recv()
            assert r["id"] == i and r["status"] == 200, r
            out = wire.decode_array(r["result"]["out"], name="out")
            assert rel_err(out, want) < F32_TOL
        raw.close()
    finally:
        srv.stop()


def test_a_stalled_frame_and_a_silent_connection_are_closed(fserver, monkeypatch):
    monkeypatch.setattr(frames_module, "BODY_IDLE_TIMEOUT_S", 0.4)
    silent = RawFrames(fserver.runtime.frames_port, hello=False)  # no hello
    stalled = RawFrames(fserver.runtime.frames_port)
    try:
        stalled.sock.sendall(PREFIX.pack(b"ATF1", 100, 0) + b"\x80")  # 1 byte of a 100-byte head
        t0 = time.monotonic()
        assert silent.closed(timeout=10) and stalled.closed(timeout=10)
        assert time.monotonic() - t0 < 8
    finally:
        silent.close()
        stalled.close()


def test_too_many_connections_and_draining_are_503(engine, rng):
    srv = LiveServer(Settings(frames_port=0, frames_max_connections=1), engine=engine).start()
    try:
        port = srv.runtime.frames_port
        with Client(srv.url) as client, client.stream(transport="frames") as fs:
            busy_and_draining_are_503(srv, client, fs, RawFrames(port, hello=False), rng)
    finally:
        srv.stop()
    with pytest.raises(OSError):  # stopped: the port no longer listens
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_shutdown_closes_open_connections(engine, rng):
    srv = LiveServer(Settings(frames_port=0), engine=engine).start()
    raw = RawFrames(srv.runtime.frames_port)
    try:
        assert raw.call({"id": 1, "op": "ping"})["status"] == 200
        srv.stop()
        assert raw.closed()
    finally:
        raw.close()
        srv.stop()


def test_async_frames_pipeline(fserver, rng):
    async def main():
        async with AsyncClient(fserver.url) as client:
            s = await client.create_session(num_qo_heads=4, num_kv_heads=2, head_dim=16)
            ref = await client.create_session(num_qo_heads=4, num_kv_heads=2, head_dim=16)
            k, v = rows(rng, 20, 2, 16), rows(rng, 20, 2, 16)
            await ref.append(0, k, v)
            async with client.stream(transport="frames") as fs:
                assert await fs.append(s, 0, k, v) == 20
                qs = [rows(rng, 1, 4, 16) for _ in range(16)]
                outs = await asyncio.gather(*(fs.attend(s, 0, q) for q in qs))
                stacked = await fs.attend_stacked([s, s], 0, np.stack(qs[:2]))
            with pytest.raises(APIConnectionError, match="closed"):
                await fs.attend(s, 0, qs[0])
            for q, out in zip(qs, outs):
                assert out.tobytes() == (await ref.attend(0, q)).tobytes()
            for q, out in zip(qs[:2], stacked):
                assert out.tobytes() == (await ref.attend(0, q)).tobytes()
            await s.delete()
            await ref.delete()

    asyncio.run(main())


def test_the_client_says_when_the_server_has_no_frames(engine):
    # a server of its own, started and stopped inside this module's: the session's
    # shared `server` first made here would take its metrics hooks from `fserver`'s
    # and lose them when `fserver` stops (test_probes then counted nothing)
    server = LiveServer(Settings(), engine=engine).start()
    try:
        _no_frames(server)
    finally:
        server.stop()


def _no_frames(server) -> None:
    with Client(server.url) as client:
        assert client.info()["frames"] is None
        with pytest.raises(InvalidInput, match="frames-port"):
            client.stream(transport="frames")
        with pytest.raises(InvalidInput, match="transport"):
            client.stream(transport="carrier-pigeon")
        with pytest.raises(InvalidInput, match="frames_address"):
            client.stream(frames_address=("127.0.0.1", 1))
