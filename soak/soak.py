#!/usr/bin/env python3
"""A bounded soak of an attnserve server: churn, then prove nothing leaked or drifted.

Workers (threads, one HTTP connection pool each) churn sessions for ``--duration``
seconds: create (POST, or PUT with an id of their own; f32 or TurboQuant, a few
shapes, 1 to 3 layers), append, attend (plain and fused decode steps, in
MessagePack and JSON), snapshot and restore (under a new id, and over a deleted
session under its own id), delete, plus requests that must be refused (offset
mismatch, unknown session, another tenant's session). With ``--tenants`` the
workers spread over API keys.

Every answer is checked as it comes: f32 attends against the float64 oracle
(``tools.reference.attention``, relative error <= 1e-5), restored sessions
against their originals bit for bit. At the end every live session is checked
once more on every layer (f32: the oracle; TurboQuant: its float64 oracle over
the codes the server holds, <= 1e-4, and the error band of exact attention), then
all are deleted, and the server must be back where it started:

* GPU bytes (``attnserve_kv_bytes`` and ``attnserve_memory_used_bytes`` of
  /metrics) at their level before the run, exactly;
* the server process's resident memory (when its pid is known: ``--spawn`` or
  ``--pid``) within ``--rss-tolerance-mb`` of its level after the warm-up. The
  warm-up (``--warmup`` seconds of the same churn, then every session deleted)
  lets caches, pipelines and the allocator reach their working size first;
* no request failed (an unexpected status or a transport error), no check failed,
  and, with ``--spawn``, no error in the server's log.

Exit 0 when all of that holds, 1 otherwise, 2 on a usage or setup problem.
``--json-out`` writes the figures (requests by operation and status, latency,
memory before and after, checks). Traffic goes only to loopback addresses.

    python soak/soak.py --spawn --duration 600 --tenants 3 --json-out soak/out/soak.json
    python soak/soak.py --url http://127.0.0.1:8421 --pid $(pgrep -f 'attnserve serve') --duration 60
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "service", ROOT / "client"):
    if _p.is_dir() and str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from tools import reference as ref  # noqa: E402
from attnserve.formats import TQ_SPECS  # noqa: E402
from attnserve.turboquant import layer_signs  # noqa: E402
from attnserve_client import wire  # noqa: E402

from tools.common import free_port, metric_sum, parse_prometheus, rel_err, stop_process  # noqa: E402

F32_TOL = 1e-5  # GPU f32 attention vs the float64 oracle (max abs error / max abs value)
TQ_TOL = 1e-4  # GPU TurboQuant attention vs its float64 oracle over the same codes
TQ_MAX_REL, TQ_MIN_CORR = 0.6, 0.8  # TurboQuant vs exact attention (tests/service/test_turboquant.py)
SHAPES = {"f32": [(4, 2, 32), (8, 8, 64), (2, 1, 16), (8, 2, 128)], "turboquant": [(4, 2, 32), (8, 2, 64), (4, 4, 128)]}
MAX_TOKENS = 256


# ── the server ───────────────────────────────────────────────────────────────


def check_loopback(url: str) -> None:
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        raise SystemExit(f"soak: cannot resolve {host!r}: {e}")
    bad = sorted({i[4][0] for i in infos if not ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback})
    if bad:
        raise SystemExit(f"soak: {url} is not a loopback address ({', '.join(bad)}); the soak only talks to loopback")


class Spawned:
    """``python -m attnserve serve`` on a free loopback port, logging to a file."""

    def __init__(self, env: dict[str, str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        pythonpath = os.pathsep.join(
            p for p in (str(ROOT / "service"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")) if p
        )
        self.env = {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp"),
            "ATTNSERVE_LOG_LEVEL": "warning",
            "ATTNSERVE_LOG_FORMAT": "json",
            "ATTNSERVE_INSTANCE_NAME": "soak",
            **env,
        }
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnserve", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
        )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"soak: the server exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit("soak: the server did not become ready")

    def stop(self) -> int | None:
        code = stop_process(self.proc, 60)
        self.log.close()
        return code

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_errors(self) -> list[str]:
        out = []
        for line in self.log_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                if "Traceback" in line or "Error" in line:
                    out.append(line)
                continue
            if rec.get("level") in ("error", "critical") or "exc" in rec:
                out.append(line[:2000])
        return out


def process_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ── bookkeeping ──────────────────────────────────────────────────────────────


@dataclass
class Sess:
    sid: str
    tenant: int
    fmt: str
    h: int
    hkv: int
    d: int
    layers: int
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.k:
            self.k = [np.zeros((0, self.hkv, self.d), np.float32) for _ in range(self.layers)]
            self.v = [np.zeros((0, self.hkv, self.d), np.float32) for _ in range(self.layers)]

    @property
    def lengths(self) -> list[int]:
        return [len(k) for k in self.k]

    def add(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])

    def copy(self, sid: str) -> "Sess":
        return Sess(sid, self.tenant, self.fmt, self.h, self.hkv, self.d, self.layers, list(self.k), list(self.v))


class Failure(Exception):
    """A request answered what it must not, or a check failed."""


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (op, status)
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.failures: list[str] = []
        self.failed_requests = 0  # an unexpected status, or no answer
        self.checks: Counter = Counter()
        self.worst = {"f32": 0.0, "turboquant": 0.0}
        self.rss_samples: list[tuple[int, float | None]] = []  # (seconds into the run, MiB)

    def request(self, op: str, status: int, seconds: float) -> None:
        with self.lock:
            self.requests[(op, status)] += 1
            lat = self.latency[op]
            if len(lat) < 200_000:
                lat.append(seconds)

    def bad_request(self) -> None:
        with self.lock:
            self.failed_requests += 1

    def fail(self, what: str) -> None:
        with self.lock:
            if len(self.failures) < 200:
                self.failures.append(what)

    def check(self, kind: str, fmt: str | None = None, err: float | None = None) -> None:
        with self.lock:
            self.checks[kind] += 1
            if fmt is not None and err is not None:
                self.worst[fmt] = max(self.worst[fmt], err)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    i = (len(xs) - 1) * q / 100
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


# ── one worker ───────────────────────────────────────────────────────────────


class Worker:
    def __init__(
        self, n: int, url: str, keys: list[str | None], stats: Stats, seed: int, max_live: int, registry: "Registry"
    ):
        self.n = n
        self.rng = np.random.default_rng(seed)
        self.rnd = random.Random(seed)
        self.keys = keys
        self.stats = stats
        self.max_live = max_live
        self.registry = registry
        self.clients = [
            httpx.Client(
                base_url=url,
                timeout=120,
                trust_env=False,
                follow_redirects=False,
                headers={"Authorization": f"Bearer {k}"} if k else {},
            )
            for k in keys
        ]
        self.live: list[Sess] = []
        self.counter = 0

    # ── HTTP ────────────────────────────────────────────────────────────────

    def call(
        self,
        op: str,
        tenant: int,
        method: str,
        path: str,
        body: Any = None,
        *,
        enc: str = "msgpack",
        expect: tuple[int, ...] = (200,),
        content: bytes | None = None,
        ctype: str | None = None,
    ) -> Any:
        headers = {"Accept": wire.MSGPACK if enc == "msgpack" else wire.JSON}
        if body is not None:
            content = wire.packb(body) if enc == "msgpack" else json.dumps(body).encode()
            headers["Content-Type"] = wire.MSGPACK if enc == "msgpack" else wire.JSON
        elif content is not None:
            headers["Content-Type"] = ctype or wire.MSGPACK
        t0 = time.perf_counter()
        try:
            r = self.clients[tenant].request(method, path, content=content, headers=headers)
        except httpx.HTTPError as e:
            self.stats.request(op, 0, time.perf_counter() - t0)
            self.stats.bad_request()
            raise Failure(f"{op} {method} {path}: {type(e).__name__}: {e}") from None
        self.stats.request(op, r.status_code, time.perf_counter() - t0)
        if r.status_code not in expect:
            self.stats.bad_request()
            raise Failure(f"{op} {method} {path}: {r.status_code} (expected {expect}): {r.text[:300]}")
        answer_type = r.headers.get("content-type", "")
        if not r.content:
            return None
        if op == "snapshot":
            return r.content
        if wire.is_msgpack(answer_type):
            return wire.unpackb(r.content, max_bytes=1 << 31)
        return r.json()

    @staticmethod
    def arr(a: np.ndarray, enc: str) -> Any:
        return wire.encode_array(a) if enc == "msgpack" else a.tolist()

    @staticmethod
    def out(body: dict) -> np.ndarray:
        o = body["out"]
        return wire.decode_array(o, name="out", finite=False) if isinstance(o, dict) else np.asarray(o, np.float32)

    def rows(self, n: int, heads: int, d: int) -> np.ndarray:
        return self.rng.standard_normal((n, heads, d)).astype(np.float32)

    # ── operations ──────────────────────────────────────────────────────────

    def create(self) -> None:
        fmt = "turboquant" if self.rnd.random() < 0.35 else "f32"
        h, hkv, d = self.rnd.choice(SHAPES[fmt])
        layers = self.rnd.randint(1, 3)
        tenant = self.rnd.randrange(len(self.keys))
        body = {
            "num_qo_heads": h,
            "num_kv_heads": hkv,
            "head_dim": d,
            "num_layers": layers,
            "kv_format": fmt,
            "max_tokens": MAX_TOKENS,
        }
        enc = self.rnd.choice(["msgpack", "json"])
        if self.rnd.random() < 0.5:
            self.counter += 1
            sid = f"soak-w{self.n}-{self.counter}-{secrets.token_hex(3)}"
            info = self.call("create", tenant, "PUT", f"/v1/sessions/{sid}", body, enc=enc, expect=(201,))
        else:
            info = self.call("create", tenant, "POST", "/v1/sessions", body, enc=enc, expect=(201,))
        if info["lengths"] != [0] * layers or info["kv_format"] != fmt:
            raise Failure(f"create: unexpected info {info}")
        s = Sess(info["session_id"], tenant, fmt, h, hkv, d, layers)
        self.live.append(s)
        self.registry.add(s)

    def append(self, s: Sess) -> None:
        layer = self.rnd.randrange(s.layers)
        n = self.rnd.choice([1, 1, 2, 7, 16, 33])
        if s.lengths[layer] + n > MAX_TOKENS:
            return self.delete(s)
        k, v = self.rows(n, s.hkv, s.d), self.rows(n, s.hkv, s.d)
        enc = "json" if n <= 7 and self.rnd.random() < 0.3 else "msgpack"
        body = {"k": self.arr(k, enc), "v": self.arr(v, enc), "offset": s.lengths[layer]}
        r = self.call("append", s.tenant, "POST", f"/v1/sessions/{s.sid}/layers/{layer}/kv", body, enc=enc)
        if r["length"] != s.lengths[layer] + n:
            raise Failure(f"append: length {r['length']}, expected {s.lengths[layer] + n}")
        s.add(layer, k, v)

    def attend(self, s: Sess) -> None:
        layer = self.rnd.randrange(s.layers)
        fused = self.rnd.random() < 0.5
        length = s.lengths[layer] + (1 if fused else 0)
        if length == 0 or length > MAX_TOKENS:
            return self.append(s) if length == 0 else self.delete(s)
        n = 1 if fused else self.rnd.randint(1, min(4, length))
        q = self.rows(n, s.h, s.d)
        enc = "json" if self.rnd.random() < 0.25 else "msgpack"
        body: dict[str, Any] = {"q": self.arr(q, enc)}
        kw: dict[str, Any] = {}
        if fused:
            k, v = self.rows(1, s.hkv, s.d), self.rows(1, s.hkv, s.d)
            body.update(k=self.arr(k, enc), v=self.arr(v, enc), offset=s.lengths[layer])
        elif self.rnd.random() < 0.3:
            kw["causal"] = False
            body["causal"] = False
        r = self.call("attend", s.tenant, "POST", f"/v1/sessions/{s.sid}/layers/{layer}/attend", body, enc=enc)
        if fused:
            s.add(layer, k, v)
        out = self.out(r)
        if r["length"] != s.lengths[layer] or out.shape != q.shape:
            raise Failure(f"attend: length {r['length']} shape {out.shape}, expected {s.lengths[layer]} {q.shape}")
        if not np.isfinite(out).all():
            raise Failure("attend: non-finite output")
        if s.fmt == "f32":
            err = rel_err(out, ref.attention(q, s.k[layer], s.v[layer], **kw))
            self.stats.check("oracle", "f32", err)
            if err > F32_TOL:
                raise Failure(f"attend: {s.sid} layer {layer}: relative error {err:.2e} > {F32_TOL}")

    def snapshot_restore(self, s: Sess) -> None:
        """Snapshot, restore under a new id (same tenant), and the copy answers bit for bit."""
        blob = self.call("snapshot", s.tenant, "GET", f"/v1/sessions/{s.sid}/snapshot")
        self.counter += 1
        new = f"soak-r{self.n}-{self.counter}-{secrets.token_hex(3)}"
        info = self.call("restore", s.tenant, "PUT", f"/v1/sessions/{new}/snapshot", content=blob, expect=(201,))
        if info["lengths"] != s.lengths:
            raise Failure(f"restore: lengths {info['lengths']}, expected {s.lengths}")
        copy = s.copy(new)
        self.live.append(copy)
        self.registry.add(copy)
        self.same_answers(s, copy)
        if self.rnd.random() < 0.5:  # keep one of the two, most of the time
            self.delete(s if self.rnd.random() < 0.5 else copy)

    def restore_over_delete(self, s: Sess) -> None:
        """Snapshot, delete, restore under the same id: the same answers as before."""
        layer = max(range(s.layers), key=lambda i: s.lengths[i])
        if not s.lengths[layer]:
            return self.append(s)
        q = self.rows(1, s.h, s.d)
        before = self.out(
            self.call(
                "attend", s.tenant, "POST", f"/v1/sessions/{s.sid}/layers/{layer}/attend", {"q": self.arr(q, "msgpack")}
            )
        )
        blob = self.call("snapshot", s.tenant, "GET", f"/v1/sessions/{s.sid}/snapshot")
        self.call("delete", s.tenant, "DELETE", f"/v1/sessions/{s.sid}", expect=(204,))
        self.call("restore", s.tenant, "PUT", f"/v1/sessions/{s.sid}/snapshot", content=blob, expect=(201,))
        after = self.out(
            self.call(
                "attend", s.tenant, "POST", f"/v1/sessions/{s.sid}/layers/{layer}/attend", {"q": self.arr(q, "msgpack")}
            )
        )
        self.stats.check("bit-identical")
        if before.tobytes() != after.tobytes():
            raise Failure(f"restore over delete: {s.sid} answers differently")

    def same_answers(self, a: Sess, b: Sess) -> None:
        for layer in range(a.layers):
            if not a.lengths[layer]:
                continue
            q = self.rows(min(2, a.lengths[layer]), a.h, a.d)
            body = {"q": self.arr(q, "msgpack")}
            x = self.out(self.call("attend", a.tenant, "POST", f"/v1/sessions/{a.sid}/layers/{layer}/attend", body))
            y = self.out(self.call("attend", b.tenant, "POST", f"/v1/sessions/{b.sid}/layers/{layer}/attend", body))
            self.stats.check("bit-identical")
            if x.tobytes() != y.tobytes():
                raise Failure(f"restore: {b.sid} answers differently from {a.sid} on layer {layer}")

    def delete(self, s: Sess) -> None:
        self.call("delete", s.tenant, "DELETE", f"/v1/sessions/{s.sid}", expect=(204,))
        self.live.remove(s)
        self.registry.remove(s)

    def refused(self, s: Sess) -> None:
        """Requests that must be refused, and change nothing."""
        layer = self.rnd.randrange(s.layers)
        kind = self.rnd.choice(["offset", "unknown", "tenant", "layer"])
        k = self.rows(1, s.hkv, s.d)
        body = {"k": self.arr(k, "msgpack"), "v": self.arr(k, "msgpack"), "offset": s.lengths[layer] + 5}
        if kind == "offset":
            self.call("refused", s.tenant, "POST", f"/v1/sessions/{s.sid}/layers/{layer}/kv", body, expect=(409,))
        elif kind == "unknown":
            self.call("refused", s.tenant, "GET", f"/v1/sessions/nope-{secrets.token_hex(4)}", expect=(404,))
        elif kind == "layer":
            self.call("refused", s.tenant, "POST", f"/v1/sessions/{s.sid}/layers/{s.layers}/kv", body, expect=(404,))
        elif len(self.keys) > 1 and self.registry.keys_enforced:
            other = (s.tenant + 1) % len(self.keys)
            self.call("refused", other, "GET", f"/v1/sessions/{s.sid}", expect=(404,))
            self.call("refused", other, "POST", f"/v1/sessions/{s.sid}/layers/{layer}/kv", body, expect=(404,))
            self.call("refused", other, "GET", f"/v1/sessions/{s.sid}/snapshot", expect=(404,))
        info = self.call("info", s.tenant, "GET", f"/v1/sessions/{s.sid}")
        if info["lengths"] != s.lengths:
            raise Failure(f"refused request changed {s.sid}: {info['lengths']} != {s.lengths}")

    def step(self) -> None:
        if len(self.live) < 2 or (len(self.live) < self.max_live and self.rnd.random() < 0.08):
            return self.create()
        s = self.rnd.choice(self.live)
        op = self.rnd.choices(
            ["append", "attend", "snapshot", "restore-over-delete", "delete", "refused", "info"],
            weights=[25, 40, 6, 3, 5, 5, 3],
        )[0]
        if op == "append":
            self.append(s)
        elif op == "attend":
            self.attend(s)
        elif op == "snapshot":
            self.snapshot_restore(s)
        elif op == "restore-over-delete":
            self.restore_over_delete(s)
        elif op == "delete":
            self.delete(s)
        elif op == "refused":
            self.refused(s)
        else:
            info = self.call("info", s.tenant, "GET", f"/v1/sessions/{s.sid}")
            if info["lengths"] != s.lengths:
                raise Failure(f"info: {s.sid} lengths {info['lengths']} != {s.lengths}")

    def run(self, until: float, stop: threading.Event) -> None:
        while time.monotonic() < until and not stop.is_set():
            try:
                self.step()
            except Failure as e:
                self.stats.fail(f"worker {self.n}: {e}")
                if len(self.stats.failures) >= 20:
                    stop.set()

    # ── the end ─────────────────────────────────────────────────────────────

    def verify(self, s: Sess) -> None:
        """Every layer of a live session, as the oracle says."""
        info = self.call("verify", s.tenant, "GET", f"/v1/sessions/{s.sid}")
        if info["lengths"] != s.lengths:
            raise Failure(f"verify: {s.sid} lengths {info['lengths']} != {s.lengths}")
        snap = None
        if s.fmt == "turboquant":
            snap = wire.unpackb(
                self.call("snapshot", s.tenant, "GET", f"/v1/sessions/{s.sid}/snapshot"), max_bytes=1 << 31
            )
        got_all, exact_all = [], []
        for layer in range(s.layers):
            n = s.lengths[layer]
            if not n:
                continue
            q = self.rows(min(4, n), s.h, s.d)
            for causal in (True, False):
                body = {"q": self.arr(q, "msgpack"), "causal": causal}
                out = self.out(
                    self.call("verify", s.tenant, "POST", f"/v1/sessions/{s.sid}/layers/{layer}/attend", body)
                )
                exact = ref.attention(q, s.k[layer], s.v[layer], causal=causal)
                if s.fmt == "f32":
                    err = rel_err(out, exact)
                    self.stats.check("final-oracle", "f32", err)
                    if err > F32_TOL:
                        raise Failure(f"verify: {s.sid} layer {layer}: relative error {err:.2e}")
                else:
                    st = snap["layers"][layer]
                    polar, jl = layer_signs(snap["config"]["seed"], layer, s.d)
                    want = ref.tqx_attention(
                        q,
                        np.frombuffer(st["k"], np.uint32),
                        np.frombuffer(st["v"], np.uint32),
                        TQ_SPECS["turboquant"],
                        n_kv_heads=s.hkv,
                        cap=st["capacity"],
                        length=st["length"],
                        polar_signs=polar,
                        jl_signs=jl,
                        causal=causal,
                    )
                    err = rel_err(out, want)
                    self.stats.check("final-oracle", "turboquant", err)
                    if err > TQ_TOL:
                        raise Failure(f"verify: {s.sid} layer {layer}: TurboQuant error vs its oracle {err:.2e}")
                    got_all.append(out.ravel())
                    exact_all.append(exact.ravel())
        if got_all and sum(map(len, got_all)) >= 256:
            got, exact = np.concatenate(got_all), np.concatenate(exact_all)
            rel = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
            corr = float(np.corrcoef(got, exact)[0, 1])
            self.stats.check("turboquant-band")
            if rel > TQ_MAX_REL or corr < TQ_MIN_CORR:
                raise Failure(
                    f"verify: {s.sid}: TurboQuant outside the band of exact attention ({rel:.2f}, {corr:.2f})"
                )

    def delete_all(self) -> None:
        for s in list(self.live):
            self.delete(s)

    def close(self) -> None:
        for c in self.clients:
            c.close()


class Registry:
    """Every live session of the run, by tenant (for the listing check)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_tenant: dict[int, set[str]] = defaultdict(set)
        self.keys_enforced = False

    def add(self, s: Sess) -> None:
        with self.lock:
            self.by_tenant[s.tenant].add(s.sid)

    def remove(self, s: Sess) -> None:
        with self.lock:
            self.by_tenant[s.tenant].discard(s.sid)


