#!/usr/bin/env python3
"""Server CPU time per small request, from the server process's own counters.

    python bench/server_cpu.py [--adapter ADAPTER] [--requests 2000] [--json-out FILE]
    python bench/server_cpu.py --quick        # CI's short form: a few hundred requests

Starts ``attnserve serve`` on a free loopback port in a child process, then sends,
one at a time over one keep-alive connection, ``--requests`` of each of:

* ``GET /v1/sessions/{id}`` (MessagePack answer),
* a tiny attend (MessagePack, 2 query heads, 1 KV head, head_dim 8, 16 timesteps),
* the same tiny attend as a frame on the ``/v1/stream`` WebSocket,

and reads the server's user + system CPU seconds (``/proc/<pid>/stat``; any
platform with psutil) before and after each kind: CPU ms per request, with the
wall time per request beside it. The GPU thread's work is included (it is the same
process); on lavapipe that is the tiny attend's shader time too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from _server import serving

from attnserve_client import Client, wire

from tools.common import write_result


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except FileNotFoundError:  # not Linux
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system


def measure(pid: int, n: int, call) -> dict:
    for _ in range(min(50, n)):  # warm-up
        call()
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    for _ in range(n):
        call()
    c1, t1 = cpu_seconds(pid), time.perf_counter()
    return {
        "requests": n,
        "cpu_ms_per_request": round(1e3 * (c1 - c0) / n, 4),
        "wall_ms_per_request": round(1e3 * (t1 - t0) / n, 4),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="a short run (CI): 200 requests of each kind")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    n = 200 if args.quick else args.requests

    with serving(args.adapter) as (server, url), Client(url, timeout=120) as client:
        info = client.info()
        rng = np.random.default_rng(0)
        s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8)
        s.append(0, rng.standard_normal((16, 1, 8)), rng.standard_normal((16, 1, 8)))
        q = rng.standard_normal((1, 2, 8)).astype(np.float32)
        body = wire.packb({"q": wire.encode_array(q)})
        headers = {"Content-Type": wire.MSGPACK, "Accept": wire.MSGPACK}
        path = f"/v1/sessions/{s.session_id}"
        results = {
            "adapter": info.get("adapter"),
            "date": time.strftime("%Y-%m-%d"),
            "commit": os.environ.get("ATTNSERVE_COMMIT", ""),
            "cores": os.cpu_count(),
        }
        with httpx.Client(base_url=url, timeout=120) as http:

            def get_info():
                assert http.get(path, headers={"Accept": wire.MSGPACK}).status_code == 200

            def attend():
                assert http.post(path + "/layers/0/attend", content=body, headers=headers).status_code == 200

            results["get_session"] = measure(server.pid, n, get_info)
            results["attend_tiny"] = measure(server.pid, n, attend)
        with client.stream() as stream:
            results["attend_tiny_stream"] = measure(server.pid, n, lambda: stream.attend(s, 0, q))
        s.delete()
    print(json.dumps(results, indent=1))
    write_result(args.json_out, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
