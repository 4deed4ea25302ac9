"""The shared-memory transport (the frames over a Unix socket, arrays in a region
both sides map), through the client library and through a raw socket, against a
real server: bit-identical to the frame transport and to single calls over HTTP
(float32, float16 and bfloat16), right against the float64 oracle; bad references
and ranges refused per operation; hello refusals (region, descriptors, seals,
version, key, the peer's user) closing the connection; regions unmapped and the
socket file removed; a connection that dies mid-operation losing nothing acknowledged."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from _core import bf16_nearest
from attnserve.config import Settings
from attnserve.metrics import counted
from attnserve.transport import frames as frames_module
from attnserve.transport import shm as shm_module
from attnserve_client import (
    AsyncClient,
    AsyncShmStream,
    Client,
    Forbidden,
    InvalidInput,
    PayloadTooLarge,
    ShmStream,
    wire,
)
from attnserve_client.errors import APIConnectionError
from attnserve_client.framing import PREFIX, frame_buffers
from attnserve_client.shm import ALIGN, create_region, peer_uid
from svc_helpers import (
    LiveServer, RawFrames, Scrape, busy_and_draining_are_503, drive_twins, errors_stay_per_operation,
    keys_and_tenants_hold, rows,
)  # fmt: skip

pytestmark = pytest.mark.gpu

RAW_NAME = "attnserve-test-raw"  # the memfd name of the raw clients' regions (/proc/self/maps)


def _path(srv: LiveServer) -> str:
    path = srv.runtime.shm_socket
    assert path is not None
    return path


def _mappings(name: str) -> int:
    """How many mappings of this process are of a memfd called ``name``."""
    with open("/proc/self/maps") as f:
        paths = [line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6]
    return sum(p in (f"/memfd:{name}", f"/memfd:{name} (deleted)") for p in paths)


def _until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class RawShm(RawFrames):
    """A bare Unix socket speaking the transport, for what the library never sends
    (the frames' framing: :class:`RawFrames`, over this socket and region)."""

    def __init__(
        self, path: str, region: int = 1 << 20, hello: bool = True, key: str | None = None, name: str = RAW_NAME
    ):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.fd, self.map = create_region(region, name)
        self.region = memoryview(self.map)
        self.next = 0
        if hello:
            r = self.hello(key=key)
            assert r["status"] == 200, r

    def hello(self, doc=None, fds=None, key: str | None = None):
        doc = doc or {"id": 0, "op": "hello", "version": 1, "region": len(self.map), **({"key": key} if key else {})}
        socket.send_fds(self.sock, [b"".join(frame_buffers(doc, wire.packb))], [self.fd] if fds is None else fds)
        return self.recv()

    def put(self, a: np.ndarray, offset: int | None = None) -> dict:
        """``a`` written into the region (at ``offset``, else the next free multiple of 64): its reference."""
        data = a.reshape(-1).view(np.uint8)
        at = self.next if offset is None else offset
        self.region[at : at + data.nbytes] = data.tobytes()
        if offset is None:
            self.next = -(-(at + data.nbytes) // ALIGN) * ALIGN
        return {"dtype": wire.dtype_name(a), "shape": list(a.shape), "shm": [at, data.nbytes]}

    def reply_room(self, nbytes: int) -> list[int]:
        at = self.next
        self.next += -(-nbytes // ALIGN) * ALIGN
        return [at, nbytes]

    def close(self) -> None:
        self.sock.close()
        os.close(self.fd)
        self.region.release()
        try:
            self.map.close()
        except BufferError:  # replies still view it: unmapped with the last of them
            pass


def _out(r) -> np.ndarray:
    assert r["status"] == 200, r
    return wire.decode_array(r["result"]["out"], name="out").copy()


# -- answers ------------------------------------------------------------------------


def test_shm_is_bit_identical_to_frames_and_to_single_calls(shm_server, rng):
    """Three twins of each shape and format: one driven over the shared memory
    (single attends pipelined, batched items, stacked steps, appends across a page
    border), one over the frames, one by one over HTTP: every output bit-identical,
    f32 within the oracle's tolerance."""
    with (
        Client(shm_server.url) as client,
        client.stream(transport="shm") as ss,
        client.stream(transport="frames") as fs,
    ):
        assert isinstance(ss, ShmStream) and ss.copy_outputs
        drive_twins(client, ss, fs, rng)
    metrics = Scrape(client_metrics(shm_server))
    assert metrics.get("attnserve_shm_events_total", event="reply_in_frame") == 0
    assert metrics.get("attnserve_requests_total", route="/v1/shm", method="UNIX", status="200") > 0


def client_metrics(srv: LiveServer) -> str:
    return httpx.get(srv.url + "/metrics", timeout=30).text


@pytest.mark.parametrize("dtype", ["<f2", "bfloat16"])
def test_half_precision_and_lse_are_bit_identical_to_the_frames(shm_server, rng, dtype):
    """Bare clients: q, k, v of a half dtype in the region, out in each dtype and
    lse written to reply_at, against the same arrays in a frame's body."""
    h, hkv, d = 4, 2, 24
    with Client(shm_server.url) as client:
        a = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)
        b = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)
    half = (lambda x: x.astype(np.float16)) if dtype == "<f2" else bf16_nearest
    raw, frames = RawShm(_path(shm_server)), RawFrames(shm_server.runtime.frames_port)
    try:
        for step, (n, out_dtype) in enumerate([(5, None), (1, "<f4"), (3, "bfloat16"), (1, "<f2")]):
            q, k, v = (half(rows(rng, n, heads, d)) for heads in (h, hkv, hkv))
            opts = {"return_lse": True, **({"out_dtype": out_dtype} if out_dtype else {})}
            sent = {"op": "attend", "layer": 0, **opts}
            raw.next = 0
            refs = {"q": raw.put(q), "k": raw.put(k), "v": raw.put(v)}
            got = raw.call({"id": step, "session_id": a.session_id, **sent, **refs, "reply_at": raw.reply_room(4096)})
            want = frames.call(
                {"id": step, "session_id": b.session_id, **sent, **{n_: wire.encode_array(x) for n_, x in
                                                                    (("q", q), ("k", k), ("v", v))}}
            )  # fmt: skip
            assert got["status"] == want["status"] == 200, (got, want)
            for name in ("out", "lse"):
                g, w = got["result"][name], want["result"][name]
                assert g["dtype"] == w["dtype"] == ((out_dtype or dtype) if name == "out" else "<f4")
                assert bytes(g["data"]) == bytes(w["data"])
            assert got["result"]["length"] == want["result"]["length"]
    finally:
        raw.close()
        frames.close()
    with Client(shm_server.url) as client:
        client.delete_session(a.session_id)
        client.delete_session(b.session_id)


def test_half_precision_through_the_library(shm_server, rng):
    """A bfloat16 engine's stacked step: bfloat16 in, bfloat16 out, as over the frames."""
    h, hkv, d = 4, 2, 32
    with (
        Client(shm_server.url) as client,
        client.stream(transport="shm") as ss,
        client.stream(transport="frames") as fs,
    ):
        mine = [client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d) for _ in range(2)]
        twins = [client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d) for _ in range(2)]
        for n in (6, 1, 1):
            q, k, v = (wire.to_bfloat16(np.stack([rows(rng, n, x, d) for _ in range(2)])) for x in (h, hkv, hkv))
            got = ss.attend_stacked(mine, 0, q, k, v)
            want = fs.attend_stacked(twins, 0, q, k, v)
            assert got.dtype == want.dtype == wire.BFLOAT16 and got.tobytes() == want.tobytes()
        for s in mine + twins:
            s.delete()


