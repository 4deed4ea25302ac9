#!/usr/bin/env python3
"""The measured spread behind the tolerances of the tests whose data is random (a new
seed every run, ``ATTNSERVE_TEST_SEED``) and whose check is statistical: a lossy
format against exact attention, an estimator's slope. Each sweep runs one test's own
measurement for seeds 0..N-1 (as ``ATTNSERVE_TEST_SEED=s`` would) and prints the
distribution of the measured values; a test's bound is set with a margin above the
worst seed, and its comment gives these numbers.

    python tools/seed_sweeps.py SWEEP [--seeds 300] [--first 0] [--json-out FILE]

Sweeps (the seeds each test's comment cites; on the 2-core host, with other work):
    sharded-tq4   tests/client/test_sharded.py::test_a_compressed_format_matches_its_unsharded_session
                  (two live servers on the tests' adapter: several seconds a seed on lavapipe)
    sharded-tq4-oracle  the same error against exact attention, tq4 emulated by the
                  oracle of its codes (2000 seeds in 10 minutes)
    estimator     tests/test_core_tq_state.py::test_estimator_unbiased_and_better_than_polarquant
    wrong-constant tests/test_core_tq_state.py::test_the_seed_comment_constant_would_be_biased
    values        tests/test_core_tq_state.py::test_value_reconstruction_bias_is_the_documented_one
    turboquant-band tests/service/test_turboquant.py::test_turboquant_within_the_band_of_exact_attention
                  (the session emulated by the oracle of its codes)
    tq4-cos       tests/test_core_tqx.py::test_chunked_prefill_equals_one_call (emulated likewise)
    gpu-slope     tests/test_core_turboquant.py::test_gpu_codes_give_an_unbiased_estimator (the
                  oracle's codes: the GPU's, bit for bit)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, *(ROOT / p for p in ("service", "client", "tests", "tests/client", "tests/service"))):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
os.environ.setdefault("ATTNSERVE_WARMUP", "none")


def spread(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, np.float64)
    q = np.quantile(a, [0.5, 0.9, 0.99])
    return {
        "n": int(a.size), "min": float(a.min()), "p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]),
        "max": float(a.max()), "mean": float(a.mean()), "std": float(a.std()),
    }  # fmt: skip


def sharded_tq4(seeds: range) -> dict[str, Any]:
    """Per seed, the largest error of an attend of the sharded tq4 session against the
    float64 oracle of the exact rows, as rel_err (max |error| over max |oracle|) and
    as the test's norm_err, and against its unsharded twin (rel_err)."""
    import test_sharded as ts
    from _core import core_engine

    from attnserve_client import Client
    from tools.common import rel_err

    engine = core_engine()
    servers = [ts.replica(engine, f"r{i}") for i in range(2)]
    clients = [Client(s.url) for s in servers]
    errs, norms, twin, worst_what = [], [], [], {}
    try:
        for seed in seeds:
            runs = ts.compressed_runs(clients, np.random.default_rng(seed))
            errs.append(max(rel_err(out, want) for _, out, _, want in runs))
            norm, what = max((ts.norm_err(out, want), what) for what, out, _, want in runs)
            norms.append(norm)
            twin.append(max(rel_err(out, plain) for _, out, plain, _ in runs))
            worst_what[what] = worst_what.get(what, 0) + 1
            print(f"seed {seed}: oracle {errs[-1]:.4f}, norm-wise {norm:.4f} ({what}), twin {twin[-1]:.2e}", flush=True)
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop()
        engine.close()
    return {
        "oracle rel_err": spread(errs), "oracle norm_err": spread(norms), "twin rel_err": spread(twin),
        "norm_err's worst attend": worst_what,
    }  # fmt: skip


