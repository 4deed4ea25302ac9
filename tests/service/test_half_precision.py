"""Half precision on the wire (float16, bfloat16) through every transport, with
clients that are not the library (httpx, a bare WebSocket, a bare frames socket):
each answer bit-identical to the float32 request of the same (widened) values,
narrowed to the answer's dtype as numpy rounds (to nearest even); within the
dtype's rounding of the float64 oracle; bad dtypes, byte counts, non-finite values
and mixed k/v dtypes refused per operation, changing nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from websockets.sync.client import connect

from _core import bf16_nearest
from attnserve.config import Settings
from attnserve_client import wire
from svc_helpers import Api, LiveServer, RawFrames, from_wire, oracle, rel_err

pytestmark = pytest.mark.gpu

# float16: 11 significant bits, bfloat16: 8; the output's own rounding plus the
# float32 kernels' error (the inputs are exact: the oracle gets the widened values)
TOL = {"<f2": 2.0**-10, "bfloat16": 2.0**-7}
TRANSPORTS = ("http", "items", "stacked", "stream", "frames")
H, HKV, D = 4, 2, 24  # awkward: 24 is no power of two


def _half(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(np.float16) if dtype == "<f2" else bf16_nearest(x)


def _narrow(x: np.ndarray, dtype: str) -> np.ndarray:
    return _half(x, dtype) if dtype != "<f4" else x


@pytest.fixture(scope="module")
def hserver(engine):
    srv = LiveServer(Settings(frames_port=0), engine=engine).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hapi(hserver):
    a = Api(hserver.url)
    yield a
    a.close()


class Wire:
    """One transport's attends, as a client speaking it bare would send them."""

    def __init__(self, srv: LiveServer, api, transport: str):
        self.api, self.transport = api, transport
        self.ws = (
            connect(srv.url.replace("http://", "ws://") + "/v1/stream").__enter__() if transport == "stream" else None
        )
        self.frames = RawFrames(srv.runtime.frames_port) if transport == "frames" else None
        self.next_id = 0

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
        if self.frames is not None:
            self.frames.close()

    def _op(self, doc: dict) -> dict:
        """A stream or frames operation's reply: ``(status, result or error)``."""
        self.next_id += 1
        frame = {"id": self.next_id, **doc}
        if self.ws is not None:
            self.ws.send(wire.packb({k: _enc(v) for k, v in frame.items()}))
            reply = wire.unpackb(self.ws.recv(timeout=60), max_bytes=1 << 26)
        else:
            assert self.frames is not None
            reply = self.frames.call({k: _enc(v) for k, v in frame.items()})
        assert reply["id"] == self.next_id
        return reply

    def attend(self, sids: list[str], q, k, v, **kw) -> list[dict]:
        """Each session's answer ``{"out", ...}`` or ``{"status", "error"}``."""
        b = len(sids)
        if self.transport == "stacked":
            r = self.api.call("POST", "/v1/batch/attend", {"session_ids": sids, "layer": 0, "q": q, "k": k, "v": v,
                                                           **kw}, enc="msgpack")  # fmt: skip
            if r.status != 200:
                return [{"status": r.status, "error": r.body}] * b
            body = from_wire(r.body)
            bad = {e["item"]: e for e in body["errors"]}
            return [{"status": bad[i]["status"], "error": bad[i]} if i in bad else {"out": body["out"][i]}
                    for i in range(b)]  # fmt: skip
        if self.transport == "items":
            items = [{"session_id": s, "layer": 0, "q": q[i], "k": k[i], "v": v[i], **kw} for i, s in enumerate(sids)]
            r = self.api.call("POST", "/v1/batch/attend", {"items": items}, enc="msgpack")
            assert r.status == 200, r.body
            return [
                {"status": x["error"]["status"], "error": x["error"]} if "error" in x else x
                for x in from_wire(r.body)["results"]
            ]
        out = []
        for i, s in enumerate(sids):
            doc = {"q": q[i], "k": k[i], "v": v[i], **kw}
            if self.transport == "http":
                r = self.api.call("POST", f"/v1/sessions/{s}/layers/0/attend", doc, enc="msgpack")
                out.append(from_wire(r.body) if r.status == 200 else {"status": r.status, "error": r.body})
            else:
                reply = self._op({"op": "attend", "session_id": s, "layer": 0, **doc})
                out.append(
                    from_wire(reply["result"]) if reply["status"] == 200
                    else {"status": reply["status"], "error": reply["error"]}
                )  # fmt: skip
        return out


