#!/usr/bin/env python3
"""End-to-end service benchmark: fused decode steps over HTTP with msgpack.

    python bench/service.py [--adapter nvidia] [--json-out FILE]

Starts an attnserve server on 127.0.0.1 (a free port, the chosen adapter) in a
child process, then for each kv format:

1. one session (32 query heads, 8 KV heads, head_dim 128, one layer) prefilled
   to ``--context`` timesteps, then ``--steps`` fused decode steps (append one
   K/V row and attend one query row in one call): p50 / p99 latency, and the
   GPU worker's time per submission from the server's own metrics
   (``attnserve_gpu_submission_seconds``: record + submit + readback), i.e.
   how much of a step is GPU work;
2. the same fused decode steps over the streaming transport (``/v1/stream``,
   one WebSocket, one step in flight) and over the frame transport (plain TCP,
   arrays as raw bytes): p50 / p99;
3. ``--sessions`` sessions (64) stepping concurrently from as many client
   threads, each prefilled to ``--concurrent-context``: attends per second, and
   jobs per GPU submission (coalescing) from the metrics;
4. the same sessions stepped as an engine does: one batched step
   (``attend_batch``, one fused decode item per session; and ``attend_stacked``,
   the same with the arrays stacked) at a time, over HTTP, over the stream and
   over the frame transport, and over the stream and the frames with
   ``--pipeline`` batches in flight (e.g. independent micro-batches): attends per
   second and batch p50 / p99.

``--transports`` picks among http, stream and frames.

Traffic goes only to the loopback server it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _server import serving

from tools.common import as_dtype, metric_sum, parse_prometheus, percentiles, write_result

from attnserve_client import AttendItem, Client

H, HKV, D = 32, 8, 128


def scrape(c: Client) -> dict[str, float]:
    import httpx

    return parse_prometheus(httpx.get(c.base_url + "/metrics", timeout=30).text)


def grew(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much metric ``name`` (all its series) grew between two scrapes."""
    return metric_sum(after, name) - metric_sum(before, name)


def prefill(sess, layer: int, n: int, rng, chunk: int = 1024) -> None:
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        sess.append(
            layer,
            rng.standard_normal((m, HKV, D), dtype=np.float32),
            rng.standard_normal((m, HKV, D), dtype=np.float32),
        )


def open_stream(c: Client, transport: str):
    """The client's stream over ``transport`` (``stream``: the WebSocket; ``frames``:
    the frame transport; ``shm``: the shared-memory transport, outputs read in place),
    or None for plain HTTP."""
    if transport == "http":
        return None
    if transport == "shm":
        return c.stream(transport="shm", copy_outputs=False)
    return c.stream(transport="frames" if transport == "frames" else "websocket")


def one_session(
    c: Client, fmt: str, context: int, steps: int, rng, transport: str = "http", dtype: str = "f32"
) -> dict:
    sess = c.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, kv_format=fmt)
    prefill(sess, 0, context, rng)
    q = as_dtype(rng.standard_normal((1, H, D), dtype=np.float32), dtype)
    k = as_dtype(rng.standard_normal((1, HKV, D), dtype=np.float32), dtype)
    stream = open_stream(c, transport)
    step = (lambda: stream.attend(sess, 0, q, k=k, v=k)) if stream else (lambda: sess.attend(0, q, k=k, v=k))
    for _ in range(10):  # warm-up
        step()
    before = scrape(c)
    lat = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        lat.append(time.perf_counter() - t)
    after = scrape(c)
    if stream:
        stream.close()
    n_sub = grew(before, after, "attnserve_gpu_submission_seconds_count")
    s_sub = grew(before, after, "attnserve_gpu_submission_seconds_sum")
    sess.delete()
    pc = percentiles(lat)
    gpu_ms = 1e3 * s_sub / max(n_sub, 1)
    return {
        "kv_format": fmt,
        "dtype": dtype,
        "transport": transport,
        "context": context,
        "steps": steps,
        **pc,
        "gpu_submission_ms": round(gpu_ms, 3),
        "gpu_fraction_of_p50": round(gpu_ms / pc["p50_ms"], 3),
    }


