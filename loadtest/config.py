"""loadtest.py's configuration: the command line, its checks, and the loopback rule
(see loadtest.py for what the load test does)."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import socket
import urllib.parse
from dataclasses import asdict, dataclass, field
from typing import Any

# the one list of the kv formats (run from a checkout, loadtest.py puts its service/ on the path)
from attnserve.formats import KV_FORMATS


#: The operations measured, in report order. decode_step is one token through all
#: layers (its latency counts from when it was due in open loop).
OPERATIONS = ("create", "prefill_chunk", "prefill_batch", "decode", "decode_batch", "decode_step", "delete")

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2

#: --batched: what carries the steps, each --transport choice as ``client.stream``'s
#: ``transport`` names it (None: no stream, POST /v1/batch/attend).
TRANSPORTS = {"stream": "websocket", "frames": "frames", "shm": "shm", "http": None}


class UsageError(Exception):
    """A setup problem (bad argument, unreachable server): exit 2."""


# ── configuration ────────────────────────────────────────────────────────────


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows an option's default where it has one: not ``(default: None)``
    nor ``(default: [])``, which an option's own help explains."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)


@dataclass
class Config:
    url: str  # the first target
    urls: list[str] = field(default_factory=list)  # every target (servers or routers); default [url]
    sessions: int = 8
    concurrency: int = 0  # 0: = sessions
    workers: int = 1
    duration: float = 30.0
    warmup_s: float = 5.0  # seconds before the duration, not measured
    mode: str = "closed"
    rate: float = 0.0
    batched: bool = False
    transport: str = "stream"  # --batched: the steps' transport (TRANSPORTS)
    shards: int = 0  # sharded sessions: shards per session (0: plain sessions)
    shard_tokens: int = 0  # sharded sessions: timesteps per shard (0: from --shards)
    prefill: int = 256
    chunk: int = 64
    decode_steps: int = 64
    layers: int = 4
    qo_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    kv_format: str = "f32"
    create: str = "put"
    timeout: float = 60.0
    retries: int = 0
    verify: float = 0.0
    max_errors: int = 100
    seed: int | None = None
    api_key: str | None = field(default=None, repr=False)
    metrics_urls: list[str] = field(default_factory=list)
    json_out: str | None = None
    plot: str | None = None
    progress: str = "auto"
    allow_remote: bool = False

    def __post_init__(self) -> None:
        if not self.urls:
            self.urls = [self.url]

    @property
    def sharded(self) -> bool:
        """Each session a ShardedSession over the targets (``--shards``, ``--shard-tokens``)."""
        return bool(self.shards or self.shard_tokens)

    def shard_size(self) -> int:
        """Timesteps per shard: ``--shard-tokens``, else a session's timesteps over ``--shards``."""
        return self.shard_tokens or math.ceil((self.prefill + self.decode_steps) / self.shards)

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["api_key"] = "***" if self.api_key else None
        return d


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(  # prog: how it was run (attnserve-loadtest, loadtest.py)
        description="Load test of an attnserve server: sessions that prefill a prompt in chunks, "
        "then run fused decode steps over several layers.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "--url",
        action="append",
        default=None,
        metavar="URL",
        help="a server or router (loopback only, see --allow-remote); repeat it or give a comma-separated list "
        "for several targets (N replicas or N routers): session i goes to target i %% N "
        "(default: http://127.0.0.1:8421)",
    )
    p.add_argument("--sessions", type=int, default=8, help="virtual users; each holds one session at a time")
    p.add_argument("--concurrency", type=int, default=0, help="most requests in flight over all users (0: --sessions)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="load-generating processes (the users are split over them; use a few on a many-core host)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=30.0,
        help="seconds of measured load, after the warm-up; then sessions are deleted and it stops",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="warm-up before the measured load: the users run as they will after it, but the requests that "
        "start in it are not measured (the server's first-use kernel compiles, cold caches); 0: none",
    )
    p.add_argument("--mode", choices=("closed", "open"), default="closed", help="closed or open loop")
    p.add_argument("--rate", type=float, default=0.0, help="open loop: decode steps per second over all users")
    p.add_argument(
        "--batched",
        action="store_true",
        help="engine-shaped: each worker runs its --sessions in lockstep, one batched step "
        "(attend_batch, stacked) per layer for all of them, prefill chunks and decode tokens alike",
    )
    p.add_argument(
        "--transport",
        choices=tuple(TRANSPORTS),
        default="stream",
        help="--batched: what carries the steps, one connection per target as an engine keeps it: the "
        "WebSocket /v1/stream (through a router too); the frame transport (plain TCP, a server run with "
        "--frames-port); shared memory (a server on this host run with --shm-socket); or http, each step a "
        "POST /v1/batch/attend. Sessions are created and deleted over HTTP whichever it is",
    )
    p.add_argument(
        "--shards",
        type=int,
        default=0,
        help="sharded sessions: each session is a ShardedSession of this many shards spread over the targets "
        "(shards of ceil((--prefill + --decode-steps) / S) timesteps; 0: plain sessions)",
    )
    p.add_argument(
        "--shard-tokens", type=int, default=0, help="sharded sessions: timesteps per shard (instead of from --shards)"
    )
    p.add_argument("--prefill", type=int, default=256, help="prompt tokens per session")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (rows per fused attend)")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps per session (0: until the end)")
    p.add_argument("--layers", type=int, default=4, help="layers per session")
    p.add_argument("--qo-heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (GQA)")
    p.add_argument("--head-dim", type=int, default=64, help="head size (turboquant: 32, 64, 128)")
    p.add_argument(
        "--kv-format", default="f32", metavar="FORMAT", help=f"one of {', '.join(KV_FORMATS)} (the server checks it)"
    )
    p.add_argument("--create", choices=("put", "post"), default="put", help="PUT with own ids (router-safe) or POST")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument(
        "--retries",
        type=int,
        default=0,
        help="client retries of 503/429 and lost connections (0: every failure counts)",
    )
    p.add_argument(
        "--verify",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="f32: check this fraction of decode outputs against a float64 reference",
    )
    p.add_argument("--max-errors", type=int, default=100, help="stop early after this many errors")
    p.add_argument("--seed", type=int, default=None, help="seed of the random inputs")
    # The key's value never becomes an argparse default: --help would print it.
    p.add_argument("--api-key", default=None, help="bearer token (default: $ATTNSERVE_API_KEY, never shown)")
    p.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        metavar="URL",
        help="scrape /metrics here (repeat: e.g. each replica behind a router); default: --url",
    )
    p.add_argument("--json-out", help="write the report as JSON to this file")
    p.add_argument("--plot", help="write a PNG latency plot to this file (needs matplotlib)")
    p.add_argument(
        "--progress",
        choices=("auto", "line", "log", "off"),
        default="auto",
        help="live progress: one rewritten line (tty), a log line every 5 s, or none",
    )
    p.add_argument(
        "--allow-remote", action="store_true", help="allow a non-loopback target (only hosts you run yourself)"
    )
    a = p.parse_args(argv)
    urls = [u.strip().rstrip("/") for given in (a.url or ["http://127.0.0.1:8421"]) for u in given.split(",")]
    urls = [u for u in urls if u]
    cfg = Config(
        url=urls[0] if urls else "",
        urls=urls,
        sessions=a.sessions,
        concurrency=a.concurrency or a.sessions,
        workers=a.workers,
        duration=a.duration,
        warmup_s=a.warmup_s,
        mode=a.mode,
        rate=a.rate,
        batched=a.batched,
        transport=a.transport,
        shards=a.shards,
        shard_tokens=a.shard_tokens,
        prefill=a.prefill,
        chunk=a.chunk,
        decode_steps=a.decode_steps,
        layers=a.layers,
        qo_heads=a.qo_heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        kv_format=a.kv_format,
        create=a.create,
        timeout=a.timeout,
        retries=a.retries,
        verify=a.verify,
        max_errors=a.max_errors,
        seed=a.seed,
        api_key=a.api_key if a.api_key is not None else os.environ.get("ATTNSERVE_API_KEY"),
        metrics_urls=[u.rstrip("/") for u in a.metrics_url] or list(urls),
        json_out=a.json_out,
        plot=a.plot,
        progress=a.progress,
        allow_remote=a.allow_remote,
    )
    try:
        check_config(cfg)
    except UsageError as exc:
        p.error(str(exc))
    return cfg


