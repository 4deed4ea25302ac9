"""bench/fidelity.py (docs/fidelity.md) in its short form: it runs on the adapter
there is, the f32 path is exact against float64, f16 is within float16's rounding
of it (cosine >= 0.9999, 16 bits per element), and the TurboQuant score estimate
has the properties the table reports: unbiased with the QJL bit, shrunk and noisier
without it; the 4-bit variant (tq4) is closer to exact attention than turboquant and
its score estimate nearly unbiased without QJL; tq3q's QJL bit keeps it unbiased."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import fidelity  # noqa: E402


def test_fidelity_quick(tmp_path):
    out = tmp_path / "fidelity.json"
    formats = ("f32", "f16", "bf16", "turboquant", "tq4", "tq3q")
    assert fidelity.main(["--quick", "--formats", ",".join(formats), "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["kv_format"], r["data"], r["context"]) for r in rows} == {
        (f, d, c) for f in formats for d in ("gaussian", "llm") for c in (256, 1024)
    }
    by = {(r["kv_format"], r["data"], r["context"]): r for r in rows}
    for r in rows:
        if r["kv_format"] == "tq4":
            assert r["bits_per_element"] == 4.25 and "qjl" not in r, r
            assert r["cos_mean"] > by[("turboquant", r["data"], r["context"])]["cos_mean"], r
            assert 0.98 <= r["polar_only"]["slope"] <= 1.0, r  # 4 bits: nearly unbiased without QJL
            continue
        if r["kv_format"] == "tq3q":
            assert r["bits_per_element"] == 3.25 and 0.97 <= r["qjl"]["slope"] <= 1.03, r
            assert r["cos_mean"] > by[("turboquant", r["data"], r["context"])]["cos_mean"], r
            continue
        if r["kv_format"] == "f32":
            assert r["cos_min"] >= 0.99999 and r["max_rel_err"] <= 1e-5, r
            continue
        if r["kv_format"] == "f16":
            # float16 keeps 11 significant bits: errors of about 2^-11 of the values, never zero
            assert r["bits_per_element"] == 16 and r["cos_min"] >= 0.9999 and 0 < r["max_rel_err"] <= 1e-2, r
            continue
        if r["kv_format"] == "bf16":
            # bfloat16 keeps 8 significant bits: about 8x f16's error (the full run, seed 0:
            # LLM-shaped cos_min 0.990-0.994 and max_rel_err 0.043-0.056 at 1k-32k, Gaussian
            # 0.999995 and 0.003; bench/results/fidelity-bf16-lavapipe.json)
            assert r["bits_per_element"] == 16 and r["cos_mean"] >= 0.999 and r["cos_min"] >= 0.98, r
            assert 0 < r["max_rel_err"] <= 0.1, r
            assert by[("f16", r["data"], r["context"])]["max_rel_err"] < r["max_rel_err"], r  # 11 bits against 8
            continue
        assert r["bits_per_element"] == 2.75
        qjl, polar = r["qjl"], r["polar_only"]
        assert 0.97 <= qjl["slope"] <= 1.03, r  # QJL's estimate is unbiased
        assert polar["slope"] < qjl["slope"] and polar["rel_var"] > qjl["rel_var"], r
        assert 0.5 < r["cos_mean"] < 1.0 and 0 < qjl["topk_mass"] <= 1.0, r