def test_lent_arrays_go_in_place_and_outputs_may_be_views(shm_server, rng):
    """An engine writing q, k, v into arrays the stream lent sends them where they
    are; with copy_outputs=False the outputs are views of the region."""
    h, hkv, d = 4, 2, 16
    with Client(shm_server.url) as client:
        a = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)
        b = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)
        with client.stream(transport="shm", copy_outputs=False, region_bytes=1 << 16) as ss:
            assert not ss.copy_outputs and ss.region_bytes == 1 << 16
            region = ss._region
            q, k, v = ss.array((3, h, d)), ss.array((3, hkv, d)), ss.array((3, hkv, d), "<f4")
            for _ in range(3):
                q[:], k[:], v[:] = rows(rng, 3, h, d), rows(rng, 3, hkv, d), rows(rng, 3, hkv, d)
                out = ss.attend(a, 0, q, k=k, v=v)
                want = b.attend(0, q.copy(), k=k.copy(), v=v.copy())
                assert out.tobytes() == want.tobytes()
                assert region.offset_of(memoryview(out).cast("B")) is not None  # a view of the region
            with pytest.raises(InvalidInput, match="lent"):
                ss.array((1 << 16,), "<f2")  # more than is free
            for x in (q, k, v):
                ss.free(x)
            with pytest.raises(InvalidInput, match="lent"):
                ss.free(q)
            assert region.ranges.taken_bytes == 0
        a.delete()
        b.delete()


