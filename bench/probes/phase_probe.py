#!/usr/bin/env python3
"""Where the time of a decode step goes (diagnostic).

    python bench/probes/phase_probe.py [context]

Times one decode attend (32 query heads, 8 KV heads, d = 128) at the given
context with variants of the split kernel cut short: after the score phase,
after the softmax, and in full; and the step without its merge pass (and, for
TurboQuant, without the query rotation), so the differences give each phase's
share. GPU time only, many attends per submission (as bench/kernel_bench.py).
"""

import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: kernels.py
import kernel_bench as B  # noqa: E402
from attnserve.gpu import shaders as S  # noqa: E402
from attnserve.gpu.batch import Batch  # noqa: E402

CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
SOFTMAX = "    // ── 2. per-head max and sum of exp over this split ──"
VALUES = "    // ── 3."
RETURN = "    if wid.x < 1000000u { return; }\n"
KERNEL = {
    "f32": S.plain_kernel("attention_split", "f32"),
    "turboquant": S.tqx_kernel("attention_split_tqx", "turboquant"),
}

orig_load = S.load_wgsl
texts = {}


def variant(kernel: str, cut: str) -> str:
    name = f"{kernel}@{cut}"
    if name not in S.KERNELS:
        spec = S.KERNELS[kernel]
        src = orig_load(spec.file, spec.defines)
        marker = SOFTMAX if cut == "scores" else VALUES
        if src.count(marker) != 1:  # not assert: a probe must not measure the unpatched kernel
            sys.exit(
                f"phase_probe: patch anchor {marker.strip()!r} found {src.count(marker)} times in "
                f"{spec.file} (kernel {kernel}), not once: the shader changed; update the anchors"
            )
        texts[name] = src.replace(marker, RETURN + marker, 1)
        S.KERNELS[name] = S.KernelSpec(name, spec.entry_point, spec.bindings)
    return name


S.load_wgsl = lambda name, defines=(), folder=None: texts.get(name) or orig_load(name, defines, folder)
for _name in (*KERNEL.values(), "attention_merge", "tq_rotate_q"):
    if _name not in S.KERNELS:  # a case below would silently time the full step
        sys.exit(f"phase_probe: no kernel {_name!r} any more: update the probe")
eng = B.Engine.open(None)
rng = np.random.default_rng(0)
q = rng.standard_normal((1, B.H, B.D), dtype=np.float32)
orig_dispatch = Batch.dispatch
for fmt in ("f32", "turboquant"):
    s = eng.session_kv(B.SessionConfig(1, B.H, B.HKV, B.D, fmt, CTX, 1))
    layer = s.layers[0]
    B.fill_layer(eng, layer, CTX, rng)
    eng.policy = dataclasses.replace(eng.policy, force="split")
    kern = KERNEL[fmt]
    cases = {
        "full step": {},
        "no merge": {"attention_merge": None},
        "no merge, no rotation": {"attention_merge": None, "tq_rotate_q": None},
        "split kernel cut after softmax": {
            "attention_merge": None,
            "tq_rotate_q": None,
            kern: variant(kern, "softmax"),
        },
        "split kernel cut after scores": {
            "attention_merge": None,
            "tq_rotate_q": None,
            kern: variant(kern, "scores"),
        },
    }
    for label, swap in cases.items():
        if fmt == "f32" and "rotation" in label:
            continue

        def dispatch(self, kernel, bindings, grid, constants=None, _swap=swap):
            k = _swap.get(kernel, kernel)
            if k is None:
                return None
            return orig_dispatch(self, k, bindings, grid, constants)

        Batch.dispatch = dispatch

        def job(ctx, iters=200):
            batch = Batch(ctx.device, ctx.pipelines, eng.worker.arenas, ctx.offset_align, eng.policy)
            qs = batch.upload(q)
            for _ in range(iters):
                layer.plan_attend_rows(
                    batch,
                    qs,
                    q.shape,
                    out=batch.scratch(q.nbytes),
                    length=CTX,
                    start_pos=CTX - 1,
                    causal=True,
                    scale=1 / math.sqrt(B.D),
                )
            enc = batch.encode()
            t = time.perf_counter()
            B.submit(batch, enc)
            ctx.device.queue.read_buffer(batch.arenas.buffers["partial"], 0, 4)
            return (time.perf_counter() - t) / iters * 1e3

        eng.worker.run(job)
        best = min(eng.worker.run(job) for _ in range(3))
        print(f"{fmt:10} ctx {CTX} {label:32s} {best:.4f} ms", flush=True)
        Batch.dispatch = orig_dispatch
    eng.release(s).result()
eng.close()
