"""``return_lse`` over a real socket, on every form: a single attend (JSON and
MessagePack), the items of a batched step, the stacked form, the stream and the
frame transport. Each answer's ``lse`` against the float64 oracle; ``out`` the same
bits with and without it; merged halves equal to attention over the whole;
a bad ``return_lse`` refused with a problem that changes nothing."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from attnserve.config import Settings
from tools import reference as ref
from attnserve_client import AttendItem, Attention, Client, merge
from _core import lse_err
from svc_helpers import F32_TOL, LiveServer, from_wire, rel_err, rows

BATCH = "/v1/batch/attend"
H, HKV, D = 6, 2, 32  # GQA group 3; head_dim 32, the least TurboQuant takes
D_ODD = 24  # a head_dim not a power of two, for the plain formats


def _session(api, rng, length: int, d: int = D, **spec):
    sid = api.create(num_qo_heads=H, num_kv_heads=HKV, head_dim=d, **spec)["session_id"]
    k, v = rows(rng, length, HKV, d), rows(rng, length, HKV, d)
    assert api.append(sid, 0, k, v).status == 200
    return sid, k, v


def test_single_attend_answers_lse_in_both_encodings(api, rng, enc):
    sid, k, v = _session(api, rng, 77, D_ODD)
    q = rows(rng, 5, H, D_ODD)
    for body in ({}, {"start_pos": 40}, {"causal": False, "scale": 0.3}):
        plain = api.attend(sid, 0, q, enc=enc, **body)
        got = api.attend(sid, 0, q, enc=enc, return_lse=True, **body)
        assert plain.status == got.status == 200
        assert "lse" not in plain.body and set(got.body) == {"out", "length", "lse"}
        lse = np.asarray(got.body["lse"], np.float32)
        assert lse.shape == (5, H)
        np.testing.assert_array_equal(got.body["out"], plain.body["out"])  # the same bits
        want, want_lse = ref.attention(q, k, v, return_lse=True, **body)
        assert rel_err(got.body["out"], want) <= F32_TOL
        assert lse_err(lse, want_lse) <= F32_TOL, body
    api.delete(sid)


def test_a_bad_return_lse_is_refused_and_changes_nothing(api, rng):
    sid, _, _ = _session(api, rng, 9)
    q, k = rows(rng, 1, H, D), rows(rng, 1, HKV, D)
    r = api.attend(sid, 0, q, k=k, v=k, return_lse="yes")
    assert r.status == 422 and "return_lse" in r.body["detail"]
    assert api.info(sid)["lengths"] == [9]  # the fused append did not happen
    api.delete(sid)


def test_batch_items_answer_lse_where_asked(api, rng, enc):
    """Items of one shape run as one stacked job, items of two shapes one job each:
    either way only the items that ask for it get ``lse``."""
    a, ka, va = _session(api, rng, 30)
    b, kb, vb = _session(api, rng, 51, kv_format="turboquant", seed=5)
    q = rows(rng, 2, H, D)
    for q2 in (q, rows(rng, 3, H, D)):  # the same shape (one job), then another (two)
        body = {
            "items": [
                {"session_id": a, "layer": 0, "q": q, "return_lse": True},
                {"session_id": b, "layer": 0, "q": q2},
            ]
        }
        r = api.call("POST", BATCH, body, enc=enc)
        assert r.status == 200, r.body
        first, second = (from_wire(x) for x in r.body["results"])
        assert "lse" in first and "lse" not in second
        want, want_lse = ref.attention(q, ka, va, return_lse=True)
        assert rel_err(np.asarray(first["out"]), want) <= F32_TOL
        assert lse_err(np.asarray(first["lse"], np.float32), want_lse) <= F32_TOL
    for sid in (a, b):
        api.delete(sid)


def test_stacked_answers_lse_zero_for_a_failed_item(api, rng, enc):
    sids, data = [], []
    for length in (12, 40, 33):
        sid, k, v = _session(api, rng, length)
        sids.append(sid)
        data.append((k, v))
    q = np.stack([rows(rng, 1, H, D) for _ in sids])
    k_new = np.stack([rows(rng, 1, HKV, D) for _ in sids])
    body = {"session_ids": sids, "layer": 0, "q": q, "k": k_new, "v": k_new, "offsets": [12, 0, 33], "return_lse": True}
    r = api.call("POST", BATCH, body, enc=enc)
    assert r.status == 200, r.body
    doc = from_wire(r.body)
    out, lse = np.asarray(doc["out"], np.float32), np.asarray(doc["lse"], np.float32)
    assert lse.shape == (3, 1, H) and doc["lengths"] == [13, None, 34]
    assert not lse[1].any() and not out[1].any()  # item 1's offset was wrong: zeros, nothing applied
    for i in (0, 2):
        k, v = data[i]
        want, want_lse = ref.attention(
            q[i], np.concatenate([k, k_new[i]]), np.concatenate([v, k_new[i]]), return_lse=True
        )
        assert rel_err(out[i], want) <= F32_TOL
        assert lse_err(lse[i], want_lse) <= F32_TOL
    r = api.call("POST", BATCH, {"session_ids": sids, "layer": 0, "q": q}, enc=enc)  # not asked: no lse
    assert r.status == 200 and "lse" not in r.body
    for sid in sids:
        api.delete(sid)


@pytest.fixture(scope="module")
def fserver(engine):
    srv = LiveServer(Settings(frames_port=0), engine=engine).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("transport", ["http", "websocket", "frames"])
def test_every_transport_answers_the_same_lse(fserver, rng, transport):
    """The client over HTTP, the stream and the frame transport: ``Attention`` from
    a single attend, an item and a stacked step, bit-identical across them, and two
    sessions holding halves of the rows merged into the whole session's answer
    (a compressed format with the same seed: the same codes, so float rounding)."""
    with Client(fserver.url) as client:
        for fmt in ("f32", "tq4"):
            spec = dict(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, kv_format=fmt, seed=21)
            whole, first, second = (client.create_session(**spec) for _ in range(3))
            k, v = rows(rng, 90, HKV, D), rows(rng, 90, HKV, D)
            whole.append(0, k, v)
            first.append(0, k[:37], v[:37])
            second.append(0, k[37:], v[37:])
            q = rows(rng, 4, H, D)
            ref_one = whole.attend(0, q, causal=False, return_lse=True)
            assert isinstance(ref_one, Attention)
            if transport == "http":
                one = whole.attend(0, q, causal=False, return_lse=True)
                item = client.attend_batch([AttendItem(whole, 0, q, causal=False, return_lse=True)])[0]
                stacked = client.attend_stacked([whole, whole], 0, np.stack([q, q]), causal=False, return_lse=True)
                parts = [s.attend(0, q, causal=False, return_lse=True) for s in (first, second)]
            else:
                with client.stream(transport=transport) as stream:
                    one = stream.attend(whole, 0, q, causal=False, return_lse=True)
                    item = stream.attend_batch([AttendItem(whole, 0, q, causal=False, return_lse=True)])[0]
                    stacked = stream.attend_stacked([whole, whole], 0, np.stack([q, q]), causal=False, return_lse=True)
                    parts = [stream.attend(s, 0, q, causal=False, return_lse=True) for s in (first, second)]
            for got in (
                one,
                item,
                Attention(stacked.out[0], stacked.lse[0]),
                Attention(stacked.out[1], stacked.lse[1]),
            ):
                np.testing.assert_array_equal(got.out, ref_one.out)
                np.testing.assert_array_equal(got.lse, ref_one.lse)
            merged = merge(parts)
            assert rel_err(merged.out, ref_one.out) <= 1e-5, fmt
            assert lse_err(merged.lse, ref_one.lse) <= 1e-5, fmt
            if fmt == "f32":
                want, want_lse = ref.attention(q, k, v, causal=False, return_lse=True)
                assert rel_err(merged.out, want) <= F32_TOL and lse_err(merged.lse, want_lse) <= F32_TOL
            for s in (whole, first, second):
                s.delete()


def _bin_as_text(doc):
    """A decoded MessagePack answer with its ``bin`` values as text, as the OpenAPI
    schema's ``format: binary`` strings stand for them."""
    if isinstance(doc, dict):
        return {key: _bin_as_text(value) for key, value in doc.items()}
    if isinstance(doc, list):
        return [_bin_as_text(value) for value in doc]
    return "<bin>" if isinstance(doc, bytes) else doc


