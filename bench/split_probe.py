#!/usr/bin/env python3
"""Where does a split-KV decode step spend its time? (diagnostic, H200)

Times, GPU-only (submit to completion, many iterations per submission), the
decode step at 32k context for both formats with: the full split + merge path;
the split kernel alone; and shader variants of the split kernel cut short
(returning right after the parameter reads; returning after the score phase).
Also reports the CPU time to record one step's commands.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as B  # noqa: E402

from attnserve.gpu import kernels as K  # noqa: E402
from attnserve.gpu import shaders as S  # noqa: E402
from attnserve.gpu.batch import Batch  # noqa: E402

CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
_orig_load = S.load_wgsl
VARIANTS = {}


def variant(name, file, cut_after):
    src = _orig_load(file)
    if cut_after == "params":
        key = "    let split = wid.x;"
        src = src.replace(key, "    if wid.x < 1000000u { return; }\n" + key, 1)
    elif cut_after == "scores":
        key = "    // ── 2. per-head max and sum over this split ──"
        src = src.replace(key, "    if wid.x < 1000000u { return; }\n" + key, 1)
    VARIANTS[name] = src


def patched_load(name):
    return VARIANTS.get(name) or _orig_load(name)


S.load_wgsl = patched_load
for fmt, file, entry in (("f32", "attention_split.wgsl", "attention_split_f32"),
                         ("turboquant", "flash_attention_tq_split.wgsl", "attention_split_tq")):
    for cut in ("params", "scores"):
        vname = f"{file}:{cut}"
        variant(vname, file, cut)
        spec = S.KERNELS[entry]
        S.KERNELS[f"{entry}:{cut}"] = S.KernelSpec(vname, spec.entry_point, spec.bindings)

eng = B.Engine.open(None)
rng = np.random.default_rng(0)
H, HKV, D = 32, 8, 128


def time_plan(plan_fn, iters=200):
    def job(ctx):
        batch = Batch(ctx.device, ctx.pipelines, eng.worker.arenas, ctx.offset_align)
        for _ in range(iters):
            plan_fn(batch)
        sync = batch.output(4)
        batch.copy(batch.scratch(4), 0, sync, 0, 4)
        t0 = time.perf_counter()
        enc = batch.encode()
        t1 = time.perf_counter()
        batch.submit(enc)
        t2 = time.perf_counter()
        return (t1 - t0) / iters * 1e3, (t2 - t1) / iters * 1e3

    eng.worker.run(job)
    return min((eng.worker.run(job) for _ in range(3)), key=lambda x: x[1])


for fmt in ("f32", "turboquant"):
    s = B.SessionKV(B.SessionConfig(1, H, HKV, D, fmt, CTX, 1))
    layer = s.layers[0]
    B.fill_layer(eng, layer, CTX, rng)
    q = rng.standard_normal((1, H, D), dtype=np.float32)
    for tw in (256, 1024, 2048, 8192):
        K.POLICY.target_workgroups = tw
        split_len, n_splits = K.choose_split(fmt, CTX, HKV, 1, H // HKV)

        def full(batch):
            layer.plan_attend_rows(batch, batch.upload(q), q.shape, out=batch.scratch(q.nbytes),
                                   length=CTX, start_pos=CTX - 1, causal=True, scale=1 / math.sqrt(D))

        res = {"full": time_plan(full)}
        entry = "attention_split_f32" if fmt == "f32" else "attention_split_tq"
        orig_dispatch = Batch.dispatch

        for label, kname, drop_merge in (("split only", entry, True), ("cut@params", f"{entry}:params", True),
                                         ("cut@scores", f"{entry}:scores", True)):
            def dispatch(self, kernel, bindings, grid, _k=kname, _d=drop_merge):
                if kernel == "attention_merge" and _d:
                    return
                if kernel == entry:
                    kernel = _k
                return orig_dispatch(self, kernel, bindings, grid)

            Batch.dispatch = dispatch
            try:
                res[label] = time_plan(full)
            finally:
                Batch.dispatch = orig_dispatch
        print(f"{fmt:10} ctx {CTX} target_wg {tw:5d} split_len {split_len:4d} n_splits {n_splits:5d} | " +
              " | ".join(f"{k}: gpu {v[1]:.4f} ms (cpu {v[0]:.3f})" for k, v in res.items()), flush=True)
    eng.release(s).result()
eng.close()