# ── the run ──────────────────────────────────────────────────────────────────


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="the server to soak (loopback only)")
    p.add_argument("--spawn", action="store_true", help="start a server of this checkout on a free loopback port")
    p.add_argument("--pid", type=int, help="the server's process id, to watch its memory (with --url)")
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an ATTNSERVE_* setting for the spawned server (repeatable)",
    )
    p.add_argument("--duration", type=float, default=60, help="seconds of churn after the warm-up (default 60)")
    p.add_argument(
        "--warmup", type=float, help="seconds of churn before the baseline (default: 20%% of the duration, 5 to 60 s)"
    )
    p.add_argument(
        "--tenants",
        default="",
        help="API keys (comma-separated), or a number N: with --spawn, N keys "
        "are made up and given to the server; without: one tenant, no key",
    )
    p.add_argument("--workers", type=int, default=4, help="concurrent workers (default 4)")
    p.add_argument("--max-live", type=int, default=6, help="sessions each worker keeps at most (default 6)")
    p.add_argument(
        "--rss-tolerance-mb",
        type=float,
        default=64.0,
        help="how far above its level after the warm-up the server's memory may end (default 64: the "
        "allocator settles 21 to 35 MiB above it, docs/reliability.md)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json-out", help="write the figures here as JSON")
    p.add_argument("--log-dir", help="where the spawned server logs (default: a temporary folder)")
    args = p.parse_args(argv)
    if bool(args.url) == bool(args.spawn):
        p.error("give exactly one of --url and --spawn")
    seed = args.seed if args.seed is not None else secrets.randbits(32)
    warmup = args.warmup if args.warmup is not None else min(60.0, max(5.0, 0.2 * args.duration))

    keys: list[str | None] = [None]
    spawn_env: dict[str, str] = {}
    tenants = args.tenants.strip()
    if tenants.isdigit():
        if int(tenants) > 1 and not args.spawn:
            p.error("--tenants N needs --spawn (else give the keys)")
        if int(tenants) >= 1 and args.spawn:
            keys = [f"soak-{i}-{secrets.token_urlsafe(12)}" for i in range(int(tenants))]
            spawn_env["ATTNSERVE_API_KEYS"] = ",".join(keys)  # type: ignore[arg-type]
    elif tenants:
        keys = [k.strip() for k in tenants.split(",") if k.strip()]
    for item in args.server_env:
        name, _, value = item.partition("=")
        spawn_env[name] = value

    server: Spawned | None = None
    if args.spawn:
        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="attnserve-soak-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        server = Spawned(spawn_env, log_dir / "server.log")
        url, pid = server.url, server.proc.pid
        server.wait_ready()
    else:
        url, pid = args.url.rstrip("/"), args.pid
    check_loopback(url)
    print(
        f"soak: {url}, {len(keys)} tenant(s), {args.workers} workers, warm-up {warmup:g} s, "
        f"run {args.duration:g} s, seed {seed}",
        flush=True,
    )

    try:
        return run(url, pid, server, keys, args, warmup, seed)
    finally:
        if server is not None:
            rc = server.stop()
            print(f"soak: server stopped ({rc}); its log: {server.log_path}")


