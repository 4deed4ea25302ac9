"""The streaming transport (/v1/stream) and the client's batched step, through the
client library against a real server: bit-identical to the same operations sent
one by one over HTTP, right against the float64 oracle, per-frame problems that
keep the connection, authentication, backpressure and a full GPU queue."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest
from websockets.frames import Opcode
from websockets.sync.client import connect

from attnserve.config import Settings
from attnserve_client import (
    AsyncClient,
    AttendItem,
    Client,
    Overloaded,
    SessionNotFound,
    wire,
)
from attnserve_client.errors import APIConnectionError
from svc_helpers import F32_TOL, LiveServer, Model, errors_stay_per_operation, from_wire, rel_err, rows
from tools.raw_peers import RawStream, flood

SHAPES = [(8, 2, 32, "f32"), (3, 1, 17, "f32"), (4, 4, 64, "turboquant"), (6, 2, 32, "turboquant")]


def _twins(client: Client, rng, layers: int = 2):
    out = []
    for h, hkv, d, fmt in SHAPES:
        spec = dict(
            num_qo_heads=h,
            num_kv_heads=hkv,
            head_dim=d,
            num_layers=layers,
            kv_format=fmt,
            seed=int(rng.integers(1 << 30)),
        )
        out.append((client.create_session(**spec), client.create_session(**spec), (h, hkv, d, fmt)))
    return out


def test_stream_and_batch_are_bit_identical_to_single_calls(server, rng):
    with Client(server.url) as client, client.stream() as stream:
        sessions = _twins(client, rng) + _twins(client, rng)  # a: stream, b: HTTP one by one
        models = {}
        for a, _, (h, hkv, d, _) in sessions:
            models[a.session_id] = Model(h, hkv, d, layers=2)
        for step, n in enumerate([11, 1, 1, 3, 1]):
            for layer in (0, 1):
                futures, singles = [], []
                for idx, (a, b, (h, hkv, d, fmt)) in enumerate(sessions):
                    q, k, v = rows(rng, n, h, d), rows(rng, n, hkv, d), rows(rng, n, hkv, d)
                    models[a.session_id].add(layer, k, v)
                    singles.append(b.attend(layer, q, k=k, v=v))
                    if idx % 2 == 0:  # half pipelined one by one on the stream
                        futures.append(stream.submit_attend(a, layer, q, k=k, v=v, offset=a.lengths[layer]))
                    else:  # half in one batched step on the stream
                        futures.append(AttendItem(a, layer, q, k, v))
                batch = [f for f in futures if isinstance(f, AttendItem)]
                batch_out = iter(stream.attend_batch(batch))
                for f, want in zip(futures, singles):
                    got = next(batch_out) if isinstance(f, AttendItem) else f.result(timeout=60)
                    assert got.dtype == np.float32 and got.shape == want.shape
                    assert got.tobytes() == want.tobytes()
        # the HTTP batched step too, and the oracle
        items = []
        for a, b, (h, hkv, d, fmt) in sessions:
            q = rows(rng, 2, h, d)
            items.append(AttendItem(a.session_id, 1, q))
            want = b.attend(1, q)
            items[-1] = (items[-1], want)
        outs = client.attend_batch([it for it, _ in items])
        for out, (it, want) in zip(outs, items):
            assert out.tobytes() == want.tobytes()
        for (a, b, (h, hkv, d, fmt)), (it, _) in zip(sessions, items):
            assert a.info().lengths == b.info().lengths == tuple(models[a.session_id].lengths)
            if fmt == "f32":
                assert rel_err(stream.attend(a, 1, it.q), models[a.session_id].attention(1, it.q)) <= F32_TOL
            a.delete()
            b.delete()


def test_stream_errors_are_per_operation(server, rng):
    with Client(server.url) as client, client.stream() as stream:
        errors_stay_per_operation(client, stream, rng).delete()


def test_malformed_frames_get_problems_and_the_connection_stays(server, rng):
    with Client(server.url) as client:
        s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
    url = server.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url) as ws:
        ws.send(b"\xc1\x00garbage")
        r = wire.unpackb(ws.recv(timeout=30), max_bytes=1 << 20)
        assert r["id"] is None and r["status"] == 400 and r["error"]["type"] == "/problems/malformed-body"
        for frame, status, slug in [
            ({"id": 1, "op": "fly"}, 422, "invalid-request"),
            ({"id": 2, "op": "attend", "session_id": s.session_id, "layer": 0}, 422, "invalid-request"),
            (
                {
                    "id": 3,
                    "op": "attend",
                    "session_id": s.session_id,
                    "layer": 9,
                    "q": wire.encode_array(rows(rng, 1, 2, 8)),
                },
                404,
                "layer-not-found",
            ),
            ({"id": [1], "op": "ping"}, 422, "invalid-request"),
            ({"id": 5, "op": "ping", "extra": 1}, 422, "invalid-request"),
        ]:
            ws.send(wire.packb(frame))
            r = wire.unpackb(ws.recv(timeout=30), max_bytes=1 << 20)
            assert r["status"] == status and r["error"]["type"] == f"/problems/{slug}", r
            assert r["id"] == (frame["id"] if isinstance(frame["id"], int) else None)
        # text frames are JSON, answered in JSON
        k = rows(rng, 2, 1, 8)
        ws.send(
            json.dumps(
                {"id": "t1", "op": "append", "session_id": s.session_id, "layer": 0, "k": k.tolist(), "v": k.tolist()}
            )
        )
        r = json.loads(ws.recv(timeout=30))
        assert r == {"id": "t1", "status": 200, "result": {"length": 2}}
    with Client(server.url) as client:
        assert client.get_session(s.session_id).info().lengths == (2,)
        client.delete_session(s.session_id)


def test_a_client_offering_compression_gets_none(server):
    """websockets offers permessage-deflate by default; the server declines it, so
    frames go uncompressed (compressing float arrays costs more than it saves)."""
    url = server.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url) as ws:  # the library's defaults, as a user's client has them
        assert "permessage-deflate" in ws.request.headers.get("Sec-WebSocket-Extensions", "")
        assert "Sec-WebSocket-Extensions" not in ws.response.headers
        assert ws.protocol.extensions == []
        ws.send(wire.packb({"id": 1, "op": "ping"}))
        assert wire.unpackb(ws.recv(timeout=30), max_bytes=1 << 20)["status"] == 200


def test_stream_needs_a_key_and_sees_only_the_tenants_sessions(engine, rng):
    srv = LiveServer(Settings(api_keys="key-a,key-b"), engine=engine).start()
    try:
        with pytest.raises(APIConnectionError):
            Client(srv.url).stream()
        with pytest.raises(APIConnectionError):
            Client(srv.url, api_key="wrong").stream()
        with Client(srv.url, api_key="key-a") as a, Client(srv.url, api_key="key-b") as b:
            sb = b.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
            with a.stream() as stream:
                with pytest.raises(SessionNotFound):
                    stream.append(sb.session_id, 0, rows(rng, 1, 1, 8), rows(rng, 1, 1, 8))
            assert sb.info().lengths == (0,)
    finally:
        srv.stop()


def test_full_gpu_queue_is_an_overload_reply(server, engine, rng):
    from test_quotas import _wait_depth, gpu_held

    with Client(server.url) as client, client.stream() as stream:
        s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
        saved = engine.worker.max_queue
        engine.worker.max_queue = 2
        try:
            with gpu_held(engine):
                futs = [stream.submit_append(s, 0, rows(rng, 1, 1, 8), rows(rng, 1, 1, 8)) for _ in range(3)]
                _wait_depth(engine, 3)
                with pytest.raises(Overloaded):
                    futs[2].result(timeout=30)
        finally:
            engine.worker.max_queue = saved
        assert sorted(f.result(timeout=30) for f in futs[:2]) == [1, 2]
        assert s.info().lengths == (2,)
        s.delete()


@pytest.mark.parametrize("transport", ["websocket", "frames"])
def test_backpressure_stops_reading_past_the_in_flight_limit(engine, rng, transport):
    """With stream_max_in_flight=2 and the GPU held, the third operation is not even
    read: it is not queued until one of the first two finishes (over the WebSocket and
    over the frame transport alike)."""
    from test_quotas import _wait_depth, gpu_held

    srv = LiveServer(Settings(stream_max_in_flight=2, frames_port=0), engine=engine).start()
    try:
        with Client(srv.url) as client, client.stream(transport=transport) as stream:
            s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
            with gpu_held(engine):
                futs = [stream.submit_append(s, 0, rows(rng, 1, 1, 8), rows(rng, 1, 1, 8)) for _ in range(4)]
                _wait_depth(engine, 3)  # the held job and two appends
                time.sleep(0.3)
                assert engine.worker.queue_depth == 3  # the others wait unread
            assert [f.result(timeout=30) for f in futs] == [1, 2, 3, 4]
            s.delete()
    finally:
        srv.stop()


def test_a_client_that_does_not_read_its_replies_stops_being_read(engine, rng):
    """A peer that sends frame after frame and reads nothing: each operation holds
    its in-flight slot until its reply is written, so once the socket buffers hold
    the unread replies the server reads no further frame (its memory stays bounded;
    before, it read every frame and kept every reply: bench/probes/unread_stream.py
    measures the server's memory). When the peer reads again, every reply comes,
    right against the oracle."""
    h, hkv, d, queries, frames, every = 8, 2, 64, 64, 2000, 10  # a reply: 128 KiB
    # phase one reads nothing for as long as a busy machine takes: past the send
    # timeout the server would rightly drop the peer (the test after this one)
    srv = LiveServer(Settings(stream_max_in_flight=8, stream_send_timeout_s=600), engine=engine).start()
    try:
        with Client(srv.url) as client, RawStream(srv.port) as raw:
            s = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)
            model = Model(h, hkv, d)
            k, v = rows(rng, queries, hkv, d), rows(rng, queries, hkv, d)
            s.append(0, k, v)
            model.add(0, k, v)
            docs, wants, group = [], [], []  # group: the attends since the last append

            def want_group() -> None:  # one oracle call for the attends between two appends
                if group:
                    want = model.attention(0, np.concatenate([q for _, q in group]), causal=False)
                    wants.extend(zip((i for i, _ in group), want.reshape(len(group), queries, h, d)))
                    group.clear()

            head = {"session_id": s.session_id, "layer": 0}
            for doc, arrays in flood(head, rng, frames=frames, every=every, queries=queries, h=h, hkv=hkv, d=d):
                docs.append(doc)
                if doc["op"] == "append":
                    want_group()
                    model.add(0, *arrays)
                    wants.append((doc["id"], {"length": model.lengths[0]}))
                else:
                    group.append((doc["id"], arrays[0]))
            want_group()
            frames_out = raw.frames(docs)

            sent, part = raw.send_until_stalled(frames_out)  # phase one: nothing read
            taken = [-1]  # one appended row per `every` frames the server took
            deadline = time.monotonic() + 60
            while True:  # the frames it took finish; then it takes no more
                time.sleep(0.5)
                taken.append(s.info().lengths[0] - queries)
                # none done yet may be a GPU slow to start (a busy machine): wait for one
                if taken[-1] == taken[-2] and (taken[-1] > 0 or time.monotonic() > deadline):
                    break
            assert sent < frames, "the server read every frame of a peer that reads nothing"
            assert 0 < taken[-1] * every < frames // 20, taken

            replies = raw.read_replies(frames, part, frames_out[sent + bool(part) :])  # phase two: every reply
            assert s.info().lengths == (queries + frames // every,)
        _check_replies(replies, wants)
    finally:
        srv.stop()


def _check_replies(replies: dict, wants) -> None:
    """Each reply by id against what was wanted: an append's result document, or an
    attend's output against the oracle."""
    for i, want in wants:
        assert replies[i]["status"] == 200, replies[i]
        if isinstance(want, dict):
            assert replies[i]["result"] == want
        else:
            assert rel_err(from_wire(replies[i]["result"])["out"], want) < F32_TOL


def _slow_gpu(monkeypatch, engine, seconds: float) -> None:
    """Every GPU submission of ``engine`` takes ``seconds`` longer (a GPU slower
    than the stream's keepalive)."""
    submit = engine.worker._submit_batch

    def slow_submit(*args, **kwargs):
        time.sleep(seconds)
        return submit(*args, **kwargs)

    monkeypatch.setattr(engine.worker, "_submit_batch", slow_submit)


KEEPALIVE = dict(stream_ping_interval_s=0.2, stream_ping_timeout_s=0.3)


def test_a_backpressured_stream_outlives_the_keepalive(engine, rng, monkeypatch):
    """A peer with more operations in flight than the server takes, on a GPU that
    holds every step longer than the ping timeout: the server stops reading (its
    pongs wait behind unread frames), and still delivers every reply, right against
    the oracle, to a stock websockets client that reads and answers pings all along
    (before, the keepalive closed it: 1011 keepalive ping timeout, no reply)."""
    h, hkv, d, queries, frames, every = 4, 2, 32, 16, 48, 8
    srv = LiveServer(Settings(stream_max_in_flight=4, **KEEPALIVE), engine=engine).start()
    try:
        with Client(srv.url) as client:
            s = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)
            model = Model(h, hkv, d)
            k, v = rows(rng, queries, hkv, d), rows(rng, queries, hkv, d)
            s.append(0, k, v)
            model.add(0, k, v)
            docs, wants = [], {}
            head = {"session_id": s.session_id, "layer": 0}
            for doc, arrays in flood(head, rng, frames=frames, every=every, queries=queries, h=h, hkv=hkv, d=d):
                docs.append(doc)
                if doc["op"] == "append":
                    model.add(0, *arrays)
                    wants[doc["id"]] = {"length": model.lengths[0]}
                else:
                    wants[doc["id"]] = model.attention(0, arrays[0], causal=False)
            _slow_gpu(monkeypatch, engine, 0.6)  # each step holds the stream unread past the ping timeout
            url = srv.url.replace("http://", "ws://") + "/v1/stream"
            replies = {}
            with connect(url, max_size=None) as ws:
                sender = threading.Thread(target=lambda: [ws.send(wire.packb(doc)) for doc in docs], daemon=True)
                sender.start()
                for _ in range(frames):
                    r = wire.unpackb(ws.recv(timeout=120), max_bytes=1 << 30)
                    replies[r["id"]] = r
                sender.join(30)
            assert s.info().lengths == (queries + frames // every,)
        _check_replies(replies, wants.items())
    finally:
        srv.stop()


def test_a_stream_peer_that_does_not_answer_pings_is_dropped(engine):
    """The keepalive still finds a dead peer: one the server reads (nothing held
    back) that answers no ping is closed once the ping timeout passes."""
    srv = LiveServer(Settings(**KEEPALIVE), engine=engine).start()
    try:
        with RawStream(srv.port, timeout=30) as raw:  # reads nothing, so answers no ping
            t0 = time.monotonic()
            got = b""
            while True:  # the server's pings, then its close frame, then the end of the stream
                data = raw.sock.recv(1 << 16)
                if not data:
                    break
                got += data
            assert time.monotonic() - t0 < 20
            raw.ws.receive_data(got)
            closes = [e for e in raw.ws.events_received() if e.opcode is Opcode.CLOSE]
            assert closes and raw.ws.close_rcvd.code == 1011, raw.ws.close_rcvd
    finally:
        srv.stop()


def test_a_stream_peer_that_reads_nothing_is_dropped_after_the_send_timeout(engine, rng, caplog):
    """A peer that floods the stream and reads none of its replies: once the
    server's writes have made no progress for stream_send_timeout_s, the connection
    is aborted and said in the log; the operations it took still complete."""
    h, hkv, d, queries, frames, every = 8, 2, 64, 64, 400, 10  # a reply: 128 KiB
    srv = LiveServer(Settings(stream_max_in_flight=8, stream_send_timeout_s=1.0), engine=engine).start()
    try:
        with Client(srv.url) as client, RawStream(srv.port, timeout=60) as raw:
            s = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)
            s.append(0, rows(rng, queries, hkv, d), rows(rng, queries, hkv, d))
            head = {"session_id": s.session_id, "layer": 0}
            docs = [doc for doc, _ in flood(head, rng, frames=frames, every=every, queries=queries, h=h, hkv=hkv, d=d)]
            with caplog.at_level("WARNING", logger="attnserve"):
                try:  # nothing read: the sending stalls, and the server aborts the connection
                    raw.send_until_stalled(raw.frames(docs), stall_s=30)
                    raw.sock.settimeout(30)
                    while raw.sock.recv(1 << 20):
                        pass
                except (ConnectionError, OSError):  # reset by the abort
                    pass
                deadline = time.monotonic() + 30
                while not any("read nothing" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, "the server kept a peer that read nothing"
                    time.sleep(0.1)
            time.sleep(0.5)
            appended = s.info().lengths[0] - queries
            assert 0 < appended < frames // every  # what it took was applied; it stopped taking frames
    finally:
        srv.stop()


def test_async_stream_pipelines(server, rng):
    async def main():
        async with AsyncClient(server.url) as client:
            s = await client.create_session(num_qo_heads=4, num_kv_heads=2, head_dim=16)
            ref = await client.create_session(num_qo_heads=4, num_kv_heads=2, head_dim=16)
            k, v = rows(rng, 20, 2, 16), rows(rng, 20, 2, 16)
            await ref.append(0, k, v)
            async with await client.stream() as stream:
                await stream.append(s, 0, k, v)
                qs = [rows(rng, 1, 4, 16) for _ in range(16)]
                outs = await asyncio.gather(*(stream.attend(s, 0, q) for q in qs))
                batch = await client.attend_batch([AttendItem(s, 0, q) for q in qs[:4]])
            for q, out in zip(qs, outs):
                assert out.tobytes() == (await ref.attend(0, q)).tobytes()
            for q, out in zip(qs, batch):
                assert out.tobytes() == (await ref.attend(0, q)).tobytes()
            await s.delete()
            await ref.delete()

    asyncio.run(main())


def test_async_stream_is_an_async_context_manager(server, rng):
    # `async with client.stream()` (no await), as `with client.stream()` on the sync
    # client: open on entry, closed on exit; `await client.stream()` still opens one
    async def main():
        async with AsyncClient(server.url) as client:
            s = await client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=16)
            k, v = rows(rng, 3, 1, 16), rows(rng, 3, 1, 16)
            async with client.stream() as stream:
                assert await stream.append(s, 0, k, v) == 3
                out = await stream.attend(s, 0, rows(rng, 1, 2, 16))
                assert out.shape == (1, 2, 16)
            with pytest.raises(APIConnectionError, match="closed"):  # closed on exit
                await stream.attend(s, 0, rows(rng, 1, 2, 16))
            awaited = await client.stream()
            try:
                assert (await awaited.attend(s, 0, rows(rng, 1, 2, 16))).shape == (1, 2, 16)
            finally:
                await awaited.close()
            await s.delete()

    asyncio.run(main())


