"""The kernels' warm-up at start (warmup.py, settings warmup and warmup_shapes): the
server answers while the kernels compile, /readyz (and /health) 503 until they are
warm; after it, a decode step and a prefill chunk of the warmed shape compile nothing,
with exact sinks and a window too; by default it warms the default format and the
recommended compressed setting, and its log names each pipeline it compiles as the
warm-up's, not as a first use."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from attnserve.app import create_app
from attnserve.config import Settings
from attnserve.formats import DEFAULT_KV_FORMAT, KV_FORMATS, RECOMMENDED
from attnserve.gpu.shaders import PipelineCache
from attnserve.warmup import Warm, warmup_plan

H, HKV, D = 4, 1, 32  # the warmed shape: GQA group 4, head_dim 32 (taken by f32 and turboquant)


def test_warmup_settings(monkeypatch):
    monkeypatch.delenv("ATTNSERVE_WARMUP", raising=False)  # tests/conftest.py sets none for the test servers
    s = Settings()
    # the defaults: the default format and the recommended compressed setting's, at a Llama-3-8B shape
    assert (s.warmup_formats(), s.warmup_shape_list()) == (("f32", "tq4v3"), [(32, 8, 128)])
    assert s.warmup_formats() == (DEFAULT_KV_FORMAT, RECOMMENDED.kv_format)
    assert Warm(RECOMMENDED.kv_format, (32, 8, 128), RECOMMENDED.sinks, RECOMMENDED.window) in warmup_plan(
        s.warmup_formats(), s.warmup_shape_list()
    )
    s = Settings(warmup=" F32, turboquant,f32 ", warmup_shapes="32x8x128, 4 x 4 x 64")
    assert s.warmup == "f32,turboquant" and s.warmup_formats() == ("f32", "turboquant")
    assert s.warmup_shapes == "32x8x128,4x4x64" and s.warmup_shape_list() == [(32, 8, 128), (4, 4, 64)]
    assert Settings(warmup="ALL").warmup_formats() == KV_FORMATS
    assert Settings(warmup="none").warmup_formats() == Settings(warmup=" ").warmup_formats() == ()
    for bad, says in [
        (dict(warmup="f23"), "'f23' is no kv format; did you mean f32?"),
        (dict(warmup="none,f32"), "'none' is no kv format"),
        (dict(warmup_shapes="32x8"), "not num_qo_heads x num_kv_heads x head_dim"),
        (dict(warmup_shapes="32x7x128"), "num_kv_heads must divide num_qo_heads"),
        (dict(warmup_shapes="8x8x256"), "head_dim be 1 to 128"),
        (dict(warmup_shapes=","), "give at least one shape"),
    ]:
        with pytest.raises(ValidationError, match=says):
            Settings(**bad)


def test_the_plan_warms_each_format_at_the_shapes_it_takes():
    shapes = [(8, 2, 96), (8, 2, 128)]
    assert warmup_plan(["f32", "turboquant"], shapes) == [
        ("f32", (8, 2, 96), 0, 0),
        ("f32", (8, 2, 128), 0, 0),
        ("turboquant", (8, 2, 128), 0, 0),  # a TurboQuant layer takes head_dim 32, 64 or 128 only
        ("turboquant", (8, 2, 128), 4, 128),  # and again with the recommended exact sinks and window
    ]
    assert [str(w) for w in warmup_plan(["tq4v3"], shapes)] == [
        "tq4v3 at 8x2x128",
        "tq4v3 with sinks 4 and window 128 at 8x2x128",
    ]
    assert warmup_plan([], shapes) == []


def _decode_and_prefill(client: TestClient, kv_format: str, rng, sinks: int = 0, window: int = 0) -> None:
    """What a client does first: a session of the warmed shape, a prefill chunk, a decode step."""
    spec = dict(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, kv_format=kv_format, sinks=sinks, window=window)
    r = client.post("/v1/sessions", json=spec)
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    # more query rows than the split kernels take (the prefill kernels), and than the
    # exact sinks and window hold (the codes are read too)
    n = 32 + sinks + window
    kv = {name: rng.standard_normal((n, HKV, D)).tolist() for name in ("k", "v")}
    q = rng.standard_normal((n, H, D))
    r = client.post(f"/v1/sessions/{sid}/layers/0/attend", json=dict(q=q.tolist(), **kv))
    assert r.status_code == 200, r.text
    r = client.post(f"/v1/sessions/{sid}/layers/0/attend", json=dict(q=q[-1:].tolist()))
    assert r.status_code == 200, r.text
    assert client.delete(f"/v1/sessions/{sid}").status_code == 204


def test_readyz_is_503_until_the_kernels_are_warm(engine, monkeypatch, caplog):
    # a pipeline cache of its own, so what the warm-up compiles is seen, whatever ran before
    cache = PipelineCache(engine.ctx.device)
    monkeypatch.setattr(cache, "_started", True)  # as after the device's start: its compiles are logged
    monkeypatch.setattr(engine.ctx, "pipelines", cache)
    caplog.set_level(logging.INFO, logger="attnserve")
    gate = threading.Event()
    engine.worker.submit_call(lambda ctx: gate.wait(120))  # the GPU thread busy: the warm-up waits
    app = create_app(Settings(warmup="f32,turboquant", warmup_shapes=f"{H}x{HKV}x{D}"), engine=engine)
    try:
        with TestClient(app) as client:
            for path in ("/readyz", "/health"):
                r = client.get(path)
                assert r.status_code == 503 and r.headers["retry-after"] == "1", path
                assert r.json()["type"] == "/problems/not-ready", path
                assert r.json()["detail"] == "the kernels are warming up (the warmup setting)", path
            assert client.get("/livez").status_code == 200
            assert client.get("/v1/info").json()["ready"] is False
            r = client.post("/v1/sessions", json=dict(num_qo_heads=H, num_kv_heads=HKV, head_dim=D))
            assert r.status_code == 503 and r.json()["type"] == "/problems/not-ready"
            for path in ("/v1/sessions", "/v1/sessions/restored"):  # reads too: nothing answers half ready
                r = client.get(path)
                assert r.status_code == 503 and r.json()["detail"].startswith("the kernels are warming up"), path
            assert len(cache) == 0
            gate.set()
            deadline = time.monotonic() + 300  # lavapipe compiles a kernel in seconds (more without Mesa's cache)
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the warm-up did not finish"
                time.sleep(0.05)
            assert client.get("/health").json() == {"status": "ready"}
            warmed = set(cache._pipelines)
            # the prefill kernel specialized on the shape (GQA group, head_dim) is among them
            assert any(kernel == "attention_prefill_rb.f32" and dict(c).get("HEAD_DIM") == D for kernel, c in warmed)
            assert any(kernel.startswith("attention_split_tqx") for kernel, _ in warmed)
            assert client.get("/v1/info").json()["pipelines"] == {"compiled": len(warmed)}
            rng = np.random.default_rng(0)
            for kv_format in ("f32", "turboquant"):
                _decode_and_prefill(client, kv_format, rng)
            _decode_and_prefill(client, "turboquant", rng, RECOMMENDED.sinks, RECOMMENDED.window)
            assert set(cache._pipelines) == warmed  # nothing left to compile on first use
    finally:
        gate.set()
    assert engine.ctx.pipelines.warming is None  # a later compile is a first use again
    lines = [r.getMessage() for r in caplog.records if r.name == "attnserve"]
    shape = f"{H}x{HKV}x{D}"
    plan = f"f32 at {shape}, turboquant at {shape}, turboquant with sinks 4 and window 128 at {shape}"
    assert f"warming up the kernels: {plan} (a decode step and a prefill chunk each)" in lines
    progress = [ln for ln in lines if ln.startswith("kernels warm: ")]
    assert [ln.split(" in ")[0] for ln in progress] == [f"kernels warm: {what}" for what in plan.split(", ")]
    for i, line in enumerate(progress, 1):
        assert line.endswith(" compiled)") and f" s ({i}/3; " in line, line
    # every pipeline it compiled has its line, naming the warm-up's session, none "on its first use"
    compiled = [r for r in caplog.records if getattr(r, "kernel", None)]
    assert not [r.getMessage() for r in compiled if "first use" in r.getMessage()]
    assert sorted(r.kernel for r in compiled) == sorted(kernel for kernel, _ in warmed)
    assert {r.warmup for r in compiled} <= set(plan.split(", "))
    prefill = next(r for r in compiled if r.kernel == "attention_prefill_rb.f32")
    assert prefill.getMessage().startswith(
        f"compiled kernel attention_prefill_rb.f32 (GROUP={H // HKV}, HEAD_DIM={D}) for the warm-up of f32 at {shape}"
    ), prefill.getMessage()
    counts = [int(ln.rsplit("; ", 1)[1].split()[0]) for ln in progress]
    assert sum(counts) == len(warmed)
    done = next(r for r in caplog.records if r.getMessage().startswith("kernel warm-up done in "))
    assert done.pipelines == len(warmed) and done.seconds >= 0


def test_warmup_none_is_ready_at_once(engine, monkeypatch, caplog):
    cache = PipelineCache(engine.ctx.device)
    monkeypatch.setattr(engine.ctx, "pipelines", cache)
    caplog.set_level(logging.INFO, logger="attnserve")
    with TestClient(create_app(Settings(warmup="none"), engine=engine)) as client:
        assert client.get("/readyz").status_code == 200 and client.get("/health").status_code == 200
    assert len(cache) == 0
    assert not [r for r in caplog.records if "warm" in r.getMessage()]


def _used_pages(engine) -> int:
    return engine.worker.run(lambda ctx: sum(p["used_pages"] for p in engine.pools.describe()["pools"]))


def test_a_stop_during_the_warmup_ends_it_quietly(engine, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="attnserve")
    used_before = _used_pages(engine)
    gate = threading.Event()
    attend = engine.attend

    def attend_behind_the_gate(*args, **kw):  # the warm-up's session holds its rows by then
        engine.worker.submit_call(lambda ctx: gate.wait(120))
        return attend(*args, **kw)

    monkeypatch.setattr(engine, "attend", attend_behind_the_gate)
    app = create_app(Settings(warmup="f32", warmup_shapes=f"{H}x{HKV}x{D}"), engine=engine)
    release = threading.Timer(1.0, gate.set)  # the GPU thread goes on while the app stops
    try:
        with TestClient(app) as client:
            deadline = time.monotonic() + 120
            while engine.worker.queue_depth < 2:  # the gate running, the decode attend queued
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert client.get("/readyz").status_code == 503
            release.start()
        rt = app.state.runtime
        assert not rt.ready and rt.not_ready_reason() == "the server is draining"
        assert _used_pages(engine) == used_before  # the warm-up's session was released
    finally:
        gate.set()
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if m.startswith(("kernel warm-up", "kernels warm:"))], messages


def test_a_failed_warmup_is_logged_and_the_server_serves(engine, monkeypatch, caplog):
    async def fails(*args):
        raise RuntimeError("no pipeline today")

    monkeypatch.setattr("attnserve.app.warm_up", fails)
    caplog.set_level(logging.INFO, logger="attnserve")
    with TestClient(create_app(Settings(warmup="f32"), engine=engine)) as client:
        deadline = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    failed = [r for r in caplog.records if r.getMessage().startswith("kernel warm-up failed")]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR and failed[0].error == "no pipeline today"
