"""The HTTP API of a running attnserve, checked from outside: every endpoint of
docs/api.md, both encodings (JSON and MessagePack) and both kv formats, with
oracles (float64 attention for f32; for TurboQuant its float64 oracle computed from
the session's own codes, bit-identical outputs for identical seeds, and the error
band against exact attention).

deploy/test-image.sh runs it against the container image (one container, then
through the nginx router in front of two). Sessions are created with PUT and an id
of their own, which is what works through the router; the one POST test follows
its session to the replica that made it (X-Attnserve-Instance). See conftest.py
for the environment; without ATTNSERVE_TEST_URL the module is skipped.
"""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from attnserve.formats import KV_FORMATS as ALL_FORMATS, TQ_SPECS
from tools import reference as ref
from attnserve.turboquant import layer_signs
from attnserve_client import Client, SessionExists, SessionNotFound, wire
from image_helpers import (
    ENCODINGS,
    F32_TOL,
    KV_FORMATS,
    PROBLEM,
    TARGET,
    TQ_MAX_REL,
    TQ_MIN_CORR,
    TQ_TOL,
    TYPES,
    Api,
    Model,
    band,
    new_id,
    rel_err,
    rows,
)

RUNS_HERE = bool(TARGET.url)
pytestmark = [
    pytest.mark.skipif(
        not RUNS_HERE,
        reason="runs against a running attnserve (the container image): set ATTNSERVE_TEST_URL, "
        "as deploy/test-image.sh does",
    ),
    pytest.mark.timeout(300),
]

# Every route of docs/api.md: (method, path template).
ROUTES = {
    ("POST", "/v1/sessions"),
    ("GET", "/v1/sessions"),
    ("PUT", "/v1/sessions/{session_id}"),
    ("GET", "/v1/sessions/{session_id}"),
    ("DELETE", "/v1/sessions/{session_id}"),
    ("POST", "/v1/sessions/{session_id}/layers/{layer}/kv"),
    ("POST", "/v1/sessions/{session_id}/layers/{layer}/attend"),
    ("GET", "/v1/sessions/{session_id}/snapshot"),
    ("PUT", "/v1/sessions/{session_id}/snapshot"),
    ("GET", "/livez"),
    ("GET", "/readyz"),
    ("GET", "/health"),
    ("GET", "/v1/info"),
    ("GET", "/metrics"),
}


def assert_problem(r, status: int, slug: str, path: str | None = None) -> dict:
    assert r.status == status, (r.status, r.body)
    assert r.content_type.startswith(PROBLEM), r.content_type
    assert r.body["type"] == f"/problems/{slug}" and r.body["status"] == status, r.body
    assert r.body.get("title") and r.body.get("detail"), r.body
    if path is not None:
        assert r.body["instance"] == path, r.body
    return r.body


def answer_type(r, enc: str) -> None:
    assert r.content_type.split(";")[0].strip() == TYPES[enc], (r.content_type, enc)


def in_list(api: Api, target, sid: str) -> bool:
    """Whether GET /v1/sessions lists ``sid``. Through a router a list is one
    replica's (each request goes to any replica), so ask a few times."""
    for _ in range(24 if target.routed else 1):
        r = api.call("GET", "/v1/sessions")
        assert r.status == 200 and isinstance(r.body["sessions"], list), r.body
        if sid in {s["session_id"] for s in r.body["sessions"]}:
            return True
    return False


# ── probes, info, description ───────────────────────────────────────────────


