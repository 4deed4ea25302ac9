#!/usr/bin/env python3
"""Prefill kernel variants side by side (diagnostic for choosing the policy).

    python bench/probes/prefill_sweep.py [--formats f32,turboquant] [--json-out FILE]

Times the plain (f32, f16) prefill (2048 causal queries over 2048 keys, and 512 over 8192;
32 query heads, 8 KV heads, d = 128) with the query-block tiled kernel and the
register-blocked one in its variants (register prefetch on/off, pipelines
specialized on the shape or generic), and the TurboQuant tiled prefill, as
bench/kernel_bench.py times them (GPU time only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: kernels.py
import kernel_bench as B  # noqa: E402
from attnserve.formats import is_plain  # noqa: E402  (kernels.py put service/ on the path)

VARIANTS = {
    "tiled": dict(prefill_f32="tiled", prefill_f16="tiled"),
    "rb": dict(prefill_f32="rb", prefill_f16="rb", prefill_rb_specialize=True),
    "rb generic": dict(prefill_f32="rb", prefill_f16="rb", prefill_rb_specialize=False),
}
SHAPES = ((2048, 2048), (512, 8192))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--adapter")
    ap.add_argument("--quick", action="store_true", help="small shapes (lavapipe)")
    ap.add_argument("--formats", default="f32,turboquant", help="kv formats (plain ones get every variant)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    shapes = ((256, 256),) if args.quick else SHAPES
    eng = B.Engine.open(args.adapter)
    rng = np.random.default_rng(0)
    default = dataclasses.replace(eng.policy, force="tiled")
    rows = []
    for fmt in args.formats.split(","):
        s = eng.session_kv(B.SessionConfig(1, B.H, B.HKV, B.D, fmt, max(k for _, k in shapes), 1))
        filled = 0
        for n, ctx_len in shapes:
            B.fill_layer(eng, s.layers[0], ctx_len - filled, rng)
            filled = max(filled, ctx_len)
            for name, knobs in VARIANTS.items() if is_plain(fmt) else [("tiled", {})]:
                eng.policy = dataclasses.replace(default, **knobs)
                ms = B.time_wgpu(eng, s.layers[0], n, ctx_len, rng, args.budget)
                rows.append(
                    {"kv_format": fmt, "queries": n, "context": ctx_len, "variant": name, "wgpu_ms": round(ms, 4)}
                )
                print(f"{fmt:10} {n:5d} x {ctx_len:5d} {name:24s} {ms:8.3f} ms", flush=True)
        eng.release(s).result()
    if args.json_out:
        args.json_out.write_text(
            json.dumps({"gpu": eng.ctx.name, "commit": B.git_commit(), "rows": rows}, indent=2) + "\n"
        )
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
