#!/usr/bin/env python3
"""Where a tiny submission's fixed cost goes, and what the readback's wake-up costs
(issue 43 item 3): a 4-byte upload (``queue.write_buffer``), one dispatch, a copy to a
``MAP_READ`` staging buffer, submit, map, read, unmap, timed phase by phase, for
each way of waiting for the map:

* ``map_sync``: what the service does today (wgpu-py's ``map_sync``: an extra empty
  submission before the map, then a wait on an event that wgpu-py's poll thread
  sets from the map callback after its blocking ``wgpuDevicePoll``);
* ``nosync``: the same without the extra empty submission (``READ_NOSYNC``, the
  mode wgpu-py keeps for its own use);
* ``poll_here``: ``READ_NOSYNC``, then a blocking ``wgpuDevicePoll`` on the
  submitting thread itself (the callback runs there or on the poll thread,
  whichever polls first), then the promise's wait (already resolved);
* ``poll_here_sync``: the same with the extra empty submission.

Each variant runs alone and beside a busy Python thread (as the server's event
loop is under load: the GIL is contended at every hand-off, and a thread woken by
the driver waits for it up to the interpreter's switch interval, 5 ms by default;
``--switch-intervals`` runs them under each interval given). Every readback is checked (the
dispatch writes the iteration's number). Prints one JSON document.

It measures a tiny submission only: what a way of waiting costs once the work is
done. It cannot show how late a way wakes after longer work. On the H100 the
blocking poll on the submitting thread won here (64 µs against 110) but made a
2 ms stacked step 5x slower in the service (docs/benchmarks.md, "Half precision on
the wire"): check a change to the service's wait with a stacked step.

    python bench/probes/readback_probe.py [--adapter nvidia] [--iters 2000] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import wgpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "service"))

from attnserve.gpu.device import open_device  # noqa: E402

KERNEL = """
@group(0) @binding(0) var<storage, read> inp: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(1)
fn main() { out[0] = inp[0] + 1u; }
"""
VARIANTS = ("map_sync", "nosync", "poll_here", "poll_here_sync")
PHASES = ("write", "encode", "submit", "wait", "read", "unmap", "total")


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def run(device: wgpu.GPUDevice, variant: str, iters: int) -> dict[str, float]:
    mod = device.create_shader_module(code=KERNEL)
    pipe = device.create_compute_pipeline(layout="auto", compute={"module": mod, "entry_point": "main"})
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
    inp = device.create_buffer(size=256, usage=usage)
    out = device.create_buffer(size=256, usage=usage)
    staging = device.create_buffer(size=256, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
    bg = device.create_bind_group(
        layout=pipe.get_bind_group_layout(0),
        entries=[{"binding": 0, "resource": {"buffer": inp}}, {"binding": 1, "resource": {"buffer": out}}],
    )
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    for i in range(iters + 100):
        t0 = time.perf_counter()
        device.queue.write_buffer(inp, 0, np.array([i], "<u4").tobytes())
        t1 = time.perf_counter()
        enc = device.create_command_encoder()
        cpass = enc.begin_compute_pass()
        cpass.set_pipeline(pipe)
        cpass.set_bind_group(0, bg)
        cpass.dispatch_workgroups(1)
        cpass.end()
        enc.copy_buffer_to_buffer(out, 0, staging, 0, 4)
        cb = enc.finish()
        t2 = time.perf_counter()
        device.queue.submit([cb])
        t3 = time.perf_counter()
        if variant == "map_sync":
            staging.map_sync(wgpu.MapMode.READ, 0, 4)
        else:
            mode = "READ" if variant == "poll_here_sync" else "READ_NOSYNC"
            promise = staging.map_async(mode, 0, 4)
            if variant.startswith("poll_here"):
                device._poll_wait()  # a blocking wgpuDevicePoll on this thread
            promise.sync_wait()
        t4 = time.perf_counter()
        got = int(np.frombuffer(staging.read_mapped(0, 4, copy=False), "<u4")[0])
        t5 = time.perf_counter()
        staging.unmap()
        t6 = time.perf_counter()
        if got != i + 1:
            raise AssertionError(f"{variant}: iteration {i} read {got}, not {i + 1}")
        if i >= 100:
            for p, (a, b) in zip(PHASES, [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6), (t0, t6)]):
                times[p].append((b - a) * 1e6)
    return {p: round(statistics.median(v), 1) for p, v in times.items()} | {
        "total_p90": round(float(np.percentile(times["total"], 90)), 1)
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=None)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--switch-intervals", default="0.005,0.0005", help="sys.setswitchinterval values (s) to run under")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    ctx = open_device(args.adapter)
    result: dict[str, object] = {"adapter": ctx.info.get("device", ""), "iters": args.iters, "us_median": {}}
    for interval in map(float, args.switch_intervals.split(",")):
        sys.setswitchinterval(interval)
        _variants(ctx.device, args.variants.split(","), args.iters, result, f"@{interval * 1e3:g}ms")
    text = json.dumps(result, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text)
    print(text)
    return 0


def _variants(device: wgpu.GPUDevice, variants: list[str], iters: int, result: dict[str, object], tag: str) -> None:
    for busy in (False, True):
        for variant in variants:
            stop = threading.Event()
            spinner = threading.Thread(target=_busy, args=(stop,), daemon=True) if busy else None
            if spinner:
                spinner.start()
            try:
                res = run(device, variant, iters)
            finally:
                stop.set()
                if spinner:
                    spinner.join()
            key = f"{variant}{'+busy_thread' if busy else ''}{tag}"
            result["us_median"][key] = res  # type: ignore[index]
            print(key, json.dumps(res), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
