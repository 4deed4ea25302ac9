"""`python -m attnserve serve` as a real process: settings from ATTNSERVE_* variables,
one JSON log line per request, draining on SIGTERM; `attnserve adapters`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from svc_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_") or k == "ATTNSERVE_ADAPTER"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), env.get("PYTHONPATH", "")])
    env.setdefault("XDG_RUNTIME_DIR", "/tmp")
    env.update(extra)
    return env


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


@pytest.mark.usefixtures("engine")  # needs an adapter: skips without one, fails under CI
def test_serve_settings_logs_and_drain():
    port = free_port()
    env = _env(ATTNSERVE_MAX_BODY_BYTES="123456", ATTNSERVE_MEMORY_BUDGET_BYTES="1000000",
               ATTNSERVE_MAX_SESSIONS="7", ATTNSERVE_DEFAULT_MAX_TOKENS="500", ATTNSERVE_DRAIN_DELAY_S="1.5",
               ATTNSERVE_LOG_LEVEL="INFO")
    proc = subprocess.Popen([sys.executable, "-m", "attnserve", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        limits = httpx.get(url + "/v1/info").json()["limits"]
        assert limits["max_body_bytes"] == 123456 and limits["memory_budget_bytes"] == 1000000
        assert limits["max_sessions"] == 7 and limits["default_max_tokens"] == 500
        headers = {"Authorization": "Bearer s3cr3t-token", "X-Request-ID": "req-cli-1"}
        r = httpx.put(url + "/v1/sessions/cli-1", json={"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 4},
                      headers=headers)
        assert r.status_code == 201 and r.json()["max_tokens"] == 500
        assert r.headers["x-request-id"] == "req-cli-1"
        r = httpx.post(url + "/v1/sessions/cli-1/layers/0/kv", headers=headers,
                       json={"k": [[[0.123456789, 1, 2, 3]]], "v": [[[4, 5, 6, 7]]]})
        assert r.status_code == 200 and r.json() == {"length": 1}
        assert httpx.get(url + "/v1/sessions/cli-1/layers").status_code == 404
        proc.send_signal(signal.SIGTERM)
        # draining: not ready any more, still alive, /v1 refused, until the delay has passed
        deadline = time.monotonic() + 1.0
        saw_draining = False
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(url + "/readyz", timeout=1)
            except httpx.TransportError:
                break
            if ready.status_code == 503:
                assert ready.json()["type"] == "/problems/not-ready"
                assert httpx.get(url + "/livez", timeout=1).status_code == 200
                assert httpx.get(url + "/v1/sessions/cli-1", timeout=1).status_code == 503
                saw_draining = True
                break
            time.sleep(0.05)
        assert saw_draining
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    access = [ln for ln in lines if ln["logger"] == "attnserve.access"]
    put = next(ln for ln in access if ln["method"] == "PUT")
    assert put["route"] == "/v1/sessions/{session_id}" and put["status"] == 201
    assert put["session_id"] == "cli-1" and put["request_id"] == "req-cli-1"
    assert isinstance(put["latency_ms"], float) and put["latency_ms"] >= 0
    append = next(ln for ln in access if ln["method"] == "POST")
    assert append["route"] == "/v1/sessions/{session_id}/layers/{layer}/kv" and append["layer"] == "0"
    missing = next(ln for ln in access if ln["status"] == 404)
    assert missing["route"] == "unmatched" and missing["problem"] == "not-found"
    assert "s3cr3t" not in err and "0.123456789" not in err  # no auth headers, no bodies
    assert any(ln["msg"] == "ready" for ln in lines) and any(ln["msg"] == "stopped" for ln in lines)


def test_serve_refuses_bad_settings():
    proc = subprocess.run([sys.executable, "-m", "attnserve", "serve"], cwd=ROOT, capture_output=True, text=True,
                          env=_env(ATTNSERVE_MAX_BODY_BYTES="lots"), timeout=60)
    assert proc.returncode == 2 and "max_body_bytes" in proc.stderr


@pytest.mark.usefixtures("engine")
def test_serve_without_a_matching_adapter_exits_with_the_reason():
    proc = subprocess.run([sys.executable, "-m", "attnserve", "serve", "--port", str(free_port()),
                           "--adapter", "no-such-gpu-anywhere"], cwd=ROOT, capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert proc.returncode != 0
    assert "no adapter matches" in proc.stderr and "no-such-gpu-anywhere" in proc.stderr


@pytest.mark.usefixtures("engine")
def test_adapters_lists_them():
    proc = subprocess.run([sys.executable, "-m", "attnserve", "adapters", "--json"], cwd=ROOT, capture_output=True,
                          text=True, env=_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    adapters = json.loads(proc.stdout)
    assert adapters and {"index", "name", "backend", "adapter_type"} <= set(adapters[0])
