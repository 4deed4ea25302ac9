#!/usr/bin/env python3
"""A layer call through an open step, by how it travels (issue 53): one server,
the same sessions, each form timed in turn in one run.

    python bench/probes/layer_call.py [--adapter nvidia] [--context 4096] [--json-out FILE]

Shapes: 32 query / 8 KV heads of 128, an f32 cache of ``--context`` rows, one query
row and one appended K/V row a session per call (a fused decode call), the arrays
in bfloat16 (``--dtype``). Forms, each after a warm-up:

- ``stacked-frames``: ``attend_stacked`` over the frame transport (a MessagePack
  head, the arrays in the body): the call before steps;
- ``step-doc-stream`` / ``step-doc-shm``: a step's ``step_call`` documents over the
  WebSocket stream and over shared memory;
- ``step-callframe``: a step's calls as call frames over the frame transport (no
  MessagePack, a call reply).

Measured: one session's call p50/p90 (ms, one call in flight); ``--batch`` sessions
stacked, p50; and ``--sessions`` sessions' attends per second with one call in
flight and with ``--in-flight`` calls in flight (the layers of a token called
together: sessions of that many layers).

Prediction (written before the first run, on the H100; issue 43 measured 2.04 ms
p50 for the fused call over frames at commit 8c37be5): the step is today's machinery
with a table lookup in C and, for call frames, no MessagePack head or array
references; the host stages that remain (the event loop's queueing, the GPU
thread's plan and replay, the readback wake-ups) are the same. So: step documents
within 0.05 ms of the stacked form, call frames 0.05-0.15 ms under it (about
1.9 ms p50 at one session), and attends/s at 64 x 4k within 10% of the stacked
form's (about 11,000 with one in flight). The goals (0.40 ms, 45,000/s) need the
compiled loop (docs/architecture.md), not this.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "client"), str(ROOT), str(ROOT / "bench")]
from _server import free_port, serving  # noqa: E402
from attnserve_client import Client, wire  # noqa: E402

H, HKV, D = 32, 8, 128


def _timed(fn: Callable[[], Any], seconds: float, warmup: int = 10) -> list[float]:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 20:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _pct(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    return {"p50_ms": round(statistics.median(s), 4), "p90_ms": round(s[int(0.9 * (len(s) - 1))], 4), "n": len(s)}


def _fill(stream: Any, sessions: list[Any], layers: int, context: int, rng: np.random.Generator) -> None:
    chunk = min(context, 1024)
    for s in sessions:
        for layer in range(layers):
            futs: list[Future[Any]] = []
            for at in range(0, context, chunk):
                n = min(chunk, context - at)
                k = rng.standard_normal((n, HKV, D), dtype=np.float32)
                futs.append(stream.submit_append(s, layer, k, k))
            for f in futs:
                f.result()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["<f4", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    half = args.dtype == "bfloat16"

    def arr(*shape: int) -> np.ndarray:
        a = rng.standard_normal(shape, dtype=np.float32)
        return wire.to_bfloat16(a) if half else a

    shm = str(Path(tempfile.mkdtemp()) / "attnserve.sock")
    env = {"ATTNSERVE_FRAMES_PORT": str(free_port()), "ATTNSERVE_SHM_SOCKET": shm,
           "ATTNSERVE_MAX_BODY_BYTES": str(1 << 28)}  # fmt: skip
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "shapes": [H, HKV, D]}
    with serving(args.adapter, **env) as (_, url), Client(url, timeout=120) as c:
        results["device"] = c.info().get("device")
        with c.stream(transport="frames") as fr, c.stream() as st, c.stream(transport="shm") as sh:
            # one session (one layer: each call is a token)
            one = c.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=1)
            _fill(fr, [one], 1, args.context, rng)
            q, k = arr(1, 1, H, D), arr(1, 1, HKV, D)
            single: dict[str, Any] = {}
            single["stacked-frames"] = _pct(_timed(lambda: fr.attend_stacked([one], 0, q, k, k), args.seconds))
            for name, opener in (("step-doc-stream", st), ("step-doc-shm", sh), ("step-callframe", fr)):
                with opener.open_step([one], rows=1, dtype=args.dtype) as step:
                    single[name] = _pct(_timed(lambda: step.call(0, q, k, k), args.seconds))
            results["single"] = single
            print("one session:", json.dumps(single), flush=True)
            one.delete()

            # B sessions stacked, and attends/s with one and several calls in flight
            layers = max(1, args.in_flight)
            many = [c.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=layers)
                    for _ in range(max(args.batch, args.sessions))]  # fmt: skip
            _fill(fr, many, layers, args.context, rng)
            batch = many[: args.batch]
            qb, kb = arr(args.batch, 1, H, D), arr(args.batch, 1, HKV, D)
            stacked: dict[str, Any] = {}
            stacked["stacked-frames"] = _pct(_timed(lambda: fr.attend_stacked(batch, 0, qb, kb, kb), args.seconds))
            with fr.open_step(batch, rows=1, dtype=args.dtype, layers=[0]) as step:
                stacked["step-callframe"] = _pct(_timed(lambda: step.call(0, qb, kb, kb), args.seconds))
            results[f"batch_{args.batch}"] = stacked
            print(f"{args.batch} sessions:", json.dumps(stacked), flush=True)

            group = many[: args.sessions]
            qs, ks = arr(args.sessions, 1, H, D), arr(args.sessions, 1, HKV, D)
            rates: dict[str, Any] = {}
            for depth in sorted({1, args.in_flight}):
                with fr.open_step(group, rows=1, dtype=args.dtype, layers=list(range(depth))) as step:
                    for _ in range(3):  # warm-up tokens
                        for f in [step.submit_call(layer, qs, ks, ks) for layer in range(depth)]:
                            f.result()
                    n, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < args.seconds:
                        for f in [step.submit_call(layer, qs, ks, ks) for layer in range(depth)]:
                            f.result()
                        n += depth
                    rates[f"step-callframe-{depth}-in-flight"] = round(n * args.sessions / (time.perf_counter() - t0))
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < args.seconds:
                    futs = [fr.submit_attend_stacked(group, layer, qs, ks, ks) for layer in range(depth)]
                    for f in futs:
                        f.result()
                    n += depth
                rates[f"stacked-frames-{depth}-in-flight"] = round(n * args.sessions / (time.perf_counter() - t0))
            results[f"attends_per_s_{args.sessions}x{args.context}"] = rates
            print(f"{args.sessions} x {args.context} attends/s:", json.dumps(rates), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
