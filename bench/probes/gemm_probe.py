#!/usr/bin/env python3
"""How fast can a WGSL kernel multiply f32 matrices on this stack? (diagnostic)

    python bench/probes/gemm_probe.py [--n 4096] [--check 256]

The f32 prefill is two matrix products per tile plus a softmax. This probe times
a plain f32 GEMM (C = A B, n x n x n) written with the register blocking of
attention_prefill_rb's score phase: 128 threads per 64 x 64 tile of C, each
thread 8 rows x 4 columns as outer products over k, A and B staged in
workgroup memory 32 values of k at a time (16 KiB), A read as vec4 along k and
B as vec4 along n (`gemm`); and a larger tile, 128 x 128 with 256 threads of 8
rows x 8 columns each (`gemm128`: twice the FMAs per workgroup-memory read).
Neither has the attention kernel's shared-read pairing or prefetch; they show
what tile size buys on this stack. torch's f32 matmul (TF32 off) on the same
GPU is printed beside them when CUDA is there. Each is checked against numpy
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "service"))
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

var<workgroup> as2: array<array<vec4<f32>, 128>, 4>;  // [k/4][m]
var<workgroup> bs2: array<array<vec4<f32>, 32>, 16>;  // [k][n/4]

// 128 x 128 tile, 256 threads, each 8 rows x 8 columns (two vec4): 4 vec4 FMAs per load.
@compute @workgroup_size(256, 1, 1)
fn gemm128(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n = dims[0];
    let n4 = n / 4u;
    let tid = lid.x;
    let tr = tid / 16u;          // rows tr + 16 i
    let tc = tid % 16u;          // vec4 columns tc, tc + 16
    let m0 = wid.y * 128u;
    let c0 = wid.x * 32u;
    var p0 = vec4<f32>(0.0); var p1 = vec4<f32>(0.0); var p2 = vec4<f32>(0.0); var p3 = vec4<f32>(0.0);
    var p4 = vec4<f32>(0.0); var p5 = vec4<f32>(0.0); var p6 = vec4<f32>(0.0); var p7 = vec4<f32>(0.0);
    var q0 = vec4<f32>(0.0); var q1 = vec4<f32>(0.0); var q2 = vec4<f32>(0.0); var q3 = vec4<f32>(0.0);
    var q4 = vec4<f32>(0.0); var q5 = vec4<f32>(0.0); var q6 = vec4<f32>(0.0); var q7 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < n; k0 += 16u) {
        for (var e = tid; e < 512u; e += 256u) {
            as2[e % 4u][e / 4u] = a[(m0 + e / 4u) * n4 + k0 / 4u + e % 4u];
            bs2[e / 32u][e % 32u] = b[(k0 + e / 32u) * n4 + c0 + e % 32u];
        }
        workgroupBarrier();
        for (var kq = 0u; kq < 4u; kq += 1u) {
            let b0 = bs2[4u * kq][tc];       let d0 = bs2[4u * kq][tc + 16u];
            let b1 = bs2[4u * kq + 1u][tc];  let d1 = bs2[4u * kq + 1u][tc + 16u];
            let b2 = bs2[4u * kq + 2u][tc];  let d2 = bs2[4u * kq + 2u][tc + 16u];
            let b3 = bs2[4u * kq + 3u][tc];  let d3 = bs2[4u * kq + 3u][tc + 16u];
            var x = as2[kq][tr];         p0 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3; q0 += x.x * d0 + x.y * d1 + x.z * d2 + x.w * d3;
            x = as2[kq][tr + 16u];       p1 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3; q1 += x.x * d0 + x.y * d1 + x.z * d2 + x.w * d3;
            x = as2[kq][tr + 32u];       p2 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3; q2 += x.x * d0 + x.y * d1 + x.z * d2 + x.w * d3;
            x = as2[kq][tr + 48u];       p3 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3; q3 += x.x * d0 + x.y * d1 + x.z * d2 + x.w * d3;
            x = as2[kq][tr + 64u];       p4 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3; q4 += x.x * d0 + x.y * d1 + x.z * d2 + x.w * d3;
            x = as2[kq][tr + 80u];       p5 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3; q5 += x.x * d0 + x.y * d1 + x.z * d2 + x.w * d3;
            x = as2[kq][tr + 96u];       p6 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3; q6 += x.x * d0 + x.y * d1 + x.z * d2 + x.w * d3;
            x = as2[kq][tr + 112u];      p7 += x.x * b0 + x.y * b1 + x.z * b2 + x.w * b3; q7 += x.x * d0 + x.y * d1 + x.z * d2 + x.w * d3;
        }
        workgroupBarrier();
    }
    let o = (m0 + tr) * n4 + c0 + tc;
    let s16 = 16u * n4;
    c[o] = p0; c[o + s16] = p1; c[o + 2u * s16] = p2; c[o + 3u * s16] = p3;
    c[o + 4u * s16] = p4; c[o + 5u * s16] = p5; c[o + 6u * s16] = p6; c[o + 7u * s16] = p7;
    c[o + 16u] = q0; c[o + s16 + 16u] = q1; c[o + 2u * s16 + 16u] = q2; c[o + 3u * s16 + 16u] = q3;
    c[o + 4u * s16 + 16u] = q4; c[o + 5u * s16 + 16u] = q5; c[o + 6u * s16 + 16u] = q6; c[o + 7u * s16 + 16u] = q7;
}
"""

