"""Sessions over a real socket, in both encodings: create (POST/PUT), get, list, delete,
the create rules of api.md, and content negotiation."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from attnserve_client import wire
from svc_helpers import PAGE, TYPES, rows

H, KV, D = 4, 2, 16
INFO_KEYS = {
    "session_id",
    "num_layers",
    "num_qo_heads",
    "num_kv_heads",
    "head_dim",
    "kv_format",
    "layer_formats",
    "max_tokens",
    "seed",
    "sinks",
    "window",
    "lengths",
    "bytes",
}


def uid(prefix: str = "t") -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


def test_post_creates_with_defaults(api, server, enc):
    r = api.call("POST", "/v1/sessions", {"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D}, enc=enc)
    assert r.status == 201
    assert r.content_type == TYPES[enc]
    info = r.body
    assert set(info) == INFO_KEYS
    assert info["num_layers"] == 1 and info["kv_format"] == "f32"
    assert (info["num_qo_heads"], info["num_kv_heads"], info["head_dim"]) == (H, KV, D)
    assert info["lengths"] == [0] and info["bytes"] == 0
    assert type(info["seed"]) is int and 0 <= info["seed"] < 2**53
    limit = server.runtime.engine.max_tokens_limit("f32", KV, D)
    assert info["max_tokens"] == min(server.runtime.settings.default_max_tokens, limit)
    sid = info["session_id"]
    assert 1 <= len(sid) <= 64 and all(c.isalnum() or c in "-_" for c in sid)
    assert r.headers["location"] == f"/v1/sessions/{sid}"
    got = api.call("GET", f"/v1/sessions/{sid}", accept=TYPES[enc])
    assert got.status == 200 and got.body == info and got.content_type == TYPES[enc]
    assert api.delete(sid).status == 204


def test_put_creates_with_chosen_id_and_all_fields(api, enc):
    sid = uid("put")
    body = {
        "num_layers": 3,
        "num_qo_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 64,
        "kv_format": "turboquant",
        "max_tokens": 100,
        "seed": 2**64 - 1,
        "sinks": 2,
        "window": 64,
    }
    r = api.call("PUT", f"/v1/sessions/{sid}", body, enc=enc)
    assert r.status == 201, r.body
    assert r.body == {
        **body,
        "session_id": sid,
        "layer_formats": [body["kv_format"]] * 3,
        "lengths": [0, 0, 0],
        "bytes": 0,
    }
    again = api.call("PUT", f"/v1/sessions/{sid}", {**body, "num_layers": 1}, enc=enc)
    assert again.status == 409 and again.problem_type == "/problems/session-exists"
    assert again.content_type == wire.PROBLEM_JSON
    assert api.info(sid)["num_layers"] == 3  # the first one is untouched
    assert api.delete(sid).status == 204


def test_ids_distinct_and_seeds_echoed(api):
    a = api.create(num_qo_heads=H, num_kv_heads=KV, head_dim=D, seed=0)
    b = api.create(num_qo_heads=H, num_kv_heads=KV, head_dim=D, seed=12345)
    assert a["session_id"] != b["session_id"]
    assert (a["seed"], b["seed"]) == (0, 12345)
    for s in (a, b):
        api.delete(s["session_id"])


def test_list_get_delete(api, enc):
    ids = [
        api.create(num_qo_heads=H, num_kv_heads=KV, head_dim=D, session_id=uid("ls"))["session_id"] for _ in range(3)
    ]
    r = api.call("GET", "/v1/sessions", accept=TYPES[enc])
    assert r.status == 200 and r.content_type == TYPES[enc]
    listed = {s["session_id"]: s for s in r.body["sessions"]}
    assert set(ids) <= set(listed)
    assert all(set(s) == INFO_KEYS for s in listed.values())
    d = api.call("DELETE", f"/v1/sessions/{ids[0]}")
    assert d.status == 204 and d.raw == b""
    gone = api.call("GET", f"/v1/sessions/{ids[0]}", accept=TYPES[enc])
    assert gone.status == 404 and gone.problem_type == "/problems/session-not-found"
    assert gone.content_type == wire.PROBLEM_JSON  # problems are JSON whatever Accept says
    assert api.call("DELETE", f"/v1/sessions/{ids[0]}").status == 404
    listed = {s["session_id"] for s in api.call("GET", "/v1/sessions").body["sessions"]}
    assert ids[0] not in listed and set(ids[1:]) <= listed
    for sid in ids[1:]:
        api.delete(sid)


def test_delete_frees_gpu_memory(api, server, rng):
    info = api.create(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
    sid = info["session_id"]
    used0 = server.runtime.store.used_bytes
    assert api.append(sid, 0, rows(rng, 5, KV, D), rows(rng, 5, KV, D)).status == 200
    held = api.info(sid)["bytes"]
    assert held == 2 * PAGE * KV * D * 4  # K and V of one page
    assert server.runtime.store.used_bytes == used0 + held
    assert api.delete(sid).status == 204
    assert server.runtime.store.used_bytes == used0


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"num_kv_heads": KV, "head_dim": D}, "num_qo_heads"),
        ({"num_qo_heads": H, "head_dim": D}, "num_kv_heads"),
        ({"num_qo_heads": H, "num_kv_heads": KV}, "head_dim"),
        ({"num_qo_heads": 0, "num_kv_heads": 1, "head_dim": D}, "num_qo_heads"),
        ({"num_qo_heads": 257, "num_kv_heads": 1, "head_dim": D}, "num_qo_heads"),
        ({"num_qo_heads": 6, "num_kv_heads": 4, "head_dim": D}, "num_kv_heads"),
        ({"num_qo_heads": H, "num_kv_heads": 0, "head_dim": D}, "num_kv_heads"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": 0}, "head_dim"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": 129}, "head_dim"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": 48, "kv_format": "turboquant"}, "head_dim"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": 16, "kv_format": "turboquant"}, "head_dim"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D, "kv_format": "fp8"}, "kv_format"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": 7, "kv_format": "f16"}, "head_dim"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": 41, "kv_format": "bf16"}, "head_dim"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D, "num_layers": 0}, "num_layers"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D, "num_layers": 257}, "num_layers"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D, "max_tokens": 0}, "max_tokens"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D, "seed": -1}, "seed"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D, "seed": 2**64}, "seed"),
        ({"num_qo_heads": True, "num_kv_heads": 1, "head_dim": D}, "num_qo_heads"),
        ({"num_qo_heads": 4.0, "num_kv_heads": KV, "head_dim": D}, "num_qo_heads"),
        ({"num_qo_heads": "4", "num_kv_heads": KV, "head_dim": D}, "num_qo_heads"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D, "kv_format": 1}, "kv_format"),
        ({"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D, "colour": "red"}, "colour"),
    ],
)
def test_create_rules(api, enc, fields, needle):
    if enc == "msgpack" and fields.get("seed") == 2**64:
        enc = "json"  # MessagePack cannot carry 2**64
    before = len(api.call("GET", "/v1/sessions").body["sessions"])
    r = api.call("POST", "/v1/sessions", fields, enc=enc)
    assert r.status == 422, r.body
    assert r.problem_type == "/problems/invalid-request" and r.content_type == wire.PROBLEM_JSON
    assert needle in r.body["detail"]
    assert set(r.body) >= {"type", "title", "status", "detail"} and r.body["status"] == 422
    assert len(api.call("GET", "/v1/sessions").body["sessions"]) == before  # nothing created


def test_max_tokens_past_the_adapter_limit_is_refused(api, server, enc):
    limit = server.runtime.engine.max_tokens_limit("f32", KV, D)
    ok = api.call(
        "POST", "/v1/sessions", {"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D, "max_tokens": limit}, enc=enc
    )
    assert ok.status == 201 and ok.body["max_tokens"] == limit
    api.delete(ok.body["session_id"])
    r = api.call(
        "POST", "/v1/sessions", {"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D, "max_tokens": limit + 1}, enc=enc
    )
    assert r.status == 422 and r.problem_type == "/problems/invalid-request"
    assert str(limit) in r.body["detail"] and r.body["max_tokens_limit"] == limit


@pytest.mark.parametrize("bad", ["a.b", "a%20b", "x" * 65, "%C3%A9t%C3%A9"])
def test_put_refuses_bad_ids(api, bad):
    r = api.call("PUT", f"/v1/sessions/{bad}", {"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D})
    assert r.status == 422 and r.problem_type == "/problems/invalid-request"


def test_put_accepts_every_allowed_character(api):
    sid = "AZaz09_-" + "x" * 56
    assert len(sid) == 64
    info = api.create(session_id=sid, num_qo_heads=H, num_kv_heads=KV, head_dim=D)
    assert info["session_id"] == sid
    api.delete(sid)


def test_create_with_no_body_is_an_invalid_request(api):
    r = api.call("POST", "/v1/sessions")
    assert r.status == 422 and "num_qo_heads" in r.body["detail"]


@pytest.mark.parametrize(
    "ctype, accept, want",
    [
        (wire.JSON, None, wire.JSON),
        (wire.MSGPACK, None, wire.MSGPACK),
        ("application/x-msgpack", None, wire.MSGPACK),
        ("application/msgpack", None, wire.MSGPACK),
        ("application/json; charset=utf-8", None, wire.JSON),
        ("Application/JSON", None, wire.JSON),
        (wire.JSON, wire.MSGPACK, wire.MSGPACK),
        (wire.MSGPACK, wire.JSON, wire.JSON),
        (wire.MSGPACK, "*/*", wire.MSGPACK),
        (wire.JSON, "text/html", wire.JSON),
        (wire.JSON, "application/json;q=0.5, application/vnd.msgpack", wire.MSGPACK),
        (wire.MSGPACK, "application/json, application/x-msgpack;q=0.1", wire.JSON),
    ],
)
def test_negotiation(api, ctype, accept, want):
    body = {"num_qo_heads": H, "num_kv_heads": KV, "head_dim": D}
    content = wire.packb(body) if "msgpack" in ctype else __import__("json").dumps(body).encode()
    headers = {"Content-Type": ctype}
    r = api.call("POST", "/v1/sessions", content=content, headers=headers, accept=accept)
    assert r.status == 201, r.body
    assert r.content_type == want
    api.delete(r.body["session_id"])


def test_get_defaults_to_json_and_follows_accept(api):
    sid = api.create(num_qo_heads=H, num_kv_heads=KV, head_dim=D)["session_id"]
    assert api.call("GET", f"/v1/sessions/{sid}").content_type == wire.JSON
    for t in wire.MSGPACK_TYPES:
        assert api.call("GET", f"/v1/sessions/{sid}", accept=t).content_type == wire.MSGPACK
    api.delete(sid)


def test_tq_session_bytes_are_whole_pages(api, rng):
    sid = api.create(num_qo_heads=4, num_kv_heads=2, head_dim=32, kv_format="turboquant", num_layers=2)["session_id"]
    assert api.info(sid)["bytes"] == 0
    assert api.append(sid, 1, rows(rng, 3, 2, 32), rows(rng, 3, 2, 32)).status == 200
    info = api.info(sid)
    key_words, value_words = 32 // 16 + 32 // 32 + 1, 32 // 16 + 1
    one_page = 2 * PAGE * (key_words + value_words) * 4  # 2 KV heads; the signs are uploaded per batch
    assert info["bytes"] == one_page and info["lengths"] == [0, 3]
    api.delete(sid)
    assert np.isfinite(info["bytes"])


def test_trailing_slashes_are_problems_not_redirects(server):
    import httpx

    for method, path in (("PUT", "/v1/sessions/%2F"), ("GET", "/v1/sessions/"), ("GET", "/v1/info/")):
        r = httpx.request(method, server.url + path, json={} if method == "PUT" else None)
        assert r.status_code in (404, 405, 422), (path, r.status_code)
        assert r.headers["content-type"].startswith("application/problem+json")