def batched(
    c: Client,
    fmt: str,
    n_sessions: int,
    context: int,
    seconds: float,
    rng,
    transport: str,
    pipeline: int = 1,
    form: str = "items",
    dtype: str = "f32",
) -> dict:
    """Engine-shaped: every step is one batched request with one fused decode item
    per session; ``pipeline`` batches in flight on the stream (each for its own
    sessions, as independent micro-batches would be). ``form``: ``items`` (one map
    per item, ``attend_batch``) or ``stacked`` (the arrays stacked, ``attend_stacked``)."""
    groups = []
    for _ in range(pipeline):
        sessions = []
        for _ in range(n_sessions):
            s = c.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, kv_format=fmt)
            prefill(s, 0, context, rng)
            sessions.append(s)
        groups.append(sessions)
    q = as_dtype(rng.standard_normal((1, H, D), dtype=np.float32), dtype)
    k = as_dtype(rng.standard_normal((1, HKV, D), dtype=np.float32), dtype)
    stream = open_stream(c, transport)
    if form == "stacked":
        qs, ks = np.repeat(q, n_sessions, 0), np.repeat(k, n_sessions, 0)
        ids = [[s.session_id for s in g] for g in groups]
        send_one = lambda i: (stream or c).attend_stacked(ids[i], 0, qs, ks, ks)  # noqa: E731
        send = (lambda i: stream.submit_attend_stacked(ids[i], 0, qs, ks, ks)) if stream else None
    else:
        items = [[AttendItem(s.session_id, 0, q, k, k) for s in g] for g in groups]
        send_one = lambda i: (stream or c).attend_batch(items[i])  # noqa: E731
        send = (lambda i: stream.submit_attend_batch(items[i])) if stream else None
    for _ in range(3):
        send_one(0)
    before = scrape(c)
    lat, n = [], 0
    t0 = time.perf_counter()
    if stream:
        inflight = [(send(i), time.perf_counter()) for i in range(pipeline)]
        i = 0
        while True:
            fut, ts = inflight[i % pipeline]
            fut.result()
            now = time.perf_counter()
            lat.append(now - ts)
            n += n_sessions
            if now - t0 >= seconds:
                break
            inflight[i % pipeline] = (send(i % pipeline), time.perf_counter())
            i += 1
        for fut, _ in inflight:
            fut.result()
    else:
        while time.perf_counter() - t0 < seconds:
            ts = time.perf_counter()
            send_one(0)
            lat.append(time.perf_counter() - ts)
            n += n_sessions
    dt = time.perf_counter() - t0
    after = scrape(c)
    if stream:
        stream.close()
    subs = grew(before, after, "attnserve_gpu_submission_seconds_count")
    gpu_s = grew(before, after, "attnserve_gpu_submission_seconds_sum")
    for g in groups:
        for s in g:
            s.delete()
    return {
        "kv_format": fmt,
        "dtype": dtype,
        "transport": transport,
        "form": form,
        "sessions": n_sessions,
        "pipeline": pipeline,
        "context": context,
        "seconds": round(dt, 2),
        "attends": n,
        "attends_per_s": round(n / dt, 1),
        **{f"batch_{k}": v for k, v in percentiles(lat).items()},
        "gpu_submission_ms": round(1e3 * gpu_s / max(subs, 1), 3),
        "submissions": int(subs),
    }


