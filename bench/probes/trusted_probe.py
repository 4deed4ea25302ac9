#!/usr/bin/env python3
"""What do naga's injected bounds checks cost? (diagnostic)

    python bench/probes/trusted_probe.py [--trusted]

Times the default decode (32k, 128k) and prefill (2048 x 2048) attends of both
formats, as bench/kernel_bench.py does. With --trusted every shader module is
created through wgpu-native's `wgpuDeviceCreateShaderModuleTrusted` with no
runtime checks (naga then adds no index clamps; the Vulkan driver's own robust
buffer access, where enabled, still bounds storage reads), instead of
`create_shader_module`. wgpu-py does not wrap that entry point, so this reaches
into its cffi layer: a measurement, not something the service does. Run it
twice (with and without the flag) and compare; each run first checks one decode
and one prefill output against the float64 oracle.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: kernels.py
import kernel_bench as B  # noqa: E402
from tools import reference as ref  # noqa: E402
from attnserve.gpu import shaders as S  # noqa: E402


def trusted_module(device, code: str, label: str):
    from wgpu.backends.wgpu_native import _api
    from wgpu.backends.wgpu_native._ffi import ffi, lib

    src = _api.new_struct_p("WGPUShaderSourceWGSL *", code=_api.to_c_string_view(code))
    src[0].chain.next = ffi.NULL
    src[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
    desc = _api.new_struct_p(
        "WGPUShaderModuleDescriptor *",
        nextInChain=ffi.cast("WGPUChainedStruct *", src),
        label=_api.to_c_string_view(label),
    )
    mid = lib.wgpuDeviceCreateShaderModuleTrusted(device._internal, desc, lib.WGPUShaderRuntimeChecks_None)
    if mid == ffi.NULL:
        raise RuntimeError("trusted shader module creation failed")
    return _api.GPUShaderModule(label, mid, device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trusted", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small shapes (lavapipe)")
    ap.add_argument("--budget", type=float, default=0.15)
    args = ap.parse_args(argv)
    if args.trusted:

        def _module(self, spec):
            key = (spec.file, spec.defines, spec.folder)
            if key not in self._modules:
                self._modules[key] = trusted_module(self._device, S.load_wgsl(*key), spec.file)
            return self._modules[key]

        S.PipelineCache._module = _module
    eng = B.Engine.open(None)
    rng = np.random.default_rng(0)
    label = "trusted (no naga checks)" if args.trusted else "checked (default)"
    decode = (512, 2048) if args.quick else (32768, 131072)
    prefill = (128, 128) if args.quick else (2048, 2048)
    # correctness first: small f32 decode and prefill against the float64 oracle
    s = eng.session_kv(B.SessionConfig(1, B.H, B.HKV, B.D, "f32", 300, 1))
    k = rng.standard_normal((300, B.HKV, B.D), dtype=np.float32)
    v = rng.standard_normal((300, B.HKV, B.D), dtype=np.float32)
    eng.append(s.layers[0], k, v).result()
    for n in (1, 100):
        q = rng.standard_normal((n, B.H, B.D), dtype=np.float32)
        out, _ = eng.attend(s.layers[0], q, start_pos=300 - n).result()
        want = ref.attention(q, k, v, start_pos=300 - n, causal=True, scale=1 / np.sqrt(B.D))
        err = np.abs(np.asarray(out) - want).max() / np.abs(want).max()
        if err > 1e-5:
            print(f"{label}: wrong output ({n} rows): {err:.2e}", file=sys.stderr)
            return 1
    eng.release(s).result()
    for fmt in ("f32", "turboquant"):
        s = eng.session_kv(B.SessionConfig(1, B.H, B.HKV, B.D, fmt, max(decode), 1))
        filled = 0
        for n, ctx in sorted([(1, c) for c in decode] + [prefill], key=lambda x: x[1]):
            B.fill_layer(eng, s.layers[0], ctx - filled, rng)
            filled = max(filled, ctx)
            ms = B.time_wgpu(eng, s.layers[0], n, ctx, rng, args.budget)
            print(f"{label:26s} {fmt:10} {n:5d} x {ctx:6d}: {ms:8.4f} ms", flush=True)
        eng.release(s).result()
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
