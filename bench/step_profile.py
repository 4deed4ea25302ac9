#!/usr/bin/env python3
"""Where a batched step's host time goes, per thread: the server's event loop, its
GPU worker, and the client, in CPU seconds per step; fitted as a fixed cost plus a
cost per item over several batch sizes.

    python bench/step_profile.py [--adapter nvidia] [--batches 16,64,256]
        [--context 4096] [--formats f32,turboquant] [--sinks 4 --window 128] [--steps 40] [--top 30]
        [--json-out FILE]

The server runs in this process (uvicorn on 127.0.0.1, the event loop on the main
thread, the configuration of ``attnserve serve``); a client thread drives the
stacked fused decode step (one query row and one K/V row per session, one layer)
over ``/v1/stream`` (``--transport stream``) or the frame transport (``frames``),
one step in flight. Each thread's CPU time comes from its own
clock (``pthread_getcpuclockid``), so the split holds however the threads overlap;
the GPU's share is the server's ``attnserve_gpu_submission_seconds`` (record,
submit and readback on the worker). With ``--top``, the event loop is profiled
(cProfile) over the largest batch's steps again, after the timed ones.

This is the measure of issue 25's "host cost per item"; docs/benchmarks.md ("The
service") keeps its results.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "client"), str(ROOT)]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

import uvicorn  # noqa: E402

from attnserve.app import create_app  # noqa: E402
from attnserve.cli import server_config  # noqa: E402
from attnserve.config import Settings  # noqa: E402
from attnserve.gc_policy import apply_gc_policy  # noqa: E402
from attnserve_client import Client  # noqa: E402
from tools.common import as_dtype, free_port, metric_sum, parse_prometheus, write_result  # noqa: E402

H, HKV, D = 32, 8, 128


def thread_clock(thread: threading.Thread) -> int:
    """The CPU-time clock of ``thread`` (Linux)."""
    assert thread.ident is not None
    return time.pthread_getcpuclockid(thread.ident)


def fit(batches: list[int], values: list[float]) -> dict[str, float]:
    """``value = fixed + per_item * batch`` by least squares."""
    slope, intercept = np.polyfit(np.asarray(batches, float), np.asarray(values, float), 1)
    return {"fixed_ms": round(float(intercept), 3), "per_item_us": round(1e3 * float(slope), 2)}


class Driver:
    """The client side, on its own thread; the server's loop runs on the main one."""

    def __init__(self, url: str, server: uvicorn.Server, args: argparse.Namespace, worker: threading.Thread):
        self.url, self.server, self.args, self.worker = url, server, args, worker
        self.loop_thread = threading.main_thread()
        self.loop = None  # the server's event loop (profiled through it with --top)
        self.engine = None  # the server's engine (its worker profiled through it with --profile worker)
        self.rows: list[dict] = []
        self.error: BaseException | None = None

    def cpu(self) -> dict[str, float]:
        me = threading.current_thread()
        return {
            name: time.clock_gettime(thread_clock(t))
            for name, t in (("loop", self.loop_thread), ("worker", self.worker), ("client", me))
        }

    def gpu_seconds(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=60).text
        return metric_sum(parse_prometheus(text), "attnserve_gpu_submission_seconds_sum")

    def profiled(self, steps) -> list[str]:
        """cProfile of the event loop's thread (``--profile loop``) or the GPU
        worker's (``worker``) over ``steps()``: enabled and disabled from a callback
        on that thread, so it records that thread."""
        prof = cProfile.Profile()
        done = threading.Event()
        if self.args.profile == "worker":
            self.engine.call(lambda _ctx: prof.enable()).result()
            steps()
            self.engine.call(lambda _ctx: (prof.disable(), done.set())).result()
        else:
            self.loop.call_soon_threadsafe(prof.enable)
            steps()
            self.loop.call_soon_threadsafe(lambda: (prof.disable(), done.set()))
        done.wait(60)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(self.args.top)
        return buf.getvalue().splitlines()

    def run(self) -> None:
        try:
            while not self.server.started:
                time.sleep(0.05)
            rng = np.random.default_rng(0)
            with Client(self.url, timeout=300) as c:
                for fmt in self.args.formats.split(","):
                    self.rows.append(self.one_format(c, fmt, rng))
        except BaseException as e:  # reported by main
            self.error = e
        finally:
            self.server.should_exit = True

    def one_format(self, c: Client, fmt: str, rng) -> dict:
        a = self.args
        batches = sorted(int(b) for b in a.batches.split(","))
        sessions = []
        for _ in range(batches[-1]):
            exact = {"sinks": a.sinks, "window": a.window} if a.sinks or a.window else {}
            s = c.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, kv_format=fmt, **exact)
            for start in range(0, a.context, 1024):
                m = min(1024, a.context - start)
                kv = rng.standard_normal((m, HKV, D), dtype=np.float32)
                s.append(0, kv, kv)
            sessions.append(s)
        per_batch = []
        held: dict = {}  # the open step of --call step
        with c.stream(transport="frames" if a.transport == "frames" else "websocket") as stream:
            for b in batches:
                ids = [s.session_id for s in sessions[:b]]
                q = as_dtype(rng.standard_normal((b, 1, H, D), dtype=np.float32), a.dtype)
                kv = as_dtype(rng.standard_normal((b, 1, HKV, D), dtype=np.float32), a.dtype)
                if a.call == "step":  # an open step's layer calls (call frames over the frame transport)
                    held["step"] = stream.open_step(ids, dtype=q.dtype)

                    def one_call(q=q, kv=kv) -> None:
                        held["step"].call(0, q, kv, kv)
                else:

                    def one_call(ids=ids, q=q, kv=kv) -> None:
                        stream.attend_stacked(ids, 0, q, kv, kv)

                for _ in range(3):
                    one_call()
                gpu0, cpu0, t0 = self.gpu_seconds(), self.cpu(), time.perf_counter()
                for _ in range(a.steps):
                    one_call()
                wall = (time.perf_counter() - t0) / a.steps
                cpu1, gpu1 = self.cpu(), self.gpu_seconds()
                row = {
                    "batch": b,
                    "step_ms": round(1e3 * wall, 3),
                    "attends_per_s": round(b / wall, 1),
                    **{f"{k}_cpu_ms": round(1e3 * (cpu1[k] - cpu0[k]) / a.steps, 3) for k in cpu0},
                    "gpu_submission_ms": round(1e3 * (gpu1 - gpu0) / a.steps, 3),
                }
                per_batch.append(row)
                print(json.dumps({"kv_format": fmt, "dtype": a.dtype, **row}), flush=True)
                if a.call == "step":
                    held.pop("step").close()
            profile = None
            if a.top:  # the largest batch's steps again, under the profiler
                if a.call == "step":
                    held["step"] = stream.open_step(ids, dtype=q.dtype)
                profile = self.profiled(lambda: [one_call() for _ in range(a.steps)])
                print("\n".join(profile), flush=True)
                if a.call == "step":
                    held.pop("step").close()
        for s in sessions:
            s.delete()
        out = {
            "kv_format": fmt,
            "dtype": a.dtype,
            "sinks": a.sinks,
            "window": a.window,
            "transport": a.transport,
            "context": a.context,
            "steps": a.steps,
            "batches": per_batch,
        }
        for k in ("step_ms", "loop_cpu_ms", "worker_cpu_ms", "client_cpu_ms", "gpu_submission_ms"):
            out[f"fit_{k.removesuffix('_ms')}"] = fit([r["batch"] for r in per_batch], [r[k] for r in per_batch])
        if profile:
            out[f"{a.profile}_profile"] = profile
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""))
    ap.add_argument("--batches", default="16,64,256", help="sessions per stacked step, comma-separated")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--formats", default="f32,turboquant")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--transport", choices=("stream", "frames"), default="stream")
    ap.add_argument(
        "--call",
        choices=("stacked", "step"),
        default="stacked",
        help="each call an attend_stacked, or a layer call of an open step (call frames over --transport frames)",
    )
    ap.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f32", help="the step's arrays' dtype")
    ap.add_argument("--top", type=int, default=0, help="cProfile rows of the profiled thread to print (0: no profile)")
    ap.add_argument("--profile", choices=("loop", "worker"), default="loop", help="--top: the thread profiled")
    ap.add_argument("--sinks", type=int, default=0, help="a compressed session's exact first timesteps")
    ap.add_argument("--window", type=int, default=0, help="a compressed session's exact recent window")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    settings = Settings(
        adapter=args.adapter or None,
        max_batch_items=max(int(b) for b in args.batches.split(",")),
        memory_budget_bytes=0,  # the largest batch's sessions may pass the default 8 GiB
        frames_port=0 if args.transport == "frames" else None,
    )
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(server_config(app, settings, host="127.0.0.1", port=port, log_level="warning"))

    def start_driver() -> None:  # once the lifespan has opened the engine
        while not server.started:
            time.sleep(0.05)
        gc_thresholds.extend(apply_gc_policy(settings.gc_threshold))  # as `attnserve serve` does once started
        rt = app.state.runtime
        driver = Driver(f"http://127.0.0.1:{port}", server, args, rt.engine.worker._thread)  # noqa: SLF001
        driver.loop, driver.engine = rt.loop, rt.engine
        drivers.append(driver)
        driver.run()

    drivers: list[Driver] = []
    gc_thresholds: list[int] = []
    t = threading.Thread(target=start_driver, name="bench-client")
    t.start()
    server.run()
    t.join()
    driver = drivers[0] if drivers else None
    if driver is None or driver.error is not None:
        raise SystemExit(f"the benchmark failed: {driver.error if driver else 'no driver'!r}")
    device = app.state.runtime.engine.describe() if app.state.runtime.engine else {}
    result = {
        "bench": "step_profile",
        "device": device,
        "args": {**vars(args), "json_out": None},
        "gc_threshold": gc_thresholds,
        "formats": driver.rows,
    }
    for r in driver.rows:
        print(json.dumps({k: v for k, v in r.items() if k.startswith("fit_")} | {"kv_format": r["kv_format"]}))
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
