"""A server of this checkout in a child process, for the benchmarks that drive it
over loopback (bench/service.py, bench/server_cpu.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "client")]
from attnserve_client import Client  # noqa: E402

from tools.common import free_port  # noqa: E402

__all__ = ["ROOT", "free_port", "serving"]


@contextlib.contextmanager
def serving(adapter: str, **env: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``attnserve serve`` on a free 127.0.0.1 port with ``ATTNSERVE_ADAPTER=adapter``
    and the ``ATTNSERVE_*`` settings in ``env``; yields ``(process, url)`` once it is
    ready, and stops it (SIGTERM, then SIGKILL after 30 s) at the end."""
    port = free_port()
    child_env = dict(
        os.environ,
        ATTNSERVE_ADAPTER=adapter,
        ATTNSERVE_LOG_LEVEL="warning",
        XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"),
        PYTHONPATH=os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")]),
        **env,
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "attnserve", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=child_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        with Client(url, timeout=30) as client:
            deadline = time.monotonic() + 120
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"server exited: {server.stderr.read().decode()[-2000:]}")
                try:
                    if client.ready():
                        break
                except Exception:  # not listening yet
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("the server was not ready within 120 s")
                time.sleep(0.1)
        yield server, url
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
