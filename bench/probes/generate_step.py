#!/usr/bin/env python3
"""Where a generate() decode call's time goes on the H200 (issue 29): the stacked
fused decode step of B sessions of L layers at a context, over the stream, timed
per call (p50) as bench/generate.py's cache sends it, in variants:

- ``same``: always layer 0; ``cycle``: layers 0..L-1 in turn (as a model does);
- ``cycle+torch``: the same with a CUDA tensor op and its copy to the host before
  each call in this process (as the model's layer does).

    python bench/probes/generate_step.py --adapter nvidia --batch 32 --layers 30 --context 1024
    python bench/probes/generate_step.py --adapter nvidia --kv-format tq4v3 --sinks 4 --window 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "client"), str(ROOT)]
from _server import serving  # noqa: E402
from server_cpu import cpu_seconds  # noqa: E402

from attnserve_client import Client  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", default="")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--kv-format", default="f32")
    ap.add_argument("--sinks", type=int, default=0, help="a compressed session's exact first timesteps")
    ap.add_argument("--window", type=int, default=0, help="a compressed session's exact recent window")
    args = ap.parse_args()
    B, L = args.batch, args.layers
    rng = np.random.default_rng(0)
    torch = None
    try:
        import torch  # noqa: F811
    except ImportError:
        pass
    exact = {"sinks": args.sinks, "window": args.window} if args.sinks or args.window else {}
    with serving(args.adapter) as (server, url), Client(url, timeout=120) as c:
        ss = [
            c.create_session(
                num_qo_heads=9, num_kv_heads=3, head_dim=64, num_layers=L, kv_format=args.kv_format, **exact
            )
            for _ in range(B)
        ]
        with c.stream() as st:
            k = rng.standard_normal((B, 64, 3, 64), dtype=np.float32)
            q0 = rng.standard_normal((B, 64, 9, 64), dtype=np.float32)
            for layer in range(L):
                for _ in range(args.context // 64):
                    st.attend_stacked(ss, layer, q0, k, k)
            q = rng.standard_normal((B, 1, 9, 64), dtype=np.float32)
            kk = rng.standard_normal((B, 1, 3, 64), dtype=np.float32)
            variants = ["same", "cycle"] + (["cycle+torch"] if torch is not None and torch.cuda.is_available() else [])
            x = torch.randn(B, 576, device="cuda") if "cycle+torch" in variants else None
            for v in variants:
                cpu0 = cpu_seconds(server.pid)
                times = []
                for i in range(args.calls):
                    layer = 0 if v == "same" else i % L
                    if x is not None and v == "cycle+torch":
                        y = (x @ x.T).cpu()  # the model's work and its sync
                        del y
                    t0 = time.perf_counter()
                    st.attend_stacked(ss, layer, q, kk, kk)
                    times.append(time.perf_counter() - t0)
                cpu = (cpu_seconds(server.pid) - cpu0) / args.calls
                print(
                    json.dumps(
                        {
                            "variant": v,
                            "batch": B,
                            "layers": L,
                            "context": args.context,
                            "kv_format": args.kv_format,
                            **exact,
                            "p50_ms": round(1000 * statistics.median(times), 3),
                            "mean_ms": round(1000 * statistics.fmean(times), 3),
                            "server_cpu_ms": round(1000 * cpu, 3),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