def test_an_operation_larger_than_the_region_is_refused_before_sending(shm_server, rng):
    with Client(shm_server.url) as client, client.stream(transport="shm", region_bytes=4096) as ss:
        s = client.create_session(num_qo_heads=8, num_kv_heads=2, head_dim=64)
        with pytest.raises(InvalidInput, match="needs .* bytes of the shared region"):
            ss.append(s, 0, rows(rng, 8, 2, 64), rows(rng, 8, 2, 64))  # 8 KiB of k, v
        assert ss.append(s, 0, rows(rng, 2, 2, 64), rows(rng, 2, 2, 64)) == 2  # the stream is fine
        # many operations in flight share the region: each waits for room, none is refused
        futs = [ss.submit_attend(s, 0, rows(rng, 1, 8, 64), causal=False) for _ in range(40)]
        assert all(f.result(timeout=60).shape == (1, 8, 64) for f in futs)
        assert s.info().lengths == (2,)
        s.delete()


# -- problems -------------------------------------------------------------------------


def test_errors_are_per_operation_and_change_nothing(shm_server, rng):
    with Client(shm_server.url) as client, client.stream(transport="shm") as ss:
        s = errors_stay_per_operation(client, ss, rng)
        assert ss._region.ranges.taken_bytes == 0  # every operation's range is free again
        s.delete()


