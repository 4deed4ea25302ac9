#!/usr/bin/env python3
"""Latency of one submission of a batched decode step against the GPU time per
step when many steps share a submission: is a step's wait GPU work or per-submission
latency? (N sessions x context, f32, one query row each.)

    python bench/probes/step_latency.py [--adapter nvidia] [--sessions 16,32,64] [--context 4096]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "client"), str(ROOT / "bench")]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from attnserve.engine import Engine  # noqa: E402
from attnserve.gpu.batch import Batch  # noqa: E402
from attnserve.kvcache import SessionConfig  # noqa: E402
from kernels import fill_layer  # noqa: E402

H, HKV, D = 32, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER"))
    ap.add_argument("--sessions", default="16,32,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--presize", action="store_true", help="grow the pool first with one session of N x context")
    args = ap.parse_args()
    engine = Engine.open(args.adapter)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, H, D), dtype=np.float32)
    for n in map(int, args.sessions.split(",")):
        if args.presize:  # as bench/kernels.py's batched rows: the slab grows with one big session first
            big = engine.session_kv(SessionConfig(1, H, HKV, D, "f32", n * args.context, 99))
            fill_layer(engine, big.layers[0], n * args.context, rng)
            engine.release(big).result()
        sessions = [engine.session_kv(SessionConfig(1, H, HKV, D, "f32", args.context, i)) for i in range(n)]
        for s in sessions:
            fill_layer(engine, s.layers[0], args.context, rng)
        layers = [s.layers[0] for s in sessions]

        def run(iters: int, read: bool) -> float:
            def job(ctx):
                batch = Batch(ctx.device, ctx.pipelines, engine.worker.arenas, ctx.offset_align, engine.policy)
                q_seg = batch.upload(q)
                outs = [batch.output(q.nbytes) if read else batch.scratch(q.nbytes) for _ in layers]
                for _ in range(iters):
                    for layer, out in zip(layers, outs):
                        layer.plan_attend_rows(
                            batch, q_seg, q.shape, out=out, length=args.context, start_pos=args.context - 1,
                            causal=True, scale=1 / math.sqrt(D),
                        )  # fmt: skip
                    batch.flush()
                if not read:
                    sync = batch.output(4)
                    batch.copy(outs[0], 0, sync, 0, 4)
                encoded = batch.encode()
                t0 = time.perf_counter()
                batch.submit(encoded)
                return time.perf_counter() - t0

            return 1e3 * min(engine.worker.run(job) for _ in range(5))

        run(1, False)
        row = {f"iters={i}": round(run(i, False), 3) for i in (1, 2, 4, 16)}
        row["iters=1, outputs read back"] = round(run(1, True), 3)
        pool = layers[0].slab
        first_pages = [layer.pages[:2] for layer in layers[:3]]
        print(
            f"{n} x {args.context}: ms per submission {row}; slabs {len({id(x.slab) for x in layers})}, "
            f"slab pages {pool.pages}, first pages {first_pages}",
            flush=True,
        )
        for s in sessions:
            engine.release(s).result()
    engine.close()


if __name__ == "__main__":
    main()
