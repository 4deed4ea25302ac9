"""/livez, /readyz, /health, /metrics, /v1/info and /openapi.json."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from attnserve import __version__
from attnserve_client import wire
from svc_helpers import TYPES, Scrape, rows


def test_livez_readyz(api, enc):
    for path, status in (("/livez", "ok"), ("/readyz", "ready"), ("/health", "ready")):
        r = api.call("GET", path, accept=TYPES[enc])
        assert r.status == 200 and r.body == {"status": status} and r.content_type == TYPES[enc]


def test_info(api, server, enc):
    r = api.call("GET", "/v1/info", accept=TYPES[enc])
    assert r.status == 200 and r.content_type == TYPES[enc]
    info = r.body
    ctx = server.runtime.engine.ctx
    assert info["version"] == __version__ and info["api_version"] == 1
    assert info["adapter"]["name"] == ctx.name and info["adapter"]["backend"] == ctx.backend
    assert info["backend"] == ctx.backend
    assert info["kv_formats"] == [
        "f32",
        "f16",
        "bf16",
        "turboquant",
        "tq4",
        "tq3",
        "tq4v2",
        "tq4v3",
        "tq3q",
        "tq4q",
        "tq4o",
        "tq3o",
        "tq2o",
    ]
    assert info["head_dims"]["turboquant"] == [32, 64, 128] and info["head_dims"]["f32"] == list(range(1, 129))
    assert info["head_dims"]["f16"] == info["head_dims"]["bf16"] == list(range(2, 129, 2))
    assert (
        info["kv_format_sizes"]["f16"]
        == info["kv_format_sizes"]["bf16"]
        == [{"head_dim": d, "bits_per_element": 16.0, "bytes_per_token_per_kv_head": 4 * d} for d in (32, 64, 128)]
    )
    assert info["kv_format_sizes"]["turboquant"][2] == {
        "head_dim": 128,
        "bits_per_element": 2.75,
        "bytes_per_token_per_kv_head": 88,
    }
    tq4 = info["kv_format_sizes"]["tq4"][2]
    assert tq4 == {"head_dim": 128, "bits_per_element": 4.25, "bytes_per_token_per_kv_head": 136}
    assert info["head_dims"]["tq3q"] == [32, 64, 128]
    s = server.runtime.settings
    limits = info["limits"]
    assert limits["max_body_bytes"] == s.max_body_bytes
    assert limits["memory_budget_bytes"] == s.memory_budget_bytes
    assert limits["max_sessions"] == s.max_sessions
    assert limits["default_max_tokens"] == s.default_max_tokens
    assert limits["max_binding_bytes"] == ctx.max_binding
    assert (limits["max_layers"], limits["max_qo_heads"]) == (256, 256)
    assert info["ready"] is True
    assert info["auth"] is False  # no API keys: anyone who reaches the server may use it
    sid = api.create(num_qo_heads=2, num_kv_heads=1, head_dim=8)["session_id"]
    assert api.attend(sid, 0, np.ones((1, 2, 8), np.float32), k=np.ones((1, 1, 8), np.float32),
                      v=np.ones((1, 1, 8), np.float32)).status == 200  # fmt: skip
    arenas = server.runtime.engine.worker.arenas
    bufs = [*arenas.buffers.values(), *[b for b in arenas.staging if b is not None]]
    assert api.call("GET", "/v1/info").body["arenas"]["bytes"] == sum(b.size for b in bufs) > 0
    pipelines = server.runtime.engine.worker.ctx.pipelines
    assert api.call("GET", "/v1/info").body["pipelines"] == {"compiled": len(pipelines._pipelines)}
    assert len(pipelines) > 0
    api.delete(sid)


def test_info_matches_its_schema(api):
    """/v1/info is what its published schema (the ServerInfo model's) says."""
    from jsonschema import Draft202012Validator

    spec = api.client.get("/openapi.json").json()
    schema = spec["components"]["schemas"]["ServerInfo"]
    info = api.call("GET", "/v1/info").body
    assert schema["properties"]["auth"]["type"] == "boolean" and "auth" in schema["required"]
    errors = [e.message[:200] for e in Draft202012Validator(schema).iter_errors(info)]
    assert not errors, errors[:3]
    wrong = {**info, "auth": "yes", "version": 1}
    assert len(list(Draft202012Validator(schema).iter_errors(wrong))) == 2  # the check can fail


def test_operation_ids_are_readable(api):
    spec = api.client.get("/openapi.json").json()
    ids = {(path, method): op["operationId"] for path, ops in spec["paths"].items() for method, op in ops.items()}
    assert ids == {
        ("/v1/sessions", "get"): "list_sessions",
        ("/v1/sessions", "post"): "create_session",
        ("/v1/sessions/{session_id}", "put"): "put_session",
        ("/v1/sessions/{session_id}", "get"): "get_session_info",
        ("/v1/sessions/{session_id}", "delete"): "delete_session",
        ("/v1/sessions/{session_id}/fork", "post"): "fork_session",
        ("/v1/steps", "post"): "open_step",
        ("/v1/steps/{step}", "get"): "get_step",
        ("/v1/steps/{step}", "delete"): "close_step",
        ("/v1/steps/{step}/layers/{layer}", "post"): "call_step",
        ("/v1/sessions/{session_id}/layers/{layer}/kv", "post"): "append_kv",
        ("/v1/sessions/{session_id}/layers/{layer}/attend", "post"): "attend",
        ("/v1/batch/attend", "post"): "batch_attend",
        ("/v1/sessions/{session_id}/snapshot", "get"): "get_snapshot",
        ("/v1/sessions/{session_id}/snapshot", "put"): "put_snapshot",
        ("/livez", "get"): "livez",
        ("/readyz", "get"): "readyz",
        ("/health", "get"): "health",
        ("/metrics", "get"): "metrics",
        ("/v1/info", "get"): "info",
    }


def test_metrics(api, server, rng):
    sid = api.create(num_qo_heads=4, num_kv_heads=2, head_dim=32, kv_format="turboquant")["session_id"]
    api.append(sid, 0, rows(rng, 3, 2, 32), rows(rng, 3, 2, 32))
    api.attend(sid, 0, rows(rng, 1, 4, 32), k=rows(rng, 1, 2, 32), v=rows(rng, 1, 2, 32))
    api.call("GET", "/v1/sessions/not-there")
    r = api.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = Scrape(r.text)
    tq_bytes = api.info(sid)["bytes"]
    assert m("attnserve_sessions", kv_format="turboquant") >= 1
    assert m("attnserve_kv_bytes", kv_format="turboquant") >= tq_bytes > 0
    assert m.has("attnserve_sessions", kv_format="f32")
    route = "/v1/sessions/{session_id}/layers/{layer}/attend"
    assert m("attnserve_requests_total", route=route, method="POST", status="200") >= 1
    assert m("attnserve_request_duration_seconds_count", route=route, method="POST") >= 1
    assert m("attnserve_request_duration_seconds_bucket", route=route, method="POST", le="+Inf") >= 1
    assert m("attnserve_errors_total", type="session-not-found") >= 1
    assert m("attnserve_requests_total", route="/v1/sessions/{session_id}", method="GET", status="404") >= 1
    for name in (
        "attnserve_gpu_queue_depth",
        "attnserve_gpu_batches_total",
        "attnserve_memory_used_bytes",
        "attnserve_memory_budget_bytes",
        "attnserve_requests_in_flight",
        "attnserve_ready",
    ):
        assert m.has(name), name
    assert m("attnserve_gpu_batches_total") >= 2
    assert m("attnserve_gpu_dispatches_per_submission_count") == m("attnserve_gpu_batches_total")
    assert m("attnserve_gpu_jobs_per_submission_sum") >= m("attnserve_gpu_batches_total")
    assert m("attnserve_rows_total", kind="append", kv_format="turboquant") >= 4
    assert m("attnserve_rows_total", kind="query", kv_format="turboquant") >= 1
    # the process collector's metrics, from prometheus_client
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ):
        assert m(name) > 0, name
    assert m.families["attnserve_requests"].type == "counter"
    assert m.families["attnserve_request_duration_seconds"].type == "histogram"
    api.delete(sid)


