"""Tenants: API keys (ATTNSERVE_API_KEYS / ATTNSERVE_API_KEYS_FILE) guard every /v1
request with a bearer token; each key sees only its own sessions (others are 404
and absent from its list), ids are per key, keys never reach logs or the store."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from attnserve.auth import KeyRing, key_id
from attnserve.config import Settings
from attnserve_client import wire
from attnserve.metrics import counted as count
from svc_helpers import F32_TOL, Api, LiveServer, Model, Scrape, rel_err, rows

KEY_A = "tenant-a-0123456789abcdef"
KEY_B = "tenant-b-fedcba9876543210"
SHAPE = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16)


def _api(server: LiveServer, key: str | None) -> Api:
    api = Api(server.url)
    if key is not None:
        api.client.headers["Authorization"] = f"Bearer {key}"
    return api


@pytest.fixture(scope="module")
def keyed(engine):
    srv = LiveServer(Settings(api_keys=f"{KEY_A}, {KEY_B}"), engine=engine).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def apis(keyed):
    a, b, anon = _api(keyed, KEY_A), _api(keyed, KEY_B), _api(keyed, None)
    yield a, b, anon
    for x in (a, b, anon):
        x.close()


def test_every_v1_request_needs_a_valid_key(keyed, apis):
    a, _, anon = apis
    m0 = keyed.runtime.metrics.auth_failures
    missing0, invalid0 = count(m0, "missing"), count(m0, "invalid")
    for method, path in (
        ("GET", "/v1/sessions"),
        ("POST", "/v1/sessions"),
        ("GET", "/v1/info"),
        ("GET", "/v1/sessions/x/snapshot"),
        ("GET", "/v1/no-such-route"),
    ):
        r = anon.call(method, path)
        assert r.status == 401 and r.problem_type == "/problems/unauthorized", (path, r.body)
        assert r.headers["www-authenticate"] == 'Bearer realm="attnserve"'
        assert r.content_type == wire.PROBLEM_JSON
    for header in (f"Bearer {KEY_A}x", f"Bearer {KEY_A[:-1]}", "Bearer"):
        r = anon.call("GET", "/v1/sessions", headers={"Authorization": header})
        assert r.status == 401
        if header != "Bearer":
            assert 'error="invalid_token"' in r.headers["www-authenticate"]
    r = anon.call("GET", "/v1/sessions", headers={"Authorization": f"Basic {KEY_A}"})
    assert r.status == 401  # only the Bearer scheme
    r = anon.call("GET", "/v1/sessions", headers={"Authorization": f"bearer {KEY_A}"})
    assert r.status == 200  # the scheme is case-insensitive
    assert count(m0, "missing") >= missing0 + 6 and count(m0, "invalid") >= invalid0 + 2
    # probes and metrics stay open (metrics_auth is off)
    for path in ("/livez", "/readyz", "/health", "/metrics"):
        assert anon.client.get(path).status_code == 200, path
    info = a.call("GET", "/v1/info").body
    assert info["auth"] is True and info["ready"] is True


def test_sessions_are_invisible_to_other_keys(keyed, apis, rng):
    a, b, _ = apis
    sid = a.create(**SHAPE)["session_id"]
    k, v = rows(rng, 5, 2, 16), rows(rng, 5, 2, 16)
    assert a.append(sid, 0, k, v).status == 200
    q = rows(rng, 2, 4, 16)
    for r in (
        b.call("GET", f"/v1/sessions/{sid}"),
        b.call("DELETE", f"/v1/sessions/{sid}"),
        b.append(sid, 0, k, v),
        b.attend(sid, 0, q),
        b.call("GET", f"/v1/sessions/{sid}/snapshot"),
        b.call("PUT", f"/v1/sessions/{sid}/snapshot", content=b"\x80", headers={"Content-Type": wire.MSGPACK}),
    ):
        if r.status != 422:  # the PUT of an invalid blob under a fresh id: 422, nothing about A
            assert r.status == 404 and r.problem_type == "/problems/session-not-found", r.body
    assert sid not in [s["session_id"] for s in b.call("GET", "/v1/sessions").body["sessions"]]
    assert sid in [s["session_id"] for s in a.call("GET", "/v1/sessions").body["sessions"]]
    assert a.info(sid)["lengths"] == [5]  # B's attempts changed nothing
    # the store holds the key's id, never the key
    owners = {s.owner for s in keyed.runtime.store.sessions.values()}
    assert key_id(KEY_A) in owners and KEY_A not in owners and KEY_B not in owners
    assert b.call("GET", "/v1/info").body["sessions"] == len(b.call("GET", "/v1/sessions").body["sessions"])
    a.delete(sid)


def test_ids_are_per_key(keyed, apis, rng):
    """PUT of an id another key holds creates the caller's own session: 201, not 409,
    so a tenant can neither probe for nor squat on another tenant's ids."""
    a, b, _ = apis
    sid = f"shared-{rng.integers(1 << 30)}"
    models = {}
    for api in (a, b):
        assert api.create(session_id=sid, **SHAPE)["session_id"] == sid
        models[id(api)] = Model(4, 2, 16)
    assert a.call("PUT", f"/v1/sessions/{sid}", SHAPE).status == 409  # the same key: taken
    for api in (a, b, a, b):
        k, v = rows(rng, 3, 2, 16), rows(rng, 3, 2, 16)
        r = api.append(sid, 0, k, v, offset=models[id(api)].lengths[0])
        assert r.status == 200, r.body
        models[id(api)].add(0, k, v)
    for api in (a, b):
        q = rows(rng, 2, 4, 16)
        r = api.attend(sid, 0, q)
        assert r.status == 200 and rel_err(r.body["out"], models[id(api)].attention(0, q)) <= F32_TOL
    assert a.delete(sid).status == 204
    assert b.info(sid)["lengths"] == [6]  # B's session is untouched by A's delete
    assert a.call("GET", f"/v1/sessions/{sid}").status == 404
    b.delete(sid)