def many_sessions(c: Client, url: str, fmt: str, n_sessions: int, context: int, seconds: float, rng) -> dict:
    sessions = []
    for _ in range(n_sessions):
        s = c.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, kv_format=fmt)
        prefill(s, 0, context, rng)
        sessions.append(s.session_id)
    counts = [0] * n_sessions
    errors = []
    stop = threading.Event()
    start_gate = threading.Barrier(n_sessions + 1)

    def user(i: int) -> None:
        r = np.random.default_rng(i)
        q = r.standard_normal((1, H, D), dtype=np.float32)
        k = r.standard_normal((1, HKV, D), dtype=np.float32)
        with Client(url, timeout=120) as cc:
            s = cc.get_session(sessions[i])
            start_gate.wait()
            while not stop.is_set():
                try:
                    s.attend(0, q, k=k, v=k)
                    counts[i] += 1
                except Exception as e:  # counted, reported
                    errors.append(repr(e))
                    return

    threads = [threading.Thread(target=user, args=(i,)) for i in range(n_sessions)]
    for t in threads:
        t.start()
    before = scrape(c)
    start_gate.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    after = scrape(c)
    jobs = grew(before, after, "attnserve_gpu_jobs_per_submission_sum")
    subs = grew(before, after, "attnserve_gpu_jobs_per_submission_count")
    for sid in sessions:
        c.delete_session(sid)
    return {
        "kv_format": fmt,
        "sessions": n_sessions,
        "context": context,
        "seconds": round(dt, 2),
        "attends": sum(counts),
        "attends_per_s": round(sum(counts) / dt, 1),
        "jobs_per_submission": round(jobs / max(subs, 1), 2),
        "errors": errors[:5],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--concurrent-context", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--formats", default="f32,turboquant")
    ap.add_argument("--pipeline", type=int, default=4, help="batches in flight in the pipelined stream run")
    ap.add_argument("--forms", default="items,stacked", help="batched-step body forms to run (items, stacked)")
    ap.add_argument("--skip-single", action="store_true", help="leave out the single-session runs")
    ap.add_argument("--skip-threads", action="store_true", help="leave out the thread-per-session run")
    ap.add_argument("--transports", default="http,stream,frames", help="transports to run (http, stream, frames, shm)")
    ap.add_argument("--dtypes", default="f32", help="the arrays' dtypes to run (f32, f16, bf16)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)

    budget = {
        "ATTNSERVE_MEMORY_BUDGET_BYTES": str(64 << 30),
        "ATTNSERVE_DEFAULT_MAX_TOKENS": "200000",
        "ATTNSERVE_FRAMES_PORT": "0",  # the frame transport on a free port
        "ATTNSERVE_SHM_SOCKET": str(Path(tempfile.mkdtemp(prefix="attnserve-bench-")) / "shm.sock"),
    }
    transports = args.transports.split(",")
    runs = [(t, 1) for t in transports] + [(t, args.pipeline) for t in transports if t != "http" and args.pipeline > 1]
    with serving(args.adapter, **budget) as (_, url), Client(url, timeout=300) as c:
        info = c.info()
        rng = np.random.default_rng(0)
        result = {
            "adapter": info.get("adapter"),
            "date": time.strftime("%Y-%m-%d"),
            "commit": os.environ.get("ATTNSERVE_COMMIT", ""),
            "single": [],
            "concurrent": [],
            "batched": [],
        }
        print(f"# adapter: {info.get('adapter')}", flush=True)
        formats = args.formats.split(",")
        dtypes = args.dtypes.split(",")
        for fmt in formats if not args.skip_single else ():
            for transport in transports:
                for dtype in dtypes:
                    r = one_session(c, fmt, args.context, args.steps, rng, transport, dtype)
                    result["single"].append(r)
                    print(json.dumps(r), flush=True)
        for fmt in formats:
            for form in args.forms.split(","):
                for transport, pipeline in runs:
                    for dtype in dtypes:
                        r = batched(
                            c, fmt, args.sessions, args.concurrent_context, args.seconds, rng, transport, pipeline,
                            form, dtype,
                        )  # fmt: skip
                        result["batched"].append(r)
                        print(json.dumps(r), flush=True)
        for fmt in formats if not args.skip_threads else ():
            r = many_sessions(c, url, fmt, args.sessions, args.concurrent_context, args.seconds, rng)
            result["concurrent"].append(r)
            print(json.dumps(r), flush=True)
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