def test_queue_wait_histogram_counts_every_job(api, server, rng):
    def scrape() -> Scrape:
        return Scrape(api.client.get("/metrics").text)

    before = scrape()
    assert before.families["attnserve_queue_wait_seconds"].type == "histogram"
    jobs0 = before("attnserve_gpu_jobs_total")
    batched0 = before.get("attnserve_queue_wait_seconds_count", kind="batch")
    calls0 = before.get("attnserve_queue_wait_seconds_count", kind="call")
    sid = api.create(num_qo_heads=2, num_kv_heads=1, head_dim=16)["session_id"]
    for _ in range(3):
        assert api.append(sid, 0, rows(rng, 2, 1, 16), rows(rng, 2, 1, 16)).status == 200
        assert api.attend(sid, 0, rows(rng, 1, 2, 16)).status == 200
    assert api.call("GET", f"/v1/sessions/{sid}/snapshot").status == 200  # a whole-cache read: a call
    after = scrape()
    batched = after("attnserve_queue_wait_seconds_count", kind="batch") - batched0
    # every append and attend is one job of a submission, and one queue wait
    assert batched == after("attnserve_gpu_jobs_total") - jobs0 >= 6
    assert after("attnserve_queue_wait_seconds_count", kind="call") > calls0
    assert after("attnserve_queue_wait_seconds_bucket", kind="batch", le="+Inf") == after(
        "attnserve_queue_wait_seconds_count", kind="batch"
    )
    assert 0 <= after("attnserve_queue_wait_seconds_sum", kind="batch") < 60
    api.delete(sid)