def _enc(v):
    return wire.encode_array(v) if isinstance(v, np.ndarray) else v


def _sessions(api, n: int, fmt: str) -> list[str]:
    return [api.create(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=1, kv_format=fmt)["session_id"]
            for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", ["<f2", "bfloat16"])
@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_half_arrays_answer_as_the_float32_request_of_their_values(hserver, hapi, rng, transport, dtype, fmt):
    api, b = hapi, 2
    half, full, as_f32 = _sessions(api, b, fmt), _sessions(api, b, fmt), _sessions(api, b, fmt)
    w = Wire(hserver, api, transport)
    keys: list[list[np.ndarray]] = [[] for _ in range(b)]
    vals: list[list[np.ndarray]] = [[] for _ in range(b)]
    try:
        for n, m in [(3, 5), (1, 1), (2, 3)]:
            x = {name: rng.standard_normal((b, rows, heads, D)).astype(np.float32)
                 for name, rows, heads in (("q", n, H), ("k", m, HKV), ("v", m, HKV))}  # fmt: skip
            halves = {name: _half(a, dtype) for name, a in x.items()}
            widened = {name: wire.to_float32(a) for name, a in halves.items()}
            got = w.attend(half, halves["q"], halves["k"], halves["v"])
            got32 = w.attend(as_f32, halves["q"], halves["k"], halves["v"], out_dtype="<f4")
            want = Wire(hserver, api, "http").attend(full, widened["q"], widened["k"], widened["v"])
            for i in range(b):
                assert "out" in got[i] and "out" in got32[i], (got[i], got32[i])
                out, out32, ref = got[i]["out"], got32[i]["out"], want[i]["out"]
                assert out.dtype == wire.DTYPES[dtype] and out.shape == (n, H, D)
                assert out32.dtype == np.float32 and out32.tobytes() == ref.tobytes()
                assert out.tobytes() == _narrow(ref, dtype).tobytes()
                keys[i].append(widened["k"][i])
                vals[i].append(widened["v"][i])
                k_all, v_all = np.concatenate(keys[i]), np.concatenate(vals[i])
                if fmt == "f16":  # the layer stores float16 (bfloat16 rows rounded once more)
                    k_all, v_all = k_all.astype(np.float16), v_all.astype(np.float16)
                if fmt == "bf16":  # bfloat16 (bfloat16 rows kept, float16 ones rounded once more)
                    k_all, v_all = (wire.to_float32(bf16_nearest(a)) for a in (k_all, v_all))
                exact = oracle(widened["q"][i], k_all, v_all)
                assert rel_err(wire.to_float32(out), exact) <= TOL[dtype]
    finally:
        w.close()
        for s in half + full + as_f32:
            api.delete(s)


def _bad_ops(rng) -> list[tuple[dict, str]]:
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    k = rng.standard_normal((1, HKV, D)).astype(np.float32)
    nan_bf16 = bf16_nearest(q).copy()
    nan_bf16.view("<u2")[0, 1, 2] = 0x7FC0
    inf_f16 = q.astype(np.float16)
    inf_f16[0, 3, 1] = np.inf
    as_map = wire.encode_array(q.astype(np.float16))
    return [
        ({"q": {**as_map, "dtype": "<f8"}}, "q: expected dtype one of ['<f2', '<f4', 'bfloat16'], got '<f8'"),
        ({"q": {**as_map, "dtype": "float16"}}, "got 'float16'"),
        ({"q": {**as_map, "data": bytes(as_map["data"])[:-2]}}, f"expected {H * D * 2} data bytes"),
        ({"q": {**as_map, "dtype": "<f4"}}, f"expected {H * D * 4} data bytes for shape (1, {H}, {D}) of <f4"),
        ({"q": nan_bf16}, "q: expected finite values, got nan at index (0, 1, 2)"),
        ({"q": inf_f16}, "q: expected finite values, got inf at index (0, 3, 1)"),
        ({"q": q, "k": k.astype(np.float16), "v": bf16_nearest(k)}, "k, v: expected one dtype for both"),
        ({"q": q, "out_dtype": "float64"}, "out_dtype: expected one of"),
    ]


@pytest.mark.parametrize("transport", ("http", "stream", "frames"))
def test_bad_half_arrays_are_refused_and_change_nothing(hserver, hapi, rng, transport):
    api = hapi
    (sid,) = _sessions(api, 1, "f32")
    k = rng.standard_normal((2, HKV, D)).astype(np.float32)
    assert api.append(sid, 0, k, k).status == 200
    w = Wire(hserver, api, transport)
    try:
        for doc, message in _bad_ops(rng):
            if transport == "http":
                r = api.call("POST", f"/v1/sessions/{sid}/layers/0/attend", {k_: _enc(v_) for k_, v_ in doc.items()},
                             enc="msgpack")  # fmt: skip
                status, problem = r.status, r.body
            else:
                reply = w._op({"op": "attend", "session_id": sid, "layer": 0, **doc})
                status, problem = reply["status"], reply["error"]
            assert status == 422 and problem["type"] == "/problems/invalid-request", problem
            assert message in problem["detail"], problem["detail"]
        # the connection goes on: a good operation after the bad ones
        good = w.attend([sid], bf16_nearest(rng.standard_normal((1, 1, H, D)).astype(np.float32)),
                        *[bf16_nearest(rng.standard_normal((1, 1, HKV, D)).astype(np.float32))] * 2)  # fmt: skip
        assert good[0]["out"].dtype == wire.BFLOAT16
    finally:
        w.close()
    assert api.info(sid)["lengths"] == [3]  # the two appended, then the good attend's one
    api.delete(sid)


def test_json_answers_give_the_values_of_the_asked_dtype(hapi, rng):
    api = hapi
    (sid,) = _sessions(api, 1, "f32")
    q = rng.standard_normal((2, H, D)).astype(np.float32)
    k = rng.standard_normal((3, HKV, D)).astype(np.float32)
    r32 = api.call("POST", f"/v1/sessions/{sid}/layers/0/attend", {"q": q, "k": k, "v": k}, enc="msgpack")
    ref = from_wire(r32.body)["out"]
    for dtype in ("bfloat16", "<f2"):
        r = api.call("POST", f"/v1/sessions/{sid}/layers/0/attend", {"q": q, "out_dtype": dtype}, enc="json")
        assert r.status == 200, r.body
        got = np.array(json.loads(r.raw)["out"], np.float64)
        assert np.array_equal(got, wire.to_float32(_narrow(ref, dtype)).astype(np.float64))
    api.delete(sid)


def test_float32_rows_that_round_to_infinity_in_bf16_are_refused(hapi, rng):
    """A bf16 layer refuses float32 rows with a value that rounds to infinity in
    bfloat16 (2^128 - 2^119 or more), in an append and in a stacked step's item
    alone, and appends nothing for them; the largest value that rounds to a
    finite bfloat16 is taken."""
    from attnserve.formats import BF16_INF_FROM

    api = hapi
    a, b = _sessions(api, 2, "bf16")
    k = rng.standard_normal((2, HKV, D)).astype(np.float32)
    bad = k.copy()
    bad[1, 0, 3] = BF16_INF_FROM
    r = api.append(a, 0, k, bad)
    assert r.status == 422 and "rounds to infinity in bfloat16" in r.body["detail"], r.body
    q = rng.standard_normal((2, 1, H, D)).astype(np.float32)
    kk = np.stack([k[:1], k[:1]])
    vv = np.stack([k[:1], bad[1:]])
    r = api.call("POST", "/v1/batch/attend", {"session_ids": [a, b], "layer": 0, "q": q, "k": kk, "v": vv},
                 enc="msgpack")  # fmt: skip
    assert r.status == 200 and [e["item"] for e in r.body["errors"]] == [1], r.body
    assert "rounds to infinity in bfloat16" in r.body["errors"][0]["detail"]
    below = np.nextafter(np.float32(BF16_INF_FROM), np.float32(0))
    bad[1, 0, 3] = below
    assert api.append(b, 0, k, bad).status == 200
    assert [api.info(s)["lengths"] for s in (a, b)] == [[1], [2]]
    for s in (a, b):
        api.delete(s)
