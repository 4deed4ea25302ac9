"""loadtest.py's driver: the virtual users (one session each, created, prefilled,
decoded, deleted), their measurements, the worker processes, and the server's
/metrics before and after.

A run starts with a warm-up (``--warmup-s``): the users run as they will after it,
but the requests that start in it are not measured (first-use kernel compiles, cold
caches); the measurement is the ``--duration`` seconds after it."""

from __future__ import annotations

import asyncio
import math
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

from attnserve_client import APIError, AsyncClient, AsyncShardedSession, AttnServeError

from .config import OPERATIONS, TRANSPORTS, Config
from .prometheus import parse_prometheus

#: --batched: array bytes of one batched request at most (a larger step is split).
BATCH_BYTES = 24 << 20

#: The running totals the report gives as rates: counted over the whole run, less
#: their values at the end of the warm-up (Recorder.end_warmup).
RATE_TOTALS = ("attends", "decode_tokens", "prefill_tokens", "kv_rows")


# ── measurements ─────────────────────────────────────────────────────────────


@dataclass
class TargetStats:
    """What went to one target (``--url``): the latencies of its sessions' operations,
    their errors, sessions, attends and decode tokens; with sharded sessions, the
    shards it held (the operations span targets: they count in the totals only)."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    sessions: int = 0
    attends: int = 0
    decode_tokens: int = 0
    shards: int = 0
    warm: dict[str, int] = field(default_factory=dict)  # attends, decode_tokens as the warm-up ended

    def add(self, other: TargetStats) -> None:
        for op, lats in other.samples.items():
            self.samples.setdefault(op, []).extend(lats)
        for name in ("errors", "sessions", "attends", "decode_tokens", "shards"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, n in other.warm.items():
            self.warm[name] = self.warm.get(name, 0) + n

    def measured(self, name: str) -> int:
        """``attends`` or ``decode_tokens`` after the warm-up."""
        return getattr(self, name) - self.warm.get(name, 0)


class Recorder:
    """Every completed operation as (start time, latency), per operation; errors by
    type; and per target (``targets``) what went there. Operations that started in
    the first ``warmup`` seconds are only counted (``warmup_requests``); errors count
    over the whole run."""

    def __init__(self, t0: float, warmup: float = 0.0) -> None:
        self.t0 = t0
        self.warmup = warmup
        self.warm: dict[str, int] | None = None  # RATE_TOTALS as the warm-up ended (end_warmup)
        self.warmup_requests: Counter[str] = Counter()
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
        self.targets: dict[str, TargetStats] = {}

    def target(self, url: str) -> TargetStats:
        return self.targets.setdefault(url, TargetStats())

    def ok(self, op: str, start: float, latency: float, target: str | None = None) -> None:
        """A completed operation (also under ``target``, its session's URL): measured
        unless it started in the warm-up."""
        if start - self.t0 < self.warmup:
            self.warmup_requests[op] += 1
            return
        self.samples[op].append((start - self.t0, latency))
        if target is not None:
            self.target(target).samples.setdefault(op, []).append(latency)

    def end_warmup(self) -> None:
        """The warm-up is over (or the run stopped in it): the rates count from now.
        Only the first call counts."""
        if self.warm is not None:
            return
        self.warm = {name: getattr(self, name) for name in RATE_TOTALS}
        for stats in self.targets.values():
            stats.warm = {"attends": stats.attends, "decode_tokens": stats.decode_tokens}

    def measured(self, name: str) -> int:
        """One of RATE_TOTALS after the warm-up."""
        return getattr(self, name) - (self.warm or {}).get(name, 0)

    def error(self, op: str, exc: BaseException, session_id: str | None) -> str:
        kind = error_kind(exc)
        self.errors[kind] += 1
        self.errors_by_op[op] += 1
        self.error_times.append(time.perf_counter() - self.t0)
        if len(self.error_examples) < 20:
            self.error_examples.append(
                {
                    "t": round(time.perf_counter() - self.t0, 3),
                    "op": op,
                    "type": kind,
                    "session_id": session_id,
                    "message": str(exc)[:300],
                }
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
        self.rec = Recorder(t0, cfg.warmup_s)
        self.load_end_requested: float | None = None
        self.seed = seed
        self.seeds = np.random.SeedSequence(seed)

    # Each request takes a concurrency slot only while it is in flight.
    async def _timed(self, op: str, coro_fn, session_id: str | None, target: str | None = None) -> Any:
        """Run one operation and record it (also under ``target``, its session's URL)."""
        async with self.sem:
            start = time.perf_counter()
            try:
                result = await coro_fn()
            except AttnServeError as exc:
                self._failed(op, exc, session_id)
                if target is not None:
                    self.rec.target(target).errors += 1
                raise
            self.rec.ok(op, start, time.perf_counter() - start, target)
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

    async def user(self, clients: list[AsyncClient], index: int) -> None:
        """One virtual user: sessions one after another on target ``index % N`` (its
        number over all worker processes), or sharded over every target."""
        cfg = self.cfg
        client: Any = clients if cfg.sharded else clients[(self.user_offset + index) % len(clients)]
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

    async def _session(self, client: Any, rng: np.random.Generator, sid: str, step_interval: float) -> None:
        """One session's life: create, prefill, decode, delete (also after a failure).
        ``client``: the session's target, or every target for a sharded session."""
        target = getattr(client, "base_url", None)
        session = await self._create(client, sid, target)
        self.rec.sessions_started += 1
        self.rec.live_sessions += 1
        if target is not None:
            self.rec.target(target).sessions += 1
        try:
            await self._run_session(session, rng, step_interval, target)
        finally:
            self.rec.live_sessions -= 1
            await self._delete(session, target)

    async def engine(self, clients: list[AsyncClient]) -> None:
        """--batched: this process's sessions as one engine's batch. A cohort of
        ``--sessions`` sessions is created, prefilled and decoded in lockstep, every
        layer of every chunk or token one batched step for all of them (ops
        ``prefill_batch``, ``decode_batch``; ``decode_step`` = one token through all
        layers), then deleted; then the next cohort. A failed step ends its cohort.
        The steps go over one stream per target (``--transport``: the WebSocket, the
        frame transport or shared memory) or over HTTP; with several targets, session
        ``i`` of a cohort lives on target ``i % N`` and each step is one batched step
        per target, at once."""
        transport = TRANSPORTS[self.cfg.transport]
        if transport is None:
            await self._engine(clients, clients)
            return
        streams = [await client.stream(transport=transport) for client in clients]
        try:
            await self._engine(clients, streams)
        finally:
            for stream in streams:
                await stream.close()

    async def _engine(self, clients: list[AsyncClient], steps: list) -> None:
        """``steps[t]``: what sends target ``t``'s batched steps (its client or stream)."""
        cfg = self.cfg
        rng = np.random.default_rng(self.seeds.spawn(1)[0])
        cohort = 0
        while not self.stop.is_set():
            ids = [f"lt-{self.run_id}-c{self.user_offset}-{cohort}-{i}" for i in range(cfg.sessions)]
            cohort += 1
            places = [i % len(clients) for i in range(len(ids))]
            created = await asyncio.gather(
                *(self._create(clients[t], sid, clients[t].base_url) for t, sid in zip(places, ids)),
                return_exceptions=True,
            )
            sessions = [c for c in created if not isinstance(c, BaseException)]
            self.rec.sessions_started += len(sessions)
            self.rec.live_sessions += len(sessions)
            for t, c in zip(places, created):
                if not isinstance(c, BaseException):
                    self.rec.target(clients[t].base_url).sessions += 1
            try:
                if len(sessions) == len(ids):
                    await self._run_cohort(steps, sessions, rng, [clients[t].base_url for t in places])
                else:
                    await self._sleep_until(time.perf_counter() + 0.2)
            except AttnServeError:
                await self._sleep_until(time.perf_counter() + 0.2)
            finally:
                self.rec.live_sessions -= len(sessions)
                await asyncio.gather(*(self._delete(s) for s in sessions))

    async def _create(self, client: Any, sid: str, target: str | None = None):
        """A session on ``client``; with sharded sessions (``client``: every target's
        client) a ShardedSession over them, whose shards open as its rows need them."""
        cfg = self.cfg
        max_tokens = cfg.prefill + cfg.decode_steps if cfg.decode_steps else None
        spec = dict(
            num_qo_heads=cfg.qo_heads,
            num_kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            num_layers=cfg.layers,
            kv_format=cfg.kv_format,
            max_tokens=max_tokens,
        )
        if cfg.sharded:
            make = lambda: AsyncShardedSession.create(client, shard_tokens=cfg.shard_size(), session_id=sid, **spec)
        else:
            make = lambda: client.create_session(
                **spec, session_id=sid if cfg.create == "put" else None, server_assigned_id=cfg.create == "post"
            )
        return await self._timed("create", make, sid, target)

    async def _run_cohort(self, steps: list, sessions: list, rng: np.random.Generator, places: list[str]) -> None:
        """``steps[t]``: what sends target ``t``'s batched steps (its client or stream);
        ``places[i]``: the URL of session ``i``'s target."""
        cfg = self.cfg
        urls = list(dict.fromkeys(places))
        groups = [[i for i, url in enumerate(places) if url == target] for target in urls]
        history = [[([], []) for _ in range(cfg.layers)] for _ in sessions] if cfg.verify else None

        async def step(op: str, layer: int, rows: int) -> None:
            b = len(sessions)
            q = self._rows(rng, b * rows, cfg.qo_heads).reshape(b, rows, cfg.qo_heads, cfg.head_dim)
            k = self._rows(rng, b * rows, cfg.kv_heads).reshape(b, rows, cfg.kv_heads, cfg.head_dim)
            v = self._rows(rng, b * rows, cfg.kv_heads).reshape(b, rows, cfg.kv_heads, cfg.head_dim)
            if history is not None:
                for i in range(b):
                    history[i][layer][0].append(k[i])
                    history[i][layer][1].append(v[i])
            outs = np.empty_like(q)

            async def one(t: int, idx: list[int]) -> None:
                at: Any = slice(None) if len(groups) == 1 else idx  # one target: the arrays as they are
                part = [sessions[i] for i in idx]
                outs[at] = await self._attend_stacked(steps[t], part, layer, q[at], k[at], v[at])

            await self._timed(op, lambda: asyncio.gather(*(one(t, idx) for t, idx in enumerate(groups))), None)
            self.rec.attends += b
            self.rec.kv_rows += rows * b
            for url, idx in zip(urls, groups):
                self.rec.target(url).attends += len(idx)
                if op == "decode_batch" and layer == cfg.layers - 1:
                    self.rec.target(url).decode_tokens += len(idx)
            if history is not None and rows == 1:
                for i, s in enumerate(sessions):
                    if rng.random() < cfg.verify:
                        self._verify(s.session_id, layer, q[i], outs[i], history[i][layer])

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

    async def _attend_stacked(
        self, steps: Any, sessions: list, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray
    ) -> np.ndarray:
        """One batched step in the stacked form (one fused append and attend per
        session, each at its offset), sent as several requests of at most
        BATCH_BYTES of arrays each when it is larger (a 32-session prefill chunk of
        256 rows at 32/8 heads of 128 is ~200 MB, past any body limit), concurrently."""
        size = max(1, BATCH_BYTES // max(1, q[0].nbytes + k[0].nbytes + v[0].nbytes))
        parts = [slice(i, i + size) for i in range(0, len(sessions), size)]
        outs = await asyncio.gather(
            *(
                steps.attend_stacked(
                    sessions[p], layer, q[p], k[p], v[p], offsets=[s.lengths[layer] for s in sessions[p]]
                )
                for p in parts
            )
        )
        return np.concatenate(outs)

    def _rows(self, rng: np.random.Generator, n: int, heads: int) -> np.ndarray:
        return rng.standard_normal((n, heads, self.cfg.head_dim), dtype=np.float32)

    async def _run_session(self, session, rng: np.random.Generator, step_interval: float, target: str | None) -> None:
        cfg = self.cfg
        counts = self.rec.target(target) if target is not None else None
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
                await self._timed(
                    "prefill_chunk", lambda ly=layer, q=q, k=k, v=v: session.attend(ly, q, k=k, v=v), sid, target
                )
                self.rec.attends += 1
                if counts is not None:
                    counts.attends += 1
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
                out = await self._timed(
                    "decode", lambda ly=layer, q=q, k=k, v=v: session.attend(ly, q, k=k, v=v), sid, target
                )
                self.rec.attends += 1
                if counts is not None:
                    counts.attends += 1
                self.rec.kv_rows += 1
                if history is not None:
                    history[layer][0].append(k)
                    history[layer][1].append(v)
                    if rng.random() < cfg.verify:
                        self._verify(sid, layer, q, out, history[layer])
            self.rec.ok("decode_step", step_start, time.perf_counter() - step_start)
            self.rec.decode_tokens += 1
            if counts is not None:
                counts.decode_tokens += 1
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

    async def _delete(self, session, target: str | None = None) -> None:
        for shard in getattr(session, "shards", ()):  # a sharded session: where its shards were
            self.rec.target(shard.base_url).shards += 1
        try:
            await self._timed("delete", session.delete, session.session_id, target)
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
        seen = 0
        last_t, last_attends, last_tokens = 0.0, 0, 0
        while True:
            await asyncio.sleep(every)
            write_progress(mode, self.progress_line(seen, last_t, last_attends, last_tokens))
            seen, last_t = len(self.rec.samples["decode_step"]), time.perf_counter() - self.t0
            last_attends, last_tokens = self.rec.attends, self.rec.decode_tokens

    def progress_line(self, seen_steps: int, last_t: float, last_attends: int, last_tokens: int) -> str:
        """The live line: rates since ``last_t`` from the running totals the summary
        counts too (``attends``, ``decode_tokens``: per session, batched or not), the
        step latencies of the decode steps after the first ``seen_steps``."""
        now = time.perf_counter() - self.t0
        window = max(now - last_t, 1e-9)
        steps = sorted(lat for _, lat in self.rec.samples["decode_step"][seen_steps:])
        attends = (self.rec.attends - last_attends) / window
        tokens = (self.rec.decode_tokens - last_tokens) / window
        return (
            f"{elapsed(self.cfg, now)} sessions {self.rec.live_sessions} live "
            f"{self.rec.sessions_started} started | attends {attends:7.1f}/s "
            f"| tokens {tokens:6.1f}/s step p50 {fmt_ms(percentile(steps, 50))} "
            f"p99 {fmt_ms(percentile(steps, 99))} | errors {self.rec.error_count}"
        )


def elapsed(cfg: Config, t: float) -> str:
    """A progress line's clock: ``t`` seconds into the run, of warm-up and load."""
    return f"[{t:6.1f}s/{cfg.warmup_s + cfg.duration:.0f}s{' warm-up' if t < cfg.warmup_s else ''}]"


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
        timeout=httpx.Timeout(cfg.timeout),
        trust_env=False,
        follow_redirects=False,
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
    # a sharded session's step is one request per shard at once
    connections = (cfg.concurrency + 4) * ((cfg.shards or len(cfg.urls)) if cfg.sharded else 1)
    async with _http(cfg, connections) as http:
        clients = [
            AsyncClient(
                url, api_key=cfg.api_key, timeout=httpx.Timeout(cfg.timeout), max_retries=cfg.retries, http_client=http
            )
            for url in cfg.urls
        ]
        if cfg.batched:
            users.append(asyncio.create_task(lt.engine(clients), name="engine"))
        else:
            users.extend(asyncio.create_task(lt.user(clients, i), name=f"user-{i}") for i in range(cfg.sessions))
        helpers = [asyncio.create_task(lt.progress(mode))]
        if slot is not None:
            helpers.append(asyncio.create_task(lt.share(slot)))
        try:
            await lt._sleep_until(lt.t0 + cfg.warmup_s)  # the warm-up (sooner when the run stops in it)
            lt.rec.end_warmup()
            await lt._sleep_until(lt.t0 + cfg.warmup_s + cfg.duration)  # the measured load
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
    return Outcome(
        lt.rec, lt.stop_reason, interrupted, lt.load_end_requested or time.perf_counter(), time.perf_counter()
    )


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
            share = Config(
                **{
                    **asdict(cfg),
                    "sessions": sessions,
                    "workers": 1,
                    "concurrency": max(1, _split(cfg.concurrency, n, i)),
                    "rate": cfg.rate * sessions / cfg.sessions,
                    "max_errors": max(1, cfg.max_errors // n),
                }
            )
            futures.append(asyncio.wrap_future(pool.submit(_worker, share, i, run_id, int(seeds[i]), t0, offset)))
            offset += sessions
        progress = asyncio.create_task(_progress_workers(cfg, slots, n, t0, mode))
        try:
            outcomes = await asyncio.gather(*futures)
        finally:
            progress.cancel()
            if mode == "line":
                sys.stderr.write("\n")
    rec = Recorder(t0, cfg.warmup_s)
    rec.warm = {name: sum((o.rec.warm or {}).get(name, 0) for o in outcomes) for name in RATE_TOTALS}
    for o in outcomes:
        rec.warmup_requests.update(o.rec.warmup_requests)
        for op in OPERATIONS:
            rec.samples[op].extend(o.rec.samples[op])
        rec.errors.update(o.rec.errors)
        rec.errors_by_op.update(o.rec.errors_by_op)
        rec.error_examples.extend(o.rec.error_examples)
        rec.error_times.extend(o.rec.error_times)
        for url, stats in o.rec.targets.items():
            rec.target(url).add(stats)
        for name in (
            "verified",
            "verify_failed",
            "sessions_started",
            "sessions_completed",
            "prefill_tokens",
            "decode_tokens",
            "kv_rows",
            "attends",
        ):
            setattr(rec, name, getattr(rec, name) + getattr(o.rec, name))
    for op in OPERATIONS:
        rec.samples[op].sort()
    rec.error_examples = sorted(rec.error_examples, key=lambda e: e.get("t", 0))[:20]
    reasons = [o.stop_reason for o in outcomes if o.stop_reason != "duration"]
    return Outcome(
        rec,
        reasons[0] if reasons else "duration",
        any(o.interrupted for o in outcomes),
        max(o.load_end for o in outcomes),
        max(o.end for o in outcomes),
    )


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
            f"{elapsed(cfg, now - t0)} {n} workers, "
            f"sessions {sum(slots[i * 5 + 3] for i in range(n)):.0f} live "
            f"{sum(slots[i * 5 + 4] for i in range(n)):.0f} started | attends {(attends - last[0]) / window:7.1f}/s "
            f"| tokens {(tokens - last[1]) / window:6.1f}/s | errors {sum(slots[i * 5 + 2] for i in range(n)):.0f}"
        )
        last = (attends, tokens, now)
        write_progress(mode, line)
