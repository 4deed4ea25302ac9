#!/usr/bin/env python3
"""Is the GPU running compute at full speed under wgpu/Vulkan? (diagnostic)

Times a WGSL kernel of independent FMA chains (compute-bound, no memory traffic)
and prints its FLOP rate, then the 32k decode step for a few split sizes; run it
with `nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv -lms 200`
in the background to see the clocks during each part.
"""

import sys
import time
from pathlib import Path
import numpy as np
import dataclasses
import wgpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: kernels.py
import kernel_bench as B  # noqa: E402

FMA = """
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var a = vec4<f32>(f32(gid.x) * 1e-9);
    var b = a + 1.0;
    var c = a + 2.0;
    var d = a + 3.0;
    let m = vec4<f32>(0.999);
    let k = vec4<f32>(1e-3);
    for (var i = 0u; i < 4096u; i += 1u) {
        a = fma(a, m, k); b = fma(b, m, k); c = fma(c, m, k); d = fma(d, m, k);
    }
    out[gid.x] = a.x + b.y + c.z + d.w;
}
"""

eng = B.Engine.open(None)


def fma_rate():
    def job(ctx):
        dev = ctx.device
        n_wg = 132 * 64
        buf = dev.create_buffer(size=n_wg * 256 * 4, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
        pipe = dev.create_compute_pipeline(
            layout="auto", compute={"module": dev.create_shader_module(code=FMA), "entry_point": "main"}
        )
        bg = dev.create_bind_group(
            layout=pipe.get_bind_group_layout(0), entries=[{"binding": 0, "resource": {"buffer": buf}}]
        )
        best = 1e9
        for _ in range(5):
            enc = dev.create_command_encoder()
            p = enc.begin_compute_pass()
            p.set_pipeline(pipe)
            p.set_bind_group(0, bg)
            for _ in range(10):
                p.dispatch_workgroups(n_wg)
            p.end()
            cb = enc.finish()
            t = time.perf_counter()
            dev.queue.submit([cb])
            dev.queue.read_buffer(buf, 0, 4)
            best = min(best, (time.perf_counter() - t) / 10)
        flops = n_wg * 256 * 4096 * 16 * 2
        return flops / best / 1e12, best * 1e3

    return eng.worker.run(job)


for _ in range(2):
    tf, ms = fma_rate()
    print(f"FMA kernel: {tf:.1f} TFLOP/s f32 ({ms:.2f} ms per dispatch)", flush=True)
rng = np.random.default_rng(0)
for fmt in ("f32", "turboquant"):
    s = eng.session_kv(B.SessionConfig(1, 32, 8, 128, fmt, 32768, 1))
    B.fill_layer(eng, s.layers[0], 32768, rng)
    for tw in (512, 2048):
        eng.policy = dataclasses.replace(eng.policy, target_workgroups=tw)
        ms = B.time_wgpu(eng, s.layers[0], 1, 32768, rng, 1.0)
        print(f"{fmt} decode 32k target {tw}: {ms:.4f} ms", flush=True)
    eng.release(s).result()
tf, ms = fma_rate()
print(f"FMA kernel again: {tf:.1f} TFLOP/s", flush=True)
eng.close()
