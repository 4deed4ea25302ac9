#!/usr/bin/env python3
"""Fork speed: a fork of a long many-layer session, over HTTP on loopback.

Starts ``attnserve serve`` (bench/_server.py), fills one session of ``--layers``
layers with ``--tokens`` timesteps each, then forks it ``--repeat`` times
(``POST /v1/sessions/{id}/fork``; each fork deleted before the next) and reports
the round trip of each fork and how many pool pages it added (``/v1/info``
``pool``). The round trip includes the loopback HTTP cost (measured with a
``GET /v1/sessions/{id}`` beside it); the fork's own cost at the server is the
difference. Prints one JSON object (``--json-out`` writes it too).

    python bench/fork.py --adapter nvidia --json-out bench/results/h200-fork.json
    python bench/fork.py --quick          # small, on the first adapter (lavapipe)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import serving  # noqa: E402

from attnserve_client import Client  # noqa: E402

from tools.common import write_result  # noqa: E402


def pool_pages(http: httpx.Client) -> int:
    return sum(p["used_pages"] for p in http.get("/v1/info").json()["pool"]["pools"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--kv-format", default="turboquant")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="4 layers x 1024 tokens, 5 forks")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.tokens, args.repeat = 4, 1024, 5
    h, hkv, d = 32, 8, 128
    rng = np.random.default_rng(0)
    with serving(args.adapter, ATTNSERVE_MEMORY_BUDGET_BYTES="0") as (_, url):
        with Client(url, timeout=600) as client, httpx.Client(base_url=url, timeout=600) as http:
            s = client.create_session(
                num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=args.layers,
                kv_format=args.kv_format, max_tokens=args.tokens + 1,
            )  # fmt: skip
            chunk = 4096
            for layer in range(args.layers):
                for start in range(0, args.tokens, chunk):
                    n = min(chunk, args.tokens - start)
                    k = rng.standard_normal((n, hkv, d), dtype=np.float32)
                    s.append(layer, k, k)
            page_tokens = http.get("/v1/info").json()["pool"]["page_tokens"]
            fork_ms, get_ms, grown = [], [], []
            for i in range(args.repeat):
                before = pool_pages(http)
                t0 = time.perf_counter()
                r = http.post(f"/v1/sessions/{s.session_id}/fork", json={})
                fork_ms.append(1e3 * (time.perf_counter() - t0))
                assert r.status_code == 201, r.text
                grown.append(pool_pages(http) - before)
                t0 = time.perf_counter()
                http.get(f"/v1/sessions/{s.session_id}")
                get_ms.append(1e3 * (time.perf_counter() - t0))
                http.delete(f"/v1/sessions/{r.json()['session_id']}")
            s.delete()
    fork_p50, get_p50 = statistics.median(fork_ms), statistics.median(get_ms)
    result = {
        "what": f"fork of a {args.layers}-layer {args.kv_format} session of {args.tokens} tokens per layer",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "commit": os.environ.get("ATTNSERVE_COMMIT") or "see git log",
        "adapter": args.adapter or "first",
        "page_tokens": page_tokens,
        "fork_ms_p50": round(fork_p50, 3),
        "fork_ms_max": round(max(fork_ms), 3),
        "get_session_ms_p50": round(get_p50, 3),
        "fork_at_server_ms_p50": round(fork_p50 - get_p50, 3),
        "pages_added": sorted(set(grown)),
        "pages_added_limit": args.layers,
    }
    print(json.dumps(result, indent=2))
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