def test_probes(api):
    r = api.call("GET", "/livez")
    assert r.status == 200 and r.body == {"status": "ok"}, r.body
    for path in ("/readyz", "/health"):
        r = api.call("GET", path)
        assert r.status == 200 and r.body == {"status": "ready"}, (path, r.body)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_info(api, target, enc):
    r = api.call("GET", "/v1/info", accept=TYPES[enc])
    assert r.status == 200, r.body
    answer_type(r, enc)
    info = r.body
    assert info["name"] == "attnserve" and info["api_version"] == 1 and info["ready"] is True, info
    # every format of this checkout, in its order (the ones tested below among them)
    assert info["kv_formats"] == list(ALL_FORMATS) and set(KV_FORMATS) <= set(ALL_FORMATS)
    assert info["head_dims"]["turboquant"] == [32, 64, 128]
    assert info["head_dims"]["f16"] == info["head_dims"]["bf16"] == list(range(2, 129, 2))
    sizes = {fmt: {s["head_dim"]: s for s in info["kv_format_sizes"][fmt]} for fmt in info["kv_formats"]}
    fmts = ("f32", "f16", "bf16", "turboquant", "tq4", "tq3", "tq2o")
    assert [sizes[fmt][128]["bytes_per_token_per_kv_head"] for fmt in fmts] == [1024, 512, 512, 88, 136, 104, 80]
    assert [sizes[fmt][64]["bits_per_element"] for fmt in fmts] == [32, 16, 16, 3.0, 4.5, 3.5, 3.0]
    assert info["adapter"]["name"] and info["backend"], info
    if target.adapter:
        assert target.adapter.lower() in info["adapter"]["name"].lower(), info["adapter"]
    limits = info["limits"]
    assert limits["max_body_bytes"] > 0 and limits["max_binding_bytes"] > 0, limits


def test_openapi_describes_every_route(api):
    r = api.call("GET", "/openapi.json")
    assert r.status == 200 and r.body["openapi"].startswith("3.1"), r.body.get("openapi")
    described = {(m.upper(), p) for p, ops in r.body["paths"].items() for m in ops}
    assert ROUTES <= described, ROUTES - described
    r = api.call("GET", "/docs")
    assert r.status == 200 and "text/html" in r.content_type and "openapi.json" in r.body


def test_request_id_is_echoed(api, target):
    r = api.call("GET", "/livez", headers={"X-Request-ID": "image-test-1"})
    if target.routed:
        # the router sends its own $request_id (deploy/nginx/attnserve.conf)
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]), r.headers
    else:
        assert r.headers["x-request-id"] == "image-test-1"


# ── sessions: create, info, list, delete ────────────────────────────────────


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("enc", ENCODINGS)
def test_session_life_cycle(api, target, enc, fmt):
    sid = new_id(f"life-{enc}-{fmt}")
    fields = dict(num_qo_heads=4, num_kv_heads=2, head_dim=32, num_layers=3, kv_format=fmt, max_tokens=200, seed=12345)
    r = api.call("PUT", f"/v1/sessions/{sid}", fields, enc=enc)
    assert r.status == 201, r.body
    answer_type(r, enc)
    assert r.headers["location"] == f"/v1/sessions/{sid}"
    created = r.body
    assert {k: created[k] for k in fields} == fields and created["session_id"] == sid
    assert created["lengths"] == [0, 0, 0] and created["bytes"] == 0
    # taken: 409, and the session is untouched
    again = api.call("PUT", f"/v1/sessions/{sid}", {**fields, "num_layers": 1}, enc=enc)
    assert_problem(again, 409, "session-exists", f"/v1/sessions/{sid}")
    r = api.call("GET", f"/v1/sessions/{sid}", accept=TYPES[enc])
    assert r.status == 200 and r.body == created, r.body
    answer_type(r, enc)
    assert in_list(api, target, sid)
    r = api.call("DELETE", f"/v1/sessions/{sid}")
    assert r.status == 204 and r.raw == b""
    assert_problem(api.call("GET", f"/v1/sessions/{sid}"), 404, "session-not-found", f"/v1/sessions/{sid}")
    assert_problem(api.call("DELETE", f"/v1/sessions/{sid}"), 404, "session-not-found")


