"""How fast a server restores its sessions at start: the number the image's
HEALTHCHECK start period is sized with (docs/deploy.md, "Health check start period").

Runs ``python -m attnserve serve`` with a snapshot directory, fills it with
``--sessions`` f32 sessions over HTTP, stops it (SIGTERM: every session written),
starts it again and reads the restore off the server's own log line
(``snapshots restored``: file bytes, seconds, rate) and off /metrics (the GPU
bytes restored). Prints one JSON object.

    python bench/snapshot_speed.py                       # 4 x 128 MiB on the first adapter
    ATTNSERVE_ADAPTER=llvmpipe python bench/snapshot_speed.py --sessions 8
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "client")]
from attnserve_client import Client  # noqa: E402

from tools.common import free_port  # noqa: E402


def start(env: dict[str, str], log: Path, url: str) -> tuple[subprocess.Popen, float]:
    t0 = time.monotonic()
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "attnserve", "serve"], env=env, stdout=f, stderr=f)
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return proc, time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def last_line(log: Path, msg: str) -> dict:
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{") and f'"msg":"{msg}"' in x]
    return lines[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4, help="sessions to write and restore (default 4)")
    ap.add_argument("--layers", type=int, default=4, help="layers per session (default 4)")
    ap.add_argument("--tokens", type=int, default=4096, help="timesteps per layer (default 4096)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="attnserve-snapshot-speed."))
    log = work / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_") or k == "ATTNSERVE_ADAPTER"}
    env.update(
        ATTNSERVE_PORT=str(port),
        ATTNSERVE_HOST="127.0.0.1",
        ATTNSERVE_SNAPSHOT_DIR=str(work / "snapshots"),
        ATTNSERVE_MEMORY_BUDGET_BYTES="0",
        ATTNSERVE_LOG_FORMAT="json",
        XDG_RUNTIME_DIR="/tmp",
        PYTHONPATH=os.pathsep.join([str(ROOT / "service"), str(ROOT / "client")]),
    )
    rng = np.random.default_rng(0)
    proc, ready_empty = start(env, log, url)
    try:
        with Client(url) as c:
            for i in range(args.sessions):
                s = c.create_session(
                    num_qo_heads=args.kv_heads,
                    num_kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    num_layers=args.layers,
                    max_tokens=args.tokens,
                    session_id=f"speed-{i}",
                )
                for layer in range(args.layers):
                    k = rng.standard_normal((args.tokens, args.kv_heads, args.head_dim), dtype=np.float32)
                    s.append(layer, k, k)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=600)
        saved = last_line(log, "snapshots written")
        proc, ready_full = start(env, log, url)
        restored = last_line(log, "snapshots restored")
        kv = sum(
            float(x.rsplit(" ", 1)[1])
            for x in httpx.get(url + "/metrics").text.splitlines()
            if x.startswith("attnserve_kv_bytes{")
        )
        info = httpx.get(url + "/v1/info").json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=600)
    out = {
        "adapter": info["adapter"]["name"],
        "sessions": restored["ok"],
        "gpu_bytes": int(kv),
        "file_bytes": restored["bytes_done"],
        "save_seconds": saved["seconds"],
        "restore_seconds": restored["seconds"],
        "restore_file_bytes_per_second": restored["bytes_per_second"],
        "restore_gpu_bytes_per_second": round(kv / restored["seconds"]),
        "ready_seconds_empty": round(ready_empty, 2),
        "ready_seconds_restored": round(ready_full, 2),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