def test_a_dropped_connection_loses_nothing_queued(server, engine, rng):
    from test_quotas import _wait_depth, gpu_held

    with Client(server.url) as client:
        s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
        stream = client.stream()
        with gpu_held(engine):
            for i in range(3):
                stream.submit_append(s, 0, rows(rng, 1, 1, 8), rows(rng, 1, 1, 8), offset=i)
            _wait_depth(engine, 4)
            threading.Thread(target=stream.close, daemon=True).start()
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        while s.info().lengths != (3,) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.info().lengths == (3,)
        s.delete()


def test_a_closed_stream_refuses_new_operations(server, rng):
    with Client(server.url) as client:
        s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
        stream = client.stream()
        stream.append(s, 0, rows(rng, 1, 1, 8), rows(rng, 1, 1, 8))
        stream.close()
        with pytest.raises(APIConnectionError, match="closed"):
            stream.attend(s, 0, rows(rng, 1, 2, 8))

        async def go() -> None:
            async with AsyncClient(server.url) as ac:
                st = await ac.stream()
                await st.close()
                with pytest.raises(APIConnectionError, match="closed"):
                    await st.attend(s.session_id, 0, rows(rng, 1, 2, 8))

        asyncio.run(go())
        assert s.info().lengths == (1,)
        s.delete()