class _TqSession:
    """A session of a TurboQuant format emulated by the float64 oracle of its codes
    (``tools/reference``: the codes the GPU writes, bit for bit, and attention from
    them within 1e-4 of the kernels'): what ``test_sharded._run`` calls on a session,
    for sweeps of many seeds at numpy's speed."""

    def __init__(self, seed: int, layers: int, hkv: int, fmt: str = "tq4"):
        self.seed, self.hkv, self.fmt = seed, hkv, fmt
        self.k: list[list[np.ndarray]] = [[] for _ in range(layers)]
        self.v: list[list[np.ndarray]] = [[] for _ in range(layers)]

    def attend(self, layer: int, q: np.ndarray, k: Any = None, v: Any = None, start_pos: int | None = None,
               causal: bool = True, scale: float | None = None) -> np.ndarray:  # fmt: skip
        from attnserve.formats import TQ_SPECS
        from attnserve.turboquant import layer_signs
        from tools import reference as ref

        if k is not None:
            self.k[layer].append(k), self.v[layer].append(v)
        keys, vals = np.concatenate(self.k[layer]), np.concatenate(self.v[layer])
        spec, length = TQ_SPECS[self.fmt], len(keys)
        ps, js = layer_signs(self.seed, layer, q.shape[-1])
        ek, ev = ref.tqx_encode(keys, vals, spec, ps, js)
        kw, vw = ref.pack_tqx_key_cache(ek, length, spec), ref.pack_tqx_value_cache(ev, length, spec)
        return ref.tqx_attention(
            q, kw, vw, spec, n_kv_heads=self.hkv, cap=length, length=length, polar_signs=ps, jl_signs=js,
            start_pos=start_pos, causal=causal, scale=scale,
        )  # fmt: skip


def sharded_tq4_oracle(seeds: range) -> dict[str, Any]:
    """sharded-tq4's error against exact attention, of tq4 emulated by the oracle of its
    codes (the sharded output is within 1e-5 of the unsharded, which is within 1e-4
    of this): per seed, the largest of an attend, as rel_err (max |error| over max
    |oracle|) and as the test's norm_err (the error's norm over the oracle's)."""
    import test_sharded as ts

    from tools.common import rel_err

    errs, norms, worst_what = [], [], {}
    for seed in seeds:
        w = ts._workload(np.random.default_rng(seed), prefill=40, chunk=16, decode=5)
        runs = ts._run(_TqSession(1234, ts.LAYERS, ts.HKV), w)
        err, what = max((rel_err(out, want), what) for what, out, want in runs)
        errs.append(err)
        norm, what = max((ts.norm_err(out, want), what) for what, out, want in runs)
        norms.append(norm)
        worst_what[what] = worst_what.get(what, 0) + 1
        if seed % 100 == 0:
            print(f"seed {seed}: oracle {err:.4f}, norm-wise {norm:.4f} ({what})", flush=True)
    return {
        "oracle rel_err": spread(errs), "oracle norm_err": spread(norms), "norm_err's worst attend": worst_what,
        "per_seed rel_err": [round(e, 5) for e in errs], "per_seed norm_err": [round(e, 5) for e in norms],
    }  # fmt: skip


class _Api:
    """``svc_helpers.Api.attend`` of one emulated session (``_TqSession``): the answer's
    status, out and length."""

    def __init__(self, session: _TqSession):
        self.session = session

    def attend(self, sid: str, layer: int, q: np.ndarray, k: Any = None, v: Any = None, offset: int | None = None,
               causal: bool = True, enc: str = "msgpack") -> Any:  # fmt: skip
        from types import SimpleNamespace

        out = self.session.attend(layer, q, k=k, v=v, causal=causal)
        length = sum(len(x) for x in self.session.k[layer])
        return SimpleNamespace(status=200, body={"out": out, "length": length})


def turboquant_band(seeds: range) -> dict[str, Any]:
    """tests/service/test_turboquant.py::test_turboquant_within_the_band_of_exact_attention,
    its session emulated (``_TqSession``): per shape, the workload's and the peaked
    attend's relative (Frobenius) error and correlation against exact attention."""
    import test_turboquant as t

    out: dict[str, Any] = {}
    for h, hkv, d in ((8, 2, 32), (4, 4, 64), (8, 1, 128)):
        fits = []
        for seed in seeds:
            rng = np.random.default_rng(seed)
            api = _Api(_TqSession(int(rng.integers(2**53)), 2, hkv, "turboquant"))
            (rel, corr), (peak_rel, peak_corr), _, _ = t.bands(api, "s", rng, h, hkv, d)
            fits.append({"rel": rel, "corr": corr, "peak_rel": peak_rel, "peak_corr": peak_corr})
        out[f"{h},{hkv},{d}"] = {name: spread([f[name] for f in fits]) for name in fits[0]}
        print(f"{h},{hkv},{d}: done", flush=True)
    return out