TILES = {"gemm": 64, "gemm128": 128}  # entry point -> tile edge


def run(dev, pipe, a: np.ndarray, b: np.ndarray, reps: int, tile: int = 64):
    n = a.shape[0]
    S = wgpu.BufferUsage
    ba = dev.create_buffer_with_data(data=a.astype(np.float32), usage=S.STORAGE)
    bb = dev.create_buffer_with_data(data=b.astype(np.float32), usage=S.STORAGE)
    bc = dev.create_buffer(size=n * n * 4, usage=S.STORAGE | S.COPY_SRC)
    bd = dev.create_buffer_with_data(data=np.array([n, 0, 0, 0], np.uint32), usage=S.STORAGE)
    bg = dev.create_bind_group(
        layout=pipe.get_bind_group_layout(0),
        entries=[{"binding": i, "resource": {"buffer": x}} for i, x in enumerate((ba, bb, bc, bd))],
    )
    best = 1e9
    for _ in range(3):
        enc = dev.create_command_encoder()
        p = enc.begin_compute_pass()
        p.set_pipeline(pipe)
        p.set_bind_group(0, bg)
        for _ in range(reps):
            p.dispatch_workgroups(n // tile, n // tile, 1)
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
    ap.add_argument("--trusted", action="store_true", help="no naga bounds checks (see trusted_probe.py)")
    args = ap.parse_args(argv)
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    dev = adapter.request_device_sync(
        required_limits={
            "max-storage-buffer-binding-size": adapter.limits["max-storage-buffer-binding-size"],
            "max-buffer-size": adapter.limits["max-buffer-size"],
        }
    )
    if args.trusted:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/probes/: trusted_probe.py
        from trusted_probe import trusted_module

        module = trusted_module(dev, GEMM, "gemm")
    else:
        module = dev.create_shader_module(code=GEMM)
    rng = np.random.default_rng(0)
    for entry, tile in TILES.items():
        pipe = dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": entry})
        n = args.check
        a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
        got, _ = run(dev, pipe, a, b, 1, tile)
        want = a.astype(np.float32).astype(np.float64) @ b.astype(np.float32).astype(np.float64)
        err = np.abs(got - want).max() / np.abs(want).max()
        print(f"# {adapter.info['device']}: {entry} check at n={n}: max error / max |C| = {err:.2e}", flush=True)
        if err > 1e-5:
            print(f"{entry} is wrong", file=sys.stderr)
            return 1
        n = args.n
        a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
        _, sec = run(dev, pipe, a, b, args.reps, tile)
        print(
            f"WGSL {entry} ({tile} x {tile} tile{', trusted' if args.trusted else ''}) n={n}: {sec * 1e3:.3f} ms, {2 * n**3 / sec / 1e12:.1f} TFLOP/s",
            flush=True,
        )
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
