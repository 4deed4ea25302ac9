#!/usr/bin/env python3
"""How close each kv format's attention is to the exact one: the measures of
docs/fidelity.md, on Gaussian data and on data shaped like a real LLM's.

    python bench/fidelity.py [--adapter ADAPTER] [--contexts 1024,4096,32768]
        [--queries 8] [--seed 0] [--json-out FILE]
    python bench/fidelity.py --quick        # small contexts (the test suite runs this)

For each format, data kind and context, one session (8 query heads, 2 KV heads,
head_dim 128) is filled with the context's K/V rows through the engine, and
``--queries`` decode rows attend over it (each the last row, causal). Against the
float64 oracle of the same inputs:

* ``cos_mean`` / ``cos_min``: cosine between the output and the exact output, per
  (query row, head), mean and worst;
* ``max_rel_err``: max |out - exact| / max |exact| over the rows;
* for TurboQuant and its variants, from the key codes the GPU wrote (read back; the
  format's own oracle decodes them bit for bit), the score estimator against the
  true ``<q, k>``: ``slope`` (least squares of estimate on truth: 1 is unbiased) and
  ``rel_var`` (residual variance / variance of the truth), with the QJL residual
  bit (``qjl``: formats that have it) and without it (``polar_only``: the
  Lloyd-Max codes alone), and the top-k attention overlap: the
  share of the exact top-k keys (k = 8) among the estimated top-k
  (``topk_overlap``) and the exact attention mass the estimated top-k hold
  against the exact top-k's (``topk_mass``).

Data: ``gaussian``: q, k, v standard normal. ``llm``: keys with 4 outlier
channels 10-50x the rest, rotary position embedding (base 10000) applied to keys
and queries by position, values with 2 outlier channels 10x, and peaked attention:
each query is mostly the direction of 3 random earlier keys (their scores stand
out), plus noise (itself rotated by the query's position).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "client"), str(ROOT)]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from attnserve.engine import Engine  # noqa: E402
from attnserve.formats import KV_FORMATS, TQ_SPECS, bits_per_element  # noqa: E402
from attnserve.kv.config import SessionConfig  # noqa: E402
from tools import reference as ref  # noqa: E402
from attnserve.turboquant import layer_signs  # noqa: E402

from tools.common import write_result  # noqa: E402

H, HKV, D = 8, 2, 128
TOP_K = 8


def rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Rotary position embedding of ``x [n, heads, d]`` at ``positions [n]`` (pairs i, i + d/2)."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-np.arange(half) / half)
    ang = positions[:, None] * freq[None, :]  # [n, half]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def make_data(kind: str, length: int, n_q: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``q [n_q, H, D]``, ``k, v [length, HKV, D]`` float32."""
    k = rng.standard_normal((length, HKV, D))
    v = rng.standard_normal((length, HKV, D))
    q = rng.standard_normal((n_q, H, D))
    if kind == "llm":
        outliers = rng.choice(D, 4, replace=False)
        k[..., outliers] *= rng.uniform(10, 50, size=4)
        v[..., rng.choice(D, 2, replace=False)] *= 10
        k = rope(k, np.arange(length, dtype=np.float64))
        q = 0.5 * rope(q, np.arange(length - n_q, length, dtype=np.float64))
        group = H // HKV
        for i in range(n_q):
            for h in range(H):  # toward 3 earlier keys as they are stored (rotated by their positions)
                picks = rng.choice(length - n_q, 3, replace=False)
                target = k[picks, h // group].sum(axis=0)
                q[i, h] += 0.5 * math.sqrt(D) * target / np.linalg.norm(target)
    elif kind != "gaussian":
        raise ValueError(kind)
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def estimator(est: np.ndarray, true: np.ndarray) -> dict:
    """Slope of ``est`` on ``true`` (least squares through the means) and residual variance."""
    t, e = true.ravel(), est.ravel()
    tc = t - t.mean()
    slope = float((tc * (e - e.mean())).sum() / (tc * tc).sum())
    resid = e - e.mean() - slope * tc
    return {"slope": round(slope, 4), "rel_var": round(float(resid.var() / t.var()), 5)}


def topk(p_true: np.ndarray, p_est: np.ndarray) -> dict:
    """``p_* [H, n, L]``: overlap of the top-k sets and the exact mass the estimated top-k hold."""
    t_idx = np.argsort(-p_true, axis=-1)[..., :TOP_K]
    e_idx = np.argsort(-p_est, axis=-1)[..., :TOP_K]
    overlap = np.mean(
        [len(set(a) & set(b)) / TOP_K for a, b in zip(t_idx.reshape(-1, TOP_K), e_idx.reshape(-1, TOP_K))]
    )
    mass_t = np.take_along_axis(p_true, t_idx, -1).sum(-1)
    mass_e = np.take_along_axis(p_true, e_idx, -1).sum(-1)
    return {"topk_overlap": round(float(overlap), 4), "topk_mass": round(float((mass_e / mass_t).mean()), 4)}


def softmax(s: np.ndarray) -> np.ndarray:
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True)


