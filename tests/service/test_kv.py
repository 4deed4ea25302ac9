"""Append and attend over a real socket, in both encodings, against the float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve_client import wire
from svc_helpers import F32_TOL, PAGE, TYPES, Model, rel_err, rows


def test_append_then_attend(api, rng, enc):
    h, hkv, d = 8, 2, 32
    sid = api.create(enc, num_qo_heads=h, num_kv_heads=hkv, head_dim=d)["session_id"]
    m = Model(h, hkv, d)
    for n in (7, 1, 54):
        k, v = rows(rng, n, hkv, d), rows(rng, n, hkv, d)
        r = api.append(sid, 0, k, v, enc=enc)
        assert r.status == 200 and r.content_type == TYPES[enc]
        m.add(0, k, v)
        assert r.body == {"length": m.lengths[0]}
    q = rows(rng, 5, h, d)
    r = api.attend(sid, 0, q, enc=enc)
    assert r.status == 200 and r.content_type == TYPES[enc]
    assert set(r.body) == {"out", "length"} and r.body["length"] == 62
    assert r.body["out"].shape == (5, h, d) and r.body["out"].dtype == np.float32
    assert rel_err(r.body["out"], m.attention(0, q)) <= F32_TOL
    assert api.info(sid)["lengths"] == [62]
    api.delete(sid)


def test_msgpack_answer_is_the_wire_array(api, rng):
    sid = api.create(num_qo_heads=2, num_kv_heads=1, head_dim=8)["session_id"]
    api.append(sid, 0, rows(rng, 3, 1, 8), rows(rng, 3, 1, 8))
    r = api.call("POST", f"/v1/sessions/{sid}/layers/0/attend", {"q": rows(rng, 2, 2, 8)}, enc="msgpack")
    out = r.body["out"]
    assert set(out) == {"dtype", "shape", "data"} and out["dtype"] == "<f4" and out["shape"] == [2, 2, 8]
    assert isinstance(out["data"], bytes) and len(out["data"]) == 2 * 2 * 8 * 4
    r = api.call("POST", f"/v1/sessions/{sid}/layers/0/attend", {"q": rows(rng, 2, 2, 8)}, enc="json")
    assert np.asarray(r.body["out"]).shape == (2, 2, 8)
    api.delete(sid)


@pytest.mark.parametrize("h, hkv", [(4, 4), (8, 2), (8, 1)])
def test_options_start_pos_causal_scale(api, rng, enc, h, hkv):
    d = 16
    sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)["session_id"]
    k, v = rows(rng, 20, hkv, d), rows(rng, 20, hkv, d)
    api.append(sid, 0, k, v, enc=enc)
    q = rows(rng, 4, h, d)
    cases = [
        ({}, dict()),
        ({"start_pos": 3}, dict(start_pos=3)),
        ({"start_pos": 0}, dict(start_pos=0)),
        ({"causal": False}, dict(causal=False)),
        ({"causal": False, "start_pos": 2}, dict(causal=False, start_pos=2)),
        ({"scale": 0.05}, dict(scale=0.05)),
        ({"scale": -0.3, "causal": True, "start_pos": 16}, dict(scale=-0.3, start_pos=16)),
        ({"scale": 1, "start_pos": None, "offset": 20}, dict(scale=1.0)),  # null = absent; offset checked
    ]
    for body, kw in cases:
        r = api.attend(sid, 0, q, enc=enc, **body)
        assert r.status == 200, (body, r.body)
        assert r.body["length"] == 20
        assert rel_err(r.body["out"], ref_attention(q, k, v, **kw)) <= F32_TOL, body
    api.delete(sid)


def ref_attention(q, k, v, **kw):
    from tools import reference as ref

    return ref.attention(q, k, v, **kw)


def test_fused_append_attend(api, rng, enc):
    h, hkv, d = 4, 2, 32
    sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)["session_id"]
    m = Model(h, hkv, d)
    # prefill chunk: n rows of q, k, v in one call
    q, k, v = rows(rng, 9, h, d), rows(rng, 9, hkv, d), rows(rng, 9, hkv, d)
    r = api.attend(sid, 0, q, k=k, v=v, offset=0, enc=enc)
    m.add(0, k, v)
    assert r.status == 200 and r.body["length"] == 9
    assert rel_err(r.body["out"], m.attention(0, q)) <= F32_TOL
    # fused with m != n rows and an explicit start_pos
    q, k, v = rows(rng, 2, h, d), rows(rng, 5, hkv, d), rows(rng, 5, hkv, d)
    r = api.attend(sid, 0, q, k=k, v=v, start_pos=10, enc=enc)
    m.add(0, k, v)
    assert r.status == 200 and r.body["length"] == 14
    assert rel_err(r.body["out"], m.attention(0, q, start_pos=10)) <= F32_TOL
    assert api.info(sid)["lengths"] == [14]
    api.delete(sid)


def test_multi_layer_sessions_keep_layers_apart(api, rng, enc):
    h, hkv, d, layers = 4, 2, 16, 4
    sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=layers)["session_id"]
    m = Model(h, hkv, d, layers)
    for step in range(3):
        for layer in range(layers):
            n = 1 + (layer + step) % 3
            k, v = rows(rng, n, hkv, d), rows(rng, n, hkv, d)
            assert api.append(sid, layer, k, v, enc=enc, offset=m.lengths[layer]).status == 200
            m.add(layer, k, v)
    info = api.info(sid)
    assert info["lengths"] == m.lengths
    assert info["bytes"] == layers * 2 * PAGE * hkv * d * 4  # one page each
    for layer in range(layers):
        q = rows(rng, 2, h, d)
        r = api.attend(sid, layer, q, enc=enc)
        assert r.body["length"] == m.lengths[layer]
        assert rel_err(r.body["out"], m.attention(layer, q)) <= F32_TOL
    api.delete(sid)


def test_retried_append_with_offset_is_refused(api, rng, enc):
    h, hkv, d = 2, 1, 8
    sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)["session_id"]
    k, v = rows(rng, 4, hkv, d), rows(rng, 4, hkv, d)
    first = api.append(sid, 0, k, v, enc=enc, offset=0)
    assert first.status == 200 and first.body == {"length": 4}
    before = api.info(sid)
    retry = api.append(sid, 0, k, v, enc=enc, offset=0)  # the same request again: its answer was "lost"
    assert retry.status == 409 and retry.problem_type == "/problems/offset-mismatch"
    assert retry.body["length"] == 4 and retry.content_type == wire.PROBLEM_JSON
    assert api.info(sid) == before
    # the fused form is refused the same way, appending nothing
    retry = api.attend(sid, 0, rows(rng, 1, h, d), k=k[:1], v=v[:1], offset=3, enc=enc)
    assert retry.status == 409 and retry.body["length"] == 4
    q = rows(rng, 1, h, d)
    r = api.attend(sid, 0, q, enc=enc, offset=4)
    assert r.status == 200 and rel_err(r.body["out"], ref_attention(q, k, v)) <= F32_TOL
    assert api.info(sid) == before
    api.delete(sid)


def test_layers_grow_up_to_max_tokens(api, rng):
    h, hkv, d = 2, 1, 8
    sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, max_tokens=150)["session_id"]
    m = Model(h, hkv, d)
    for n in (60, 60, 30):
        k, v = rows(rng, n, hkv, d), rows(rng, n, hkv, d)
        assert api.append(sid, 0, k, v).status == 200
        m.add(0, k, v)
    info = api.info(sid)
    pages = -(-150 // PAGE)
    assert info["lengths"] == [150] and info["bytes"] == 2 * pages * PAGE * hkv * d * 4  # whole pages
    q = rows(rng, 3, h, d)
    assert rel_err(api.attend(sid, 0, q).body["out"], m.attention(0, q)) <= F32_TOL
    r = api.append(sid, 0, rows(rng, 1, hkv, d), rows(rng, 1, hkv, d))
    assert r.status == 409 and r.problem_type == "/problems/capacity-exceeded"
    assert (r.body["length"], r.body["max_tokens"]) == (150, 150)
    api.delete(sid)
