#!/usr/bin/env python3
"""The service as a user with a client we did not write sees it: plain ``websockets``
and ``httpx`` with their library defaults, MessagePack by hand.

    python bench/generic_clients.py [--adapter nvidia] [--json-out FILE]

Starts an attnserve server on 127.0.0.1 (a free port) in a child process and, per
kv format, prefills ``--sessions`` sessions (32 query heads, 8 KV heads, head_dim
128, one layer) to ``--context`` timesteps, then measures:

1. the stacked fused decode step of all sessions (one query and one K/V row each)
   over ``/v1/stream`` with ``websockets.sync.client.connect(url)`` as it comes
   (it offers ``permessage-deflate``; the result records what the server agreed
   to), one step in flight: attends/s and step p50/p99;
2. one session's fused decode step over the same stream and over HTTP (``httpx``,
   one keep-alive connection): p50/p99.

Traffic goes only to the loopback server it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import msgpack
import numpy as np
from _server import serving
from websockets.sync.client import connect

from tools.common import percentiles, write_result

H, HKV, D = 32, 8, 128
MSGPACK = "application/vnd.msgpack"


def wire(a: np.ndarray) -> dict:
    """The wire form of a float32 array, as docs/api.md describes it."""
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"dtype": "<f4", "shape": list(a.shape), "data": a.tobytes()}


def call(http: httpx.Client, method: str, path: str, doc: dict | None = None) -> dict:
    r = http.request(
        method,
        path,
        content=None if doc is None else msgpack.packb(doc),
        headers={"Content-Type": MSGPACK, "Accept": MSGPACK},
    )
    if r.status_code >= 400:
        raise SystemExit(f"{method} {path}: {r.status_code} {r.text[:300]}")
    return msgpack.unpackb(r.content) if r.content else {}


def sessions(http: httpx.Client, fmt: str, n: int, context: int, rng) -> list[str]:
    ids = []
    for _ in range(n):
        sid = call(
            http, "POST", "/v1/sessions", {"num_qo_heads": H, "num_kv_heads": HKV, "head_dim": D, "kv_format": fmt}
        )["session_id"]
        for start in range(0, context, 1024):
            m = min(1024, context - start)
            kv = rng.standard_normal((m, HKV, D), dtype=np.float32)
            call(http, "POST", f"/v1/sessions/{sid}/layers/0/kv", {"k": wire(kv), "v": wire(kv)})
        ids.append(sid)
    return ids


def stream_stacked(ws_url: str, ids: list[str], seconds: float, rng) -> dict:
    b = len(ids)
    q = wire(rng.standard_normal((b, 1, H, D), dtype=np.float32))
    kv = wire(rng.standard_normal((b, 1, HKV, D), dtype=np.float32))
    frame = {"op": "attend_batch", "session_ids": ids, "layer": 0, "q": q, "k": kv, "v": kv}
    with connect(ws_url, max_size=None) as ws:  # the library's defaults otherwise
        extensions = ws.response.headers.get("Sec-WebSocket-Extensions")

        def step(i: int) -> None:
            ws.send(msgpack.packb({"id": i, **frame}))
            reply = msgpack.unpackb(ws.recv())
            if reply["status"] != 200 or reply["result"]["errors"]:
                raise SystemExit(f"stacked step failed: {str(reply)[:300]}")

        for i in range(3):
            step(i)
        lat, t0, i = [], time.perf_counter(), 3
        while time.perf_counter() - t0 < seconds:
            ts = time.perf_counter()
            step(i)
            lat.append(time.perf_counter() - ts)
            i += 1
        dt = time.perf_counter() - t0
    return {
        "sessions": b,
        "extensions_agreed": extensions,
        "attends_per_s": round(b * len(lat) / dt, 1),
        **{f"step_{k}": v for k, v in percentiles(lat).items()},
    }


def single(http: httpx.Client, ws_url: str, sid: str, steps: int, rng) -> dict:
    q = wire(rng.standard_normal((1, H, D), dtype=np.float32))
    kv = wire(rng.standard_normal((1, HKV, D), dtype=np.float32))
    body = msgpack.packb({"q": q, "k": kv, "v": kv})
    path = f"/v1/sessions/{sid}/layers/0/attend"
    headers = {"Content-Type": MSGPACK, "Accept": MSGPACK}
    lat_http = []
    for i in range(steps + 10):
        ts = time.perf_counter()
        r = http.post(path, content=body, headers=headers)
        if r.status_code != 200:
            raise SystemExit(f"attend: {r.status_code} {r.text[:300]}")
        if i >= 10:
            lat_http.append(time.perf_counter() - ts)
    lat_ws = []
    frame = {"op": "attend", "session_id": sid, "layer": 0, "q": q, "k": kv, "v": kv}
    with connect(ws_url, max_size=None) as ws:
        for i in range(steps + 10):
            ts = time.perf_counter()
            ws.send(msgpack.packb({"id": i, **frame}))
            if msgpack.unpackb(ws.recv())["status"] != 200:
                raise SystemExit("stream attend failed")
            if i >= 10:
                lat_ws.append(time.perf_counter() - ts)
    return {"http": percentiles(lat_http), "stream": percentiles(lat_ws)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--formats", default="f32,turboquant")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    with serving(args.adapter) as (_, url):
        ws_url = url.replace("http://", "ws://") + "/v1/stream"
        with httpx.Client(base_url=url, timeout=120) as http:
            device = http.get("/v1/info").json().get("device", {})
            for fmt in args.formats.split(","):
                ids = sessions(http, fmt, args.sessions, args.context, rng)
                row = {"kv_format": fmt, "context": args.context}
                row["stacked_stream"] = stream_stacked(ws_url, ids, args.seconds, rng)
                row["single"] = single(http, ws_url, ids[0], args.steps, rng)
                for sid in ids:
                    http.delete(f"/v1/sessions/{sid}")
                print(json.dumps(row), flush=True)
                rows.append(row)
    result = {"bench": "generic_clients", "device": device, "args": vars(args) | {"json_out": None}, "rows": rows}
    if args.json_out:
        write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
