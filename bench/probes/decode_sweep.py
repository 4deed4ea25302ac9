#!/usr/bin/env python3
"""Decode kernel variants side by side (diagnostic for choosing the policy).

    python bench/probes/decode_sweep.py [--contexts 4096,32768,131072] [--targets 256,512,1024,2048]
                                 [--json-out bench/results/h200-decode-sweep.json]

For each format and context, times one decode attend (as bench/kernel_bench.py does:
many attends in one submission, GPU time only) with the split-KV kernels at
several split sizes (``target_workgroups``); the subgroup variant (one subgroup
per key) it also timed went, measured slower at every context. Prints ms and GB/s of the bytes
the step must read; the copy bandwidth is measured in the same run.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--targets", default="256,512,1024,2048")
    ap.add_argument("--formats", default="f32,turboquant")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--adapter")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    targets = [int(x) for x in args.targets.split(",")]
    eng = B.Engine.open(args.adapter)
    variants = ["plain"]  # the subgroup variants went (measured slower at every context)
    cgbps, _ = B.copy_gbps(eng)
    print(f"# {eng.ctx.name}; copy bandwidth {cgbps:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    default = eng.policy
    for fmt in args.formats.split(","):
        s = eng.session_kv(B.SessionConfig(1, B.H, B.HKV, B.D, fmt, max(contexts), 1))
        filled = 0
        for ctx_len in sorted(contexts):
            B.fill_layer(eng, s.layers[0], ctx_len - filled, rng)
            filled = ctx_len
            nbytes = ctx_len * B.bytes_per_token(fmt, B.HKV, B.D) + B.H * B.D * 4
            for v in variants:
                for tw in targets:
                    eng.policy = dataclasses.replace(default, force="split", target_workgroups=tw)
                    split_len, n_splits = B.choose_split(fmt, ctx_len, B.HKV, 1, B.H // B.HKV, tw)
                    ms = B.time_wgpu(eng, s.layers[0], 1, ctx_len, rng, args.budget)
                    gbps = nbytes / ms / 1e6
                    rows.append(
                        {
                            "kv_format": fmt,
                            "context": ctx_len,
                            "variant": v,
                            "target_workgroups": tw,
                            "split_len": split_len,
                            "workgroups": n_splits * B.HKV,
                            "wgpu_ms": round(ms, 4),
                            "gbps": round(gbps, 1),
                            "bandwidth_fraction": round(gbps / cgbps, 4),
                        }
                    )
                    print(
                        f"{fmt:10} ctx {ctx_len:6d} {v:5} target {tw:5d} (split {split_len:4d}, "
                        f"{n_splits * B.HKV:5d} wg): {ms:7.4f} ms {gbps:7.1f} GB/s {100 * gbps / cgbps:5.1f}%",
                        flush=True,
                    )
        eng.release(s).result()
    eng.policy = default
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {"gpu": eng.ctx.name, "commit": B.git_commit(), "copy_gbps": round(cgbps, 1), "rows": rows}, indent=2
            )
            + "\n"
        )
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
