#!/usr/bin/env python3
"""The client's CPU per layer call of an open step (issue 53 item 4): the caller's
thread and the stream's reader thread, each by its own clock
(``pthread_getcpuclockid``), summed and divided by the calls; the server runs in
this process (``tests/live_server.py``) on its own threads, which are not counted.

    .venv/bin/python bench/probes/client_call_cpu.py [--calls 400] [--calls-32 60] [--json-out FILE]

Decode calls (one row a session, one layer) over the frame and the shared-memory
transports, at 1 and 32 sessions of 32 query / 8 KV heads of 128 and 4 sessions
of 8 / 2 heads of 64, float32 and bfloat16 numpy arrays; each without ``out=``
and, where the client takes it, with ``out=`` (one destination reused), in
alternating blocks on one step. ``--client-dir`` runs another checkout's client
(``git worktree add``: the commit before) against this checkout's server.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "client"), str(ROOT / "tests"), str(ROOT)]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

ac: Any = None  # attnserve_client, from --client-dir (main)
wire: Any = None

SHAPES = [(1, 32, 8, 128), (32, 32, 8, 128), (4, 8, 2, 64)]  # sessions, heads, kv heads, head_dim


def reader_thread(name: str) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == name)


def clock(t: threading.Thread) -> float:
    assert t.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


def one(c: ac.Client, transport: str, shape: tuple[int, int, int, int], dtype: str, calls: int, has_out: bool) -> dict:
    """Blocks of ``calls // 10`` calls, without ``out=`` and with it in turns (ten
    of each, on one open step), so that the host's drift falls on both alike."""
    b, h, hkv, d = shape
    sessions = [c.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=1) for _ in range(b)]
    rng = np.random.default_rng(0)

    def arr(*s: int) -> np.ndarray:
        a = rng.standard_normal(s, dtype=np.float32)
        return wire.to_bfloat16(a) if dtype == "bfloat16" else a

    q, k, v = arr(b, h, d), arr(b, hkv, d), arr(b, hkv, d)
    dest = np.empty_like(q)
    modes = [False, True] if has_out else [False]
    cpu = {m: [0.0, 0.0, 0.0] for m in modes}  # caller, reader, wall
    block = max(1, calls // 10)
    try:
        with c.stream(transport=transport) as stream, stream.open_step(sessions, dtype=dtype) as step:
            reader = reader_thread(f"attnserve-{transport}")
            me = threading.current_thread()
            for m in modes:
                for _ in range(10):
                    step.call(0, q, k, v, **({"out": dest} if m else {}))
            for _ in range(10):
                for m in modes:
                    kw = {"out": dest} if m else {}
                    c0, r0, t0 = clock(me), clock(reader), time.perf_counter()
                    for _ in range(block):
                        step.call(0, q, k, v, **kw)
                    c1, r1, t1 = clock(me), clock(reader), time.perf_counter()
                    cpu[m][0] += c1 - c0
                    cpu[m][1] += r1 - r0
                    cpu[m][2] += t1 - t0
    finally:
        for s in sessions:
            s.delete()
    n = 10 * block
    row: dict = {
        "transport": transport, "sessions": b, "heads": h, "kv_heads": hkv, "head_dim": d, "dtype": dtype,
        "reply_bytes": q.nbytes, "calls_each": n,
    }  # fmt: skip
    for m in modes:
        tag = "out" if m else "no_out"
        row[f"{tag}_client_cpu_us"] = round(1e6 * (cpu[m][0] + cpu[m][1]) / n, 1)
        row[f"{tag}_caller_cpu_us"] = round(1e6 * cpu[m][0] / n, 1)
        row[f"{tag}_reader_cpu_us"] = round(1e6 * cpu[m][1] / n, 1)
        row[f"{tag}_wall_us"] = round(1e6 * cpu[m][2] / n, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400, help="calls of each mode (without out=, with it)")
    ap.add_argument("--client-dir", type=Path, default=ROOT / "client", help="the client package's directory")
    ap.add_argument("--calls-32", type=int, default=60, help="calls at 32 sessions (lavapipe: ~0.3 s each)")
    ap.add_argument("--transports", default="frames,shm")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(args.client_dir))
    global ac, wire
    import attnserve_client as ac  # (the server imports it too: framing, wire)
    from attnserve.config import Settings
    from attnserve_client import wire
    from live_server import LiveServer

    print(f"the client of {ac.__file__}", flush=True)
    has_out = "out" in inspect.signature(ac.StreamStep.call).parameters
    sock = str(Path(tempfile.mkdtemp()) / "attnserve.sock")
    server = LiveServer(Settings(frames_port=0, shm_socket=sock, max_tokens=1 << 16)).start()
    rows = []
    try:
        with ac.Client(server.url) as c:
            for transport in args.transports.split(","):
                for shape in SHAPES:
                    for dtype in ("<f4", "bfloat16"):
                        calls = args.calls_32 if shape[0] == 32 else args.calls
                        row = one(c, transport, shape, dtype, calls, has_out)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    finally:
        server.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {
        "bench": "client_call_cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit.stdout.strip(),
        "host": {"cpus": os.cpu_count(), "machine": os.uname().machine},
        "client": str(args.client_dir),
        "client_takes_out": has_out,
        "rows": rows,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
