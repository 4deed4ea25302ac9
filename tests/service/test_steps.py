"""The explicit step (docs/api.md, "Steps: a batch held open across layers"): a
step over a fixed batch of sessions, called once per layer per token, answers
bit-identically to the stacked form (``POST /v1/batch/attend``) on twin
sessions, over HTTP, the WebSocket stream, the frame transport and shared
memory, in float32 and bfloat16, and right against the float64 oracle; and
every rule and problem of a session in a step: session-in-step, step-not-found
(closed, unknown, another tenant's), step-layer-called, step-broken, refusals
that change nothing, connections that close their steps, the idle timeout of a
step opened over HTTP, the token's advance, a subset of the layers.

The transports are spoken raw (``tools/raw_peers.py``), not through the client
library, so these tests pin the protocol's documents themselves."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from _core import bf16_nearest
from attnserve.config import Settings
from attnserve_client import framing, wire
from svc_helpers import F32_TOL, Api, LiveServer, Model, Scrape, from_wire, rel_err, rows
from tools.raw_peers import RawFrames, RawShm, RawStream

pytestmark = pytest.mark.gpu

H, HKV, D, LAYERS = 6, 2, 40, 2  # awkward: 40 is no power of two, 3 query heads a KV head
TOL = {"<f4": F32_TOL, "bfloat16": 2.0**-7}  # bfloat16: the output's own rounding (test_half_precision)
TRANSPORTS = ("http", "stream", "frames", "shm")


# ── the transports, spoken raw ──────────────────────────────────────────────


class Peer:
    """One transport's step operations as documents: ``op(doc)`` sends a stream
    document (``{"op", ...members}``; over HTTP, the route it maps to) and returns
    ``(status, body)``: the reply's ``result`` (arrays decoded) or its problem."""

    def __init__(self, srv: LiveServer, transport: str, key: str | None = None):
        self.transport, self.api, self.raw, self.ids = transport, None, None, 0
        if transport == "http":
            self.api = Api(srv.url)
            if key:
                self.api.client.headers["Authorization"] = f"Bearer {key}"
        elif transport == "stream":
            self.raw = RawStream(srv.port, key=key, rcvbuf=1 << 20)
        elif transport == "frames":
            self.raw = RawFrames(srv.runtime.frames_port, key=key, rcvbuf=1 << 20)
        else:
            self.raw = RawShm(srv.runtime.shm_socket, key=key, rcvbuf=1 << 20)

    def op(self, doc: dict[str, Any]) -> tuple[int, Any]:
        if self.api is not None:
            return self._http(dict(doc))
        self.ids += 1
        doc = {"id": self.ids, **{k: wire.encode_array(v) if isinstance(v, np.ndarray) else v for k, v in doc.items()}}
        reply = self.raw.read_replies(1, memoryview(b""), self.raw.frames([doc]))[self.ids]
        if reply["status"] != 200:
            return reply["status"], reply["error"]
        return 200, from_wire(reply["result"])

    def _http(self, doc: dict[str, Any]) -> tuple[int, Any]:
        op = doc.pop("op")
        if op == "step_open":
            r = self.api.call("POST", "/v1/steps", doc, enc="msgpack")
        elif op == "step_close":
            r = self.api.call("DELETE", f"/v1/steps/{doc['step']}")
        elif op == "step_call":
            step, layer = doc.pop("step"), doc.pop("layer")
            r = self.api.call("POST", f"/v1/steps/{step}/layers/{layer}", doc, enc="msgpack")
        else:
            raise AssertionError(op)
        if r.status in (200, 201, 204):
            return 200, {} if r.status == 204 else from_wire(r.body)
        return r.status, r.body

    def open(self, session_ids: list[str], **members: Any) -> dict[str, Any]:
        status, body = self.op({"op": "step_open", "session_ids": session_ids, **members})
        assert status == 200, body
        return body

    def call(self, step: int, layer: int, **arrays: Any) -> tuple[int, Any]:
        return self.op({"op": "step_call", "step": step, "layer": layer, **arrays})

    def close_step(self, step: int) -> tuple[int, Any]:
        return self.op({"op": "step_close", "step": step})

    def close(self) -> None:
        if self.api is not None:
            self.api.close()
        else:
            self.raw.close()


def _stacked(api: Api, ids: list[str], layer: int, q, k=None, v=None, **opts: Any) -> dict[str, Any]:
    """The stacked form's answer (the reference a step's call must equal)."""
    body = {"session_ids": ids, "layer": layer, "q": q, **opts}
    if k is not None:
        body |= {"k": k, "v": v}
    r = api.call("POST", "/v1/batch/attend", body, enc="msgpack")
    assert r.status == 200, r.body
    return from_wire(r.body)


