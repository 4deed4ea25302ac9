#!/usr/bin/env python3
"""The floor under a layer call's GPU thread (issue 53): what one tiny submission
and its readback cost the thread that makes them, and the process, before any of
attnserve's planning.

    python bench/probes/submit_floor.py [--adapter nvidia] [--calls 2000] [--json-out FILE]

One dispatch of a one-thread kernel (adds 1 to a word) and a copy of 256 bytes to
a readback buffer, then the buffer mapped, read and unmapped, made three ways:

- ``wgpu_py``: every call through wgpu-py (write_buffer, an encoder, a pass, the
  copy, finish, submit, map_sync, read_mapped, unmap): what any Python client of
  wgpu pays;
- ``native``: the write, the commands and the submission in one compiled call
  (``attnserve.gpu.native.run``, as the GPU thread encodes a batch), the readback
  through wgpu-py (``map_sync``, ``read_mapped``, ``unmap``) as ``Batch.read_back``
  makes it;

Measured per call: wall time (p50, mean), the calling thread's CPU time
(``time.thread_time``: user + system of this thread) and the process's
(``time.process_time``: every thread, the driver's included; on lavapipe that is
where the kernel itself runs). The goals of issue 53 bound the server's CPU per
call per thread (0.1 ms): a design that makes one submission and one readback per
layer call cannot go under this floor on the same host.

Prediction (written before the first run, on the 2-core lavapipe host): wgpu_py
about 0.25 ms of the thread (a plain script measured 0.26 ms and 0.55 ms of the
process); native 0.10-0.15 ms (the ~13 wgpu-py calls before the submit become one
C call; the map stays); on the H100 host both lower in CPU, with the wall time
bounded by the driver's submit-to-complete latency (~0.1 ms, gpu-notes.md).

Seen (2026-12-07, the 2-core lavapipe host with other work running, load ~3;
bench/results/submit-floor-lavapipe-2a6a40f.json): wgpu_py 0.24 ms of the thread
(0.54 ms of the process, p50 wall 0.32 ms), native 0.19 ms (0.46 ms, 0.28 ms): the
compiled encode takes ~0.06 ms off; the map and its wait (wgpu-py's map_sync polls
the device) are most of what is left. On this host the GPU thread's floor with one
submission and one readback per call is about twice the goal of 0.1 ms a call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from array import array
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "service"), str(ROOT)]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

import wgpu  # noqa: E402

from attnserve.gpu import native  # noqa: E402
from attnserve.gpu.device import open_device  # noqa: E402
from tools.common import write_result  # noqa: E402

KERNEL = """
@group(0) @binding(0) var<storage, read_write> b: array<u32>;
@compute @workgroup_size(1) fn main() { b[0] = b[0] + 1u; }
"""
NBYTES = 256


def measure(fn: Callable[[], None], calls: int) -> dict[str, float]:
    for _ in range(max(20, calls // 20)):
        fn()
    walls: list[float] = []
    c0, p0 = time.thread_time(), time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    thread_ms = 1e3 * (time.thread_time() - c0) / calls
    process_ms = 1e3 * (time.process_time() - p0) / calls
    return {
        "wall_p50_ms": round(1e3 * statistics.median(walls), 4),
        "wall_mean_ms": round(1e3 * statistics.fmean(walls), 4),
        "thread_cpu_ms": round(thread_ms, 4),
        "process_cpu_ms": round(process_ms, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3, help="each form measured this many times, interleaved")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)

    ctx = open_device(args.adapter or None)
    dev = ctx.device
    module = dev.create_shader_module(code=KERNEL)
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    buf = dev.create_buffer(size=NBYTES, usage=usage)
    staging = dev.create_buffer(size=NBYTES, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
    group = dev.create_bind_group(
        layout=pipe.get_bind_group_layout(0), entries=[{"binding": 0, "resource": {"buffer": buf}}]
    )
    zeros = np.zeros(4, np.uint32)
    program = array(
        "Q",
        [
            native.OP_DISPATCH, native.handle(pipe), native.handle(group), 1, 1, 1,
            native.OP_COPY, native.handle(buf), 0, native.handle(staging), 0, NBYTES,
        ],
    )  # fmt: skip
    writes: native.Writes = [(native.handle(buf), 0, zeros)]
    seen: list[int] = []

    def read_back() -> None:
        staging.map_sync(wgpu.MapMode.READ, 0, NBYTES)
        try:
            seen.append(int(np.frombuffer(staging.read_mapped(0, NBYTES, copy=False), np.uint32)[0]))
        finally:
            staging.unmap()

    def wgpu_py() -> None:
        dev.queue.write_buffer(buf, 0, zeros)
        enc = dev.create_command_encoder()
        p = enc.begin_compute_pass()
        p.set_pipeline(pipe)
        p.set_bind_group(0, group)
        p.dispatch_workgroups(1)
        p.end()
        enc.copy_buffer_to_buffer(buf, 0, staging, 0, NBYTES)
        dev.queue.submit([enc.finish()])
        read_back()

    def compiled() -> None:
        native.run(dev, writes, program)
        read_back()

    forms = {"wgpu_py": wgpu_py, "native": compiled}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in forms}
    for _ in range(args.repeats):
        for name, fn in forms.items():
            runs[name].append(measure(fn, args.calls))
    if not seen or set(seen) != {1}:  # every readback saw its own dispatch's write
        raise SystemExit(f"readbacks saw {sorted(set(seen))[:5]}, expected 1 each time")
    summary: dict[str, Any] = {
        name: {key: round(statistics.median(r[key] for r in rs), 4) for key in rs[0]} for name, rs in runs.items()
    }
    result = {
        "bench": "submit_floor",
        "device": ctx.describe(),
        "calls": args.calls,
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "forms": summary,
        "runs": runs,
    }
    for name, row in summary.items():
        print(json.dumps({"form": name, **row}), flush=True)
    write_result(args.json_out, result)
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
