#!/usr/bin/env python3
"""Score-phase variants of the f32 split kernel at 32k context (diagnostic)."""
import math, sys, time
from pathlib import Path
import numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as B  # noqa
from attnserve.gpu import kernels as K, shaders as S  # noqa
from attnserve.gpu.batch import Batch  # noqa

CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
CUT = "    // ── 2. per-head max and sum over this split ──"
DOT = "            for (var x = 0u; x < head_dim; x += 1u) {\n                dot += q_sh[qo + x] * k_tile[ko + x];\n            }"
LOAD = "            let kv = k_cache[((t0 + tb + row) * kv_dim + kv_head * head_dim) / 4u + part];"
base = S.load_wgsl("attention_split.wgsl")
cut = base.replace(CUT, "    if wid.x < 1000000u { return; }\n" + CUT, 1)
assert DOT in cut and LOAD in cut
VAR = {
    "cut@scores": cut,
    "const-128 dot": cut.replace(DOT, DOT.replace("x < head_dim", "x < 128u")),
    "no dot": cut.replace(DOT, "            dot = k_tile[ko];"),
    "no K load": cut.replace(LOAD, "            let kv = vec4<f32>(f32(row), f32(part), 1.0, 2.0);"),
    "no dot, no K load": cut.replace(DOT, "            dot = k_tile[ko];").replace(LOAD, "            let kv = vec4<f32>(f32(row), f32(part), 1.0, 2.0);"),
    "full": base,
}
orig = S.load_wgsl
S.load_wgsl = lambda name: VAR.get(name) or orig(name)
spec = S.KERNELS["attention_split_f32"]
for name in VAR:
    S.KERNELS[name] = S.KernelSpec(name, spec.entry_point, spec.bindings)

eng = B.Engine.open(None)
rng = np.random.default_rng(0)
H, HKV, D = 32, 8, 128
s = B.SessionKV(B.SessionConfig(1, H, HKV, D, "f32", CTX, 1))
layer = s.layers[0]
B.fill_layer(eng, layer, CTX, rng)
q = rng.standard_normal((1, H, D), dtype=np.float32)
orig_dispatch = Batch.dispatch
for name in VAR:
    def dispatch(self, kernel, bindings, grid, _n=name):
        if kernel == "attention_merge":
            return
        return orig_dispatch(self, _n if kernel == "attention_split_f32" else kernel, bindings, grid)
    Batch.dispatch = dispatch

    def job(ctx, iters=200):
        batch = Batch(ctx.device, ctx.pipelines, eng.worker.arenas, ctx.offset_align)
        qs = batch.upload(q)
        for _ in range(iters):
            layer.plan_attend_rows(batch, qs, q.shape, out=batch.scratch(q.nbytes), length=CTX,
                                   start_pos=CTX - 1, causal=True, scale=1 / math.sqrt(D))
        enc = batch.encode()
        t = time.perf_counter()
        batch.submit(enc)
        ctx.device.queue.read_buffer(batch.arenas.buffers["partial"], 0, 4)
        return (time.perf_counter() - t) / iters * 1e3
    eng.worker.run(job)
    print(f"{name:20s} {min(eng.worker.run(job) for _ in range(3)):.4f} ms", flush=True)
Batch.dispatch = orig_dispatch
eng.close()
