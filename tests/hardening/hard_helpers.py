"""Helpers of the hardening tests: real server processes on 127.0.0.1, their
/metrics and memory, and sessions whose every layer is checked against the
float64 oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from attnserve_client import wire
from svc_helpers import F32_TOL, Api, Model, rel_err, rows
from tools.common import free_port, metric_sum, parse_prometheus, stop_process  # noqa: F401  (metric_sum: the tests import it from here)

ROOT = Path(__file__).resolve().parents[2]


def no_adapter(reason: str) -> None:
    """As tests/conftest.py: skip on a developer machine, FAIL under CI."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"CI needs a wgpu adapter (lavapipe): {reason}", pytrace=False)
    pytest.skip(reason)


class ServerProcess:
    """``python -m attnserve serve`` in its own process, on a free port of 127.0.0.1,
    logging JSON lines to ``log_path``. ``env`` adds ATTNSERVE_* settings."""

    def __init__(self, log_dir: Path, name: str = "server", env: dict[str, str] | None = None):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"{name}-{self.port}.log"
        pythonpath = os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
        self.env = {
            **os.environ,
            "PYTHONPATH": pythonpath.rstrip(os.pathsep),
            "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp"),
            "ATTNSERVE_LOG_LEVEL": "warning",
            "ATTNSERVE_LOG_FORMAT": "json",
            "ATTNSERVE_INSTANCE_NAME": name,
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> "ServerProcess":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnserve", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                log = self.log_text()
                if "cannot open a GPU device" in log or "no wgpu adapter" in log.lower():
                    no_adapter(f"{self.name}: {log[-500:]}")
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {log[-2000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not become ready: {self.log_text()[-2000:]}")
            time.sleep(0.1)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc is None:
            return None
        code = stop_process(self.proc, timeout)
        self._log.close()
        return code

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"level": "raw", "msg": line})
        return out

    def server_errors(self) -> list[dict[str, Any]]:
        """Log records at error level or above, and tracebacks (an unhandled error
        is logged with its traceback, and answered 500)."""
        return [
            r
            for r in self.log_records()
            if r.get("level") in ("error", "critical") or "exc" in r or "Traceback" in str(r.get("msg"))
        ]

    def rss_bytes(self) -> int:
        return process_rss(self.pid)

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(httpx.get(self.url + "/metrics", timeout=30).text)


def process_rss(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class OracleSession:
    """A session with random rows in every layer, and what each layer must answer."""

    def __init__(
        self,
        api: Api,
        rng: np.random.Generator,
        *,
        h: int,
        hkv: int,
        d: int,
        layers: int,
        fill: tuple[int, ...],
        kv_format: str = "f32",
        session_id: str | None = None,
        max_tokens: int = 512,
        enc: str = "msgpack",
    ):
        self.api, self.rng = api, rng
        self.h, self.hkv, self.d, self.layers = h, hkv, d, layers
        self.kv_format = kv_format
        self.model = Model(h, hkv, d, layers)
        info = api.create(
            enc,
            session_id,
            num_qo_heads=h,
            num_kv_heads=hkv,
            head_dim=d,
            num_layers=layers,
            kv_format=kv_format,
            max_tokens=max_tokens,
        )
        self.sid = info["session_id"]
        for layer, n in enumerate(fill):
            if n:
                self.append(layer, n, enc=enc)

    def append(self, layer: int, n: int, enc: str = "msgpack") -> None:
        k, v = rows(self.rng, n, self.hkv, self.d), rows(self.rng, n, self.hkv, self.d)
        r = self.api.append(self.sid, layer, k, v, offset=self.model.lengths[layer], enc=enc)
        assert r.status == 200, r.body
        self.model.add(layer, k, v)

    def check(self, queries: int = 3) -> None:
        """Every non-empty layer answers like the oracle (f32), and its length is kept."""
        info = self.api.info(self.sid)
        assert info["lengths"] == self.model.lengths, (info["lengths"], self.model.lengths)
        for layer, n in enumerate(self.model.lengths):
            if not n:
                continue
            q = rows(self.rng, min(queries, n), self.h, self.d)
            r = self.api.attend(self.sid, layer, q)
            assert r.status == 200, r.body
            assert r.body["length"] == n
            if self.kv_format == "f32":
                err = rel_err(r.body["out"], self.model.attention(layer, q))
                assert err <= F32_TOL, (self.sid, layer, err)


def msgpack_call(client: httpx.Client, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    content = None if body is None else wire.packb(body)
    headers = {"Content-Type": wire.MSGPACK, "Accept": wire.MSGPACK} if body is not None else {"Accept": wire.MSGPACK}
    return client.request(method, path, content=content, headers=headers, **kw)
