#!/usr/bin/env python3
"""How fast can a WGSL kernel multiply f32 matrices on this stack? (diagnostic)

    python bench/gemm_probe.py [--n 4096] [--check 256]

The f32 prefill is two matrix products per tile plus a softmax. This probe times
a plain f32 GEMM (C = A B, n x n x n) written with the register blocking of
attention_prefill_rb's score phase: 128 threads per 64 x 64 tile of C, each
thread 8 rows x 4 columns as outer products over k, A and B staged in
workgroup memory 32 values of k at a time (16 KiB), A read as vec4 along k and
B as vec4 along n. Its FLOP rate is a ceiling for that tile design (the
attention kernel does the same work and more); torch's f32 matmul (TF32 off)
on the same GPU is printed beside it when CUDA is there. Checked against numpy
(float64) at a small size first.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import wgpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

GEMM = """
@group(0) @binding(0) var<storage, read> a: array<vec4<f32>>;    // [n][n/4]: row m, k as vec4
@group(0) @binding(1) var<storage, read> b: array<vec4<f32>>;    // [n][n/4]: row k, n as vec4
@group(0) @binding(2) var<storage, read_write> c: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> dims: array<u32, 4>;

var<workgroup> as_: array<array<vec4<f32>, 64>, 8>;   // [k/4][m]
var<workgroup> bs: array<array<vec4<f32>, 16>, 32>;   // [k][n/4]

@compute @workgroup_size(128, 1, 1)
fn gemm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n = dims[0];
    let n4 = n / 4u;
    let tid = lid.x;
    let tr = tid / 16u;          // rows tr + 8 i
    let tc = tid % 16u;          // columns 4 tc .. 4 tc + 3
    let m0 = wid.y * 64u;
    let c0 = wid.x * 16u;        // in vec4
    var acc0 = vec4<f32>(0.0); var acc1 = vec4<f32>(0.0); var acc2 = vec4<f32>(0.0); var acc3 = vec4<f32>(0.0);
    var acc4 = vec4<f32>(0.0); var acc5 = vec4<f32>(0.0); var acc6 = vec4<f32>(0.0); var acc7 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < n; k0 += 32u) {
        // stage A: 64 rows x 8 vec4; B: 32 rows x 16 vec4 (four of each per thread)
        for (var e = tid; e < 512u; e += 128u) {
            as_[e % 8u][e / 8u] = a[(m0 + e / 8u) * n4 + k0 / 4u + e % 8u];
            bs[e / 16u][e % 16u] = b[(k0 + e / 16u) * n4 + c0 + e % 16u];
        }
        workgroupBarrier();
        for (var kq = 0u; kq < 8u; kq += 1u) {
            let b0 = bs[4u * kq][tc];
            let b1 = bs[4u * kq + 1u][tc];
            let b2 = bs[4u * kq + 2u][tc];
            let b3 = bs[4u * kq + 3u][tc];
            var x = as_[kq][tr];       acc0 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3;
            x = as_[kq][tr + 8u];      acc1 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3;
            x = as_[kq][tr + 16u];     acc2 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3;
            x = as_[kq][tr + 24u];     acc3 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3;
            x = as_[kq][tr + 32u];     acc4 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3;
            x = as_[kq][tr + 40u];     acc5 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3;
            x = as_[kq][tr + 48u];     acc6 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3;
            x = as_[kq][tr + 56u];     acc7 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3;
        }
        workgroupBarrier();
    }
    let o = (m0 + tr) * n4 + c0 + tc;
    c[o] = acc0; c[o + 8u * n4] = acc1; c[o + 16u * n4] = acc2; c[o + 24u * n4] = acc3;
    c[o + 32u * n4] = acc4; c[o + 40u * n4] = acc5; c[o + 48u * n4] = acc6; c[o + 56u * n4] = acc7;
}
"""


def run(dev, pipe, a: np.ndarray, b: np.ndarray, reps: int):
    n = a.shape[0]
    S = wgpu.BufferUsage
    ba = dev.create_buffer_with_data(data=a.astype(np.float32), usage=S.STORAGE)
    bb = dev.create_buffer_with_data(data=b.astype(np.float32), usage=S.STORAGE)
    bc = dev.create_buffer(size=n * n * 4, usage=S.STORAGE | S.COPY_SRC)
    bd = dev.create_buffer_with_data(data=np.array([n, 0, 0, 0], np.uint32), usage=S.STORAGE)
    bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": i, "resource": {"buffer": x}} for i, x in enumerate((ba, bb, bc, bd))])
    best = 1e9
    for _ in range(3):
        enc = dev.create_command_encoder()
        p = enc.begin_compute_pass()
        p.set_pipeline(pipe)
        p.set_bind_group(0, bg)
        for _ in range(reps):
            p.dispatch_workgroups(n // 64, n // 64, 1)
        p.end()
        cb = enc.finish()
        t = time.perf_counter()
        dev.queue.submit([cb])
        out = dev.queue.read_buffer(bc)
        best = min(best, (time.perf_counter() - t) / reps)
    return np.frombuffer(out, np.float32).reshape(n, n), best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--check", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    dev = adapter.request_device_sync(required_limits={
        "max-storage-buffer-binding-size": adapter.limits["max-storage-buffer-binding-size"],
        "max-buffer-size": adapter.limits["max-buffer-size"]})
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": dev.create_shader_module(code=GEMM),
                                                               "entry_point": "gemm"})
    rng = np.random.default_rng(0)
    n = args.check
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    got, _ = run(dev, pipe, a, b, 1)
    want = a.astype(np.float32).astype(np.float64) @ b.astype(np.float32).astype(np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"# {adapter.info['device']}: check at n={n}: max error / max |C| = {err:.2e}", flush=True)
    if err > 1e-5:
        print("GEMM probe is wrong", file=sys.stderr)
        return 1
    n = args.n
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    _, sec = run(dev, pipe, a, b, args.reps)
    print(f"WGSL GEMM (rb tile) n={n}: {sec * 1e3:.3f} ms, {2 * n**3 / sec / 1e12:.1f} TFLOP/s", flush=True)
    try:
        import torch

        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = False
            x = torch.randn(n, n, device="cuda")
            y = torch.randn(n, n, device="cuda")
            for _ in range(3):
                x @ y
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(20):
                x @ y
            e1.record()
            torch.cuda.synchronize()
            t = e0.elapsed_time(e1) / 20 / 1e3
            print(f"torch f32 matmul (TF32 off) n={n}: {t * 1e3:.3f} ms, {2 * n**3 / t / 1e12:.1f} TFLOP/s")
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
