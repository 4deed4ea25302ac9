#!/usr/bin/env python3
"""Several engine processes on one GPU: how batched steps scale with the processes.

    python bench/shards.py [--adapter nvidia] [--shards 1,2,4,8] [--sessions 64]
        [--context 4096] [--seconds 8] [--pipeline 2] [--formats f32,turboquant]
        [--json-out FILE]

For each shard count N it starts N attnserve servers (one process each, all on the
same adapter) on 127.0.0.1, splits ``--sessions`` sessions among them, and drives
each server from its own client process: every client prefills its sessions to
``--context`` timesteps, then, all starting together, runs stacked batched steps
(one fused decode item per session, ``attend_stacked`` over the stream,
``--pipeline`` steps in flight) for ``--seconds``. Reported per N: the attends per
second of all shards together, each shard's, and the batch p50. This is the
measure of what a deployment of N replicas on one GPU behind the router serves when
an engine splits each step by replica. Traffic goes only to the loopback servers it
starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np
from _server import serving

from attnserve_client import Client

from tools.common import write_result

H, HKV, D = 32, 8, 128


def drive(url: str, fmt: str, n: int, context: int, seconds: float, pipeline: int, start, out) -> None:
    """One shard's client (a process of its own): set up, wait for the start, step."""
    from attnserve_client import Client

    rng = np.random.default_rng(os.getpid())
    with Client(url, timeout=300) as c:
        groups = []
        for _ in range(pipeline):
            ids = []
            for _ in range(n):
                s = c.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, kv_format=fmt)
                for at in range(0, context, 1024):
                    m = min(1024, context - at)
                    k = rng.standard_normal((m, HKV, D), dtype=np.float32)
                    s.append(0, k, k)
                ids.append(s.session_id)
            groups.append(ids)
        q = rng.standard_normal((n, H, D), dtype=np.float32)
        k = rng.standard_normal((n, HKV, D), dtype=np.float32)
        with c.stream() as stream:
            for ids in groups:
                stream.attend_stacked(ids, 0, q, k, k)
            start.wait()
            lat, steps = [], 0
            t0 = time.perf_counter()
            inflight = [(stream.submit_attend_stacked(ids, 0, q, k, k), time.perf_counter()) for ids in groups]
            i = 0
            while True:
                fut, ts = inflight[i]
                fut.result()
                now = time.perf_counter()
                lat.append(now - ts)
                steps += 1
                if now - t0 >= seconds:
                    break
                inflight[i] = (stream.submit_attend_stacked(groups[i], 0, q, k, k), time.perf_counter())
                i = (i + 1) % pipeline
            for fut, _ in inflight:
                fut.result()
            dt = time.perf_counter() - t0
        for ids in groups:
            for sid in ids:
                c.delete_session(sid)
    lat.sort()
    out.put({"attends": steps * n, "seconds": dt, "batch_p50_ms": 1e3 * lat[len(lat) // 2]})


def run(adapter: str, fmt: str, shards: int, sessions: int, context: int, seconds: float, pipeline: int) -> dict:
    env = {"ATTNSERVE_MEMORY_BUDGET_BYTES": str(max(1, 64 // shards) << 30), "ATTNSERVE_DEFAULT_MAX_TOKENS": "200000"}
    per = [sessions // shards + (1 if i < sessions % shards else 0) for i in range(shards)]
    ctx = mp.get_context("spawn")
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serving(adapter, **env))[1] for _ in range(shards)]
        with Client(urls[0], timeout=60) as c:
            adapter_name = c.info().get("adapter", {}).get("name")
        start, out = ctx.Barrier(shards + 1), ctx.Queue()
        procs = [
            ctx.Process(target=drive, args=(url, fmt, n, context, seconds, pipeline, start, out))
            for url, n in zip(urls, per)
        ]
        for p in procs:
            p.start()
        start.wait(timeout=900)
        results = [out.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(60)
    total = sum(r["attends"] / r["seconds"] for r in results)
    return {
        "adapter": adapter_name,
        "kv_format": fmt,
        "shards": shards,
        "sessions": sessions,
        "context": context,
        "pipeline": pipeline,
        "attends_per_s": round(total, 1),
        "per_shard_attends_per_s": [round(r["attends"] / r["seconds"], 1) for r in results],
        "batch_p50_ms": [round(r["batch_p50_ms"], 2) for r in results],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""))
    ap.add_argument("--shards", default="1,2,4,8")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--pipeline", type=int, default=2, help="stacked steps in flight per shard")
    ap.add_argument("--formats", default="f32,turboquant")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    result = {"date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("ATTNSERVE_COMMIT", ""), "runs": []}
    for fmt in args.formats.split(","):
        for shards in map(int, args.shards.split(",")):
            r = run(args.adapter, fmt, shards, args.sessions, args.context, args.seconds, args.pipeline)
            result["runs"].append(r)
            print(json.dumps(r), flush=True)
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
