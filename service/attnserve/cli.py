"""``attnserve serve``: run the HTTP service; ``attnserve adapters``: list GPUs.

Settings come from ``ATTNSERVE_*`` environment variables (see
:class:`attnserve.config.Settings`); ``serve`` has one option per setting (API keys
excepted: they stay out of ``ps``), generated from the settings' fields, that
overrides its variable.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import logging
import os
import socket
import sys
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, Sequence, get_args, get_origin

import uvicorn
from pydantic import SecretStr

if TYPE_CHECKING:
    from .config import Settings

__all__ = ["main", "server_config"]

log = logging.getLogger("attnserve")


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from .app import create_app, open_engine
    from .config import Settings, unknown_env
    from .gpu.device import DeviceError
    from .logging_setup import configure_logging

    given = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None}
    try:
        settings = Settings(**given)
    except ValidationError as e:  # one line per mistake, naming the flag or variable the user set
        for line in settings_errors(e, given, os.environ):
            print(f"attnserve: {line}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    for name, close in unknown_env(os.environ):
        hint = f"; did you mean {close}?" if close else ""
        log.warning(f"{name} is not a setting and is ignored{hint}", extra={"variable": name, "did_you_mean": close})
    # the port first: a busy one stops the start at once, before the device opens
    try:
        sockets = _bind_sockets(settings.host, settings.port)
    except OSError as e:
        print(f"attnserve: {_bind_error(settings, e, given)}", file=sys.stderr)
        return 3
    try:
        engine = open_engine(settings)
    except DeviceError as e:
        for sock in sockets:
            sock.close()
        where = f" ({_source('adapter', given, os.environ)})" if settings.adapter else ""
        print(f"attnserve: cannot open a GPU device{where}: {e}", file=sys.stderr)
        return 3
    try:
        app = create_app(settings, engine=engine)
        rt = app.state.runtime
        if not rt.keys.enabled and not is_loopback(settings.host):
            log.warning(
                f"no API keys: anyone who can reach {settings.host}:{settings.port} can use this server; "
                "set ATTNSERVE_API_KEYS or ATTNSERVE_API_KEYS_FILE (docs/deploy.md)",
                extra={"host": settings.host, "port": settings.port},
            )
        config = server_config(app, settings)
        server = _Server(config, rt, settings.drain_delay_s)
        log.info("starting", extra={"host": settings.host, "port": settings.port})
        try:
            server.run(sockets=sockets)
        except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its clean shutdown
            return 130
    finally:
        engine.close()
        for sock in sockets:
            sock.close()
    if server.listen_error is not None:  # a listener lost as the server started: stopped, say why
        print(f"attnserve: {_bind_error(settings, server.listen_error, given)}", file=sys.stderr)
        return 3
    # uvicorn leaves started False when the start failed (restore failed): exit non-zero.
    return 0 if server.started else 3


# listen()'s backlog: uvicorn.Config's default, given to uvicorn too (server_config),
# which calls listen() again on the sockets of _bind_sockets with it
_BACKLOG = 2048


def _bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to ``port`` on every address ``host`` names (all of them for an
    empty host), as asyncio's ``create_server`` binds them, and listening at once:
    SO_REUSEADDR lets another process bind the port until one of them listens, so a
    socket only bound would hold nothing while the device opens and the app starts,
    and the second server to listen would fail only then, inside uvicorn. Connections
    wait in the backlog until uvicorn serves them. Raises OSError (the port taken,
    no such address)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(_BACKLOG)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bind_error(settings: Settings, e: OSError, given: Mapping[str, Any]) -> str:
    """``cannot listen on 127.0.0.1:8421 (--port=8421): address already in use; ...``,
    naming what the user set of the settings that matter: the port when it is in
    use, the host and the port otherwise (no such address, say)."""
    address = f"[{settings.host}]:{settings.port}" if ":" in settings.host else f"{settings.host}:{settings.port}"
    in_use = e.errno == errno.EADDRINUSE
    names = ("port",) if in_use else ("host", "port")
    set_by_user = [s for name in names if (s := _source(name, given, os.environ)) != name]
    where = f" ({', '.join(set_by_user)})" if set_by_user else ""
    reason = (e.strerror or str(e)).lower()
    if in_use:
        reason += "; another process listens there: stop it, or choose another port (--port, ATTNSERVE_PORT)"
    return f"cannot listen on {address}{where}: {reason}"


def _lost_listener(server: uvicorn.Server) -> bool:
    """Whether a socket the started ``server`` was given does not listen: uvloop's
    ``create_server(sock=...)`` closes a socket whose listen() fails (EADDRINUSE:
    another process listened on the port first) without raising, and its server's
    ``sockets`` then holds None."""
    return any(sock is None for srv in server.servers for sock in (srv.sockets or [None]))


def _urls(server: uvicorn.Server) -> list[str]:
    """The URLs a started server listens on (see :func:`_lost_listener` first)."""
    urls = []
    for srv in server.servers:
        for sock in srv.sockets:
            host, port = sock.getsockname()[:2]
            urls.append(f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}")
    return urls


def server_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration ``attnserve serve`` runs ``app`` under (tests start
    their servers from it too, with ``overrides`` such as the port)."""
    # imported here, as the app is: the WebSocket transport's module brings the app's stack
    from .transport.websocket import stream_websocket_protocol

    options: dict[str, Any] = dict(
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
        server_header=False,
        backlog=_BACKLOG,  # as _bind_sockets listens
        ws_max_size=settings.max_body_bytes,  # a /v1/stream frame may be as large as a body
        # No permessage-deflate on /v1/stream: a generic client (Python websockets)
        # offers it by default, and compressing float arrays costs ~2.5 ms per step
        # for a few percent of bytes (docs/api.md#streaming-transport-v1stream-websocket).
        ws_per_message_deflate=False,
        # the keepalive judges a late pong only while the server reads the stream, and a
        # peer that reads nothing for stream_send_timeout_s is dropped (transport/websocket.py)
        ws=stream_websocket_protocol(settings.stream_send_timeout_s, settings.stream_max_unsent_bytes),
        ws_ping_interval=settings.stream_ping_interval_s or None,
        ws_ping_timeout=settings.stream_ping_timeout_s,
    )
    options.update(overrides)
    return uvicorn.Config(app, **options)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _source(name: str, given: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """Where a setting's value came from, as the user wrote it: ``--port=abc`` or
    ``ATTNSERVE_PORT=abc`` (a secret's value left out)."""
    from .config import Settings, env_name

    secret = _is_secret(Settings.model_fields[name])
    if name in given:
        return _flag(name) if secret else f"{_flag(name)}={given[name]}"
    var = env_name(name)
    for key, value in environ.items():
        if key.upper() == var:
            return key if secret else f"{key}={value}"
    return name


_REASONS = {
    "int_parsing": "not an integer",
    "int_from_float": "not an integer",
    "float_parsing": "not a number",
    "bool_parsing": "not a boolean (true or false)",
}


def settings_errors(e: Any, given: Mapping[str, Any], environ: Mapping[str, str]) -> list[str]:
    """A pydantic ValidationError of :class:`Settings` as lines such as
    ``ATTNSERVE_PORT=abc: not an integer`` (never a secret's value)."""
    from .config import Settings

    lines = []
    for err in e.errors(include_input=False):
        loc = err.get("loc") or ()
        msg = _REASONS.get(err.get("type", ""), str(err.get("msg", "invalid")).removeprefix("Value error, "))
        if loc and loc[0] in Settings.model_fields:
            lines.append(f"{_source(str(loc[0]), given, environ)}: {msg}")
            continue
        # a check of several settings: its message starts with the setting it is about
        name, sep, rest = msg.partition(": ")
        lines.append(f"{_source(name, given, environ)}: {rest}" if sep and name in Settings.model_fields else msg)
    return lines


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
        # why the server stopped as it started: a socket it was given does not listen
        self.listen_error: OSError | None = None

    async def startup(self, sockets: Any = None) -> None:
        try:
            await super().startup(sockets)
        except OSError as e:  # asyncio's loop: listen() raised, after the app's start
            log.error(f"cannot listen: {e}", extra={"errno": e.errno})
            self.listen_error = e
            self.should_exit = True
            for srv in getattr(self, "servers", []):  # those made before it
                srv.close()
            await self.lifespan.shutdown()
            return
        if self.started and _lost_listener(self):
            # uvloop's loop closed it without a word: listen() on a bound TCP socket fails
            # only with EADDRINUSE. Stop (uvicorn shuts the app down, started as it is).
            log.error("a listening socket was lost as the server started: another process listens on the port")
            self.listen_error = OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
            self.should_exit = True
            return
        if self.started:  # the app is up: what is alive now lives as long as the process
            import gc

            from .gc_policy import apply_gc_policy

            thresholds = apply_gc_policy(self._rt.settings.gc_threshold)
            log.info("garbage collector", extra={"gc_thresholds": list(thresholds), "frozen": gc.get_freeze_count()})
            urls = _urls(self)
            log.info(f"listening on {', '.join(urls)}", extra={"urls": urls})
            # "ready" once the port listens and the app is ready (after the kernels' warm-up)
            self._rt.when_ready(lambda: self._log_ready(urls))

    def _log_ready(self, urls: list[str]) -> None:
        from . import __version__

        rt = self._rt
        log.info(
            "ready",
            extra={
                "urls": urls,
                "adapter": rt.engine.describe() if rt.engine is not None else None,
                "version": __version__,
                "api_keys": len(rt.keys),
                "sessions": len(rt.store),
            },
        )

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


SERVE_EPILOG = """\
Every option overrides its ATTNSERVE_* environment variable; the defaults shown are
the built-in ones. Sizes take a plain integer or a unit: 64k, 512MiB, 8GiB (powers
of 1024), 10MB (powers of 1000).

API keys have no option: a key on a command line is visible to every user of the
machine (ps). Set ATTNSERVE_API_KEYS, or put the keys in a file and name it with
--api-keys-file (ATTNSERVE_API_KEYS_FILE). Without keys, anyone who can reach the
server can use it: keep --host on 127.0.0.1 or turn keys on.
"""


def _is_secret(field: Any) -> bool:
    return field.annotation is SecretStr or SecretStr in get_args(field.annotation)


def _shown_default(field: Any) -> str:
    from .config import format_size, parse_size

    value = field.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if any(getattr(m, "func", None) is parse_size for m in field.metadata):
        return format_size(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _metavar(name: str, field: Any) -> str:
    from .config import parse_size

    if any(getattr(m, "func", None) is parse_size for m in field.metadata):
        return "SIZE"
    if field.annotation is float:
        return "SECONDS"
    return "N" if field.annotation in (int, int | None) else name.upper()


class _NoOption(argparse.Action):
    """A secret's option, refused without its value being shown (else argparse would read
    ``--api-keys KEY`` as an abbreviation of ``--api-keys-file`` and name KEY as a file)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from .config import Settings, env_name

        instead = env_name(self.dest)
        if f"{self.dest}_file" in Settings.model_fields:
            instead += f" or name a file of them with {_flag(self.dest + '_file')}"
        parser.error(f"{_flag(self.dest)} is no option: a command line is visible to every user (ps); set {instead}")


def add_setting_options(parser: argparse.ArgumentParser) -> None:
    """One option per setting (a secret's is refused: _NoOption), each named after its
    field, its help the field's description, its variable and its built-in default. Values
    go to :class:`Settings` as given, so flags and variables are checked alike."""
    from .config import Settings, env_name

    for name, field in Settings.model_fields.items():
        if _is_secret(field):  # API keys: the environment or --api-keys-file only (SERVE_EPILOG)
            parser.add_argument(
                _flag(name), nargs="?", action=_NoOption, default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )
            continue
        text = f"{field.description} [{env_name(name)}; default: {_shown_default(field)}]".replace("%", "%%")
        if field.annotation is bool:
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif get_origin(field.annotation) is Literal:
            parser.add_argument(_flag(name), dest=name, choices=get_args(field.annotation), help=text)
        else:
            parser.add_argument(_flag(name), dest=name, metavar=_metavar(name, field), help=text)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="attnserve", description="Attention served over HTTP on a wgpu device.")
    p.add_argument("--version", action="version", version=f"attnserve {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="run the HTTP service (settings: options or ATTNSERVE_* environment variables)",
        description="Run the HTTP service.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_setting_options(s)
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
