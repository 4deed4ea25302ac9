"""Quotas and overload: per-key session and byte quotas (507 with a ``quota``
member), the bounded GPU queue (503 overloaded with Retry-After), request
timeouts (a job still queued past ATTNSERVE_REQUEST_TIMEOUT_S is dropped
unapplied: 503 timeout; a started one completes), idle-session expiry
(ATTNSERVE_SESSION_TTL_SECONDS), all counted in /metrics.

The overload and timeout tests hold the GPU thread with a blocking job, so the
queue's state is exact, not a race."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from attnserve.config import Settings
from attnserve_client import wire
from svc_helpers import F32_TOL, PAGE, Api, LiveServer, Model, rel_err, rows

KEY_A = "quota-a-0123456789abcdef"
KEY_B = "quota-b-fedcba9876543210"
SHAPE = dict(num_qo_heads=2, num_kv_heads=1, head_dim=32)  # f32: 256 bytes per timestep (K and V)
PAGE_BYTES = PAGE * 256  # what a layer's first append takes: one page


def _api(server: LiveServer, key: str | None = None) -> Api:
    api = Api(server.url)
    if key:
        api.client.headers["Authorization"] = f"Bearer {key}"
    return api


@contextlib.contextmanager
def serving(engine, **settings):
    srv = LiveServer(Settings(**settings), engine=engine).start()
    try:
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def gpu_held(engine):
    """Keep the GPU thread busy until the block exits."""
    release = threading.Event()
    started = threading.Event()

    def hold(ctx):
        started.set()
        release.wait(30)

    fut = engine.call(hold)
    assert started.wait(10)
    try:
        yield
    finally:
        release.set()
        fut.result(30)


def _wait_depth(engine, depth: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while engine.worker.queue_depth < depth:
        assert time.monotonic() < deadline, f"queue depth {engine.worker.queue_depth} < {depth}"
        time.sleep(0.005)


def _metric(server, name: str) -> float:
    for line in _api(server).client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}")


def test_session_quota_per_key(engine, rng):
    with serving(engine, api_keys=f"{KEY_A},{KEY_B}", quota_sessions_per_key=2) as srv:
        a, b = _api(srv, KEY_A), _api(srv, KEY_B)
        s1 = a.create(**SHAPE)["session_id"]
        a.create(session_id="two", **SHAPE)
        for r in (a.call("POST", "/v1/sessions", SHAPE), a.call("PUT", "/v1/sessions/three", SHAPE)):
            assert r.status == 507 and r.problem_type == "/problems/out-of-memory", r.body
            assert r.body["quota"] == "sessions" and r.body["quota_limit"] == 2 and "quota" in r.body["detail"]
        blob = a.client.get(f"/v1/sessions/{s1}/snapshot").content
        r = a.call("PUT", "/v1/sessions/four/snapshot", content=blob, headers={"Content-Type": wire.MSGPACK})
        assert r.status == 507 and r.body["quota"] == "sessions"
        for sid in ("b1", "b2"):  # another key has its own quota
            b.create(session_id=sid, **SHAPE)
        assert a.delete(s1).status == 204
        assert a.call("PUT", "/v1/sessions/three", SHAPE).status == 201
        assert _metric(srv, 'attnserve_quota_rejections_total{quota="sessions"}') == 3
        assert _metric(srv, 'attnserve_limit_sessions{name="quota_sessions_per_key"}') == 2


def test_byte_quota_per_key(engine, rng):
    # a first append takes one page: PAGE_BYTES; the quota holds two and a half
    quota = 2 * PAGE_BYTES + PAGE_BYTES // 2
    with serving(engine, api_keys=f"{KEY_A},{KEY_B}", quota_bytes_per_key=quota) as srv:
        a, b = _api(srv, KEY_A), _api(srv, KEY_B)
        sids = [a.create(**SHAPE)["session_id"] for _ in range(3)]
        k, v = rows(rng, 1, 1, 32), rows(rng, 1, 1, 32)
        assert a.append(sids[0], 0, k, v).status == 200
        assert a.append(sids[1], 0, k, v).status == 200
        r = a.append(sids[2], 0, k, v)
        assert r.status == 507 and r.body["quota"] == "bytes", r.body
        assert r.body["quota_limit"] == quota
        assert r.body["used_bytes"] == 2 * PAGE_BYTES and r.body["requested_bytes"] == PAGE_BYTES
        r = a.attend(sids[2], 0, rows(rng, 1, 2, 32), k=k, v=v)  # a fused append counts the same
        assert r.status == 507 and r.body["quota"] == "bytes"
        assert a.info(sids[2])["lengths"] == [0]  # nothing appended
        # growing inside the page already held needs no more bytes
        fill = PAGE - 1
        assert a.append(sids[0], 0, rows(rng, fill, 1, 32), rows(rng, fill, 1, 32)).status == 200
        assert a.append(sids[0], 0, k, v).status == 507  # PAGE + 1 timesteps: a second page
        blob = a.client.get(f"/v1/sessions/{sids[1]}/snapshot").content
        r = a.call("PUT", "/v1/sessions/copy/snapshot", content=blob, headers={"Content-Type": wire.MSGPACK})
        assert r.status == 507 and r.body["quota"] == "bytes"
        r = b.call("PUT", "/v1/sessions/copy/snapshot", content=blob, headers={"Content-Type": wire.MSGPACK})
        assert r.status == 201  # B's quota is its own
        assert b.call("GET", "/v1/info").body["tenant_bytes"] == PAGE_BYTES
        a.delete(sids[1])
        assert a.append(sids[2], 0, k, v).status == 200  # room again once A frees a session
        assert _metric(srv, 'attnserve_quota_rejections_total{quota="bytes"}') == 4


def test_a_full_gpu_queue_is_503_with_retry_after(engine, rng):
    with serving(engine, request_timeout_s=0) as srv:
        api = _api(srv)
        sid = api.create(**SHAPE)["session_id"]
        saved = engine.worker.max_queue
        engine.worker.max_queue = 2
        try:
            with ThreadPoolExecutor(2) as pool, gpu_held(engine):
                futs = [
                    pool.submit(_api(srv).append, sid, 0, rows(rng, 1, 1, 32), rows(rng, 1, 1, 32)) for _ in range(2)
                ]
                _wait_depth(engine, 3)  # the held job, and two appends queued
                t0 = time.perf_counter()
                r = api.append(sid, 0, rows(rng, 1, 1, 32), rows(rng, 1, 1, 32))
                print(f"\nqueue full: answered 503 in {1000 * (time.perf_counter() - t0):.1f} ms")
                assert r.status == 503 and r.problem_type == "/problems/overloaded", r.body
                assert r.headers["retry-after"] == "1"
                assert r.body["detail"] == "the GPU queue is full (2 jobs waiting)"
                assert api.info(sid)["lengths"] == [2]  # the two queued, not the refused one
            assert sorted(f.result().body["length"] for f in futs) == [1, 2]
        finally:
            engine.worker.max_queue = saved
        assert api.info(sid)["lengths"] == [2]
        assert _metric(srv, 'attnserve_errors_total{type="overloaded"}') == 1
        assert _metric(srv, "attnserve_gpu_queue_limit") == saved


def test_a_job_queued_past_the_timeout_is_dropped_unapplied(engine, rng, caplog):
    caplog.set_level(logging.WARNING)
    with serving(engine, request_timeout_s=0.4) as srv:
        api = _api(srv)
        sid = api.create(**SHAPE)["session_id"]
        model = Model(2, 1, 32)
        k, v = rows(rng, 3, 1, 32), rows(rng, 3, 1, 32)
        assert api.append(sid, 0, k, v).status == 200
        model.add(0, k, v)
        with ThreadPoolExecutor(3) as pool, gpu_held(engine):
            t0 = time.monotonic()
            read = pool.submit(_api(srv).attend, sid, 0, rows(rng, 1, 2, 32))
            # two appends, the second checked against the first: they time out from the tail
            first = pool.submit(_api(srv).append, sid, 0, rows(rng, 2, 1, 32), rows(rng, 2, 1, 32), offset=3)
            _wait_depth(engine, 3)
            second = pool.submit(
                _api(srv).attend, sid, 0, rows(rng, 1, 2, 32), k=rows(rng, 1, 1, 32), v=rows(rng, 1, 1, 32), offset=5
            )
            _wait_depth(engine, 4)
            answers = [f.result() for f in (read, first, second)]
            waited = time.monotonic() - t0
            print(f"\ntimeout 0.4 s: the three queued requests answered 503 after {waited:.2f} s")
            for r in answers:
                assert r.status == 503 and r.problem_type == "/problems/timeout", r.body
                assert r.headers["retry-after"] == "1" and "nothing was applied" in r.body["detail"]
            assert 0.4 <= waited < 5
            assert api.info(sid)["lengths"] == [3]  # while the GPU is still held: given back
        assert api.info(sid)["lengths"] == [3]
        k, v = rows(rng, 1, 1, 32), rows(rng, 1, 1, 32)
        r = api.append(sid, 0, k, v, offset=3)
        assert r.status == 200 and r.body["length"] == 4
        model.add(0, k, v)
        q = rows(rng, 2, 2, 32)
        out = api.attend(sid, 0, q, start_pos=0, causal=False)
        assert out.status == 200 and out.body["length"] == 4
        assert rel_err(out.body["out"], model.attention(0, q, start_pos=0, causal=False)) <= F32_TOL
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no 500, no traceback
        assert _metric(srv, "attnserve_request_timeouts_total") == 3
        assert _metric(srv, 'attnserve_errors_total{type="timeout"}') == 3


def test_a_batched_step_queued_past_the_timeout_is_dropped_unapplied(engine, rng):
    """A stacked step is one job: it times out whole, its items together (the same
    session twice included: its second append was checked against its first, and
    both are dropped), one wake-up settles them all, and nothing is applied; each
    item counts as a timed-out request."""
    with serving(engine, request_timeout_s=0.3) as srv:
        api = _api(srv)
        a, b = (api.create(**SHAPE)["session_id"] for _ in range(2))
        assert api.append(a, 0, rows(rng, 3, 1, 32), rows(rng, 3, 1, 32)).status == 200
        body = {"session_ids": [a, b, a], "layer": 0, "q": np.stack([rows(rng, 1, 2, 32) for _ in range(3)])}
        body["k"] = body["v"] = np.stack([rows(rng, 1, 1, 32) for _ in range(3)])
        with ThreadPoolExecutor(1) as pool, gpu_held(engine):
            t0 = time.monotonic()
            fut = pool.submit(_api(srv).call, "POST", "/v1/batch/attend", body, enc="msgpack")
            _wait_depth(engine, 2)  # the held job and the step's one job
            r = fut.result()
            waited = time.monotonic() - t0
            assert r.status == 200, r.body
            assert [e["type"] for e in r.body["errors"]] == ["/problems/timeout"] * 3 and 0.3 <= waited < 5
            assert r.body["lengths"] == [None] * 3
            assert api.info(a)["lengths"] == [3] and api.info(b)["lengths"] == [0]
        assert _metric(srv, "attnserve_request_timeouts_total") == 3
        r = api.call("POST", "/v1/batch/attend", body, enc="msgpack")
        assert r.status == 200 and r.body["errors"] == [] and r.body["lengths"] == [4, 1, 5]


def test_a_started_job_completes_despite_the_timeout(engine, rng):
    with serving(engine, request_timeout_s=0.2) as srv:
        api = _api(srv)
        sid = api.create(**SHAPE)["session_id"]
        model = Model(2, 1, 32)
        layer = srv.runtime.store.get(sid, None).kv.layers[0]
        gate, entered = threading.Event(), threading.Event()
        original = layer.state

        def slow_plan():  # runs on the GPU thread as the step is planned: the job has started
            entered.set()
            gate.wait(30)
            return original()

        layer.state = slow_plan
        try:
            with ThreadPoolExecutor(1) as pool:
                k, v = rows(rng, 4, 1, 32), rows(rng, 4, 1, 32)
                fut = pool.submit(_api(srv).append, sid, 0, k, v, offset=0)
                assert entered.wait(10)
                time.sleep(0.6)  # well past the timeout
                gate.set()
                r = fut.result()
        finally:
            layer.state = original
        assert r.status == 200 and r.body["length"] == 4
        model.add(0, k, v)
        q = rows(rng, 4, 2, 32)
        out = api.attend(sid, 0, q)
        assert out.status == 200 and rel_err(out.body["out"], model.attention(0, q, start_pos=0)) <= F32_TOL
        assert _metric(srv, "attnserve_request_timeouts_total") == 0


def test_idle_sessions_expire_and_free_their_memory(engine, rng):
    """An idle session goes once its TTL has passed, never before; one used every 20 ms
    stays. No deadline of the test's own to race: it waits for the expiry (30 s at most)
    and for the release's bookkeeping (next loop turn) by polling, and the TTL (1.5 s)
    leaves a stalled test thread 1.5 s between the uses that keep the busy one alive."""
    ttl = 1.5
    with serving(engine, session_ttl_seconds=ttl) as srv:
        api = _api(srv)
        idle = api.create(**SHAPE)["session_id"]
        busy = api.create(**SHAPE)["session_id"]
        t0 = time.monotonic()  # the idle session's last use is after this
        for sid in (idle, busy):
            assert api.append(sid, 0, rows(rng, 5, 1, 32), rows(rng, 5, 1, 32)).status == 200
        assert srv.runtime.store.used_bytes == 2 * PAGE_BYTES
        deadline = t0 + 30
        while len(srv.runtime.store) == 2:
            assert api.info(busy)["lengths"] == [5]  # used: kept alive
            assert time.monotonic() < deadline, "the idle session did not expire in 30 s"
            time.sleep(0.02)
        expired_after = time.monotonic() - t0
        print(f"\nttl {ttl} s: idle session gone after {expired_after:.2f} s")
        assert expired_after >= ttl
        assert api.call("GET", f"/v1/sessions/{idle}").status == 404
        assert [s["session_id"] for s in api.call("GET", "/v1/sessions").body["sessions"]] == [busy]
        while srv.runtime.store.used_bytes != PAGE_BYTES:  # the release lands on the next loop turn
            assert time.monotonic() < deadline, srv.runtime.store.used_bytes
            time.sleep(0.01)
        assert _metric(srv, "attnserve_sessions_expired_total") == 1
        assert _metric(srv, 'attnserve_limit_seconds{name="session_ttl"}') == ttl
        assert api.call("GET", "/v1/info").body["limits"]["session_ttl_seconds"] == ttl


@pytest.mark.parametrize(
    "name, value",
    [
        ("quota_sessions_per_key", -1),
        ("session_ttl_seconds", -1),
        ("request_timeout_s", -0.5),
        ("quota_bytes_per_key", "lots"),
    ],
)
def test_settings_are_checked(name, value):
    with pytest.raises(ValueError, match=name):
        Settings(**{name: value})
