#!/usr/bin/env python3
"""Load test of an attnserve server (or of the router in front of its replicas).

Each virtual user holds one session at a time and runs it through the life of a
sequence in a model with ``--layers`` layers:

1. create it (``PUT /v1/sessions/{id}`` with an id of its own, so it also works
   through the router; ``--create post`` uses ``POST``);
2. prefill a prompt of ``--prefill`` tokens in chunks of ``--chunk``: each chunk
   is one fused attend (q, k and v of ``chunk`` rows) per layer, chunk by chunk;
3. run fused decode steps: one attend with q, k, v of one row per layer, layer
   after layer, ``--decode-steps`` times (0: until the end of the run);
4. delete it, and start over with a new session.

Closed loop (default): a user sends its next request when the last one answered.
Open loop (``--mode open --rate R``): decode steps arrive as a Poisson process of
R steps per second over all users; a step's latency counts from when it was due,
so queueing behind a slow server is measured, not hidden. ``--concurrency`` caps
the requests in flight over all users.

It prints a live progress line, then p50/p90/p99/max latency per operation,
attends and tokens per second, errors by type and the server's own metrics
(``/metrics``) before and after; ``--json-out`` writes all of it as JSON and
``--plot`` a PNG (latency histogram and latency over time). It stops by itself
after ``--duration`` seconds (then deletes its sessions), and exits 1 on any
error (an error answer, a transport failure, a wrong result with ``--verify``),
2 on a usage or setup problem.

Traffic goes only to the address given with ``--url`` (and any ``--metrics-url``),
which must be a loopback address unless ``--allow-remote`` is given; proxies from
the environment are ignored and redirects are not followed.

    python loadtest/loadtest.py --url http://127.0.0.1:8000 --sessions 16 --duration 60 \\
        --prefill 512 --kv-format turboquant --json-out out/run.json --plot out/run.png
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import ipaddress
import json
import math
import os
import platform
import random
import re
import signal
import socket
import sys
import time
import urllib.parse
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

try:
    import attnserve_client
except ImportError:  # a plain checkout: use the client from the repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
    import attnserve_client

from attnserve_client import APIError, AsyncClient, AttendItem, AttnServeError

__all__ = ["main", "parse_args", "run", "summarize"]

#: The operations measured, in report order. decode_step is one token through all
#: layers (its latency counts from when it was due in open loop).
OPERATIONS = ("create", "prefill_chunk", "prefill_batch", "decode", "decode_batch", "decode_step", "delete")

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2
#: --batched: array bytes of one batched request at most (a larger step is split).
BATCH_BYTES = 24 << 20


class UsageError(Exception):
    """A setup problem (bad argument, unreachable server): exit 2."""


# ── configuration ────────────────────────────────────────────────────────────


@dataclass
class Config:
    url: str
    sessions: int = 8
    concurrency: int = 0  # 0: = sessions
    workers: int = 1
    duration: float = 30.0
    mode: str = "closed"
    rate: float = 0.0
    batched: bool = False
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

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["api_key"] = "***" if self.api_key else None
        return d


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(
        prog="loadtest.py",
        description="Load test of an attnserve server: sessions that prefill a prompt in chunks, "
        "then run fused decode steps over several layers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server or router (loopback only, see --allow-remote)")
    p.add_argument("--sessions", type=int, default=8, help="virtual users; each holds one session at a time")
    p.add_argument("--concurrency", type=int, default=0, help="most requests in flight over all users (0: --sessions)")
    p.add_argument("--workers", type=int, default=1,
                   help="load-generating processes (the users are split over them; use a few on a many-core host)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load; then sessions are deleted and it stops")
    p.add_argument("--mode", choices=("closed", "open"), default="closed", help="closed or open loop")
    p.add_argument("--rate", type=float, default=0.0, help="open loop: decode steps per second over all users")
    p.add_argument("--batched", action="store_true",
                   help="engine-shaped: each worker runs its --sessions in lockstep, one batched step "
                   "(POST /v1/batch/attend) per layer for all of them, prefill chunks and decode tokens alike")
    p.add_argument("--prefill", type=int, default=256, help="prompt tokens per session")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (rows per fused attend)")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps per session (0: until the end)")
    p.add_argument("--layers", type=int, default=4, help="layers per session")
    p.add_argument("--qo-heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (GQA)")
    p.add_argument("--head-dim", type=int, default=64, help="head size (turboquant: 32, 64, 128)")
    p.add_argument("--kv-format", default="f32", help="f32 or turboquant (what the server offers)")
    p.add_argument("--create", choices=("put", "post"), default="put", help="PUT with own ids (router-safe) or POST")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--retries", type=int, default=0,
                   help="client retries of 503/429 and lost connections (0: every failure counts)")
    p.add_argument("--verify", type=float, default=0.0, metavar="FRACTION",
                   help="f32: check this fraction of decode outputs against a float64 reference")
    p.add_argument("--max-errors", type=int, default=100, help="stop early after this many errors")
    p.add_argument("--seed", type=int, default=None, help="seed of the random inputs")
    # The key's value never becomes an argparse default: --help would print it.
    p.add_argument("--api-key", default=None, help="bearer token (default: $ATTNSERVE_API_KEY, never shown)")
    p.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="scrape /metrics here (repeat: e.g. each replica behind a router); default: --url")
    p.add_argument("--json-out", help="write the report as JSON to this file")
    p.add_argument("--plot", help="write a PNG latency plot to this file (needs matplotlib)")
    p.add_argument("--progress", choices=("auto", "line", "log", "off"), default="auto",
                   help="live progress: one rewritten line (tty), a log line every 5 s, or none")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback target (only hosts you run yourself)")
    a = p.parse_args(argv)
    cfg = Config(
        url=a.url.rstrip("/"), sessions=a.sessions, concurrency=a.concurrency or a.sessions, workers=a.workers,
        duration=a.duration, mode=a.mode, rate=a.rate, batched=a.batched, prefill=a.prefill, chunk=a.chunk,
        decode_steps=a.decode_steps, layers=a.layers, qo_heads=a.qo_heads, kv_heads=a.kv_heads,
        head_dim=a.head_dim, kv_format=a.kv_format, create=a.create, timeout=a.timeout,
        retries=a.retries, verify=a.verify, max_errors=a.max_errors, seed=a.seed,
        api_key=a.api_key if a.api_key is not None else os.environ.get("ATTNSERVE_API_KEY"),
        metrics_urls=[u.rstrip("/") for u in a.metrics_url] or [a.url.rstrip("/")],
        json_out=a.json_out, plot=a.plot, progress=a.progress, allow_remote=a.allow_remote,
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

    need(cfg.sessions >= 1, "--sessions must be >= 1")
    need(cfg.concurrency >= 1, "--concurrency must be >= 1")
    need(1 <= cfg.workers <= 64, "--workers must be in 1..64")
    need(0 < cfg.duration <= 24 * 3600, "--duration must be in (0, 86400] seconds")
    need(cfg.mode == "closed" or cfg.rate > 0, "--mode open needs --rate > 0")
    need(not (cfg.batched and cfg.mode == "open"), "--batched runs a closed loop (an engine steps when it can)")
    need(cfg.prefill >= 0 and cfg.chunk >= 1, "--prefill must be >= 0 and --chunk >= 1")
    need(cfg.decode_steps >= 0, "--decode-steps must be >= 0")
    need(cfg.layers >= 1 and cfg.qo_heads >= 1 and cfg.kv_heads >= 1 and cfg.head_dim >= 1, "sizes must be >= 1")
    need(cfg.qo_heads % cfg.kv_heads == 0, "--kv-heads must divide --qo-heads")
    need(cfg.timeout > 0 and cfg.retries >= 0 and cfg.max_errors >= 1, "--timeout > 0, --retries >= 0, --max-errors >= 1")
    need(0.0 <= cfg.verify <= 1.0, "--verify is a fraction in [0, 1]")
    need(not (cfg.verify and cfg.kv_format != "f32"), "--verify checks f32 sessions only (TurboQuant is lossy)")
    for url in [cfg.url, *cfg.metrics_urls]:
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


# ── measurements ─────────────────────────────────────────────────────────────


class Recorder:
    """Every completed operation as (start time, latency), per operation; errors by type."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.samples: dict[str, list[tuple[float, float]]] = {op: [] for op in OPERATIONS}
        self.errors: Counter[str] = Counter()
        self.errors_by_op: Counter[str] = Counter()
        self.error_examples: list[dict[str, Any]] = []
        self.error_times: list[float] = []
        self.verified = 0
        self.verify_failed = 0
        self.sessions_started = 0
        self.sessions_completed = 0
        self.live_sessions = 0
        self.prefill_tokens = 0  # prompt tokens through all layers
        self.decode_tokens = 0  # decode steps through all layers
        self.kv_rows = 0  # rows appended, summed over layers
        self.attends = 0

    def ok(self, op: str, start: float, latency: float) -> None:
        self.samples[op].append((start - self.t0, latency))

    def error(self, op: str, exc: BaseException, session_id: str | None) -> str:
        kind = error_kind(exc)
        self.errors[kind] += 1
        self.errors_by_op[op] += 1
        self.error_times.append(time.perf_counter() - self.t0)
        if len(self.error_examples) < 20:
            self.error_examples.append(
                {"t": round(time.perf_counter() - self.t0, 3), "op": op, "type": kind,
                 "session_id": session_id, "message": str(exc)[:300]}
            )
        return kind

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def error_kind(exc: BaseException) -> str:
    """An error's type for the report: the problem slug of an error answer
    (``session-not-found``), else the exception's class name."""
    if isinstance(exc, APIError):
        if exc.type:
            return exc.type.rstrip("/").rsplit("/", 1)[-1]
        return f"http-{exc.status}"
    if isinstance(exc, WrongResult):
        return "wrong-result"
    return type(exc).__name__


