"""The real attnserve app under uvicorn in a background thread, on a free loopback
port, as `attnserve serve` configures it: the live server of the service and client
tests (``svc_helpers`` re-exports it)."""

from __future__ import annotations

import threading
import time

import uvicorn

from attnserve.app import create_app
from attnserve.cli import server_config
from attnserve.config import Settings
from tools.common import free_port


class LiveServer:
    """The real app under uvicorn in a background thread."""

    def __init__(self, settings: Settings | None = None, *, engine=None, app=None):
        self.app = app or create_app(settings or Settings(), engine=engine)
        self.runtime = self.app.state.runtime
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the configuration `attnserve serve` runs under, on a free loopback port
        config = server_config(self.app, self.runtime.settings, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"attnserve-{self.port}", daemon=True)

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        # listening, and ready (the kernels' warm-up done): what /readyz 200 says to a client
        while not (self.server.started and self.runtime.ready):
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the attnserve server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
