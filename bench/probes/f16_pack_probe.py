#!/usr/bin/env python3
"""Whether the adapter's float16 conversions round as numpy does (to nearest, ties
to even): ``pack2x16float`` of random float32 values (several magnitudes, exact
midpoints between two float16 among them), and ``unpack2x16float(pack2x16float(x))``,
each against numpy's ``astype(float16)``. Prints the mismatches per magnitude.

    python bench/probes/f16_pack_probe.py [--adapter nvidia]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "service")]
from attnserve.gpu.device import open_device  # noqa: E402

KERNEL = """
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> packed: array<u32>;
@group(0) @binding(2) var<storage, read_write> round_trip: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i >= arrayLength(&x) { return; }
    packed[i] = pack2x16float(vec2<f32>(x[i], 0.0));
    round_trip[i] = unpack2x16float(pack2x16float(vec2<f32>(x[i], 0.0))).x;
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER"))
    ap.add_argument("--n", type=int, default=1 << 16, help="values per magnitude")
    args = ap.parse_args()
    import wgpu

    ctx = open_device(args.adapter)
    dev = ctx.device
    print(f"adapter: {ctx.name} ({ctx.backend})")
    pipe = dev.create_compute_pipeline(
        layout="auto", compute={"module": dev.create_shader_module(code=KERNEL), "entry_point": "main"}
    )
    rng = np.random.default_rng(0)
    S = wgpu.BufferUsage
    for mag in (1e-6, 1e-3, 1.0, 300.0, 3000.0, 8000.0):
        x = (rng.standard_normal(args.n) * mag).astype(np.float32)
        half = x.astype(np.float16).astype(np.float32)  # midpoints: halfway to the next float16
        nxt = np.nextafter(x.astype(np.float16), np.float16(np.inf)).astype(np.float32)
        mid = ((half.astype(np.float64) + nxt) / 2).astype(np.float32)
        x[: args.n // 4] = mid[: args.n // 4]
        x = x[np.isfinite(x)]
        bx = dev.create_buffer_with_data(data=x, usage=S.STORAGE)
        bp = dev.create_buffer(size=x.nbytes, usage=S.STORAGE | S.COPY_SRC)
        br = dev.create_buffer(size=x.nbytes, usage=S.STORAGE | S.COPY_SRC)
        group = dev.create_bind_group(
            layout=pipe.get_bind_group_layout(0),
            entries=[{"binding": i, "resource": {"buffer": b}} for i, b in enumerate((bx, bp, br))],
        )
        enc = dev.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, group)
        cp.dispatch_workgroups((len(x) + 63) // 64)
        cp.end()
        dev.queue.submit([enc.finish()])
        packed = np.frombuffer(dev.queue.read_buffer(bp), np.uint32) & 0xFFFF
        rt = np.frombuffer(dev.queue.read_buffer(br), np.float32)
        want = x.astype(np.float16)
        bad_pack = packed.astype(np.uint16) != want.view(np.uint16)
        bad_rt = rt != want.astype(np.float32)
        ties = np.arange(len(x)) < args.n // 4
        print(
            f"|x| ~ {mag:g}: pack2x16float differs from numpy in {int(bad_pack.sum())} of {len(x)} "
            f"({int((bad_pack & ties).sum())} of them exact midpoints); unpack(pack(x)) in {int(bad_rt.sum())} "
            f"({int((bad_rt & ties).sum())} midpoints)"
        )
        for i in np.flatnonzero(bad_rt | bad_pack)[:3]:
            got = packed[i].astype(np.uint16).view(np.float16)
            print(f"    x={x[i]!r} numpy={want[i]!r} pack={got!r} round_trip={rt[i]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
