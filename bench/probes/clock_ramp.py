#!/usr/bin/env python3
"""Does the GPU run a decode step at full speed under wgpu/Vulkan? (diagnostic)

The batched decode step of N sessions x context (f32, one query row each, the plan
of bench/kernel_bench.py's batched rows) timed on the GPU per dispatch: R steps recorded
into one submission (does the split kernel speed up from the first step to the
last?), then single-step submissions back to back and with host pauses between
them (the service's pattern). ``--cuda`` first opens what a CUDA program would and
keeps it: ``init`` (cuInit alone), ``retain`` (the primary context retained, not
current: what attnserve.gpu.cuda_clocks.hold does), ``hold`` (retained and
current), ``torch`` (a tensor on the GPU, as bench/kernel_bench.py makes for its copy
bandwidth and its peer). The H200's answer (docs/benchmarks.md): 3.46 ms a step
with none, 0.79 ms with retain, hold or torch. Run
``nvidia-smi --query-gpu=clocks.sm --format=csv -lms 100`` beside it.

    python bench/probes/clock_ramp.py [--adapter nvidia] [--sessions 64] [--context 4096]
        [--cuda none|init|retain|hold|torch] [--pauses 0,5,20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "client"), str(ROOT / "bench"), str(ROOT)]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from gpu_timing import GpuTimer, dispatch_times, request_timestamps  # noqa: E402
from kernel_bench import D, H, HKV, fill_layer, plan_batched_steps  # noqa: E402

from attnserve.engine import Engine  # noqa: E402
from attnserve.gpu.batch import Batch  # noqa: E402
from attnserve.kv.config import SessionConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER"))
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=16, help="steps in one submission")
    ap.add_argument("--cuda", choices=["none", "init", "retain", "hold", "torch"], default="none")
    ap.add_argument("--pauses", default="0,5,20", help="ms between single-step submissions")
    args = ap.parse_args()
    keep = None
    if args.cuda == "torch":
        import torch

        keep = torch.ones(1 << 20, device="cuda")
        torch.cuda.synchronize()
    elif args.cuda == "init":
        import ctypes

        ctypes.CDLL("libcuda.so.1").cuInit(0)
    elif args.cuda in ("retain", "hold"):
        from attnserve.gpu.cuda_clocks import hold

        keep = hold(make_current=args.cuda == "hold")
    request_timestamps()
    engine = Engine.open(args.adapter)
    rng = np.random.default_rng(0)
    sessions = [engine.session_kv(SessionConfig(1, H, HKV, D, "f32", args.context, i)) for i in range(args.sessions)]
    for s in sessions:
        fill_layer(engine, s.layers[0], args.context, rng)
    q = rng.standard_normal((1, H, D), dtype=np.float32)
    ctx = engine.ctx

    def batch_of(steps: int) -> Batch:
        batch = Batch(ctx.device, ctx.pipelines, engine.worker.arenas, ctx.offset_align, engine.policy)
        plan_batched_steps(batch, [s.layers[0] for s in sessions], q, steps)
        return batch

    def job(_ctx):
        res = {"cuda": args.cuda, "sessions": args.sessions, "context": args.context}
        dispatch_times(batch_of(1))  # pipelines, arenas
        rows, _ = dispatch_times(batch_of(args.repeat))
        res["split_us_in_one_submission"] = [r["gpu_us"] for r in rows if r["kernel"].startswith("attention_split")]
        timer = GpuTimer(ctx.device)
        for pause_ms in map(int, args.pauses.split(",")):
            gpu = []
            for _ in range(30):
                batch = batch_of(1)
                encoded = batch.encode()
                gpu.append(timer.run(encoded[0]))
                batch.read_back(encoded)
                if pause_ms:
                    time.sleep(pause_ms / 1e3)
            res[f"single_step_gpu_ms_pause_{pause_ms}ms"] = [round(g, 3) for g in gpu]
        return res

    print(json.dumps(engine.worker.run(job)), flush=True)
    del keep
    engine.close()


if __name__ == "__main__":
    main()
