#!/usr/bin/env python3
"""Where a GPU submission's time goes: plan (the jobs' Python), encode (arenas,
bind groups, command encoding), and submit + readback (the GPU and the driver),
for a batched step of N fused decode items, with a cProfile summary of the
planning and encoding.

    python bench/worker_profile.py [--adapter nvidia] [--sessions 64] [--context 4096]
        [--formats f32,turboquant] [--steps 30] [--sinks 4 --window 128] [--layers 1]
        [--profile-out FILE]

With ``--layers L`` the sessions have L layers and the steps go through them in
turn, as an engine's decode does: step ``i`` is layer ``i % L``'s, and layers 1..L-1
of a token attend at the lengths layer 0 did (a stacked step's plan is made on
layer 0 and run on the others: ``gpu/step_plan.py``).

It drives the engine directly (no HTTP): one :class:`~attnserve.gpu.batch.Batch`
per step, on the calling thread while the GPU worker is idle, so the phases are
timed separately. Prints one JSON line per format (times in ms per step and per
item) and, with ``--top``, the functions that take the most planning/encoding time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import wgpu

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "client"), str(ROOT / "bench"), str(ROOT)]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from attnserve.engine import Engine  # noqa: E402
from attnserve.gpu.batch import Batch  # noqa: E402
from attnserve.gpu.step_plan import PLAN_REASONS, StepPlans  # noqa: E402
from attnserve.kv.config import SessionConfig  # noqa: E402
from attnserve.metrics import counted  # noqa: E402

from gpu_timing import GpuTimer, dispatch_times, request_timestamps  # noqa: E402
from kernel_bench import D, H, HKV, plan_batched_steps  # noqa: E402
from tools.common import write_result  # noqa: E402


def run(
    engine: Engine,
    fmt: str,
    n: int,
    context: int,
    steps: int,
    top: int,
    read_only: bool = False,
    stacked: bool = False,
    gpu_phases: bool = False,
    exact: tuple[int, int] = (0, 0),
    sort: str = "tottime",
    num_layers: int = 1,
) -> dict:
    rng = np.random.default_rng(0)
    ctx = engine.ctx
    sessions = [
        engine.session_kv(SessionConfig(num_layers, H, HKV, D, fmt, context + 4 * steps + 64, i, *exact))
        for i in range(n)
    ]
    for s in sessions:
        k = rng.standard_normal((context, HKV, D), dtype=np.float32)
        for layer in s.layers:
            engine.append(layer, k, k).result()
    q = rng.standard_normal((1, H, D), dtype=np.float32)
    k1 = rng.standard_normal((1, HKV, D), dtype=np.float32)
    qb, kb = np.broadcast_to(q, (n, *q.shape)).copy(), np.broadcast_to(k1, (n, *k1.shape)).copy()
    arenas = engine.worker.arenas
    step_plans = StepPlans()  # the sessions' step plans, as the store keeps a group's

    turn = [0]  # the steps so far: the layer of the next one

    def plan(batch: Batch, stacked: bool, read_only: bool) -> list:
        li = turn[0] % num_layers
        turn[0] += 1
        if stacked:  # one job for the step, its items planned as columns (Engine.plan_stacked)
            fused = {} if read_only else {"k": kb, "v": kb}
            layers = [s.layers[li] for s in sessions]
            return [engine.plan_stacked(layers, qb, start_pos=[None] * n, plans=step_plans, **fused)(batch)]
        fused = {} if read_only else {"k": k1, "v": k1}
        return [engine.plan_attend(s.layers[li], q, **fused)(batch) for s in sessions]

    def new_batch() -> Batch:
        return Batch(ctx.device, ctx.pipelines, arenas, ctx.offset_align, engine.policy)

    def step(prof: cProfile.Profile | None) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        batch = new_batch()
        finishes = plan(batch, stacked, read_only)
        batch.flush()  # the deferred groups' planning (encode would do it first)
        t1 = time.perf_counter()
        encoded = batch.encode()
        if prof:
            prof.disable()
        t2 = time.perf_counter()
        command_buffer, staging, n_out = encoded
        ctx.device.queue.submit([command_buffer])  # as Batch.queue_submit, timed alone
        t3 = time.perf_counter()
        staging.map_sync(wgpu.MapMode.READ, 0, n_out)
        t35 = time.perf_counter()
        try:
            out = memoryview(bytes(staging.read_mapped(0, n_out, copy=False)))
        finally:
            staging.unmap()
        t4 = time.perf_counter()
        for f in finishes:
            f(out)
        return t1 - t0, t2 - t1, t4 - t2, t3 - t2, t4 - t35

    # the worker must be idle while this thread drives the device
    engine.worker.run(lambda c: None)
    events = engine.step_plans

    def plan_events() -> dict[str, float]:
        return {e: counted(events, e, "") for e in ("made", "run")} | {
            "missed": sum(counted(events, "missed", r) for r in PLAN_REASONS)
        }

    before = plan_events()
    for _ in range(3):
        step(None)
    times = np.array([step(None) for _ in range(steps)]) * 1e3  # timed without the profiler
    prof = cProfile.Profile()
    for _ in range(steps if top else 0):
        step(prof)
    med = np.median(times, axis=0)
    replays = {e: n - before[e] for e, n in plan_events().items()}
    res = {
        "kv_format": fmt,
        **({"sinks": exact[0], "window": exact[1]} if any(exact) else {}),
        "items": n,
        "context": context,
        **({"layers": num_layers} if num_layers > 1 else {}),
        **({"step_plans": replays} if replays and stacked else {}),
        "fused_append": not read_only,
        "stacked": stacked,
        "steps": steps,
        "plan_ms": round(float(med[0]), 3),
        "encode_ms": round(float(med[1]), 3),
        "submit_readback_ms": round(float(med[2]), 3),
        "queue_submit_ms": round(float(med[3]), 3),
        "read_mapped_ms": round(float(med[4]), 3),
        "per_item_us": {
            "plan": round(1e3 * med[0] / n, 1),
            "encode": round(1e3 * med[1] / n, 1),
            "submit_readback": round(1e3 * med[2] / n, 1),
        },
    }
    if gpu_phases and "timestamp-query" in ctx.features:
        res["gpu_phases"] = phases(new_batch, plan, stacked, read_only, sessions, q)
    if top:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
        res["profile_tottime"] = buf.getvalue().splitlines()
    for s in sessions:
        engine.release(s).result()
    return res


def phases(new_batch, plan, stacked: bool, read_only: bool, sessions: list, q: np.ndarray, repeats: int = 7) -> dict:
    """Where the GPU time of one step goes: the step as served (whole, then each
    dispatch timed in a pass of its own), without its appends, and bench/kernel_bench.py's
    batched plan of the same layers (one query upload shared, outputs left on the GPU,
    no readback): per dispatch the median GPU µs over ``repeats`` steps, and each
    plan's whole GPU span and wall time of submit + readback."""
    timer = GpuTimer(new_batch().device)

    def kernels_plan(batch: Batch) -> list:
        plan_batched_steps(batch, [s.layers[0] for s in sessions], q)
        return []

    plans = {
        "served": lambda b: plan(b, stacked, read_only),
        "served_read_only": lambda b: plan(b, stacked, True),
        "bench_kernels": kernels_plan,
    }
    res = {}
    for name, make in plans.items():
        whole, walls, per = [], [], []
        for _ in range(repeats):
            batch = new_batch()
            make(batch)
            encoded = batch.encode()
            t0 = time.perf_counter()
            whole.append(timer.run(encoded[0]))
            batch.read_back(encoded)
            walls.append(1e3 * (time.perf_counter() - t0))
            batch = new_batch()
            make(batch)
            per.append(dispatch_times(batch)[0])
        rows = per[0]
        for i, row in enumerate(rows):
            row["gpu_us"] = float(np.median([p[i]["gpu_us"] for p in per]))
            row["start_us"] = float(np.median([p[i]["start_us"] for p in per]))
        res[name] = {
            "whole_gpu_ms": round(float(np.median(whole)), 3),
            "whole_wall_ms": round(float(np.median(walls)), 3),
            "sum_dispatch_gpu_ms": round(sum(r["gpu_us"] for r in rows) / 1e3, 3),
            "dispatches": rows,
        }
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER"))
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--formats", default="f32,turboquant")
    ap.add_argument("--read-only", action="store_true", help="attend without the fused append")
    ap.add_argument("--stacked", action="store_true", help="the step as one stacked job (plan_stacked)")
    ap.add_argument("--top", type=int, default=25, help="cProfile rows to print (0: none)")
    ap.add_argument(
        "--gpu-phases",
        action="store_true",
        help="GPU timestamps per dispatch of the step (device feature timestamp-query)",
    )
    ap.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"), help="the profile's order")
    ap.add_argument("--sinks", type=int, default=0, help="a compressed layer's exact first timesteps")
    ap.add_argument("--window", type=int, default=0, help="a compressed layer's exact recent window")
    ap.add_argument("--layers", type=int, default=1, help="layers per session, stepped in turn (an engine's decode)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    if args.gpu_phases:
        request_timestamps()
    engine = Engine.open(args.adapter or None)
    results = []
    try:
        print(f"# adapter: {engine.ctx.describe()}", flush=True)
        for fmt in args.formats.split(","):
            for n in sorted({1, args.sessions}):
                r = run(
                    engine, fmt, n, args.context, args.steps, args.top if n > 1 else 0, args.read_only, args.stacked,
                    args.gpu_phases and n > 1, (args.sinks, args.window), args.sort, args.layers,
                )  # fmt: skip
                results.append(r)
                prof = r.pop("profile_tottime", None)
                print(json.dumps(r), flush=True)
                if prof:
                    print("\n".join(prof[: args.top + 12]), flush=True)
                    r["profile_tottime"] = prof
    finally:
        engine.close()
    write_result(args.json_out, {"adapter": engine.ctx.describe(), "results": results}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