def test_answers_with_lse_match_the_published_schema(api, rng, enc):
    """Each form's answer with ``lse`` (rank 2 for an attend, rank 3 stacked beside
    the rank-4 ``out``) is what ``/openapi.json`` says, in both encodings."""
    from jsonschema import Draft202012Validator

    components = api.call("GET", "/openapi.json").body["components"]
    kind = "Json" if enc == "json" else "Msgpack"

    def check(name: str, r) -> None:  # the answer's own bytes, decoded as a plain client would
        body = json.loads(r.raw) if enc == "json" else msgpack.unpackb(r.raw)
        schema = {"$ref": f"#/components/schemas/{name}{kind}", "components": components}
        errors = [e.message[:200] for e in Draft202012Validator(schema).iter_errors(_bin_as_text(body))]
        assert not errors, (name, errors[:3])

    sids = [_session(api, rng, length)[0] for length in (20, 35)]
    q = rows(rng, 2, H, D)
    r = api.attend(sids[0], 0, q, enc=enc, return_lse=True)
    assert r.status == 200 and "lse" in r.body
    check("AttendResult", r)
    items = [{"session_id": sid, "layer": 0, "q": q, "return_lse": True} for sid in sids]
    r = api.call("POST", BATCH, {"items": items}, enc=enc)
    assert r.status == 200 and all("lse" in x for x in r.body["results"])
    check("BatchAttendResult", r)
    body = {"session_ids": sids, "layer": 0, "q": np.stack([q, q]), "return_lse": True}
    r = api.call("POST", BATCH, body, enc=enc)
    assert r.status == 200 and "lse" in r.body
    check("BatchAttendResult", r)
    for sid in sids:
        api.delete(sid)