def run(
    url: str, pid: int | None, server: Spawned | None, keys: list[str | None], args, warmup: float, seed: int
) -> int:
    probe = httpx.Client(
        base_url=url, timeout=30, trust_env=False, headers={"Authorization": f"Bearer {keys[0]}"} if keys[0] else {}
    )

    def metrics() -> dict[str, float]:
        return parse_prometheus(probe.get("/metrics").text)

    def gpu() -> tuple[float, float, float]:
        m = metrics()
        return (
            metric_sum(m, "attnserve_kv_bytes"),
            m.get("attnserve_memory_used_bytes", float("nan")),
            metric_sum(m, "attnserve_sessions"),
        )

    def rss() -> int | None:
        return process_rss(pid) if pid else None

    info = probe.get("/v1/info").raise_for_status().json()  # with keys, /v1/info needs one too
    # On a CPU adapter (lavapipe) GPU buffers are the server's own memory: a KV pool
    # slab that doubles for a longer or busier session than the warm-up saw, or an
    # arena or readback buffer that grows for a larger batch (both kept for reuse),
    # grows the RSS by its size. That growth is reported by /v1/info and is told
    # apart from the rest.
    cpu_adapter = (info.get("adapter") or {}).get("adapter_type") == "CPU"

    def gpu_buffers() -> tuple[int, int, int]:
        """(bytes of the KV pool's slabs and the arenas, KV pool pages in use,
        compute pipelines compiled)."""
        now = probe.get("/v1/info").raise_for_status().json()
        pools = (now.get("pool") or {}).get("pools", [])
        held = sum(int(p.get("bytes", 0)) for p in pools) + int((now.get("arenas") or {}).get("bytes", 0))
        pipelines = int((now.get("pipelines") or {}).get("compiled", 0))
        return held, sum(int(p.get("used_pages", 0)) for p in pools), pipelines

    registry = Registry()
    if keys[0] is not None:
        bare = httpx.get(url + "/v1/sessions", timeout=30, trust_env=False)
        registry.keys_enforced = bare.status_code == 401
        if not registry.keys_enforced:
            print("soak: the server takes requests without a key: tenants are not enforced there", flush=True)
    stats = Stats()
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    rss_start = rss()
    gpu_start = gpu()
    workers = [Worker(i, url, keys, stats, seed + i, args.max_live, registry) for i in range(args.workers)]

    def churn(seconds: float) -> None:
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=w.run, args=(until, stop), name=f"soak-{w.n}") for w in workers]
        for t in threads:
            t.start()
        peak = 0
        while any(t.is_alive() for t in threads):
            time.sleep(0.25)
            r = rss()
            peak = max(peak, r or 0)
        for t in threads:
            t.join()
        return peak

    def clear() -> None:
        for w in workers:
            try:
                w.delete_all()
            except Failure as e:
                stats.fail(f"delete: {e}")

    def settle(target: tuple[float, float], timeout: float = 30) -> tuple[float, float, float]:
        deadline = time.monotonic() + timeout
        g = gpu()
        while (g[0], g[1]) != target and time.monotonic() < deadline:
            time.sleep(0.1)
            g = gpu()
        time.sleep(1.0)  # let the allocator give back what the last frees released
        return gpu()

    # warm-up: the same churn, then nothing left
    t0 = time.monotonic()
    peak_warm = churn(warmup)
    clear()
    gpu_base = settle((gpu_start[0], gpu_start[1]))
    rss_base, (pool_base, _, pipelines_base) = rss(), gpu_buffers()
    warm_requests = sum(stats.requests.values())
    print(
        f"soak: warm-up done ({warm_requests} requests); baseline RSS "
        f"{(rss_base or 0) / 2**20:.1f} MiB, GPU bytes {gpu_base[0]:.0f}",
        flush=True,
    )

    # the run
    t1 = time.monotonic()
    progress = threading.Thread(target=_progress, args=(stats, t1, args.duration, stop, rss), daemon=True)
    progress.start()
    peak_run = churn(args.duration)
    run_seconds = time.monotonic() - t1
    live = sum(len(w.live) for w in workers)
    gpu_live = gpu()

    # every live session, every layer, as the oracle says; and the tenants' lists
    for w in workers:
        for s in list(w.live):
            try:
                w.verify(s)
            except Failure as e:
                stats.fail(str(e))
    if registry.keys_enforced:
        for t, key in enumerate(keys):
            c = workers[0].clients[t]
            listed = {
                x["session_id"]
                for x in wire.unpackb(
                    c.get("/v1/sessions", headers={"Accept": wire.MSGPACK}).content, max_bytes=1 << 31
                )["sessions"]
            }
            mine = registry.by_tenant[t]
            stats.check("tenant-listing")
            if not mine <= listed or any(
                sid in listed for u, sids in registry.by_tenant.items() if u != t for sid in sids
            ):
                stats.fail(f"tenant {t} lists {len(listed)} sessions, holds {len(mine)}, or sees another's")
    clear()
    gpu_end = settle((gpu_start[0], gpu_start[1]))
    rss_end, (pool_end, pages_end, pipelines_end) = rss(), gpu_buffers()
    for w in workers:
        w.close()

    requests = sum(stats.requests.values())
    by_op: dict[str, dict[str, int]] = defaultdict(dict)
    for (op, status), n in sorted(stats.requests.items()):
        by_op[op][str(status)] = n
    problems = list(stats.failures)
    if (gpu_end[0], gpu_end[1]) != (gpu_start[0], gpu_start[1]):
        problems.append(
            f"GPU bytes did not return: kv {gpu_start[0]:.0f} -> {gpu_end[0]:.0f}, "
            f"used {gpu_start[1]:.0f} -> {gpu_end[1]:.0f}"
        )
    if gpu_end[2] != gpu_start[2]:
        problems.append(f"sessions did not return: {gpu_start[2]:.0f} -> {gpu_end[2]:.0f}")
    if pages_end:  # every session is gone: so is every page (what makes the RSS allowance below safe)
        problems.append(f"{pages_end} KV pool pages are still in use after every session was deleted")
    rss_growth = None
    pool_growth = (pool_end - pool_base) / 2**20 if cpu_adapter else 0.0
    if rss_base is not None and rss_end is not None:
        rss_growth = (rss_end - rss_base) / 2**20
        if rss_growth - pool_growth > args.rss_tolerance_mb:
            problems.append(
                f"server memory grew {rss_growth:.1f} MiB past the warm-up level, {pool_growth:.1f} MiB of it "
                f"GPU buffers (KV pool, arenas) (tolerance {args.rss_tolerance_mb:g} MiB beyond them)"
            )
    log_errors = server.log_errors() if server is not None else []
    if log_errors:
        problems.append(f"{len(log_errors)} error line(s) in the server log: {log_errors[0][:500]}")
    mib = lambda b: None if b is None else round(b / 2**20, 1)
    report = {
        "url": url,
        "seed": seed,
        "workers": args.workers,
        "tenants": len(keys),
        "tenants_enforced": registry.keys_enforced,
        "warmup_seconds": round(t1 - t0, 1),
        "run_seconds": round(run_seconds, 1),
        "requests": requests,
        "requests_in_run": requests - warm_requests,
        "requests_per_second": round((requests - warm_requests) / max(run_seconds, 1e-9), 1),
        "failed_requests": stats.failed_requests,
        "failures": problems,
        "by_operation": by_op,
        "latency_ms": {
            op: {"p50": round(pct(xs, 50) * 1e3, 2), "p99": round(pct(xs, 99) * 1e3, 2), "max": round(max(xs) * 1e3, 2)}
            for op, xs in sorted(stats.latency.items())
        },
        "checks": dict(stats.checks),
        "worst_relative_error": stats.worst,
        "sessions_live_at_end": live,
        "memory": {
            "rss_start_mib": mib(rss_start),
            "rss_after_warmup_mib": mib(rss_base),
            "rss_peak_mib": mib(max(peak_warm or 0, peak_run or 0)) if pid else None,
            "rss_end_mib": mib(rss_end),
            "rss_growth_mib": None if rss_growth is None else round(rss_growth, 1),
            "gpu_buffer_growth_mib_in_rss": round(pool_growth, 1),
            "pipelines_after_warmup": pipelines_base,
            "pipelines_end": pipelines_end,
            "rss_tolerance_mib": args.rss_tolerance_mb,
            "gpu_kv_bytes_start": gpu_start[0],
            "gpu_kv_bytes_with_live_sessions": gpu_live[0],
            "gpu_kv_bytes_end": gpu_end[0],
            "memory_used_bytes_start": gpu_start[1],
            "memory_used_bytes_end": gpu_end[1],
            "rss_every_10s_mib": stats.rss_samples,
        },
        "ok": not problems,
    }
    stop.set()
    print(
        json.dumps(
            {
                k: report[k]
                for k in (
                    "requests",
                    "requests_per_second",
                    "failed_requests",
                    "checks",
                    "worst_relative_error",
                    "memory",
                )
            },
            indent=1,
        )
    )
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if problems:
        print("soak: FAILED", *problems[:20], sep="\n  ")
        return 1
    print(f"soak: passed: {requests} requests, no failure, memory and GPU bytes back to their levels")
    return 0


def _progress(stats: Stats, t0: float, duration: float, stop: threading.Event, rss) -> None:
    while not stop.wait(10):
        done = time.monotonic() - t0
        if done > duration + 5:
            return
        r = rss()
        stats.rss_samples.append((round(done), None if r is None else round(r / 2**20, 1)))
        print(
            f"soak: {done:5.0f}/{duration:g} s, {sum(stats.requests.values())} requests, "
            f"{len(stats.failures)} failures" + (f", RSS {r / 2**20:.0f} MiB" if r else ""),
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