@pytest.mark.parametrize("enc", ENCODINGS)
def test_post_creates_with_a_server_id(api, target, enc):
    r = api.call("POST", "/v1/sessions", {"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 8}, enc=enc)
    assert r.status == 201, r.body
    answer_type(r, enc)
    sid = r.body["session_id"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", sid), sid
    assert r.headers["location"] == f"/v1/sessions/{sid}"
    assert r.body["kv_format"] == "f32" and r.body["num_layers"] == 1 and 0 <= r.body["seed"] < 2**53
    # Through a router the session lives where the POST landed, named in the answer.
    where = Api(target.replicas[r.headers["x-attnserve-instance"]]) if target.routed else api
    try:
        assert where.info(sid)["session_id"] == sid
        assert where.delete(sid).status == 204
    finally:
        if where is not api:
            where.close()


# ── K/V and attention, f32: against float64 ─────────────────────────────────


@pytest.mark.parametrize("enc", ENCODINGS)
def test_f32_append_and_attend_match_float64(api, rng, enc):
    h, hkv, d = 8, 2, 32  # GQA groups of 4
    sid = new_id(f"f32-{enc}")
    api.create(sid, enc, num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2)
    m = Model(h, hkv, d, 2)
    # append with offset on both layers
    for layer, n in ((0, 37), (1, 5)):
        k, v = rows(rng, n, hkv, d), rows(rng, n, hkv, d)
        r = api.append(sid, layer, k, v, offset=0, enc=enc)
        assert r.status == 200 and r.body == {"length": n}, r.body
        answer_type(r, enc)
        m.add(layer, k, v)
    # a stale offset: 409 with the length, and nothing appended
    r = api.append(sid, 0, rows(rng, 1, hkv, d), rows(rng, 1, hkv, d), offset=0, enc=enc)
    assert assert_problem(r, 409, "offset-mismatch")["length"] == 37
    # prefill chunk: a fused attend of 9 rows on layer 1
    q, k, v = rows(rng, 9, h, d), rows(rng, 9, hkv, d), rows(rng, 9, hkv, d)
    r = api.attend(sid, 1, q, k=k, v=v, offset=5, enc=enc)
    assert r.status == 200 and r.body["length"] == 14, r.body
    answer_type(r, enc)
    m.add(1, k, v)
    assert r.body["out"].shape == (9, h, d)
    assert rel_err(r.body["out"], m.attention(1, q)) <= F32_TOL
    # decode steps: one fused row per layer
    for step in range(4):
        for layer in (0, 1):
            q, k, v = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
            r = api.attend(sid, layer, q, k=k, v=v, offset=m.lengths[layer], enc=enc)
            assert r.status == 200 and r.body["length"] == m.lengths[layer] + 1, r.body
            m.add(layer, k, v)
            assert rel_err(r.body["out"], m.attention(layer, q)) <= F32_TOL, (step, layer)
    # attend without appending: start_pos, non-causal, a custom scale
    q = rows(rng, 6, h, d)
    for kw in ({"start_pos": 3}, {"causal": False}, {"causal": False, "scale": 0.3}, {"start_pos": 0, "scale": -0.1}):
        r = api.attend(sid, 0, q, enc=enc, **kw)
        assert r.status == 200 and r.body["length"] == m.lengths[0], r.body
        assert rel_err(r.body["out"], m.attention(0, q, **kw)) <= F32_TOL, kw
    info = api.info(sid)
    assert info["lengths"] == m.lengths == [41, 18] and info["bytes"] > 0
    api.delete(sid)


# ── TurboQuant: its own oracle from the session's codes, seeds, error band ───


def _tq_oracle(snapshot: dict, layer: int, q: np.ndarray, **kw) -> np.ndarray:
    """float64 TurboQuant attention over the codes the server holds (from a snapshot)."""
    cfg = snapshot["config"]
    state = snapshot["layers"][layer]
    d = cfg["head_dim"]
    polar, jl = layer_signs(cfg["seed"], layer, d)
    return ref.tqx_attention(
        q,
        np.frombuffer(state["k"], np.uint32),
        np.frombuffer(state["v"], np.uint32),
        TQ_SPECS["turboquant"],
        n_kv_heads=cfg["num_kv_heads"],
        cap=state["capacity"],
        length=state["length"],
        polar_signs=polar,
        jl_signs=jl,
        **kw,
    )


def _snapshot(api: Api, sid: str) -> tuple[bytes, dict]:
    r = api.client.get(f"/v1/sessions/{sid}/snapshot", headers={"Accept": wire.JSON})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == wire.MSGPACK  # whatever Accept says
    return r.content, wire.unpackb(r.content, max_bytes=1 << 30)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_turboquant_matches_its_oracle_and_the_band(api, rng, enc):
    h, hkv, d = 8, 2, 64
    seed = int(rng.integers(2**53))
    sid = new_id(f"tq-{enc}")
    api.create(sid, enc, num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2, kv_format="turboquant", seed=seed)
    m = Model(h, hkv, d, 2)
    for layer in (0, 1):
        k, v = rows(rng, 70, hkv, d), rows(rng, 70, hkv, d)
        r = api.append(sid, layer, k, v, offset=0, enc=enc)
        assert r.status == 200 and r.body == {"length": 70}, r.body
        m.add(layer, k, v)
    fused = []
    for step in range(6):
        layer = step % 2
        q, k, v = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
        r = api.attend(sid, layer, q, k=k, v=v, offset=m.lengths[layer], enc=enc)
        assert r.status == 200 and r.body["length"] == m.lengths[layer] + 1, r.body
        m.add(layer, k, v)
        fused.append((layer, q, r.body["out"]))
    _, snap = _snapshot(api, sid)
    assert snap["config"]["seed"] == seed and [s["length"] for s in snap["layers"]] == m.lengths == [73, 73]
    # The fused decode steps, against the oracle of the final codes: appending a
    # row does not change the codes of the rows before it, and start_pos pins the
    # step's position (row 70 + its index on that layer).
    for i, (layer, q, out) in enumerate(fused):
        want = _tq_oracle(snap, layer, q, start_pos=70 + i // 2)
        assert rel_err(out, want) <= TQ_TOL, (i, rel_err(out, want))
    # Attends over the held codes: against the float64 oracle of those codes.
    outs, exact = [], []
    for layer in (0, 1):
        q = rows(rng, 5, h, d)
        for kw in ({}, {"start_pos": 10}, {"causal": False, "scale": 0.2}):
            r = api.attend(sid, layer, q, enc=enc, **kw)
            assert r.status == 200 and r.body["length"] == m.lengths[layer], r.body
            want = _tq_oracle(snap, layer, q, **kw)
            assert rel_err(r.body["out"], want) <= TQ_TOL, (layer, kw, rel_err(r.body["out"], want))
            outs.append(r.body["out"].ravel())
            exact.append(m.attention(layer, q, **kw).ravel())
    rel, corr = band(np.concatenate(outs), np.concatenate(exact))
    assert rel < TQ_MAX_REL and corr > TQ_MIN_CORR, (rel, corr)
    api.delete(sid)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_turboquant_identical_seeds_give_identical_bits(api, enc):
    h, hkv, d = 8, 2, 32
    results = []
    for seed in (4321, 4321, 99):
        sid = new_id(f"seed{seed}-{enc}")
        api.create(
            sid, enc, num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=1, kv_format="turboquant", seed=seed
        )
        gen = np.random.default_rng(7)  # the same inputs for every session
        outs = []
        q, k, v = rows(gen, 40, h, d), rows(gen, 40, hkv, d), rows(gen, 40, hkv, d)
        r = api.attend(sid, 0, q, k=k, v=v, offset=0, enc=enc)
        assert r.status == 200, r.body
        outs.append(r.body["out"])
        for _ in range(5):
            q, k, v = rows(gen, 1, h, d), rows(gen, 1, hkv, d), rows(gen, 1, hkv, d)
            r = api.attend(sid, 0, q, k=k, v=v, enc=enc)
            assert r.status == 200, r.body
            outs.append(r.body["out"])
        assert api.info(sid)["seed"] == seed
        api.delete(sid)
        results.append(np.concatenate([o.ravel() for o in outs]))
    assert results[0].tobytes() == results[1].tobytes(), "same seed and inputs, different bits"
    assert results[0].tobytes() != results[2].tobytes(), "another seed gave the same bits"


# ── snapshots ───────────────────────────────────────────────────────────────


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_snapshot_round_trip(api, rng, fmt):
    h, hkv, d = 4, 2, 32
    sid, copy = new_id(f"snap-{fmt}"), new_id(f"copy-{fmt}")
    info = api.create(sid, num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2, kv_format=fmt, max_tokens=256)
    for layer, n in ((0, 66), (1, 3)):
        assert api.append(sid, layer, rows(rng, n, hkv, d), rows(rng, n, hkv, d)).status == 200
    info = api.info(sid)
    blob, doc = _snapshot(api, sid)
    assert doc["format"] == "attnserve-snapshot" and doc["version"] == 1 and doc["checksum"].startswith("sha256:")
    assert doc["config"] == {
        k: info[k]
        for k in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "kv_format", "max_tokens", "seed")
    }
    # restore under another id: the same session, and attends agree bit for bit
    r = api.call("PUT", f"/v1/sessions/{copy}/snapshot", content=blob, headers={"Content-Type": wire.MSGPACK})
    assert r.status == 201 and r.body == {**info, "session_id": copy}, r.body
    for layer in (0, 1):
        q, k, v = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
        a, b = api.attend(sid, layer, q, k=k, v=v), api.attend(copy, layer, q, k=k, v=v)
        assert a.status == b.status == 200 and a.body["length"] == b.body["length"]
        assert a.body["out"].tobytes() == b.body["out"].tobytes()
    taken = api.call("PUT", f"/v1/sessions/{copy}/snapshot", content=blob, headers={"Content-Type": wire.MSGPACK})
    assert_problem(taken, 409, "session-exists")
    # a corrupted blob creates nothing; JSON is not a snapshot
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0xFF
    other = new_id("bad")
    r = api.call("PUT", f"/v1/sessions/{other}/snapshot", content=bytes(bad), headers={"Content-Type": wire.MSGPACK})
    assert r.status in (400, 422), r.body
    assert r.problem_type in ("/problems/invalid-snapshot", "/problems/malformed-body"), r.body
    r = api.call("PUT", f"/v1/sessions/{other}/snapshot", {"format": "attnserve-snapshot"}, enc="json")
    assert_problem(r, 415, "unsupported-media-type")
    assert_problem(api.call("GET", f"/v1/sessions/{other}"), 404, "session-not-found")
    assert_problem(api.call("GET", f"/v1/sessions/{other}/snapshot"), 404, "session-not-found")
    api.delete(sid)
    api.delete(copy)


# ── errors: problem documents, in either encoding ───────────────────────────


@pytest.mark.parametrize("enc", ENCODINGS)
def test_errors_are_problems(api, rng, enc):
    h, hkv, d = 4, 2, 16
    sid = new_id(f"err-{enc}")
    api.create(sid, enc, num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2, max_tokens=8)
    base = f"/v1/sessions/{sid}/layers"
    kv = {"k": rows(rng, 2, hkv, d), "v": rows(rng, 2, hkv, d)}
    accept = TYPES[enc]  # errors are problem+json whatever Accept says
    assert_problem(
        api.call("POST", f"/v1/sessions/{new_id('none')}/layers/0/kv", kv, enc=enc, accept=accept),
        404,
        "session-not-found",
    )
    body = assert_problem(api.call("POST", f"{base}/2/kv", kv, enc=enc, accept=accept), 404, "layer-not-found")
    assert body["num_layers"] == 2
    assert_problem(api.call("GET", "/v1/nowhere", accept=accept), 404, "not-found")
    r = api.call("PATCH", f"/v1/sessions/{sid}", accept=accept)
    assert_problem(r, 405, "method-not-allowed")
    assert "GET" in r.headers["allow"] and "DELETE" in r.headers["allow"]
    r = api.call("POST", f"{base}/0/kv", content=b"\x00\x01", headers={"Content-Type": "text/plain"})
    assert_problem(r, 415, "unsupported-media-type")
    r = api.call(
        "POST",
        f"{base}/0/kv",
        content=b'{"k": [' if enc == "json" else b"\xc1\xc1",
        headers={"Content-Type": TYPES[enc]},
    )
    assert_problem(r, 400, "malformed-body")
    wrong = {"k": rows(rng, 2, hkv + 1, d), "v": rows(rng, 2, hkv + 1, d)}
    assert_problem(api.call("POST", f"{base}/0/kv", wrong, enc=enc), 422, "invalid-request")
    body = assert_problem(api.call("POST", f"{base}/0/kv", {**kv, "extra": 1}, enc=enc), 422, "invalid-request")
    assert body.get("fields") == ["extra"], body
    nan = rows(rng, 2, hkv, d)
    nan[0, 0, 0] = np.nan
    if enc == "msgpack":
        r = api.call(
            "POST",
            f"{base}/0/kv",
            content=wire.packb(
                {
                    "k": {"dtype": "<f4", "shape": list(nan.shape), "data": nan.tobytes()},
                    "v": wire.encode_array(kv["v"]),
                }
            ),
            headers={"Content-Type": wire.MSGPACK},
        )
    else:
        r = api.call(
            "POST",
            f"{base}/0/kv",
            content=f'{{"k": {nan.tolist()}, "v": {kv["v"].tolist()}}}'.replace("nan", "NaN").encode(),
            headers={"Content-Type": wire.JSON},
        )
    assert_problem(r, 422, "invalid-request")
    # capacity: max_tokens 8
    assert api.append(sid, 0, rows(rng, 6, hkv, d), rows(rng, 6, hkv, d), enc=enc).status == 200
    body = assert_problem(
        api.append(sid, 0, rows(rng, 3, hkv, d), rows(rng, 3, hkv, d), enc=enc), 409, "capacity-exceeded"
    )
    assert body["length"] == 6 and body["max_tokens"] == 8
    # start_pos out of range, and a fused attend that fails appends nothing
    body = assert_problem(api.attend(sid, 0, rows(rng, 2, h, d), start_pos=5, enc=enc), 422, "invalid-request")
    r = api.attend(sid, 0, rows(rng, 1, h, d), k=rows(rng, 1, hkv, d), v=rows(rng, 1, hkv, d), offset=3, enc=enc)
    assert_problem(r, 409, "offset-mismatch")
    assert api.info(sid)["lengths"] == [6, 0]
    # an empty body with a declared type
    r = api.call("POST", f"{base}/0/attend", content=b"", headers={"Content-Type": TYPES[enc]})
    assert_problem(r, 400, "malformed-body")
    # a session config the server refuses
    r = api.call(
        "PUT", f"/v1/sessions/{new_id('cfg')}", {"num_qo_heads": 3, "num_kv_heads": 2, "head_dim": 16}, enc=enc
    )
    assert_problem(r, 422, "invalid-request")
    r = api.call(
        "PUT",
        f"/v1/sessions/{new_id('cfg')}",
        {"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 48, "kv_format": "turboquant"},
        enc=enc,
    )
    assert_problem(r, 422, "invalid-request")
    r = api.call("PUT", "/v1/sessions/bad%20id", {"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 8}, enc=enc)
    assert_problem(r, 422, "invalid-request")
    api.delete(sid)


# ── the client package against the container ────────────────────────────────


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_client_package(target, rng, fmt):
    h, hkv, d = 4, 1, 32
    http = httpx.Client(trust_env=False, timeout=60.0)
    with Client(target.url, http_client=http, max_retries=2) as client:
        assert client.health() and client.ready()
        assert fmt in client.info()["kv_formats"]
        sid = new_id(f"client-{fmt}")
        session = client.create_session(
            num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2, kv_format=fmt, seed=2024, session_id=sid
        )
        with pytest.raises(SessionExists):
            client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, session_id=sid)
        m = Model(h, hkv, d, 2)
        # the oracle holds the rows as the format stores them (f16: rounded to float16,
        # bf16: to bfloat16, as wire.to_bfloat16 rounds)
        kept = {
            "f16": lambda x: x.astype(np.float16).astype(np.float32),
            "bf16": lambda x: wire.to_float32(wire.to_bfloat16(x)),
        }.get(fmt, lambda x: x)
        for layer in (0, 1):
            k, v = rows(rng, 20, hkv, d), rows(rng, 20, hkv, d)
            assert session.append(layer, k, v) == 20
            m.add(layer, kept(k), kept(v))
        outs, exact = [], []
        for _ in range(3):
            for layer in (0, 1):
                q, k, v = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
                out = session.attend(layer, q, k=k, v=v)
                m.add(layer, kept(k), kept(v))
                outs.append(out.ravel())
                exact.append(m.attention(layer, q).ravel())
        if fmt != "turboquant":
            assert rel_err(np.concatenate(outs), np.concatenate(exact)) <= F32_TOL
        else:
            rel, corr = band(np.concatenate(outs), np.concatenate(exact))
            assert rel < TQ_MAX_REL and corr > TQ_MIN_CORR, (rel, corr)
        assert list(client.get_session(sid).lengths) == m.lengths == [23, 23]
        session.delete()
        with pytest.raises(SessionNotFound):
            client.get_session(sid)
    http.close()


# ── metrics (last: the counters of everything above) ────────────────────────


def _metrics(url: str) -> str:
    r = httpx.get(f"{url}/metrics", trust_env=False, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.headers
    assert "version=0.0.4" in r.headers["content-type"]
    return r.text


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics(api, target):
    assert "attnserve_requests_total" in api.call("GET", "/metrics").body
    # Through a router /metrics is one replica's: read each replica directly.
    urls = list(target.replicas.values()) if target.routed else [target.url]
    texts = [_metrics(url) for url in urls]
    for text in texts:
        for name in (
            "attnserve_sessions",
            "attnserve_kv_bytes",
            "attnserve_memory_used_bytes",
            "attnserve_request_duration_seconds_bucket",
            "attnserve_gpu_batches_total",
            "attnserve_rows_total",
            "attnserve_build_info",
            "attnserve_errors_total",
        ):
            assert re.search(rf"^{name}[{{ ]", text, re.MULTILINE), name
        assert _sample(text, "attnserve_ready") == 1
        if target.adapter:
            assert re.search(
                rf'attnserve_build_info{{[^}}]*adapter="[^"]*{re.escape(target.adapter)}', text, re.IGNORECASE
            )
    attend = "/v1/sessions/{session_id}/layers/{layer}/attend"
    served = sum(_sample(t, "attnserve_requests_total", route=attend, method="POST", status="200") for t in texts)
    assert served >= 10, served
    errors = sum(_sample(t, "attnserve_errors_total", type="session-not-found") for t in texts)
    assert errors >= 1
    for fmt in KV_FORMATS:
        assert sum(_sample(t, "attnserve_rows_total", kind="append", kv_format=fmt) for t in texts) > 0, fmt
    # every answer above named its replica (checked per call by Api)
    assert api.seen and all(inst for *_, inst in api.seen)
