#!/usr/bin/env python3
"""Where a TurboQuant variant's error comes from on bench/fidelity.py's LLM-shaped
data, and what per-vector outlier channels would buy (diagnostic, numpy only).

    python bench/probes/tq_error_split.py [--context 4096] [--queries 8]

The float64 oracle's reconstruction (rotation, b-bit Lloyd-Max codes, float16
norm: what the GPU's codes decode to) of the keys only, the values only, and
both; then per-vector "dense and sparse" splits: the n largest-|x| channels of a
vector kept as float16 (with their channel index; they replace what the codes
reconstruct there, as the format ``tq4o`` does), the rest, its own norm, b-bit
codes. Prints the output cosine (mean and worst row) against exact
attention, and each point's bits per element with whole 32-bit words per slot
at head_dim 128 (an outlier costs a float16 and an 8-bit index).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "service"), str(ROOT)]

import fidelity as F  # noqa: E402
from tools import reference as ref  # noqa: E402
from attnserve.turboquant import codebook, layer_signs  # noqa: E402

D = F.D


def recon(x: np.ndarray, bits: int, n_out: int, ps: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    rest = x.copy()
    if n_out:
        idx = np.argsort(-np.abs(x), axis=-1, kind="stable")[..., :n_out]
        np.put_along_axis(rest, idx, 0.0, axis=-1)
    cb = codebook(D, bits)
    e = ref.encode_values(rest, ps, cb)
    r = ref.rht_inv(np.asarray(cb.centroids)[e.idx] * ref.f16_value(ref.f16_bits(e.norm))[..., None], ps)
    if n_out:
        np.put_along_axis(r, idx, np.take_along_axis(x, idx, -1).astype(np.float16).astype(np.float64), axis=-1)
    return r


def words(bits: int, n_out: int) -> int:
    """32-bit words of a slot: codes, the norm and the outliers' halves, their index bytes."""
    halves = 1 + n_out
    return bits * D // 32 + -(-halves // 2) + -(-n_out // 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--queries", type=int, default=8)
    args = ap.parse_args(argv)
    L, nq = args.context, args.queries
    q, k, v = F.make_data("llm", L, nq, np.random.default_rng([0, L, 1]))
    ps, _ = layer_signs(0, 0, D)

    def cos(kk, vv):
        cs = []
        for i in range(nq):
            pos = L - nq + i
            o = ref.attention(q[i : i + 1], kk[: pos + 1], vv[: pos + 1], start_pos=pos)[0]
            e = ref.attention(q[i : i + 1], k[: pos + 1], v[: pos + 1], start_pos=pos)[0]
            cs.append((o * e).sum(-1) / np.linalg.norm(o, axis=-1) / np.linalg.norm(e, axis=-1))
        c = np.concatenate(cs)
        return f"{c.mean():.4f} (worst {c.min():.3f})"

    print(f"llm data, context {L}, {nq} decode rows: output cosine, mean (worst row)")
    for kb, ko, vb, vo in (
        (3, 0, 3, 0),
        (4, 0, 4, 0),
        (3, 4, 4, 2),
        (3, 6, 4, 0),
        (2, 8, 4, 2),
        (2, 7, 4, 4),
        (2, 8, 4, 4),
    ):
        K, V = recon(k, kb, ko, ps), recon(v, vb, vo, ps)
        bpe = 32 * (words(kb, ko) + words(vb, vo)) / (2 * D)
        print(
            f"keys {kb} bits + {ko} outliers, values {vb} bits + {vo}: {bpe:.3f} bits/element; "
            f"keys alone {cos(K, v)}, values alone {cos(k, V)}, both {cos(K, V)}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