def tq4_cos(seeds: range) -> dict[str, Any]:
    """tests/test_core_tqx.py::test_chunked_prefill_equals_one_call: the cosine of tq4's
    prefill of 301 rows (seed 77, emulated: ``_TqSession``) with exact attention."""
    from _core import rows

    from tools import reference as ref

    cos = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        h, hkv, d, L = 8, 2, 64, 301
        q, k, v = rows(rng, L, h, d), rows(rng, L, hkv, d), rows(rng, L, hkv, d)
        whole = _TqSession(77, 1, hkv).attend(0, q, k=k, v=v)
        want = ref.attention(q, k, v)
        cos.append(float((whole * want).sum() / np.linalg.norm(whole) / np.linalg.norm(want)))
    return {"cos": spread(cos)}


def _per_d(seeds: range, fit: Callable[[np.random.Generator, int], dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in (32, 64, 128):
        fits = [fit(np.random.default_rng(seed), d) for seed in seeds]
        out[f"d={d}"] = {name: spread([f[name] for f in fits]) for name in fits[0]}
        print(f"d={d}: done", flush=True)
    return out


def estimator(seeds: range) -> dict[str, Any]:
    """tests/test_core_tq_state.py::test_estimator_unbiased_and_better_than_polarquant:
    per head_dim, the slopes of TurboQuant's and PolarQuant's scores, their RMS errors,
    and how much PolarQuant's exceeds TurboQuant's."""
    import test_core_tq_state as t

    def fit(rng: np.random.Generator, d: int) -> dict[str, float]:
        f = t.estimator_fit(rng, d)
        return {**f, "slope - 1": abs(f["slope"] - 1), "polar_rms / rms": f["polar_rms"] / f["rms"]}

    return _per_d(seeds, fit)


def wrong_constant(seeds: range) -> dict[str, Any]:
    """tests/test_core_tq_state.py::test_the_seed_comment_constant_would_be_biased:
    |slope - 1| of the estimator with the wrong constant."""
    import test_core_tq_state as t

    return {"|slope - 1|": spread([abs(t.wrong_constant_slope(np.random.default_rng(seed)) - 1) for seed in seeds])}


def values(seeds: range) -> dict[str, Any]:
    """tests/test_core_tq_state.py::test_value_reconstruction_bias_is_the_documented_one:
    per head_dim, the slope and the relative error of PolarQuant's values."""
    import test_core_tq_state as t

    def fit(rng: np.random.Generator, d: int) -> dict[str, float]:
        slope, rel = t.value_fit(rng, d)
        return {"slope": slope, "rel": rel}

    return _per_d(seeds, fit)


def gpu_slope(seeds: range) -> dict[str, Any]:
    """tests/test_core_turboquant.py::test_gpu_codes_give_an_unbiased_estimator, on
    the oracle's key words (the GPU's, bit for bit): |slope - 1|, and how much
    PolarQuant's mean error exceeds TurboQuant's."""
    import test_core_turboquant as t

    from attnserve.turboquant import codebook, layer_signs
    from tools import reference as ref

    def oracle_words(seed: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, int]:
        ps, js = layer_signs(seed, 0, k.shape[-1])
        return ref.pack_key_cache(ref.encode_keys(k, ps, js, codebook(k.shape[-1])), len(k)), len(k)

    fits = [t.codes_fit(np.random.default_rng(seed), oracle_words) for seed in seeds]
    return {
        "|slope - 1|": spread([abs(slope - 1) for slope, _, _ in fits]),
        "polar_err / err": spread([polar / err for _, err, polar in fits]),
    }


SWEEPS: dict[str, Callable[[range], dict[str, Any]]] = {
    "turboquant-band": turboquant_band,
    "tq4-cos": tq4_cos,
    "gpu-slope": gpu_slope,
    "sharded-tq4": sharded_tq4,
    "sharded-tq4-oracle": sharded_tq4_oracle,
    "estimator": estimator,
    "wrong-constant": wrong_constant,
    "values": values,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", choices=sorted(SWEEPS))
    ap.add_argument("--seeds", type=int, default=300, help="seeds 0..N-1")
    ap.add_argument("--first", type=int, default=0, help="the first seed")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = SWEEPS[args.sweep](range(args.first, args.first + args.seeds))
    result = {"sweep": args.sweep, "seeds": [args.first, args.first + args.seeds], **result}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