def test_limit_metrics_have_one_unit_each(api, server):
    m = Scrape(api.client.get("/metrics").text)
    s = server.runtime.settings
    assert "attnserve_limit" not in m.families  # the old metric of mixed units
    limits = {
        name: {dict(labels)["name"]: v for labels, v in m.samples[name].items()}
        for name in m.samples
        if name.startswith("attnserve_limit")
    }
    assert limits == {
        "attnserve_limit_sessions": {
            "max_sessions": s.max_sessions,
            "quota_sessions_per_key": s.quota_sessions_per_key,
        },
        "attnserve_limit_bytes": {"quota_bytes_per_key": s.quota_bytes_per_key},
        "attnserve_limit_seconds": {
            "request_timeout": s.request_timeout_s,
            "session_ttl": s.session_ttl_seconds,
            "step_idle_timeout": s.step_idle_timeout_s,
        },
    }
    for name in limits:  # Prometheus naming: the unit is the name's suffix
        assert m.families[name].type == "gauge" and name.rsplit("_", 1)[1] in ("sessions", "bytes", "seconds")


def test_openapi_documents_both_encodings(api):
    r = api.client.get("/openapi.json")
    assert r.status_code == 200
    spec = r.json()
    assert spec["openapi"].startswith("3.1")
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(spec)
    paths = spec["paths"]
    expected = {
        "/v1/sessions": {"get", "post"},
        "/v1/sessions/{session_id}": {"get", "put", "delete"},
        "/v1/sessions/{session_id}/layers/{layer}/kv": {"post"},
        "/v1/sessions/{session_id}/layers/{layer}/attend": {"post"},
        "/v1/sessions/{session_id}/snapshot": {"get", "put"},
        "/livez": {"get"},
        "/readyz": {"get"},
        "/health": {"get"},
        "/metrics": {"get"},
        "/v1/info": {"get"},
    }
    for path, methods in expected.items():
        assert methods <= set(paths[path]), path
    assert paths["/health"]["get"]["responses"] == paths["/readyz"]["get"]["responses"]  # one answer, two names
    for path, method in [
        ("/v1/sessions", "post"),
        ("/v1/sessions/{session_id}/layers/{layer}/kv", "post"),
        ("/v1/sessions/{session_id}/layers/{layer}/attend", "post"),
    ]:
        op = paths[path][method]
        assert set(op["requestBody"]["content"]) == {wire.JSON, wire.MSGPACK}
        ok = op["responses"]["201" if path == "/v1/sessions" else "200"]["content"]
        assert set(ok) == {wire.JSON, wire.MSGPACK}
        assert wire.PROBLEM_JSON in op["responses"]["422"]["content"]
    schemas = spec["components"]["schemas"]
    assert schemas["ArrayMsgpack"]["properties"]["data"]["format"] == "binary"
    assert schemas["AttendMsgpack"]["properties"]["q"]["$ref"].endswith("/ArrayMsgpack")
    assert schemas["AttendJson"]["properties"]["q"]["$ref"].endswith("/ArrayJson")


def test_a_stacked_step_planned_item_by_item_is_counted(server, rng, monkeypatch):
    """A batched step whose columns fail still answers (item by item) and shows in
    /metrics as attnserve_step_fallbacks_total{reason="error"}."""
    from attnserve.kv.layer import LayerCache
    from attnserve_client import Client

    def broken(*args, **kw):
        raise RuntimeError("a bug in the columns")

    with Client(server.url) as client:
        sessions = [client.create_session(num_qo_heads=4, num_kv_heads=2, head_dim=32) for _ in range(3)]
        before = Scrape(httpx.get(server.url + "/metrics").text).get("attnserve_step_fallbacks_total", reason="error")
        monkeypatch.setattr(LayerCache, "plan_stacked", staticmethod(broken))
        q, k, v = rows(rng, 3, 4, 32)[:, None], rows(rng, 3, 2, 32)[:, None], rows(rng, 3, 2, 32)[:, None]
        out = client.attend_stacked(sessions, 0, q, k, v)
        assert out.shape == (3, 1, 4, 32) and [s.lengths[0] for s in sessions] == [1, 1, 1]
        after = Scrape(httpx.get(server.url + "/metrics").text)("attnserve_step_fallbacks_total", reason="error")
        assert after == before + 1