def test_bad_references_and_ranges_get_problems_and_the_connection_stays(shm_server, rng):
    with Client(shm_server.url) as client:
        s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
    sid = s.session_id
    raw = RawShm(_path(shm_server), region=1 << 16)
    try:
        q = raw.put(rows(rng, 1, 2, 8), 0)  # 64 bytes at 0
        k, v = raw.put(rows(rng, 2, 1, 8), 64), raw.put(rows(rng, 2, 1, 8), 128)
        size = 1 << 16
        cases = [
            ({"q": {**q, "shm": [size - 32, 64]}}, "range of the region's 65536 bytes"),
            ({"q": {**q, "shm": [2, 64]}}, "multiple of 4"),
            ({"q": {**q, "shm": [0, 64, 1]}}, "[offset, nbytes]"),
            ({"q": {**q, "shm": [-64, 64]}}, "[offset, nbytes]"),
            ({"q": {**q, "shm": [0, 60]}}, "expected 64 data bytes"),
            ({"q": {**q, "at": [0, 64]}}, "exactly the keys"),
            ({"q": q, "reply_at": [4096, 63]}, "need 64 bytes"),
            ({"q": q, "reply_at": [4100, 64]}, "multiple of 64"),
            ({"q": q, "reply_at": [size - 64, 128]}, "range of the region's"),
            ({"q": q, "reply_at": "anywhere"}, "[offset, nbytes]"),
            # a fused append whose reply cannot fit: refused before it runs, nothing appended
            ({"q": q, "k": k, "v": v, "reply_at": [4096, 32]}, "nothing was done"),
        ]
        for i, (members, said) in enumerate(cases):
            r = raw.call({"id": i, "op": "attend", "session_id": sid, "layer": 0, **members})
            assert r["id"] == i and r["status"] == 422 and r["error"]["type"] == "/problems/invalid-request", r
            assert said in r["error"]["detail"], r
            assert r["error"]["instance"] == "/v1/shm"
        assert r["error"]["reply_bytes"] == 64
        # a second hello is an unknown op; any descriptor it carries is dropped, not kept
        before = len(os.listdir("/proc/self/fd"))
        extra = os.memfd_create("attnserve-extra", os.MFD_CLOEXEC)
        r = raw.hello(doc={"id": 90, "op": "hello", "version": 1, "region": size}, fds=[extra])
        os.close(extra)
        assert r["status"] == 422 and "op" in r["error"]["detail"], r
        assert r["id"] == 90
        assert _until(lambda: len(os.listdir("/proc/self/fd")) <= before)
        # the connection still serves, with the arrays in the region or in the body
        r = raw.call({"id": 91, "op": "append", "session_id": sid, "layer": 0, "k": k, "v": wire.encode_array(
            np.frombuffer(raw.region[128:192], np.float32).reshape(2, 1, 8))})  # fmt: skip
        assert r == {"id": 91, "status": 200, "result": {"length": 2}}
        raw.next = 4096
        reply_at = raw.reply_room(64)
        r = raw.call({"id": 92, "op": "attend", "session_id": sid, "layer": 0, "q": q, "reply_at": reply_at})
        assert r["status"] == 200 and r["result"]["out"]["data"].obj is raw.map  # written to the region
        assert r["result"]["length"] == 2
    finally:
        raw.close()
    with Client(shm_server.url) as client:
        assert client.get_session(sid).info().lengths == (2,)
        client.delete_session(sid)


def test_the_frame_transport_refuses_region_references(shm_server, rng):
    with Client(shm_server.url) as client:
        s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
    raw = RawFrames(shm_server.runtime.frames_port)
    try:
        r = raw.call({"id": 1, "op": "attend", "session_id": s.session_id, "layer": 0,
                      "q": {"dtype": "<f4", "shape": [1, 2, 8], "shm": [0, 64]}})  # fmt: skip
        assert r["status"] == 422 and "only a connection of the shared-memory transport" in r["error"]["detail"]
        r = raw.call({"id": 2, "op": "ping", "reply_at": [0, 64]})
        assert r["status"] == 422 and "reply_at" in r["error"]["detail"]
    finally:
        raw.close()
    with Client(shm_server.url) as client:
        client.delete_session(s.session_id)