def measure(engine: Engine, fmt: str, kind: str, length: int, n_q: int, seed: int) -> dict:
    rng = np.random.default_rng([seed, length, ["gaussian", "llm"].index(kind)])
    q, k, v = make_data(kind, length, n_q, rng)
    kv = engine.session_kv(SessionConfig(1, H, HKV, D, fmt, length + n_q, seed))
    layer = kv.layers[0]
    try:
        for at in range(0, length, 8192):
            engine.append(layer, k[at : at + 8192], v[at : at + 8192]).result()
        outs, exact = [], []
        for i in range(n_q):  # decode rows: query i at position length - n_q + i
            pos = length - n_q + i
            out, _ = engine.attend(layer, q[i : i + 1], start_pos=pos, causal=True).result()
            outs.append(out[0])
            exact.append(ref.attention(q[i : i + 1], k[: pos + 1], v[: pos + 1], start_pos=pos)[0])
        out, want = np.stack(outs).astype(np.float64), np.stack(exact)
        cos = (out * want).sum(-1) / (np.linalg.norm(out, axis=-1) * np.linalg.norm(want, axis=-1))
        row = {
            "kv_format": fmt,
            "data": kind,
            "context": length,
            "bits_per_element": round(bits_per_element(fmt, D), 3),
            "cos_mean": round(float(cos.mean()), 6),
            "cos_min": round(float(cos.min()), 6),
            "max_rel_err": round(float(np.abs(out - want).max() / np.abs(want).max()), 6),
        }
        if fmt in TQ_SPECS:
            row.update(score_stats(engine, layer, fmt, q, k, seed))
        return row
    finally:
        engine.release(kv).result()


def score_stats(engine: Engine, layer, fmt: str, q: np.ndarray, k: np.ndarray, seed: int) -> dict:
    """The TurboQuant score estimator on the key codes the GPU wrote, with QJL (where
    the format has it) and without."""
    spec = TQ_SPECS[fmt]
    kb, _ = engine.call(lambda ctx: layer.read_words(ctx.device)).result()
    length = k.shape[0]
    idx, bits, norm, rn = ref.unpack_tqx_key_cache(
        np.frombuffer(kb, np.uint32), spec, n_kv_heads=HKV, cap=layer.capacity, d=D, length=length
    )
    polar_signs, jl_signs = layer_signs(seed, 0, D)
    q_rot, q_jl, _ = ref.rotate_q(q.astype(np.float64), polar_signs, jl_signs)
    true = np.einsum("nhd,lhd->hnl", q.astype(np.float64), np.repeat(k.astype(np.float64), H // HKV, axis=1))
    out: dict = {}
    scale = 1.0 / math.sqrt(D)
    kcb, _ = ref.tqx_codebooks(spec, D)
    for name, polar_only in (("qjl", False), ("polar_only", True)) if spec.qjl else (("polar_only", True),):
        est = ref.tq_scores(q_rot, q_jl, idx, bits, norm, rn, kcb, polar_only=polar_only)
        if spec.key_outliers:  # the outlier channels' exact part
            o = ref.unpack_tqx_outliers(
                np.frombuffer(kb, np.uint32), spec, True, n_kv_heads=HKV, cap=layer.capacity, d=D, length=length
            )
            dense = np.repeat(ref.outlier_values(o, polar_signs, D), H // HKV, axis=1)
            est = est + np.einsum("nhd,lhd->hnl", q.astype(np.float64), dense)
        stats = estimator(est, true)
        stats.update(topk(softmax(true * scale), softmax(est * scale)))
        out[name] = stats
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER"))
    ap.add_argument("--contexts", default="1024,4096,32768")
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", default=",".join(KV_FORMATS))
    ap.add_argument("--quick", action="store_true", help="contexts 256 and 1024, 4 queries")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    contexts = [256, 1024] if args.quick else [int(x) for x in args.contexts.split(",")]
    n_q = 4 if args.quick else args.queries
    engine = Engine.open(args.adapter)
    result = {
        "adapter": engine.describe().get("name"),
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("ATTNSERVE_COMMIT", ""),
        "shape": {"num_qo_heads": H, "num_kv_heads": HKV, "head_dim": D, "queries": n_q, "top_k": TOP_K},
        "rows": [],
    }
    try:
        for kind in ("gaussian", "llm"):
            for length in contexts:
                for fmt in args.formats.split(","):
                    row = measure(engine, fmt, kind, length, n_q, args.seed)
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
    finally:
        engine.close()
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