def check_config(cfg: Config) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise UsageError(what)

    need(bool(cfg.urls), "--url: expected at least one URL")
    need(len(set(cfg.urls)) == len(cfg.urls), "--url: a target is given twice")
    need(cfg.sessions >= 1, "--sessions must be >= 1")
    need(cfg.concurrency >= 1, "--concurrency must be >= 1")
    need(1 <= cfg.workers <= 64, "--workers must be in 1..64")
    need(0 < cfg.duration <= 24 * 3600, "--duration must be in (0, 86400] seconds")
    need(0 <= cfg.warmup_s <= 3600, "--warmup-s must be in [0, 3600] seconds")
    need(cfg.mode == "closed" or cfg.rate > 0, "--mode open needs --rate > 0")
    need(not (cfg.batched and cfg.mode == "open"), "--batched runs a closed loop (an engine steps when it can)")
    need(cfg.transport in TRANSPORTS, f"--transport: expected one of {', '.join(TRANSPORTS)}")
    need(
        cfg.batched or cfg.transport in ("stream", "http"),
        f"--transport {cfg.transport} carries --batched steps (without --batched each user's calls go over HTTP)",
    )
    need(cfg.shards >= 0 and cfg.shard_tokens >= 0, "--shards and --shard-tokens must be >= 0")
    need(not (cfg.sharded and cfg.batched), "sharded sessions run one session per user (not with --batched)")
    need(not (cfg.sharded and cfg.create == "post"), "sharded sessions name their shards (not with --create post)")
    need(
        not cfg.shards or cfg.shard_tokens or cfg.decode_steps > 0,
        "--shards needs --decode-steps > 0 (a session's length) or --shard-tokens",
    )
    need(cfg.prefill >= 0 and cfg.chunk >= 1, "--prefill must be >= 0 and --chunk >= 1")
    need(cfg.decode_steps >= 0, "--decode-steps must be >= 0")
    need(cfg.layers >= 1 and cfg.qo_heads >= 1 and cfg.kv_heads >= 1 and cfg.head_dim >= 1, "sizes must be >= 1")
    need(cfg.qo_heads % cfg.kv_heads == 0, "--kv-heads must divide --qo-heads")
    need(
        cfg.timeout > 0 and cfg.retries >= 0 and cfg.max_errors >= 1, "--timeout > 0, --retries >= 0, --max-errors >= 1"
    )
    need(0.0 <= cfg.verify <= 1.0, "--verify is a fraction in [0, 1]")
    need(not (cfg.verify and cfg.kv_format != "f32"), "--verify checks f32 sessions only (TurboQuant is lossy)")
    for url in [*cfg.urls, *cfg.metrics_urls]:
        parts = urllib.parse.urlsplit(url)
        need(parts.scheme in ("http", "https") and bool(parts.hostname), f"not an http(s) URL: {url!r}")
    if cfg.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib: pip install matplotlib (or the project's extra: pip install -e '.[bench]')"
            ) from None


def check_loopback(urls: list[str]) -> None:
    """Refuse any URL whose host resolves to an address outside 127.0.0.0/8 and ::1."""
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
        except socket.gaierror as exc:
            raise UsageError(f"{url}: cannot resolve {host!r}: {exc}") from None
        bad = sorted({info[4][0] for info in infos if not ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback})
        if bad:
            raise UsageError(
                f"{url}: {host} is not a loopback address ({', '.join(bad)}); "
                "pass --allow-remote only for a host you run yourself"
            )
