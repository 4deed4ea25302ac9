#!/usr/bin/env python3
"""Decode time against context, each kernel and its torch peer, log scale: the chart
docs/benchmarks.md leads with, from a bench/kernel_bench.py result file.

    python bench/plot_kernels.py bench/results/h200-latest.json docs/h200-decode.png

Needs matplotlib (the project's [bench] extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="a bench/kernel_bench.py --json-out file")
    ap.add_argument("png", type=Path, help="where to write the chart")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(args.results.read_text())
    rows = [r for r in doc["rows"] if r["kernel"] == "decode"]
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        series.setdefault(f"attnserve {r['kv_format']}", []).append((r["context"], r["wgpu_ms"]))
        if r["kv_format"] == "f32":  # the peers do not depend on our format
            for dtype in ("bf16", "f32"):
                peer = (r.get("torch_peer") or {}).get(dtype) or {}
                if peer.get("ms") is not None:
                    series.setdefault(f"torch {dtype} (best GQA form)", []).append((r["context"], peer["ms"]))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    styles = {
        "attnserve turboquant": "o-",
        "attnserve f32": "s-",
        "attnserve f16": "d-",
        "torch bf16 (best GQA form)": "^--",
        "torch f32 (best GQA form)": "v--",
    }
    for name, pts in series.items():
        pts.sort()
        ax.plot([c for c, _ in pts], [t for _, t in pts], styles.get(name, "o-"), label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (timesteps), one query row, 32 query / 8 KV heads, head_dim 128")
    ax.set_ylabel("decode attend, ms")
    ax.set_title(f"Decode on {doc.get('gpu', '?')} (commit {str(doc.get('commit', '?'))[:7]})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
