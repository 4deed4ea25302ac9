"""``attnserve serve``: run the HTTP service; ``attnserve adapters``: list GPUs.

Settings come from ``ATTNSERVE_*`` environment variables (see
:class:`attnserve.config.Settings`); the options below override them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from types import FrameType
from typing import Any, Sequence

import uvicorn

__all__ = ["main"]

log = logging.getLogger("attnserve")


def _serve(args: argparse.Namespace) -> int:
    from .app import create_app
    from .config import Settings
    from .logging_setup import configure_logging

    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "adapter": args.adapter,
            "log_level": args.log_level,
            "log_format": args.log_format,
        }.items()
        if v is not None
    }
    try:
        settings = Settings(**overrides)
    except Exception as e:  # pydantic ValidationError: say which setting, then stop
        print(f"attnserve: invalid settings: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    app = create_app(settings)
    rt = app.state.runtime
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
        server_header=False,
        ws_max_size=settings.max_body_bytes,  # a /v1/stream frame may be as large as a body
    )
    server = _Server(config, rt, settings.drain_delay_s)
    log.info("starting", extra={"host": settings.host, "port": settings.port})
    server.run()
    # uvicorn leaves started False when the lifespan failed (no device): exit non-zero.
    return 0 if server.started else 3


class _Server(uvicorn.Server):
    """On the first SIGTERM/SIGINT, mark the app draining (``/readyz`` 503, new
    ``/v1`` requests 503) and, with ``drain_delay_s`` > 0, keep answering that long
    before shutting down, so a load balancer takes the replica out first. A second
    signal stops at once."""

    def __init__(self, config: uvicorn.Config, runtime: Any, drain_delay_s: float):
        super().__init__(config)
        self._rt = runtime
        self._drain_delay_s = drain_delay_s
        self._signalled = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._rt.begin_drain()
        loop = self._rt.loop
        if self._signalled or self._drain_delay_s <= 0 or not self.started or loop is None:
            super().handle_exit(sig, frame)
            return
        self._signalled = True
        log.info("draining before shutdown", extra={"seconds": self._drain_delay_s})
        loop.call_soon_threadsafe(loop.call_later, self._drain_delay_s, super().handle_exit, sig, frame)


def _adapters(args: argparse.Namespace) -> int:
    from .gpu.device import list_adapters

    adapters = list_adapters()
    rows = []
    for i, a in enumerate(adapters):
        info = a.info
        rows.append(
            {
                "index": i,
                "name": str(info.get("device", "")),
                "backend": str(info.get("backend_type", "")),
                "adapter_type": str(info.get("adapter_type", "")),
                "vendor": str(info.get("vendor", "")),
                "description": str(info.get("description", "")),
                "max_storage_buffer_binding_size": int(a.limits.get("max-storage-buffer-binding-size", 0)),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no wgpu adapter found (install a GPU driver, or mesa-vulkan-drivers for lavapipe)")
    else:
        for r in rows:
            print(f"[{r['index']}] {r['name']} ({r['backend']}, {r['adapter_type']}) {r['description']}")
    return 0 if rows else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnserve", description="Attention served over HTTP on a wgpu device.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the HTTP service (settings: ATTNSERVE_* environment variables)")
    s.add_argument("--host", help="address to bind (ATTNSERVE_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port to bind (ATTNSERVE_PORT, default 8000)")
    s.add_argument("--adapter", help="adapter: index, backend, type or part of its name (ATTNSERVE_ADAPTER)")
    s.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level (ATTNSERVE_LOG_LEVEL, default info)")
    s.add_argument("--log-format", choices=["json", "text"], help="log format (ATTNSERVE_LOG_FORMAT, default json)")
    s.set_defaults(func=_serve)
    a = sub.add_parser("adapters", help="list the wgpu adapters this machine offers")
    a.add_argument("--json", action="store_true", help="print JSON")
    a.set_defaults(func=_adapters)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