class WrongResult(AttnServeError):
    """A decode output that differs from the float64 reference (``--verify``)."""


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, by linear interpolation."""
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def op_stats(latencies: list[float]) -> dict[str, Any]:
    xs = sorted(latencies)
    ms = lambda v: None if math.isnan(v) else round(v * 1000.0, 3)  # noqa: E731
    return {
        "count": len(xs),
        "p50_ms": ms(percentile(xs, 50)),
        "p90_ms": ms(percentile(xs, 90)),
        "p99_ms": ms(percentile(xs, 99)),
        "max_ms": ms(xs[-1] if xs else math.nan),
        "mean_ms": ms(sum(xs) / len(xs) if xs else math.nan),
    }


# ── server metrics ──────────────────────────────────────────────────────────

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?)\s+(\S+)(?:\s+\d+)?$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            out[m.group(1)] = float(m.group(2))
        except ValueError:
            continue
    return out


def metric_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What changed between two scrapes (new series count from zero)."""
    delta = {}
    for key, value in after.items():
        d = value - before.get(key, 0.0)
        if d != 0 and not math.isnan(d):
            delta[key] = d
    return delta


async def scrape(http: httpx.AsyncClient, urls: list[str], headers: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for base in urls:
        try:
            r = await http.get(base + "/metrics", headers=headers)
            if r.status_code != 200:
                out[base] = {"error": f"GET /metrics answered {r.status_code}"}
            else:
                out[base] = {"samples": parse_prometheus(r.text), "instance": r.headers.get("x-attnserve-instance")}
        except httpx.HTTPError as exc:
            out[base] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


# ── the virtual users ───────────────────────────────────────────────────────


def reference_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """float64 attention of one query row over all of k, v: q [H, D], k/v [L, KV, D] -> [H, D]."""
    heads, d = q.shape
    group = heads // k.shape[1]
    kk = np.repeat(k.astype(np.float64), group, axis=1)  # [L, H, D]
    vv = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("lhd,hd->hl", kk, q.astype(np.float64)) / math.sqrt(d)
    scores -= scores.max(axis=1, keepdims=True)
    w = np.exp(scores)
    w /= w.sum(axis=1, keepdims=True)
    return np.einsum("hl,lhd->hd", w, vv)


class LoadTest:
    """The virtual users of one process (``cfg`` is this process's share of the run).

    ``t0`` is a ``time.perf_counter()`` instant (CLOCK_MONOTONIC, the same in every
    process of the host), so worker processes' samples share one time axis.
    """

    def __init__(self, cfg: Config, *, run_id: str, seed: int, t0: float, user_offset: int = 0) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.user_offset = user_offset
        self.stop = asyncio.Event()
        self.stop_reason = "duration"
        self.sem = asyncio.Semaphore(cfg.concurrency)
        self.t0 = t0
        self.rec = Recorder(t0)
        self.load_end_requested: float | None = None
        self.seed = seed
        self.seeds = np.random.SeedSequence(seed)

    # Each request takes a concurrency slot only while it is in flight.
    async def _timed(self, op: str, coro_fn, session_id: str | None) -> Any:
        async with self.sem:
            start = time.perf_counter()
            try:
                result = await coro_fn()
            except AttnServeError as exc:
                self._failed(op, exc, session_id)
                raise
            self.rec.ok(op, start, time.perf_counter() - start)
            return result

    def _failed(self, op: str, exc: BaseException, session_id: str | None) -> None:
        self.rec.error(op, exc, session_id)
        if self.rec.error_count >= self.cfg.max_errors and not self.stop.is_set():
            self.stop_reason = f"{self.rec.error_count} errors (--max-errors)"
            self.stop.set()

    async def _sleep_until(self, when: float) -> None:
        delay = when - time.perf_counter()
        if delay > 0:
            try:
                await asyncio.wait_for(self.stop.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass

    async def user(self, client: AsyncClient, index: int) -> None:
        cfg = self.cfg
        rng = np.random.default_rng(self.seeds.spawn(1)[0])
        step_interval = cfg.sessions / cfg.rate if cfg.mode == "open" else 0.0
        # Spread the users' starts over a moment so they don't all create at once.
        await self._sleep_until(self.t0 + min(0.5, cfg.duration / 10) * index / cfg.sessions)
        n = 0
        while not self.stop.is_set():
            sid = f"lt-{self.run_id}-u{self.user_offset + index}-{n}"
            n += 1
            try:
                await self._session(client, rng, sid, step_interval)
            except AttnServeError:
                await self._sleep_until(time.perf_counter() + 0.2)  # no hot loop on a failing server

    async def _session(self, client: AsyncClient, rng: np.random.Generator, sid: str, step_interval: float) -> None:
        """One session's life: create, prefill, decode, delete (also after a failure)."""
        session = await self._create(client, sid)
        self.rec.sessions_started += 1
        self.rec.live_sessions += 1
        try:
            await self._run_session(session, rng, step_interval)
        finally:
            self.rec.live_sessions -= 1
            await self._delete(session)

    async def engine(self, client: AsyncClient) -> None:
        """--batched: this process's sessions as one engine's batch. A cohort of
        ``--sessions`` sessions is created, prefilled and decoded in lockstep, every
        layer of every chunk or token one batched step for all of them (ops
        ``prefill_batch``, ``decode_batch``; ``decode_step`` = one token through all
        layers), then deleted; then the next cohort. A failed step ends its cohort."""
        cfg = self.cfg
        rng = np.random.default_rng(self.seeds.spawn(1)[0])
        cohort = 0
        while not self.stop.is_set():
            ids = [f"lt-{self.run_id}-c{self.user_offset}-{cohort}-{i}" for i in range(cfg.sessions)]
            cohort += 1
            created = await asyncio.gather(*(self._create(client, sid) for sid in ids), return_exceptions=True)
            sessions = [c for c in created if not isinstance(c, BaseException)]
            self.rec.sessions_started += len(sessions)
            self.rec.live_sessions += len(sessions)
            try:
                if len(sessions) == len(ids):
                    await self._run_cohort(client, sessions, rng)
                else:
                    await self._sleep_until(time.perf_counter() + 0.2)
            except AttnServeError:
                await self._sleep_until(time.perf_counter() + 0.2)
            finally:
                self.rec.live_sessions -= len(sessions)
                await asyncio.gather(*(self._delete(s) for s in sessions))

    async def _create(self, client: AsyncClient, sid: str):
        cfg = self.cfg
        max_tokens = cfg.prefill + cfg.decode_steps if cfg.decode_steps else None
        return await self._timed(
            "create",
            lambda: client.create_session(
                num_qo_heads=cfg.qo_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                num_layers=cfg.layers, kv_format=cfg.kv_format, max_tokens=max_tokens,
                session_id=sid if cfg.create == "put" else None, server_assigned_id=cfg.create == "post",
            ),
            sid,
        )

    async def _run_cohort(self, client: AsyncClient, sessions: list, rng: np.random.Generator) -> None:
        cfg = self.cfg
        history = [[([], []) for _ in range(cfg.layers)] for _ in sessions] if cfg.verify else None

        async def step(op: str, layer: int, rows: int) -> None:
            items, qs = [], []
            for i, s in enumerate(sessions):
                q = self._rows(rng, rows, cfg.qo_heads)
                k, v = self._rows(rng, rows, cfg.kv_heads), self._rows(rng, rows, cfg.kv_heads)
                items.append(AttendItem(s, layer, q, k, v, offset=s.lengths[layer]))
                qs.append(q)
                if history is not None:
                    history[i][layer][0].append(k)
                    history[i][layer][1].append(v)
            outs = await self._timed(op, lambda: self._attend_batch(client, items), None)
            self.rec.attends += len(items)
            self.rec.kv_rows += rows * len(items)
            if history is not None and rows == 1:
                for i, (s, q, out) in enumerate(zip(sessions, qs, outs)):
                    if rng.random() < cfg.verify:
                        self._verify(s.session_id, layer, q, out, history[i][layer])

        for start in range(0, cfg.prefill, cfg.chunk):
            rows = min(cfg.chunk, cfg.prefill - start)
            for layer in range(cfg.layers):
                if self.stop.is_set():
                    return
                await step("prefill_batch", layer, rows)
            self.rec.prefill_tokens += rows * len(sessions)
        n = 0
        while (cfg.decode_steps == 0 or n < cfg.decode_steps) and not self.stop.is_set():
            t = time.perf_counter()
            for layer in range(cfg.layers):
                await step("decode_batch", layer, 1)
            self.rec.ok("decode_step", t, time.perf_counter() - t)
            self.rec.decode_tokens += len(sessions)
            n += 1
        if cfg.decode_steps and n >= cfg.decode_steps:
            self.rec.sessions_completed += len(sessions)

    async def _attend_batch(self, client: AsyncClient, items: list) -> list:
        """One batched step, sent as several requests of at most BATCH_BYTES of
        arrays each when it is larger (a 32-session prefill chunk of 256 rows at
        32/8 heads of 128 is ~200 MB, past any body limit), concurrently."""
        per_item = max(1, sum(a.nbytes for a in (items[0].q, items[0].k, items[0].v) if a is not None))
        size = max(1, BATCH_BYTES // per_item)
        parts = [items[i:i + size] for i in range(0, len(items), size)]
        outs = await asyncio.gather(*(client.attend_batch(p) for p in parts))
        return [o for part in outs for o in part]

    def _rows(self, rng: np.random.Generator, n: int, heads: int) -> np.ndarray:
        return rng.standard_normal((n, heads, self.cfg.head_dim), dtype=np.float32)

    async def _run_session(self, session, rng: np.random.Generator, step_interval: float) -> None:
        cfg = self.cfg
        sid = session.session_id
        history: list[tuple[list[np.ndarray], list[np.ndarray]]] | None = (
            [([], []) for _ in range(cfg.layers)] if cfg.verify else None
        )
        # Prefill: chunk by chunk, each chunk through every layer.
        for start in range(0, cfg.prefill, cfg.chunk):
            rows = min(cfg.chunk, cfg.prefill - start)
            for layer in range(cfg.layers):
                if self.stop.is_set():
                    return
                q = self._rows(rng, rows, cfg.qo_heads)
                k = self._rows(rng, rows, cfg.kv_heads)
                v = self._rows(rng, rows, cfg.kv_heads)
                await self._timed("prefill_chunk", lambda ly=layer, q=q, k=k, v=v: session.attend(ly, q, k=k, v=v), sid)
                self.rec.attends += 1
                self.rec.kv_rows += rows
                if history is not None:
                    history[layer][0].append(k)
                    history[layer][1].append(v)
            self.rec.prefill_tokens += rows
        # Decode: one row per layer per step; in open loop each step is due at a
        # Poisson arrival and its latency counts from then.
        due = time.perf_counter()
        step = 0
        while (cfg.decode_steps == 0 or step < cfg.decode_steps) and not self.stop.is_set():
            if step_interval:
                due += rng.exponential(step_interval)
                await self._sleep_until(due)
                if self.stop.is_set():
                    return
            step_start = due if step_interval else time.perf_counter()
            for layer in range(cfg.layers):
                q = self._rows(rng, 1, cfg.qo_heads)
                k = self._rows(rng, 1, cfg.kv_heads)
                v = self._rows(rng, 1, cfg.kv_heads)
                out = await self._timed("decode", lambda ly=layer, q=q, k=k, v=v: session.attend(ly, q, k=k, v=v), sid)
                self.rec.attends += 1
                self.rec.kv_rows += 1
                if history is not None:
                    history[layer][0].append(k)
                    history[layer][1].append(v)
                    if rng.random() < cfg.verify:
                        self._verify(sid, layer, q, out, history[layer])
            self.rec.ok("decode_step", step_start, time.perf_counter() - step_start)
            self.rec.decode_tokens += 1
            step += 1
        if cfg.decode_steps and step >= cfg.decode_steps:
            self.rec.sessions_completed += 1

    def _verify(self, sid: str, layer: int, q: np.ndarray, out: np.ndarray, hist) -> None:
        k = np.concatenate(hist[0])
        v = np.concatenate(hist[1])
        ref = reference_decode(q[0], k, v)
        self.rec.verified += 1
        err = float(np.max(np.abs(out[0].astype(np.float64) - ref)))
        if not np.all(np.isfinite(out)) or err > 2e-3 + 2e-3 * float(np.max(np.abs(ref))):
            self.rec.verify_failed += 1
            self._failed("decode", WrongResult(f"layer {layer} at length {len(k)}: max |out - ref| = {err:.3g}"), sid)

    async def _delete(self, session) -> None:
        try:
            await self._timed("delete", session.delete, session.session_id)
        except AttnServeError:
            pass

    # ── progress ──────────────────────────────────────────────────────────────

    async def share(self, slot: Any) -> None:
        """Worker processes: publish running totals to the parent's progress line."""
        while True:
            slot[0], slot[1] = self.rec.attends, self.rec.decode_tokens
            slot[2], slot[3] = self.rec.error_count, self.rec.live_sessions
            slot[4] = self.rec.sessions_started
            await asyncio.sleep(0.25)

    async def progress(self, mode: str) -> None:
        if mode == "off":
            return
        every = 1.0 if mode == "line" else 5.0
        seen = {op: 0 for op in OPERATIONS}
        last_t = 0.0
        while True:
            await asyncio.sleep(every)
            now = time.perf_counter() - self.t0
            window = max(now - last_t, 1e-9)
            recent = {op: self.rec.samples[op][seen[op]:] for op in OPERATIONS}
            seen = {op: len(self.rec.samples[op]) for op in OPERATIONS}
            last_t = now
            steps = sorted(lat for _, lat in recent["decode_step"])
            attends = len(recent["decode"]) + len(recent["prefill_chunk"])
            line = (
                f"[{now:6.1f}s/{self.cfg.duration:.0f}s] sessions {self.rec.live_sessions} live "
                f"{self.rec.sessions_started} started | attends {attends / window:7.1f}/s "
                f"| tokens {len(steps) / window:6.1f}/s step p50 {fmt_ms(percentile(steps, 50))} "
                f"p99 {fmt_ms(percentile(steps, 99))} | errors {self.rec.error_count}"
            )
            write_progress(mode, line)


def write_progress(mode: str, line: str) -> None:
    if mode == "line":
        sys.stderr.write("\r" + line.ljust(118)[:160])
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def fmt_ms(seconds: float) -> str:
    return "    -  " if math.isnan(seconds) else f"{seconds * 1000:6.1f}ms"


# ── the run ──────────────────────────────────────────────────────────────────


@dataclass
class Outcome:
    """What the users of one process did (picklable, for worker processes)."""

    rec: Recorder
    stop_reason: str
    interrupted: bool
    load_end: float
    end: float


def _http(cfg: Config, connections: int) -> httpx.AsyncClient:
    # trust_env=False: no proxy from the environment; traffic goes to --url only.
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        timeout=httpx.Timeout(cfg.timeout), trust_env=False, follow_redirects=False,
    )


async def drive(cfg: Config, lt: LoadTest, mode: str, slot: Any = None) -> Outcome:
    """Run ``lt``'s users until the duration is over (or the error limit, or a
    signal), then let them finish and delete their sessions."""
    loop = asyncio.get_running_loop()
    interrupted = False
    users: list[asyncio.Task[None]] = []

    def on_signal() -> None:
        nonlocal interrupted
        if lt.stop.is_set():
            for task in users:
                task.cancel()
        interrupted = True
        lt.stop_reason = "interrupted"
        lt.stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):
            pass
    async with _http(cfg, cfg.concurrency + 4) as http:
        client = AsyncClient(cfg.url, api_key=cfg.api_key, timeout=httpx.Timeout(cfg.timeout),
                             max_retries=cfg.retries, http_client=http)
        if cfg.batched:
            users.append(asyncio.create_task(lt.engine(client), name="engine"))
        else:
            users.extend(asyncio.create_task(lt.user(client, i), name=f"user-{i}") for i in range(cfg.sessions))
        helpers = [asyncio.create_task(lt.progress(mode))]
        if slot is not None:
            helpers.append(asyncio.create_task(lt.share(slot)))
        try:
            try:
                remaining = lt.t0 + cfg.duration - time.perf_counter()
                await asyncio.wait_for(lt.stop.wait(), timeout=max(remaining, 0.0))
            except asyncio.TimeoutError:
                lt.stop.set()
            lt.load_end_requested = time.perf_counter()
            # Requests in flight finish (each within --timeout, plus retries), then
            # every user deletes its session; past that deadline, stop regardless.
            grace = cfg.timeout * (cfg.retries + 1) * 2 + 10
            done, pending = await asyncio.wait(users, timeout=grace)
            for task in pending:
                task.cancel()
                lt.rec.errors["deadline"] += 1
            if pending:
                await asyncio.wait(pending, timeout=5)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    exc = task.exception()
                    lt.rec.errors[f"crash-{type(exc).__name__}"] += 1
                    lt.rec.error_examples.append({"op": "user", "type": "crash", "message": repr(exc)[:300]})
        finally:
            for task in helpers:
                task.cancel()
            if slot is not None:
                slot[0], slot[1], slot[2], slot[3] = lt.rec.attends, lt.rec.decode_tokens, lt.rec.error_count, 0
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.remove_signal_handler(sig)
                except (NotImplementedError, RuntimeError):
                    pass
            if mode == "line":
                sys.stderr.write("\n")
    return Outcome(lt.rec, lt.stop_reason, interrupted, lt.load_end_requested or time.perf_counter(), time.perf_counter())


def _split(total: int, parts: int, i: int) -> int:
    return total // parts + (1 if i < total % parts else 0)


# The workers' shared counters: set before the pool forks, so inherited (a shared
# array cannot travel through the pool's pickling queue).
_WORKER_SLOTS: Any = None


def _worker(cfg: Config, i: int, run_id: str, seed: int, t0: float, offset: int) -> Outcome:
    """One load-generating process of ``--workers``: its share of the users."""
    lt = LoadTest(cfg, run_id=run_id, seed=seed, t0=t0, user_offset=offset)
    return asyncio.run(drive(cfg, lt, "off", _Slot(_WORKER_SLOTS, i)))


class _Slot:
    """Five shared doubles of one worker: attends, decode tokens, errors, live, started."""

    def __init__(self, array: Any, i: int) -> None:
        self.array, self.base = array, i * 5

    def __setitem__(self, k: int, v: float) -> None:
        self.array[self.base + k] = v

    def __getitem__(self, k: int) -> float:
        return self.array[self.base + k]


async def run_workers(cfg: Config, run_id: str, seed: int, mode: str) -> Outcome:
    """Split the users over ``cfg.workers`` processes (forked: the load generator
    is Python, and one process saturates a core before a fast server does)."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    n = min(cfg.workers, cfg.sessions)
    global _WORKER_SLOTS
    slots = _WORKER_SLOTS = ctx.Array("d", n * 5, lock=False)
    t0 = time.perf_counter() + 0.5  # every worker starts its users at the same instant
    seeds = np.random.SeedSequence(seed).generate_state(n)
    futures = []
    offset = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
        for i in range(n):
            sessions = _split(cfg.sessions, n, i)
            share = Config(**{
                **asdict(cfg), "sessions": sessions, "workers": 1,
                "concurrency": max(1, _split(cfg.concurrency, n, i)),
                "rate": cfg.rate * sessions / cfg.sessions,
                "max_errors": max(1, cfg.max_errors // n),
            })
            futures.append(asyncio.wrap_future(pool.submit(_worker, share, i, run_id, int(seeds[i]), t0, offset)))
            offset += sessions
        progress = asyncio.create_task(_progress_workers(cfg, slots, n, t0, mode))
        try:
            outcomes = await asyncio.gather(*futures)
        finally:
            progress.cancel()
            if mode == "line":
                sys.stderr.write("\n")
    rec = Recorder(t0)
    for o in outcomes:
        for op in OPERATIONS:
            rec.samples[op].extend(o.rec.samples[op])
        rec.errors.update(o.rec.errors)
        rec.errors_by_op.update(o.rec.errors_by_op)
        rec.error_examples.extend(o.rec.error_examples)
        rec.error_times.extend(o.rec.error_times)
        for name in ("verified", "verify_failed", "sessions_started", "sessions_completed", "prefill_tokens",
                     "decode_tokens", "kv_rows", "attends"):
            setattr(rec, name, getattr(rec, name) + getattr(o.rec, name))
    for op in OPERATIONS:
        rec.samples[op].sort()
    rec.error_examples = sorted(rec.error_examples, key=lambda e: e.get("t", 0))[:20]
    reasons = [o.stop_reason for o in outcomes if o.stop_reason != "duration"]
    return Outcome(rec, reasons[0] if reasons else "duration", any(o.interrupted for o in outcomes),
                   max(o.load_end for o in outcomes), max(o.end for o in outcomes))


async def _progress_workers(cfg: Config, slots: Any, n: int, t0: float, mode: str) -> None:
    if mode == "off":
        return
    every = 1.0 if mode == "line" else 5.0
    last = (0.0, 0.0, time.perf_counter())
    while True:
        await asyncio.sleep(every)
        now = time.perf_counter()
        attends = sum(slots[i * 5] for i in range(n))
        tokens = sum(slots[i * 5 + 1] for i in range(n))
        window = max(now - last[2], 1e-9)
        line = (
            f"[{now - t0:6.1f}s/{cfg.duration:.0f}s] {n} workers, sessions {sum(slots[i * 5 + 3] for i in range(n)):.0f} live "
            f"{sum(slots[i * 5 + 4] for i in range(n)):.0f} started | attends {(attends - last[0]) / window:7.1f}/s "
            f"| tokens {(tokens - last[1]) / window:6.1f}/s | errors {sum(slots[i * 5 + 2] for i in range(n)):.0f}"
        )
        last = (attends, tokens, now)
        write_progress(mode, line)


async def run(cfg: Config) -> dict[str, Any]:
    """Run the load test; return the report (see :func:`summarize`)."""
    if not cfg.allow_remote:
        check_loopback([cfg.url, *cfg.metrics_urls])
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with _http(cfg, 4) as http:
        client = AsyncClient(cfg.url, api_key=cfg.api_key, timeout=httpx.Timeout(cfg.timeout), max_retries=0,
                             http_client=http)
        try:
            info = await client.info()
        except AttnServeError as exc:
            raise UsageError(f"{cfg.url}: the server does not answer GET /v1/info: {exc}") from None
        formats = info.get("kv_formats")
        if isinstance(formats, list) and cfg.kv_format not in formats:
            raise UsageError(f"--kv-format {cfg.kv_format!r}: the server offers {formats}")
        before = await scrape(http, cfg.metrics_urls, headers)

    run_id = f"{random.getrandbits(32):08x}"
    seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(1 << 32)
    mode = cfg.progress
    if mode == "auto":
        mode = "line" if sys.stderr.isatty() else "log"
    if cfg.workers > 1 and cfg.sessions > 1:
        outcome = await run_workers(cfg, run_id, seed, mode)
    else:
        lt = LoadTest(cfg, run_id=run_id, seed=seed, t0=time.perf_counter())
        outcome = await drive(cfg, lt, mode)

    async with _http(cfg, 4) as http:
        after = await scrape(http, cfg.metrics_urls, headers)
    return summarize(cfg, outcome, run_id, seed, info, before, after)


def summarize(cfg: Config, outcome: Outcome, run_id: str, seed: int, info: dict[str, Any],
              before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    rec = outcome.rec
    end = outcome.end
    stop_at = outcome.load_end - rec.t0
    # Throughput over the load phase: from the start until the stop (the requests
    # that finish after it count too; the final deletes are not load).
    window = max(stop_at, 1e-9)
    ops = {op: op_stats([lat for _, lat in rec.samples[op]]) for op in OPERATIONS}
    for op in OPERATIONS:
        ops[op]["errors"] = rec.errors_by_op.get(op, 0)
    metrics: dict[str, Any] = {}
    for base in cfg.metrics_urls:
        b, a = before.get(base, {}), after.get(base, {})
        entry: dict[str, Any] = {"instance_before": b.get("instance"), "instance_after": a.get("instance")}
        if "samples" in b and "samples" in a:
            entry["before"] = b["samples"]
            entry["after"] = a["samples"]
            entry["delta"] = metric_delta(b["samples"], a["samples"])
        else:
            entry["error"] = b.get("error") or a.get("error")
        metrics[base] = entry
    timeline = []
    seconds = int(math.ceil(end - rec.t0))
    by_second: dict[int, list[float]] = defaultdict(list)
    for t, lat in rec.samples["decode_step"]:
        by_second[int(t + lat)].append(lat)
    attends_by_second: Counter[int] = Counter(int(t + lat) for op in ("decode", "prefill_chunk") for t, lat in rec.samples[op])
    errors_by_second: Counter[int] = Counter(int(t) for t in rec.error_times)
    for s in range(seconds):
        lats = sorted(by_second.get(s, []))
        timeline.append({
            "t": s, "decode_steps": len(lats), "attends": attends_by_second.get(s, 0),
            "step_p50_ms": None if not lats else round(percentile(lats, 50) * 1000, 3),
            "step_p99_ms": None if not lats else round(percentile(lats, 99) * 1000, 3),
            "errors": errors_by_second.get(s, 0),
        })
    errors = dict(rec.errors)
    return {
        "tool": "attnserve-loadtest",
        "report_version": 1,
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": cfg.public(),
        "seed": seed,
        "run_id": run_id,
        "client": {"python": platform.python_version(), "host": platform.node(),
                   "attnserve_client": getattr(attnserve_client, "__version__", None)},
        "server": info,
        "stop_reason": outcome.stop_reason,
        "interrupted": outcome.interrupted,
        "load_seconds": round(stop_at, 3),
        "total_seconds": round(end - rec.t0, 3),
        "operations": ops,
        "throughput": {
            "attends_per_s": round(rec.attends / window, 2),
            "decode_tokens_per_s": round(rec.decode_tokens / window, 2),
            "prefill_tokens_per_s": round(rec.prefill_tokens / window, 2),
            "kv_rows_per_s": round(rec.kv_rows / window, 2),
            "requests_per_s": round(sum(len(rec.samples[op]) for op in OPERATIONS if op != "decode_step") / window, 2),
        },
        "totals": {
            "attends": rec.attends, "decode_tokens": rec.decode_tokens, "prefill_tokens": rec.prefill_tokens,
            "kv_rows": rec.kv_rows, "sessions_started": rec.sessions_started,
            "sessions_completed": rec.sessions_completed,
        },
        "errors": errors,
        "error_count": sum(errors.values()),
        "error_examples": rec.error_examples,
        "verify": {"fraction": cfg.verify, "checked": rec.verified, "failed": rec.verify_failed},
        "server_metrics": metrics,
        "timeline": timeline,
        "_samples": rec.samples,  # for the plot; dropped from the JSON
    }


# ── output ──────────────────────────────────────────────────────────────────

# Server metrics worth a line in the text report (deltas of counters; gauges after).
_METRIC_LINES = re.compile(
    r"^attnserve_(requests_total|errors_total|gpu_|batch|sessions|kv_bytes|memory_used_bytes|"
    r"request_duration_seconds_(sum|count))"
)


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = []
    server = report.get("server") or {}
    adapter = (server.get("adapter") or {}).get("name", "?")
    lines.append(
        f"attnserve load test: {cfg['url']} ({adapter}, {server.get('backend', '?')}), "
        f"{cfg['mode']} loop{' at %.1f steps/s' % cfg['rate'] if cfg['mode'] == 'open' else ''}, "
        f"{cfg['sessions']} sessions, concurrency {cfg['concurrency']}"
        f"{', %d load processes' % cfg['workers'] if cfg.get('workers', 1) > 1 else ''}"
    )
    lines.append(
        f"  {cfg['layers']} layers, {cfg['qo_heads']}/{cfg['kv_heads']} heads x {cfg['head_dim']}, "
        f"{cfg['kv_format']}, prefill {cfg['prefill']} in chunks of {cfg['chunk']}, "
        f"{cfg['decode_steps'] or 'unbounded'} decode steps; {report['load_seconds']:.1f} s of load "
        f"(stopped by {report['stop_reason']})"
    )
    lines.append("")
    lines.append(f"  {'operation':<14}{'count':>9}{'errors':>8}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for op, st in report["operations"].items():
        cell = lambda v: f"{v:10.2f}" if v is not None else f"{'-':>10}"  # noqa: E731
        lines.append(
            f"  {op:<14}{st['count']:>9}{st['errors']:>8}{cell(st['p50_ms'])}{cell(st['p90_ms'])}"
            f"{cell(st['p99_ms'])}{cell(st['max_ms'])}"
        )
    th = report["throughput"]
    lines.append("")
    lines.append(
        f"  attends/s {th['attends_per_s']:.1f} | decode tokens/s {th['decode_tokens_per_s']:.1f} | "
        f"prefill tokens/s {th['prefill_tokens_per_s']:.1f} | KV rows/s {th['kv_rows_per_s']:.1f} | "
        f"requests/s {th['requests_per_s']:.1f}"
    )
    tot = report["totals"]
    lines.append(f"  sessions: {tot['sessions_started']} started, {tot['sessions_completed']} ran all their decode steps")
    if report["verify"]["fraction"]:
        v = report["verify"]
        lines.append(f"  verified {v['checked']} decode outputs against float64: {v['failed']} wrong")
    if report["errors"]:
        lines.append("  errors: " + ", ".join(f"{k} {n}" for k, n in sorted(report["errors"].items(), key=lambda x: -x[1])))
        for ex in report["error_examples"][:5]:
            lines.append(f"    e.g. {ex.get('op')}: {ex.get('message')}")
    else:
        lines.append("  errors: none")
    for base, m in report["server_metrics"].items():
        lines.append("")
        who = m.get("instance_after") or m.get("instance_before")
        lines.append(f"  server metrics {base}/metrics{' (instance ' + who + ')' if who else ''}:")
        if "error" in m:
            lines.append(f"    unavailable: {m['error']}")
            continue
        shown = 0
        keys = [k for k in sorted(m["delta"]) if _METRIC_LINES.match(k) and "_bucket" not in k]
        width = min(max((len(k) for k in keys), default=0), 100)
        for key in keys:
            before = m["before"].get(key, 0.0)
            lines.append(f"    {key:<{width}} {before:>12.6g} -> {m['after'][key]:<12.6g} (+{m['delta'][key]:.6g})")
            shown += 1
            if shown >= 40:
                lines.append("    ...")
                break
        if not shown:
            lines.append("    (no attnserve_* series changed)")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["_samples"]
    colors = {"create": "tab:green", "prefill_chunk": "tab:orange", "decode": "tab:blue",
              "decode_step": "tab:purple", "delete": "tab:gray"}
    fig, (ax_h, ax_t) = plt.subplots(2, 1, figsize=(11, 8.5))
    all_lat = [lat for op in OPERATIONS for _, lat in samples[op]]
    if all_lat:
        lo = max(min(all_lat) * 1000, 1e-3)
        hi = max(max(all_lat) * 1000, lo * 1.01)
        bins = np.logspace(math.log10(lo), math.log10(hi), 60)
        for op in OPERATIONS:
            lats = [lat * 1000 for _, lat in samples[op]]
            if lats:
                st = report["operations"][op]
                ax_h.hist(lats, bins=bins, histtype="step", linewidth=1.5, color=colors[op],
                          label=f"{op} (n={len(lats)}, p50 {st['p50_ms']:.1f}, p99 {st['p99_ms']:.1f} ms)")
        ax_h.set_xscale("log")
        ax_h.set_yscale("log")
        ax_h.legend(fontsize=8)
    ax_h.set_xlabel("latency (ms)")
    ax_h.set_ylabel("requests")
    ax_h.set_title("latency histogram")
    rng = np.random.default_rng(0)
    for op in OPERATIONS:
        pts = samples[op]
        if not pts:
            continue
        if len(pts) > 20000:  # keep the PNG light
            idx = rng.choice(len(pts), 20000, replace=False)
            pts = [pts[i] for i in sorted(idx)]
        ax_t.scatter([t + lat for t, lat in pts], [lat * 1000 for _, lat in pts], s=2, alpha=0.35,
                     color=colors[op], label=op, rasterized=True)
    tl = [row for row in report["timeline"] if row["step_p99_ms"] is not None]
    if tl:
        xs = [r["t"] + 0.5 for r in tl]
        ax_t.plot(xs, [r["step_p50_ms"] for r in tl], color="black", linewidth=1.2, label="decode_step p50 (1 s)")
        ax_t.plot(xs, [r["step_p99_ms"] for r in tl], color="red", linewidth=1.2, label="decode_step p99 (1 s)")
    err_t = [row["t"] + 0.5 for row in report["timeline"] if row["errors"]]
    for t in err_t:
        ax_t.axvline(t, color="red", alpha=0.15, linewidth=3)
    ax_t.axvline(report["load_seconds"], color="gray", linestyle="--", linewidth=1)
    if any(samples[op] for op in OPERATIONS):
        ax_t.set_yscale("log")
    ax_t.set_xlabel("time since start (s); dashed: end of load, red bands: seconds with errors")
    ax_t.set_ylabel("latency (ms)")
    ax_t.set_title("latency over time")
    ax_t.legend(fontsize=8, markerscale=4, loc="upper right")
    cfg = report["config"]
    th = report["throughput"]
    fig.suptitle(
        f"attnserve load test, {cfg['mode']} loop, {cfg['sessions']} sessions x {cfg['layers']} layers, "
        f"{cfg['kv_format']}, prefill {cfg['prefill']}: {th['decode_tokens_per_s']:.0f} tokens/s, "
        f"{th['attends_per_s']:.0f} attends/s, errors {report['error_count']}",
        fontsize=10,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def exit_code(report: dict[str, Any]) -> int:
    if report["error_count"] or report["interrupted"]:
        return EXIT_ERRORS
    if report["totals"]["attends"] == 0:
        return EXIT_ERRORS  # nothing was measured: not a pass
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        report = asyncio.run(run(cfg))
    except UsageError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(format_report(report))
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in report.items() if not k.startswith("_")}
        Path(cfg.json_out).write_text(json.dumps(data, indent=1, default=str) + "\n")
        print(f"\n  report: {cfg.json_out}")
    if cfg.plot:
        write_plot(report, cfg.plot)
        print(f"  plot: {cfg.plot}")
    code = exit_code(report)
    if code:
        why = "interrupted" if report["interrupted"] and not report["error_count"] else (
            f"{report['error_count']} errors" if report["error_count"] else "no attend completed")
        print(f"\nloadtest: FAILED ({why})", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