def _sessions(api: Api, n: int, seed: int = 7, **spec: Any) -> list[str]:
    spec = dict(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=LAYERS, seed=seed) | spec
    return [api.create(**spec)["session_id"] for _ in range(n)]


def _lengths(api: Api, ids: list[str]) -> list[list[int]]:
    return [api.info(s)["lengths"] for s in ids]


def _problem(status: int, body: Any, want_status: int, slug: str, *needles: str) -> None:
    assert status == want_status and body["type"] == f"/problems/{slug}", (status, body)
    for needle in needles:
        assert needle in body["detail"], (needle, body["detail"])


@pytest.fixture(scope="module")
def srv(shm_server):
    return shm_server


@pytest.fixture(scope="module")
def api(srv):
    a = Api(srv.url)
    yield a
    a.close()


# ── answers: bit-identical to the stacked form, right against the oracle ────


@pytest.mark.parametrize("dtype", ["<f4", "bfloat16"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_step_answers_as_the_stacked_form_on_twins(srv, api, rng, transport, dtype):
    """Three sessions (6 query heads, 2 KV heads, head_dim 40): a prefill step of 5
    rows, then a decode step of one row for several tokens, every layer every token,
    with return_lse; each call bit-identical (out, lse, lengths) to the stacked form
    on twin sessions, and within the float64 oracle's tolerance."""
    b = 3
    mine, twins = _sessions(api, b), _sessions(api, b)
    models = [Model(H, HKV, D, layers=LAYERS) for _ in range(b)]
    half = dtype == "bfloat16"

    def arrays(n: int, heads: int) -> np.ndarray:
        a = rng.standard_normal((b, n, heads, D)).astype(np.float32)
        return bf16_nearest(a) if half else a

    peer = Peer(srv, transport)
    try:
        for rows_, tokens in ((5, 1), (1, 3)):
            step = peer.open(mine, rows=rows_, dtype=dtype, return_lse=True)
            assert step["rows"] == rows_ and step["queries"] == rows_ and step["layers"] == [0, 1]
            assert step["token"] == 0 and step["broken"] is None and step["dtype"] == dtype
            assert step["lengths"] == [m.lengths for m in models]
            for token in range(tokens):
                for layer in (1, 0):  # any order within a token
                    q, k, v = arrays(rows_, H), arrays(rows_, HKV), arrays(rows_, HKV)
                    squeeze = rows_ == 1 and token % 2 == 1  # [B, H, d] arrays: an answer without the rows axis
                    sent = {"q": q[:, 0], "k": k[:, 0], "v": v[:, 0]} if squeeze else {"q": q, "k": k, "v": v}
                    status, got = peer.call(step["step"], layer, **sent)
                    assert status == 200, got
                    want = _stacked(api, twins, layer, q, k, v, return_lse=True)
                    assert got["token"] == token and got["errors"] == [] and got["lengths"] == want["lengths"]
                    out, lse = np.asarray(got["out"]), np.asarray(got["lse"])
                    assert out.dtype == wire.DTYPES[dtype]
                    if squeeze:
                        assert out.shape == (b, H, D) and lse.shape == (b, H)
                    else:
                        assert out.shape == (b, rows_, H, D) and lse.shape == (b, rows_, H)
                    assert out.tobytes() == np.asarray(want["out"]).tobytes()
                    assert lse.tobytes() == np.asarray(want["lse"]).tobytes()
                    full = out.reshape(b, rows_, H, D)
                    for i, m in enumerate(models):
                        m.add(layer, wire.to_float32(k[i]), wire.to_float32(v[i]))
                        exact = m.attention(layer, wire.to_float32(q[i]))
                        assert rel_err(wire.to_float32(full[i]), exact) <= TOL[dtype]
            assert peer.close_step(step["step"]) == (200, {})
        assert _lengths(api, mine) == _lengths(api, twins) == [m.lengths for m in models]
    finally:
        peer.close()
        for s in mine + twins:
            api.delete(s)


# ── call frames: a layer call with no MessagePack ───────────────────────────


def _call_reply(reply: dict[str, Any], shapes: list[tuple[tuple[int, ...], str]]) -> list[np.ndarray]:
    """A call reply's arrays (``shapes``: each one's shape and dtype, in order)."""
    assert reply["status"] == 200 and "call_reply" in reply, reply
    body, at, out = reply["call_reply"], 0, []
    for shape, dtype in shapes:
        n = int(np.prod(shape)) * wire.DTYPES[dtype].itemsize
        out.append(np.frombuffer(body, wire.DTYPES[dtype], int(np.prod(shape)), at).reshape(shape))
        at += n
    assert at == len(body)
    return out


@pytest.mark.parametrize("dtype", ["<f4", "bfloat16"])
def test_call_frames_answer_as_the_stacked_form_on_twins(srv, api, rng, dtype):
    """The same steps as above sent as call frames (the arrays' bytes after a
    20-byte head): every call answered by a call reply whose out and lse are
    bit-identical to the stacked form's on twin sessions; the sessions end
    where the twins do."""
    b = 3
    mine, twins = _sessions(api, b), _sessions(api, b)
    half = dtype == "bfloat16"

    def arrays(n: int, heads: int) -> np.ndarray:
        a = rng.standard_normal((b, n, heads, D)).astype(np.float32)
        return bf16_nearest(a) if half else a

    peer = Peer(srv, "frames")
    try:
        seq = 1000
        for rows_, tokens, lse in ((5, 1, True), (1, 3, True), (1, 2, False)):
            step = peer.open(mine, rows=rows_, dtype=dtype, return_lse=lse)
            for token in range(tokens):
                for layer in (0, 1):
                    q, k, v = arrays(rows_, H), arrays(rows_, HKV), arrays(rows_, HKV)
                    seq += 1
                    frame = peer.raw.call_frame(step["step"], layer, seq, [q, k, v])
                    reply = peer.raw.read_replies(1, memoryview(b""), [frame])[seq]
                    want = _stacked(api, twins, layer, q, k, v, return_lse=lse)
                    shapes = [((b, rows_, H, D), dtype)] + ([((b, rows_, H), "<f4")] if lse else [])
                    got = _call_reply(reply, shapes)
                    assert got[0].tobytes() == np.asarray(want["out"]).tobytes()
                    if lse:
                        assert got[1].tobytes() == np.asarray(want["lse"]).tobytes()
            status, info = peer.op({"op": "step_close", "step": step["step"]})
            assert status == 200
        assert _lengths(api, mine) == _lengths(api, twins)
    finally:
        peer.close()
        for s in mine + twins:
            api.delete(s)


def test_a_call_frame_the_step_refuses_is_answered_with_its_problem(srv, api, rng):
    """A call frame that fails a check is answered by an ordinary reply frame
    whose id is its seq, with the problem a document's call gets (the body's
    length, the layer, called this token, another step's handle), and changes
    nothing; a NaN in one item's q fails that item alone (the call's answer
    document, with its errors) and breaks the step, as a document's call does."""
    b = 2
    ids = _sessions(api, b)
    peer = Peer(srv, "frames")
    try:
        step = peer.open(ids, rows=1)
        s = step["step"]
        q, k, v = rows(rng, b, H, D)[:, None], rows(rng, b, HKV, D)[:, None], rows(rng, b, HKV, D)[:, None]

        def send(frame: bytes, seq: int) -> dict[str, Any]:
            return peer.raw.read_replies(1, memoryview(b""), [frame])[seq]

        r = send(peer.raw.call_frame(s, 0, 1, [q, k]), 1)  # v missing: the body is short
        assert r["status"] == 422 and "expected" in r["error"]["detail"], r
        r = send(peer.raw.call_frame(s, 5, 2, [q, k, v]), 2)
        assert r["status"] == 422 and "not one of this step's layers" in r["error"]["detail"], r
        r = send(peer.raw.call_frame(s + 1000, 0, 3, [q, k, v]), 3)
        assert r["status"] == 404 and r["error"]["type"] == "/problems/step-not-found", r
        assert _lengths(api, ids) == [[0, 0]] * b  # nothing changed
        assert "call_reply" in send(peer.raw.call_frame(s, 0, 4, [q, k, v]), 4)
        r = send(peer.raw.call_frame(s, 0, 5, [q, k, v]), 5)
        assert r["status"] == 409 and r["error"]["type"] == "/problems/step-layer-called", r
        bad = q.copy()
        bad[1, 0, 0, 0] = np.nan
        r = send(peer.raw.call_frame(s, 1, 6, [bad, k, v]), 6)
        assert r["status"] == 200 and [e["item"] for e in r["result"]["errors"]] == [1], r
        assert r["result"]["lengths"][0] == 1 and r["result"]["lengths"][1] is None
        r = send(peer.raw.call_frame(s, 0, 7, [q, k, v]), 7)
        assert r["status"] == 409 and r["error"]["type"] == "/problems/step-broken", r
    finally:
        peer.close()
        for sid in ids:
            api.delete(sid)


def test_any_call_frame_gets_a_problem_or_a_close_and_changes_nothing(srv, api):
    """Call frames mutated at random (their step, layer and body_len, bodies short,
    long or of random bytes of the right length but no NaN, seeds swept): each one
    is answered with its problem (an ordinary reply frame, id its seq), none changes
    a session; a body_len past the limit is 413 and closes the connection, as a
    head cut short does; the server answers as before afterwards."""
    b = 2
    ids = _sessions(api, b)
    max_body = srv.runtime.settings.max_body_bytes
    try:
        for seed in range(4):
            rng = np.random.default_rng(seed)
            peer = Peer(srv, "frames")
            step = peer.open(ids, rows=1, layers=[0])
            s = step["step"]
            want = (b * H * D + 2 * b * HKV * D) * 4
            for seq in range(1, 41):
                kind = int(rng.integers(0, 5))
                if kind == 0:  # another handle
                    head, n, status = (s + int(rng.integers(1, 2**31)), 0), want, 404
                elif kind == 1:  # a layer not in the step
                    head, n, status = (s, int(rng.integers(1, 2**32))), want, 422
                elif kind == 2:  # a body too short
                    head, n, status = (s, 0), int(rng.integers(0, want)), 422
                elif kind == 3:  # a body too long
                    head, n, status = (s, 0), want + int(rng.integers(1, 4096)), 422
                else:  # the right length, the wrong shape: step, layer right, k and v missing, q longer
                    head, n, status = (s, 0), want - 4, 422
                body = rng.integers(0, 2**15, n // 2, dtype=np.uint16).tobytes() + b"\0" * (n % 2)
                frame = framing.CALL_HEAD.pack(framing.CALL_MAGIC, head[0], head[1], seq, n) + body
                r = peer.raw.read_replies(1, memoryview(b""), [frame])[seq]
                assert r["status"] == status and "error" in r, (kind, r)
            assert _lengths(api, ids) == [[0, 0]] * b
            # a body_len past the limit: 413 and the connection closed (its step with it)
            big = framing.CALL_HEAD.pack(framing.CALL_MAGIC, s, 0, 99, max_body + 1)
            r = peer.raw.read_replies(1, memoryview(b""), [big])
            assert r[None]["status"] == 413, r
            peer.close()
            # a head cut short, then the peer leaves
            cut = RawFrames(srv.runtime.frames_port, rcvbuf=1 << 20)
            cut.sock.sendall(framing.CALL_HEAD.pack(framing.CALL_MAGIC, s, 0, 1, 16)[: int(rng.integers(5, 20))])
            cut.close()
        peer = Peer(srv, "frames")
        try:
            step = peer.open(ids, rows=1, layers=[0])  # every earlier step closed with its connection
            q, k = np.ones((b, 1, H, D), np.float32), np.ones((b, 1, HKV, D), np.float32)
            reply = peer.raw.read_replies(1, memoryview(b""), [peer.raw.call_frame(step["step"], 0, 7, [q, k, k])])[7]
            assert "call_reply" in reply
        finally:
            peer.close()
        assert _lengths(api, ids) == [[1, 0]] * b
    finally:
        for sid in ids:
            api.delete(sid)


# ── the rules of a session in a step ────────────────────────────────────────


def test_a_session_in_a_step_is_called_only_through_it(srv, api, rng):
    a, b, c = _sessions(api, 3)
    for s in (a, b, c):
        assert api.append(s, 0, rows(rng, 2, HKV, D), rows(rng, 2, HKV, D)).status == 200
    peer = Peer(srv, "http")
    step = peer.open([a, b], layers=[0])
    h = step["step"]
    before = _lengths(api, [a, b, c])
    q, kv = rows(rng, 1, H, D), rows(rng, 1, HKV, D)
    needle = f"is in step {h}"
    r = api.append(a, 0, kv, kv)
    _problem(r.status, r.body, 409, "session-in-step", needle, "close the step first")
    assert r.body["step"] == h
    r = api.attend(a, 0, q)
    _problem(r.status, r.body, 409, "session-in-step", needle)
    r = api.attend(b, 1, q, k=kv, v=kv)  # a layer the step does not call: still the step's session
    _problem(r.status, r.body, 409, "session-in-step", needle)
    r = api.call("POST", "/v1/batch/attend", {"items": [
        {"session_id": c, "layer": 0, "q": q, "k": kv, "v": kv},
        {"session_id": a, "layer": 0, "q": q},
    ]}, enc="msgpack")  # fmt: skip
    assert r.status == 200 and "out" in r.body["results"][0], r.body
    _problem(409, r.body["results"][1]["error"], 409, "session-in-step", needle)
    r = api.call("POST", "/v1/batch/attend", {"session_ids": [c, b], "layer": 0, "q": np.stack([q, q])}, enc="msgpack")
    assert r.status == 200 and r.body["lengths"] == [3, None], r.body
    _problem(409, r.body["errors"][0], 409, "session-in-step", needle)
    assert r.body["errors"][0]["item"] == 1
    status, body = peer.op({"op": "step_open", "session_ids": [c, b]})  # a second step over b
    _problem(status, body, 409, "session-in-step", needle)
    r = api.delete(a)
    _problem(r.status, r.body, 409, "session-in-step", needle)
    with _closing(Peer(srv, "stream")) as stream:  # the stream's ops too
        status, body = stream.op({"op": "attend", "session_id": a, "layer": 0, "q": q})
        _problem(status, body, 409, "session-in-step", needle)
        status, body = stream.op({"op": "append", "session_id": b, "layer": 0, "k": kv, "v": kv})
        _problem(status, body, 409, "session-in-step", needle)
    # allowed: info, list, snapshot, fork (a new session outside the step)
    assert api.info(a)["lengths"] == before[0]
    assert {s["session_id"] for s in api.call("GET", "/v1/sessions").body["sessions"]} >= {a, b, c}
    assert api.call("GET", f"/v1/sessions/{a}/snapshot").status == 200
    fork = api.call("POST", f"/v1/sessions/{a}/fork", {})
    assert fork.status == 201, fork.body
    assert api.append(fork.body["session_id"], 0, kv, kv).status == 200
    assert _lengths(api, [a, b]) == before[:2] and api.info(c)["lengths"] == [3, 0]
    # through the step: fine; closed: the sessions are free again
    status, got = peer.call(h, 0, q=np.stack([q, q]), k=np.stack([kv, kv]), v=np.stack([kv, kv]))
    assert status == 200 and got["lengths"] == [3, 3], got
    assert peer.close_step(h)[0] == 200
    assert api.append(a, 0, kv, kv).body == {"length": 4}
    for s in (a, b, c, fork.body["session_id"]):
        assert api.delete(s).status == 204
    peer.close()


class _closing:
    def __init__(self, peer: Peer):
        self.peer = peer

    def __enter__(self) -> Peer:
        return self.peer

    def __exit__(self, *exc: object) -> None:
        self.peer.close()


# ── handles: tenants, closed and unknown steps ──────────────────────────────

KEY_A, KEY_B = "steps-tenant-a-0123456789", "steps-tenant-b-9876543210"


@pytest.fixture(scope="module")
def keyed(engine, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("shm") / "keyed.sock")
    srv = LiveServer(Settings(api_keys=f"{KEY_A},{KEY_B}", frames_port=0, shm_socket=path), engine=engine).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_step_is_its_tenants_and_gone_once_closed(keyed, rng, transport):
    a_api = Peer(keyed, "http", KEY_A).api
    ids = _sessions(a_api, 2)
    mine, theirs = Peer(keyed, transport, KEY_A), Peer(keyed, transport, KEY_B)
    try:
        h = mine.open(ids)["step"]
        q, kv = np.stack([rows(rng, 1, H, D)] * 2), np.stack([rows(rng, 1, HKV, D)] * 2)
        for doc in (
            {"op": "step_call", "step": h, "layer": 0, "q": q, "k": kv, "v": kv},
            {"op": "step_close", "step": h},
            {"op": "step_call", "step": 987654321, "layer": 0, "q": q, "k": kv, "v": kv},
        ):
            _problem(*theirs.op(doc), 404, "step-not-found", "no open step")
        status, body = theirs.op({"op": "step_open", "session_ids": ids})  # nor its sessions
        _problem(status, body, 404, "session-not-found")
        b_api = Peer(keyed, "http", KEY_B).api
        for method in ("GET", "DELETE"):
            r = b_api.call(method, f"/v1/steps/{h}")
            _problem(r.status, r.body, 404, "step-not-found")
        r = a_api.call("GET", f"/v1/steps/{h}")
        assert r.status == 200 and r.body["step"] == h and r.body["session_ids"] == ids
        r = a_api.call("GET", "/v1/steps/not-a-handle")
        _problem(r.status, r.body, 404, "step-not-found")
        assert mine.call(h, 0, q=q, k=kv, v=kv)[0] == 200
        assert mine.close_step(h) == (200, {})
        _problem(*mine.call(h, 1, q=q, k=kv, v=kv), 404, "step-not-found")
        _problem(*mine.close_step(h), 404, "step-not-found")
        r = a_api.call("GET", f"/v1/steps/{h}")
        _problem(r.status, r.body, 404, "step-not-found")
        assert a_api.info(ids[0])["lengths"] == [1, 0]
        h2 = mine.open(ids)["step"]
        assert h2 > h  # a handle is never reused
        assert mine.close_step(h2) == (200, {})
        b_api.close()
    finally:
        mine.close()
        theirs.close()
        for s in ids:
            a_api.delete(s)
        a_api.close()


# ── per token: each layer once, then the token advances ────────────────────


def test_each_layer_once_a_token_and_a_subset_of_layers(srv, api, rng):
    ids = _sessions(api, 2, num_layers=3)
    peer = Peer(srv, "http")
    step = peer.open(ids, layers=[2, 0])
    h = step["step"]
    assert step["layers"] == [2, 0] and step["lengths"] == [[0, 0], [0, 0]]

    def arrays() -> dict[str, np.ndarray]:
        return {"q": np.stack([rows(rng, 1, H, D)] * 2), "k": np.stack([rows(rng, 1, HKV, D)] * 2),
                "v": np.stack([rows(rng, 1, HKV, D)] * 2)}  # fmt: skip

    status, body = peer.call(h, 1, **arrays())
    _problem(status, body, 422, "invalid-request", "layer 1 is not one of this step's layers [2, 0]")
    for token in range(3):
        status, got = peer.call(h, 2, **arrays())
        assert status == 200 and got["token"] == token and got["lengths"] == [token + 1] * 2, got
        status, body = peer.call(h, 2, **arrays())
        _problem(status, body, 409, "step-layer-called", f"layer 2 was already called for token {token}")
        assert api.call("GET", f"/v1/steps/{h}").body["token"] == token
        status, got = peer.call(h, 0, **arrays())
        assert status == 200 and got["token"] == token, got
        info = api.call("GET", f"/v1/steps/{h}").body
        assert info["token"] == token + 1 and info["lengths"] == [[token + 1] * 2] * 2
    assert _lengths(api, ids) == [[3, 0, 3]] * 2  # layer 1 untouched
    assert peer.close_step(h) == (200, {})
    peer.close()
    for s in ids:
        api.delete(s)


# ── refusals change nothing; a partial failure breaks the step ──────────────


def test_a_refused_call_leaves_the_step_as_it_was(srv, api, rng):
    ids = _sessions(api, 3)
    peer = Peer(srv, "frames")
    h = peer.open(ids, rows=2)["step"]
    q = rng.standard_normal((3, 2, H, D)).astype(np.float32)
    kv = rng.standard_normal((3, 2, HKV, D)).astype(np.float32)
    for arrays, needle in [
        ({"q": q[:, :1], "k": kv, "v": kv}, "q: expected shape [3, 2, 6, 40]"),
        ({"q": q[:2], "k": kv, "v": kv}, "q: expected shape [3, 2, 6, 40]"),
        ({"q": q, "k": kv[..., :1, :], "v": kv}, "k: expected shape [3, 2, 2, 40]"),
        ({"q": q, "k": kv}, "v: required"),
        ({"q": q.astype(np.float16), "k": kv, "v": kv}, "this step's arrays are <f4"),
        ({"q": q, "k": kv, "v": kv, "causal": False}, "the step fixed rows, queries, dtype, causal"),
        ({"q": q, "k": kv, "v": kv, "offsets": [0, 0, 0]}, "keeps the offsets"),
    ]:
        status, body = peer.call(h, 0, **arrays)
        _problem(status, body, 422, "invalid-request", needle)
    # every item failing (a NaN in each q) applies nothing: the layer may be called again, the step is whole
    bad = q.copy()
    bad[:, 0, 0, 0] = np.nan
    status, got = peer.call(h, 0, q=bad, k=kv, v=kv)
    assert status == 200 and got["lengths"] == [None] * 3 and len(got["errors"]) == 3, got
    assert _lengths(api, ids) == [[0, 0]] * 3
    info = api.call("GET", f"/v1/steps/{h}").body
    assert info["token"] == 0 and info["broken"] is None
    status, got = peer.call(h, 0, q=q, k=kv, v=kv)
    assert status == 200 and got["errors"] == [] and got["lengths"] == [2] * 3 and got["token"] == 0, got
    assert peer.close_step(h) == (200, {})
    zero = peer.open(ids, rows=0, queries=2)["step"]  # a step that appends nothing takes no k, v
    _problem(*peer.call(zero, 0, q=q, k=kv, v=kv), 422, "invalid-request", "this step appends no rows")
    status, got = peer.call(zero, 0, q=q)
    assert status == 200 and got["lengths"] == [2] * 3, got
    peer.close()
    for s in ids:
        api.delete(s)


@pytest.mark.parametrize("transport", ["http", "stream"])
def test_a_call_that_applies_to_some_sessions_breaks_the_step(srv, api, rng, transport):
    ids = _sessions(api, 3)
    peer = Peer(srv, transport)
    h = peer.open(ids)["step"]
    q, kv = rng.standard_normal((3, 1, H, D)).astype(np.float32), rng.standard_normal((3, 1, HKV, D)).astype("<f4")
    q[1, 0, 2, 5] = np.nan  # item 1 fails alone, as in the stacked form
    status, got = peer.call(h, 0, q=q, k=kv, v=kv)
    assert status == 200 and got["lengths"] == [1, None, 1] and got["token"] == 0, got
    assert [e["item"] for e in got["errors"]] == [1] and got["errors"][0]["type"] == "/problems/invalid-request"
    assert _lengths(api, ids) == [[1, 0], [0, 0], [1, 0]]
    status, body = peer.call(h, 1, q=q, k=kv, v=kv)
    _problem(status, body, 409, "step-broken", f"step {h} is broken", "layer 0 for token 0", "item 1",
             f"session {ids[1]!r}", "/problems/invalid-request", "close it and open a new step")  # fmt: skip
    assert body["failure"]["item"] == 1 and body["failure"]["layer"] == 0
    info = api.call("GET", f"/v1/steps/{h}").body
    assert info["broken"] == body["failure"] and info["lengths"] == [[1, 0], [0, 0], [1, 0]]
    assert _lengths(api, ids) == [[1, 0], [0, 0], [1, 0]]  # the refused call changed nothing
    assert peer.close_step(h) == (200, {})
    peer.close()
    for s in ids:
        api.delete(s)


# ── opening: what a step may be ─────────────────────────────────────────────


def test_an_open_is_refused_whole_and_changes_nothing(srv, api):
    a, b = _sessions(api, 2)
    (other,) = _sessions(api, 1, num_qo_heads=4)
    (three,) = _sessions(api, 1, num_layers=3)
    peer = Peer(srv, "stream")
    for members, status, slug, needle in [
        ({"session_ids": [a, b, a]}, 422, "invalid-request", "session_ids[2]: " + repr(a) + " repeats session_ids[0]"),
        ({"session_ids": []}, 422, "invalid-request", "session_ids"),
        ({"session_ids": [a, "nope"]}, 404, "session-not-found", "'nope'"),
        ({"session_ids": [a, other]}, 422, "invalid-request", "a step's sessions share one shape"),
        ({"session_ids": [a, three]}, 422, "invalid-request", "different num_layers"),
        ({"session_ids": [a, three], "layers": [2]}, 404, "layer-not-found", "layer 2"),
        ({"session_ids": [a], "layers": [0, 0]}, 422, "invalid-request", "named twice"),
        ({"session_ids": [a], "rows": -1}, 422, "invalid-request", "rows"),
        ({"session_ids": [a], "queries": 0}, 422, "invalid-request", "queries"),
        ({"session_ids": [a], "dtype": "<f8"}, 422, "invalid-request", "dtype"),
        ({"session_ids": [a], "offsets": [0]}, 422, "invalid-request", "offsets"),
    ]:
        _problem(*peer.op({"op": "step_open", **members}), status, slug, needle)
    assert len(srv.runtime.steps) == 0
    step = peer.open([a, three], layers=[1])
    assert step["lengths"] == [[0], [0]] and step["queries"] == 1
    kv = np.zeros((1, HKV, D), np.float32)
    assert api.append(b, 0, kv, kv).status == 200  # b: in no step
    peer.close()
    _wait_closed(api, step["step"])
    for s in (a, b, other, three):
        assert api.delete(s).status == 204


def _wait_closed(api: Api, handle: int, within: float = 30.0) -> None:
    """Poll until the step answers 404 (its connection's end reached the server)."""
    deadline = time.monotonic() + within
    while api.call("GET", f"/v1/steps/{handle}").status != 404:
        assert time.monotonic() < deadline, f"step {handle} still open after {within:g} s"
        time.sleep(0.02)


# ── lifetimes: a connection's steps, the idle timeout, the sessions' TTL ───


@pytest.mark.parametrize("transport", ["stream", "frames", "shm"])
def test_a_connections_steps_close_with_it(srv, api, rng, transport):
    ids = _sessions(api, 2)
    peer = Peer(srv, transport)
    h = peer.open(ids)["step"]
    q, kv = np.stack([rows(rng, 1, H, D)] * 2), np.stack([rows(rng, 1, HKV, D)] * 2)
    assert peer.call(h, 0, q=q, k=kv, v=kv)[0] == 200
    closed = srv.runtime.metrics.steps_closed.labels("connection")._value.get()
    peer.close()
    _wait_closed(api, h)
    assert srv.runtime.metrics.steps_closed.labels("connection")._value.get() == closed + 1
    for s in ids:  # free again: appended to from outside, deleted
        assert api.append(s, 0, kv[0], kv[0]).body == {"length": 2}
        assert api.delete(s).status == 204


def test_a_shared_memory_reply_at_is_checked_against_the_steps_shapes(srv, api, rng):
    ids = _sessions(api, 2)
    peer = Peer(srv, "shm")
    h = peer.open(ids, return_lse=True, out_dtype="bfloat16")["step"]
    q, kv = np.stack([rows(rng, 1, H, D)] * 2), np.stack([rows(rng, 1, HKV, D)] * 2)
    need = 2 * H * D * 2 + 64  # out in bfloat16, lse in float32 (2 x 6 x 4 = 48), each rounded up to 64
    status, body = peer.op({"op": "step_call", "step": h, "layer": 0, "q": q, "k": kv, "v": kv, "reply_at": [0, 64]})
    _problem(status, body, 422, "invalid-request", f"need {need} bytes")
    assert _lengths(api, ids) == [[0, 0]] * 2
    status, got = peer.call(h, 0, q=q, k=kv, v=kv)
    assert status == 200 and np.asarray(got["out"]).dtype == wire.BFLOAT16, got
    peer.close()
    _wait_closed(api, h)
    for s in ids:
        api.delete(s)


def test_a_step_over_http_closes_when_idle_and_its_sessions_outlive_their_ttl(engine, rng):
    """step_idle_timeout_s closes a step opened over HTTP that no call used; a step
    on a stream does not expire, and while it is open its sessions do not expire
    by the TTL, which a session in no step does."""
    settings = Settings(step_idle_timeout_s=0.3, session_ttl_seconds=0.3)
    srv = LiveServer(settings, engine=engine).start()
    api = Api(srv.url)
    stream = Peer(srv, "stream")
    try:
        held, idle, free = _sessions(api, 3)
        bound = stream.open([held])["step"]
        h = Peer(srv, "http").open([idle])["step"]
        _wait_closed(api, h)  # expired: idle for 0.3 s (its session is free, and the TTL's again)
        deadline = time.monotonic() + 30
        while api.call("GET", f"/v1/sessions/{free}").status != 404:  # the TTL ran past 0.3 s ...
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert api.call("GET", f"/v1/steps/{bound}").status == 200  # ... and spared the step on the stream
        q, kv = rows(rng, 1, H, D)[None], rows(rng, 1, HKV, D)[None]
        status, got = stream.call(bound, 0, q=q, k=kv, v=kv)
        assert status == 200 and got["lengths"] == [1], got
        m = Scrape(api.client.get("/metrics").text)
        assert m("attnserve_steps_closed_total", reason="idle") == 1
        assert m("attnserve_steps_opened_total") == 2 and m("attnserve_steps_open") == 1
        assert m("attnserve_step_calls_total", outcome="applied") == 1
        assert m.samples["attnserve_limit_seconds"][frozenset({("name", "step_idle_timeout")})] == 0.3
    finally:
        stream.close()
        api.close()
        srv.stop()


def test_step_table_bookkeeping():
    """The registry's steps keep their per-token bookkeeping in the compiled step
    table (the binary call frame's parser checks against the same record): a
    layer is claimed once, called once a token, released when its call applied
    nothing; the token advances when every layer is called; a partial call breaks
    the step; a closed step's late settle changes nothing."""
    from attnserve.step_registry import CallFrameError, StepRegistry

    class Members:  # the store's side of a step: who is in which
        def __init__(self) -> None:
            self.step_of: dict[str, int] = {}

        def enter_step(self, sessions: list[Any], handle: int) -> None:
            self.step_of.update((s.id, handle) for s in sessions)

        def leave_step(self, sessions: list[Any], handle: int) -> None:
            for s in sessions:
                assert self.step_of.pop(s.id) == handle

    class One:
        id = "s"

    store = Members()
    sessions = [One()]
    reg = StepRegistry(store, 4)  # type: ignore[arg-type]
    step = reg.open(None, sessions, (32, 16, 16), bound=None, layers=[3, 1], rows=1, queries=1, dtype="<f4",
                    causal=True, scale=None, return_lse=False, out_dtype=None)  # fmt: skip
    assert step.claim(3) == 0
    with pytest.raises(CallFrameError) as e:
        step.claim(3)
    assert e.value.status == "LAYER_CALLED" and step.in_flight_layers() == [3]
    assert step.settle(3, 0, 1) == "failed" and step.in_flight_layers() == [] and step.token == 0
    assert step.claim(3) == 0 and step.claim(1) == 0  # two layers in flight at once
    with pytest.raises(CallFrameError) as e:
        step.claim(2)
    assert e.value.status == "LAYER_NOT_IN_STEP"
    assert step.settle(1, 1, 0) == "applied" and step.token == 0
    with pytest.raises(CallFrameError) as e:
        step.claim(1)
    assert e.value.status == "LAYER_CALLED"
    assert step.settle(3, 1, 0) == "applied" and step.token == 1
    assert step.claim(1) == 1 and step.settle(1, 1, 1) == "partial"
    with pytest.raises(CallFrameError) as e:
        step.claim(3)
    assert e.value.status == "BROKEN"
    assert step.in_flight_layers() == []
    reg.close(step, "closed")
    assert len(reg.table) == 0 and store.step_of == {}
    assert step.settle(3, 1, 0) == "applied"  # a call in flight at the close settles without a record
