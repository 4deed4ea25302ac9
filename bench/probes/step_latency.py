#!/usr/bin/env python3
"""Latency of one submission of a batched decode step against the GPU time per
step when many steps share a submission: is a step's wait GPU work or a cost per
submission? (N sessions x context, f32, one query row each; the steps of
bench/kernel_bench.py's batched rows, ``iters`` of them per submission.)

    python bench/probes/step_latency.py [--adapter nvidia] [--sessions 16,32,64] [--context 4096] [--presize]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "client"), str(ROOT / "bench"), str(ROOT)]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from attnserve.engine import Engine  # noqa: E402
from attnserve.kv.config import SessionConfig  # noqa: E402
from kernel_bench import D, H, HKV, fill_layer, time_batched  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER"))
    ap.add_argument("--sessions", default="16,32,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--presize", action="store_true", help="grow the pool first with one session of N x context")
    args = ap.parse_args()
    engine = Engine.open(args.adapter)
    rng = np.random.default_rng(0)
    for n in map(int, args.sessions.split(",")):
        if args.presize:  # as bench/kernel_bench.py's batched rows: the slab grows with one big session first
            big = engine.session_kv(SessionConfig(1, H, HKV, D, "f32", n * args.context, 99))
            fill_layer(engine, big.layers[0], n * args.context, rng)
            engine.release(big).result()
        sessions = [engine.session_kv(SessionConfig(1, H, HKV, D, "f32", args.context, i)) for i in range(n)]
        for s in sessions:
            fill_layer(engine, s.layers[0], args.context, rng)
        layers = [s.layers[0] for s in sessions]
        row = {f"iters={i}": round(i * time_batched(engine, layers, rng, 0, iters=i), 3) for i in (1, 2, 4, 16)}
        print(f"{n} x {args.context}: ms per submission {row}; slabs {len({id(x.slab) for x in layers})}", flush=True)
        for s in sessions:
            engine.release(s).result()
    engine.close()


if __name__ == "__main__":
    main()
