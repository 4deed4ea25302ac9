#!/usr/bin/env python3
"""A/B of the single fused decode step: the server of each given source tree (its
``service/`` and ``client/``), one after the other, alternating ``--rounds`` times,
driven by this tree's client over HTTP, the stream and the frames (f32, 4k context).

    python bench/probes/ab_single.py --adapter nvidia ROOT_A ROOT_B
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(HERE / "client"), str(HERE)]
from attnserve_client import Client  # noqa: E402

from tools.common import free_port  # noqa: E402

H, HKV, D = 32, 8, 128


def measure(root: str, adapter: str, steps: int, fmt: str) -> dict:
    port = free_port()
    env = dict(os.environ, ATTNSERVE_ADAPTER=adapter, ATTNSERVE_LOG_LEVEL="warning",
               PYTHONPATH=os.pathsep.join([f"{root}/service", f"{root}/client", os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port)]
    env["ATTNSERVE_FRAMES_PORT"] = str(free_port())
    proc = subprocess.Popen([sys.executable, "-m", "attnserve", *argv],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        with Client(url, timeout=60) as c:
            for _ in range(600):
                try:
                    if c.ready():
                        break
                except Exception:
                    pass
                time.sleep(0.1)
            rng = np.random.default_rng(0)
            s = c.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, kv_format=fmt)
            k = rng.standard_normal((4096, HKV, D), dtype=np.float32)
            s.append(0, k, k)
            q = rng.standard_normal((1, H, D), dtype=np.float32)
            k1 = rng.standard_normal((1, HKV, D), dtype=np.float32)
            res = {}
            with c.stream() as st, c.stream(transport="frames") as fr:
                for name, fn in (("http", lambda: s.attend(0, q, k=k1, v=k1)),
                                 ("stream", lambda: st.attend(s, 0, q, k=k1, v=k1)),
                                 ("frames", lambda: fr.attend(s, 0, q, k=k1, v=k1))):  # fmt: skip
                    for _ in range(20):
                        fn()
                    lat = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        fn()
                        lat.append(time.perf_counter() - t0)
                    lat.sort()
                    res[name] = round(1e3 * lat[len(lat) // 2], 3)
            return res
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("roots", nargs="+")
    ap.add_argument("--adapter", default="")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fmt", default="f32")
    args = ap.parse_args()
    for r in range(args.rounds):
        for root in args.roots:
            print(
                json.dumps({"round": r, "root": root, **measure(root, args.adapter, args.steps, args.fmt)}), flush=True
            )


if __name__ == "__main__":
    main()
