#!/usr/bin/env python3
"""How many key outlier channels a 2-bit TurboQuant format should keep: the float64
oracle of the outlier formats (``reference.tqx_encode``: the encoder the GPU
matches word for word, outliers corrected by what the codes reconstruct) on
bench/fidelity.py's data, for keys of 2-bit codes plus n outlier channels and
values of 2-bit codes without outliers (numpy only).

    python bench/probes/tq_outlier_count.py [--contexts 1024,4096] [--outliers 0,1,2,3,4] [--queries 8]

Prints, per data kind and context, each n's words per slot and bits per element at
head_dim 128 (``formats.outlier_words``: n = 2 and n = 3 cost the same) and the
output cosine against exact attention (mean and worst (query row, head)) of
decode rows as fidelity.py makes them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "service"), str(ROOT)]

import fidelity as F  # noqa: E402
from attnserve.formats import TqSpec, outlier_words  # noqa: E402
from tools import reference as ref  # noqa: E402
from attnserve.turboquant import layer_signs  # noqa: E402

D = F.D


def output_cosine(q, k, v, spec: TqSpec, ps, js) -> np.ndarray:
    """Cosine of the format's oracle attention with exact attention, per (decode row, head)."""
    L, nq = k.shape[0], q.shape[0]
    ek, ev = ref.tqx_encode(k, v, spec, ps, js)
    kw, vw = ref.pack_tqx_key_cache(ek, L, spec), ref.pack_tqx_value_cache(ev, L, spec)
    cs = []
    for i in range(nq):
        pos = L - nq + i
        got = ref.tqx_attention(
            q[i : i + 1], kw, vw, spec, n_kv_heads=F.HKV, cap=L, length=pos + 1,
            polar_signs=ps, jl_signs=js, start_pos=pos,
        )[0]  # fmt: skip
        want = ref.attention(q[i : i + 1], k[: pos + 1], v[: pos + 1], start_pos=pos)[0]
        cs.append((got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1))
    return np.concatenate(cs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--outliers", default="0,1,2,3,4")
    ap.add_argument("--queries", type=int, default=8)
    args = ap.parse_args(argv)
    ps, js = layer_signs(0, 0, D)
    for kind in ("gaussian", "llm"):
        for L in (int(x) for x in args.contexts.split(",")):
            q, k, v = F.make_data(kind, L, args.queries, np.random.default_rng([0, L, ["gaussian", "llm"].index(kind)]))
            for n in (int(x) for x in args.outliers.split(",")):
                spec = TqSpec(2, False, 2, key_outliers=n)
                words = 2 * D // 32 + 1 + outlier_words(n) + 2 * D // 32 + 1
                c = output_cosine(q, k, v, spec, ps, js)
                print(
                    f"{kind} {L}: keys 2 bits + {n} outliers, values 2 bits: {words} words, "
                    f"{32 * words / (2 * D):.3f} bits/element; output cosine {c.mean():.4f} (worst {c.min():.4f})",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