def test_a_json_container_bomb_is_refused_before_it_is_built(server):
    """A JSON body or text frame of empty arrays, far past one per 8 bytes, is 400
    malformed-body at once (as MessagePack's is), on HTTP and on the stream."""
    with Client(server.url) as client:
        s = client.create_session(num_qo_heads=1, num_kv_heads=1, head_dim=4)
    n = 1_000_000
    bomb = b'{"k": [' + b"[]," * (n - 1) + b'[]], "v": [], "offset": 0}'
    r = httpx.post(
        f"{server.url}/v1/sessions/{s.session_id}/layers/0/kv",
        content=bomb,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["type"] == "/problems/malformed-body", r.text
    assert "arrays and objects" in r.json()["detail"]
    frame = b'{"id": 1, "op": "append", "session_id": "%s", "layer": 0, "k": [' % s.session_id.encode()
    with connect(server.url.replace("http://", "ws://") + "/v1/stream", max_size=None) as ws:
        ws.send((frame + b"[]," * (n - 1) + b"[]]}").decode())
        reply = json.loads(ws.recv(timeout=60))
        assert reply["status"] == 400 and reply["error"]["type"] == "/problems/malformed-body", reply
        assert "arrays and objects" in reply["error"]["detail"]
    with Client(server.url) as client:
        assert client.get_session(s.session_id).info().lengths == (0,)
        client.delete_session(s.session_id)