def _memfd(nbytes: int, seals: int | None = fcntl.F_SEAL_SHRINK) -> int:
    fd = os.memfd_create("attnserve-test-bad", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals is not None:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _hello(region: int = 4096, **kw):
    return {"id": 0, "op": "hello", "version": 1, "region": region, **kw}


@pytest.mark.parametrize(
    "case, status, slug, said",
    [
        ("no-fd", 422, "invalid-request", "got none"),
        ("two-fds", 422, "invalid-request", "got 2"),
        ("too-big", 413, "payload-too-large", "at most 268435456"),
        ("pipe", 422, "invalid-request", "a descriptor of another kind"),
        ("unsealed", 422, "invalid-request", "F_SEAL_SHRINK"),
        ("short", 422, "invalid-request", "fewer than the 8192"),
        ("no-region", 422, "invalid-request", "region: required"),
        ("version", 422, "invalid-request", "version"),
        ("not-hello", 422, "invalid-request", "first frame"),
        ("not-a-frame", 400, "malformed-body", "ATF1"),
        ("huge-head", 413, "payload-too-large", "frame head"),
    ],
)
def test_hello_refusals_close_the_connection(shm_server, case, status, slug, said):
    name = f"attnserve-test-{case}"
    raw = RawShm(_path(shm_server), region=4096, hello=False, name=name)
    opened: list[int] = []
    try:
        if case == "not-a-frame":
            raw.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            r = raw.recv()
        elif case == "huge-head":
            socket.send_fds(raw.sock, [PREFIX.pack(b"ATF1", (1 << 20) + 1, 0)], [raw.fd])
            r = raw.recv()
        else:
            doc, fds = _hello(), [raw.fd]
            if case == "no-fd":
                fds = []
            elif case == "two-fds":
                fds = [raw.fd, raw.fd]
            elif case == "too-big":
                doc = _hello(region=(256 << 20) + 1)
            elif case == "pipe":
                opened = list(os.pipe())
                fds = [opened[0]]
            elif case == "unsealed":
                opened = [_memfd(4096, seals=None)]
                fds = opened
            elif case == "short":
                opened = [_memfd(4096)]
                fds, doc = opened, _hello(region=8192)
            elif case == "no-region":
                del doc["region"]
            elif case == "version":
                doc["version"] = 2
            elif case == "not-hello":
                doc = {"id": 0, "op": "ping"}
            r = raw.hello(doc=doc, fds=fds)
        assert r["status"] == status and r["error"]["type"] == f"/problems/{slug}", r
        assert said in r["error"]["detail"], r
        assert raw.closed()
    finally:
        raw.close()
        for fd in opened:
            os.close(fd)
    assert _until(lambda: _mappings(name) == 0)  # nothing of a refused region is kept


def test_a_peer_of_another_user_is_refused(shm_server, monkeypatch):
    """The peer's user comes from SO_PEERCRED (a test cannot change its uid: the
    check is made to refuse this process's)."""
    left, right = socket.socketpair(socket.AF_UNIX)
    assert peer_uid(left) == os.getuid()
    left.close()
    right.close()
    monkeypatch.setattr(shm_module, "_peer_allowed", lambda uid: False)
    before = Scrape(client_metrics(shm_server)).get("attnserve_shm_events_total", event="peer_refused")
    with pytest.raises(Forbidden, match="uid"):
        Client(shm_server.url).stream(transport="shm")
    raw = RawShm(_path(shm_server), hello=False)
    try:
        r = raw.recv()  # refused before its hello is read
        assert r["status"] == 403 and r["error"]["type"] == "/problems/forbidden", r
        assert raw.closed()
    finally:
        raw.close()
    after = Scrape(client_metrics(shm_server)).get("attnserve_shm_events_total", event="peer_refused")
    assert after == before + 2


def test_the_client_shares_nothing_with_a_server_of_another_user(tmp_path, monkeypatch):
    """The client checks the server's user (SO_PEERCRED) before its hello: a socket
    that another user made at the path gets neither the region nor the key. (A
    test cannot change its uid: the check's uid is replaced, once it is shown to
    read the listener's user.)"""
    from attnserve_client import _shm as client_shm

    path = str(tmp_path / "other.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    got = bytearray()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while chunk := conn.recv(65536):
                got.extend(chunk)

    reader = threading.Thread(target=serve)
    reader.start()
    try:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(path)
        assert peer_uid(probe) == os.getuid()  # the listener is this process
        probe.close()
        reader.join(5)
        reader = threading.Thread(target=serve)
        reader.start()
        other = os.getuid() + 12345
        assert client_shm._trusted_server(os.getuid(), None) and client_shm._trusted_server(0, None)
        assert not client_shm._trusted_server(other, None) and not client_shm._trusted_server(other, other + 1)
        assert client_shm._trusted_server(other, other)  # the user the server said it runs as
        monkeypatch.setattr(client_shm, "peer_uid", lambda sock: other)
        target = client_shm.ShmTarget(path, 1 << 16, key="sk-not-for-them", server_uid=other + 1)
        region = client_shm._Region(target.region_bytes, True)
        try:
            said = f"runs as uid {other}, .* nor the server's \\(uid {other + 1}"
            with pytest.raises(APIConnectionError, match=said):
                client_shm._connect(target, region, timeout=5)
        finally:
            region.close()
        reader.join(5)
        assert not reader.is_alive() and bytes(got) == b""  # no hello, no key, no descriptor
    finally:
        listener.close()


def test_the_client_trusts_the_user_the_server_reports(shm_server, rng, monkeypatch):
    """GET /v1/info names the user the server runs as; a stream that took the socket
    from it connects to a server of that user (a root client's, of another user)."""
    from attnserve_client import _shm as client_shm

    with Client(shm_server.url) as client:
        assert client.info()["shm"]["uid"] == os.getuid()
        seen = os.getuid() + 4242  # as if the server ran as another user, and said so
        monkeypatch.setattr(client_shm, "peer_uid", lambda sock: seen)
        with pytest.raises(APIConnectionError, match="were not sent"):
            client.stream(transport="shm", shm_socket=_path(shm_server), region_bytes=1 << 16)  # (info not asked)
        real = client._server_info_flow

        def told():  # GET /v1/info as that server would answer it
            info = yield from real()
            return {**info, "shm": {**info["shm"], "uid": seen}}

        monkeypatch.setattr(client, "_server_info_flow", told)
        s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
        try:
            with client.stream(transport="shm") as ss:
                k = rng.standard_normal((3, 1, 8)).astype(np.float32)
                assert ss.append(s, 0, k, k) == 3
        finally:
            s.delete()


def test_the_socket_is_the_users_only():
    assert shm_module._peer_allowed(os.getuid()) and shm_module._peer_allowed(0)
    assert not shm_module._peer_allowed(os.getuid() + 12345)


def test_shm_needs_a_key_and_sees_only_the_tenants_sessions(engine, rng, tmp_path):
    path = str(tmp_path / "keys.sock")
    srv = LiveServer(Settings(api_keys="key-a,key-b", shm_socket=path), engine=engine).start()
    try:
        keys_and_tenants_hold(srv.url, "shm", rng, shm_socket=path, region_bytes=4096)
    finally:
        srv.stop()


# -- lifecycle --------------------------------------------------------------------------


def test_regions_are_unmapped_and_the_socket_removed(engine, rng, tmp_path):
    """A connection's region is unmapped when it closes, when it dies with work in
    flight, and at shutdown; the socket file is the server's user's only, and goes."""
    path = str(tmp_path / "life.sock")
    srv = LiveServer(Settings(shm_socket=path), engine=engine).start()
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        with Client(srv.url) as client:
            s = client.create_session(num_qo_heads=4, num_kv_heads=2, head_dim=16)
        raw = RawShm(path)
        assert _mappings(RAW_NAME) == 2  # the client's, and the server's
        raw.close()
        assert _until(lambda: _mappings(RAW_NAME) == 0)
        # one that dies with operations in flight: the region goes once they finished
        raw = RawShm(path)
        q = raw.put(rows(rng, 8, 4, 16))
        for i in range(32):
            raw.send({"id": i, "op": "attend", "session_id": s.session_id, "layer": 0, "q": q, "causal": False,
                      "k": raw.put(rows(rng, 8, 2, 16)), "v": raw.put(rows(rng, 8, 2, 16)),
                      "reply_at": raw.reply_room(8 * 4 * 16 * 4)})  # fmt: skip
        raw.sock.close()
        assert _until(lambda: _mappings(RAW_NAME) == 1)  # the server's went; the dead client's we still hold
        raw.region.release()
        raw.map.close()
        os.close(raw.fd)
        assert _until(lambda: srv.runtime.in_flight == 0)
        # and at shutdown
        raw = RawShm(path)
        assert raw.call({"id": 1, "op": "ping"})["status"] == 200
        assert _mappings(RAW_NAME) == 2
        srv.stop()
        assert raw.closed()
        assert _mappings(RAW_NAME) == 1  # the server's is unmapped before it stops
        raw.close()
        assert not os.path.exists(path)
    finally:
        srv.stop()
    events = srv.runtime.metrics.shm_events
    assert counted(events, "mapped") == counted(events, "unmapped") == 3


def test_a_dying_connection_loses_nothing_acknowledged(engine, rng, tmp_path):
    """Appends pipelined with offsets; the connection dies after some replies: every
    acknowledged append is in the session, the rest applied in order or not at all."""
    path = str(tmp_path / "die.sock")
    srv = LiveServer(Settings(shm_socket=path), engine=engine).start()
    try:
        with Client(srv.url) as client:
            s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
            ref = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
        raw = RawShm(path)
        ks = [rows(rng, 2, 1, 8) for _ in range(64)]
        vs = [rows(rng, 2, 1, 8) for _ in range(64)]
        for i in range(64):
            raw.send({"id": i, "op": "append", "session_id": s.session_id, "layer": 0, "offset": 2 * i,
                      "k": raw.put(ks[i]), "v": raw.put(vs[i])})  # fmt: skip
        acked = 0
        for _ in range(8):
            r = raw.recv()
            assert r["status"] == 200, r
            acked = max(acked, r["result"]["length"])
        raw.close()  # dies with up to 56 appends unanswered
        assert _until(lambda: srv.runtime.in_flight == 0)
        with Client(srv.url) as client:
            got = client.get_session(s.session_id)
            length = got.info().lengths[0]
            assert length >= acked and length % 2 == 0
            r = client.get_session(ref.session_id)
            r.append(0, np.concatenate(ks[: length // 2]), np.concatenate(vs[: length // 2]))
            q = rows(rng, 1, 2, 8)
            assert got.attend(0, q, causal=False).tobytes() == r.attend(0, q, causal=False).tobytes()
    finally:
        srv.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the starts that fail
def test_stale_sockets_are_replaced_and_other_files_refused(engine, tmp_path, caplog):
    stale = str(tmp_path / "stale.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(stale)
    dead.close()  # its file stays: a server that was killed
    srv = LiveServer(Settings(shm_socket=stale), engine=engine).start()
    try:
        with Client(srv.url) as client, client.stream(transport="shm", region_bytes=4096) as ss:
            ss.ping()
        other = LiveServer(Settings(shm_socket=stale), engine=engine)
        with pytest.raises(RuntimeError, match="did not start"):  # another server listens there
            other.start()
        other.stop()
        assert "another process listens on" in caplog.text
        assert os.path.exists(stale)
        with Client(srv.url) as client, client.stream(transport="shm", region_bytes=4096) as ss:
            ss.ping()  # untouched by the one that did not start
    finally:
        srv.stop()
    regular = tmp_path / "file.sock"
    regular.write_text("keep me")
    srv = LiveServer(Settings(shm_socket=str(regular)), engine=engine)
    with pytest.raises(RuntimeError, match="did not start"):
        srv.start()
    srv.stop()
    assert regular.read_text() == "keep me" and "exists and is no socket" in caplog.text


def test_a_silent_connection_and_a_stalled_frame_are_closed(shm_server, monkeypatch):
    monkeypatch.setattr(shm_module, "BODY_IDLE_TIMEOUT_S", 0.4)
    monkeypatch.setattr(frames_module, "BODY_IDLE_TIMEOUT_S", 0.4)
    silent = RawShm(_path(shm_server), hello=False)
    stalled = RawShm(_path(shm_server))
    try:
        stalled.sock.sendall(PREFIX.pack(b"ATF1", 100, 0) + b"\x80")  # 1 byte of a 100-byte head
        t0 = time.monotonic()
        assert silent.closed(timeout=10) and stalled.closed(timeout=10)
        assert time.monotonic() - t0 < 8
    finally:
        silent.close()
        stalled.close()


def test_too_many_connections_and_draining_are_503(engine, rng, tmp_path):
    path = str(tmp_path / "busy.sock")
    srv = LiveServer(Settings(shm_socket=path, frames_max_connections=1), engine=engine).start()
    try:
        with Client(srv.url) as client, client.stream(transport="shm", region_bytes=4096) as ss:
            busy_and_draining_are_503(srv, client, ss, RawShm(path, hello=False), rng)
    finally:
        srv.stop()
    assert not os.path.exists(path)


def test_async_shm_pipeline(shm_server, rng):
    async def main():
        async with AsyncClient(shm_server.url) as client:
            s = await client.create_session(num_qo_heads=4, num_kv_heads=2, head_dim=16)
            ref = await client.create_session(num_qo_heads=4, num_kv_heads=2, head_dim=16)
            k, v = rows(rng, 20, 2, 16), rows(rng, 20, 2, 16)
            await ref.append(0, k, v)
            async with client.stream(transport="shm", region_bytes=8192) as ss:
                assert isinstance(ss, AsyncShmStream) and ss.region_bytes == 8192
                assert await ss.append(s, 0, k, v) == 20
                qs = [rows(rng, 1, 4, 16) for _ in range(64)]  # more than the region holds at once
                outs = await asyncio.gather(*(ss.attend(s, 0, q) for q in qs))
                stacked = await ss.attend_stacked([s, s], 0, np.stack(qs[:2]))
                buf = ss.array((1, 4, 16))
                buf[:] = qs[0]
                lent = await ss.attend(s, 0, buf)
                ss.free(buf)
                with pytest.raises(InvalidInput, match="needs"):
                    await ss.attend(s, 0, rows(rng, 200, 4, 16))
            with pytest.raises(APIConnectionError, match="closed"):
                await ss.attend(s, 0, qs[0])
            for q, out in zip(qs, outs):
                assert out.tobytes() == (await ref.attend(0, q)).tobytes()
            for q, out in zip(qs[:2], stacked):
                assert out.tobytes() == (await ref.attend(0, q)).tobytes()
            assert lent.tobytes() == outs[0].tobytes()
            await s.delete()
            await ref.delete()

    asyncio.run(main())


def test_the_client_says_when_the_server_has_no_shm(engine):
    server = LiveServer(Settings(), engine=engine).start()
    try:
        with Client(server.url) as client:
            assert client.info()["shm"] is None
            with pytest.raises(InvalidInput, match="shm-socket"):
                client.stream(transport="shm")
            with pytest.raises(InvalidInput, match="shm_socket"):
                client.stream(shm_socket="/nowhere")
            with pytest.raises(InvalidInput, match="copy_outputs"):
                client.stream(transport="frames", copy_outputs=False)
            with pytest.raises(InvalidInput, match="frames_address"):
                client.stream(transport="shm", frames_address=("127.0.0.1", 1))
            with pytest.raises(InvalidInput, match="region_bytes"):
                client.stream(transport="shm", shm_socket="/nowhere", region_bytes=1)
            with pytest.raises(APIConnectionError, match="cannot connect"):
                client.stream(transport="shm", shm_socket="/nowhere/attnserve.sock", region_bytes=4096)
    finally:
        server.stop()


def test_a_too_large_region_is_refused_by_the_client_path(shm_server):
    with Client(shm_server.url) as client:
        with pytest.raises(PayloadTooLarge, match="shm_max_region_bytes"):
            client.stream(transport="shm", region_bytes=(256 << 20) + 64)  # (memory is touched lazily)