def test_a_restored_snapshot_belongs_to_whoever_put_it(keyed, apis, rng):
    a, b, _ = apis
    sid = a.create(kv_format="turboquant", num_layers=2, **{**SHAPE, "head_dim": 32})["session_id"]
    assert a.append(sid, 1, rows(rng, 7, 2, 32), rows(rng, 7, 2, 32)).status == 200
    blob = a.client.get(f"/v1/sessions/{sid}/snapshot").content
    copy = f"copy-{rng.integers(1 << 30)}"
    r = b.call("PUT", f"/v1/sessions/{copy}/snapshot", content=blob, headers={"Content-Type": wire.MSGPACK})
    assert r.status == 201, r.body
    assert a.call("GET", f"/v1/sessions/{copy}").status == 404
    q = rows(rng, 1, 4, 32)
    ra, rb = a.attend(sid, 1, q), b.attend(copy, 1, q)
    assert ra.status == rb.status == 200 and ra.body["out"].tobytes() == rb.body["out"].tobytes()
    a.delete(sid)
    b.delete(copy)


def test_keys_file_metrics_auth_and_no_key_in_logs(engine, tmp_path, caplog, rng):
    path = tmp_path / "keys"
    path.write_text(f"# tenants\n{KEY_A}\n\n  {KEY_B}  \n")
    settings = Settings(api_keys_file=str(path), metrics_auth=True)
    assert settings.api_key_list() == [KEY_A, KEY_B]
    assert KEY_A not in repr(settings)
    caplog.set_level(logging.DEBUG)
    srv = LiveServer(settings, engine=engine).start()
    try:
        anon, a = _api(srv, None), _api(srv, KEY_B)
        r = anon.client.get("/metrics")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert a.client.get("/metrics").status_code == 200
        for path in ("/livez", "/readyz", "/health"):  # probes stay open, whatever metrics_auth says
            assert anon.client.get(path).status_code == 200, path
        sid = a.create(**SHAPE)["session_id"]
        assert a.append(sid, 0, rows(rng, 2, 2, 16), rows(rng, 2, 2, 16)).status == 200
        assert anon.call("GET", "/v1/sessions", headers={"Authorization": f"Bearer {KEY_A}-wrong"}).status == 401
        m = Scrape(a.client.get("/metrics").text)
        assert m("attnserve_tenant_sessions", tenant=key_id(KEY_B)) == 1
        assert m("attnserve_auth_failures_total", reason="invalid") == 1
        spec = anon.client.get("/openapi.json").json()
        assert spec["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
        assert spec["paths"]["/v1/sessions"]["get"]["security"] == [{"apiKey": []}]
        a.delete(sid)
        anon.close()
        a.close()
    finally:
        srv.stop()
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "attnserve.access" in {r.name for r in caplog.records}
    assert KEY_A not in logged and KEY_B not in logged


def test_key_settings_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNSERVE_API_KEYS", "k1,k2")
    monkeypatch.setenv("ATTNSERVE_METRICS_AUTH", "true")
    s = Settings()
    assert s.api_key_list() == ["k1", "k2"] and s.metrics_auth is True
    monkeypatch.setenv("ATTNSERVE_API_KEYS", "ok,has space")
    with pytest.raises(ValueError) as e:
        Settings()
    assert "key #2" in str(e.value) and "has space" not in str(e.value)
    monkeypatch.delenv("ATTNSERVE_API_KEYS")
    monkeypatch.setenv("ATTNSERVE_API_KEYS_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="api_keys_file"):
        Settings()


def test_keyring_compares_every_key():
    ring = KeyRing(["alpha", "beta"])
    assert ring.authenticate(b"Bearer beta") == key_id("beta") != key_id("alpha")
    assert len(key_id("x")) == 24 and key_id("x") == key_id("x")
    for bad in (None, b"", b"Bearer", b"Token beta", b"Bearer gamma"):
        with pytest.raises(Exception) as e:
            ring.authenticate(bad)
        assert e.value.status == 401
    assert not KeyRing([]).enabled


def test_without_keys_everything_is_open(api):
    r = api.call("GET", "/v1/info")
    assert r.status == 200 and r.body["auth"] is False
    assert np.isfinite(r.body["limits"]["request_timeout_s"])
