"""The TurboQuant split-kernel variants of bench/probes/tq_decode_variants.py
(bench/probes/shaders/flash_attention_tq_split_v2.wgsl, _v3.wgsl) against the float64 oracle
of the GPU's packed cache and against the shipped split kernel, at awkward sizes.

Each variant replaces only the split kernel's dispatches (same params, bindings and
partials; attention_merge finishes it), so the outputs must match the shipped
kernel's and the oracle's to <= 1e-4 of the output's max abs value. Cases: contexts
that are no multiple of the split (1000, 3001; pages of 16 rows), G in 1, 4, 8, d in
64 and 128, the policy's splits and the longest each pipeline takes (target 1), one
decode row, three causal rows, two rows in the middle of the context (the splits
past their window are empty), and a non-causal row with another scale; pages of 16
rows (the core tests' engine) and of 128 rows (a second engine: v3 reads a
thread's eight value rows of a step through one page lookup when they share a page).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from _core import rel_err, rows, session

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "probes"))
import tq_decode_variants as TV  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = 1e-4  # max abs error over the reference's max abs value
VARIANTS = ("v2", "v2-alu", "v3", "v3-vpf0", "v3-vpf2", "v3-vpf2-valu", "v3-k1")
CONTEXTS = (1000, 3001)


def _queries(length):
    """(n, start_pos, causal, scale factor) of the cases at one context."""
    return [(1, length - 1, True, 1.0), (3, length - 3, True, 1.0), (2, length // 3, True, 1.0), (1, 0, False, 0.7)]


@pytest.fixture(scope="module")
def layers(engine):
    """One filled TurboQuant layer per (d, G, context): 2 KV heads (G = 8: 1)."""
    rng = np.random.default_rng(1234)
    made = {}
    for d in (64, 128):
        for g in (1, 4, 8):
            hkv = 1 if g == 8 else 2
            for length in CONTEXTS:
                s = session(engine, "turboquant", hkv * g, hkv, d, layers=2, seed=int(rng.integers(2**53)))
                layer = s.layers[1]  # layer 1: signs at an offset
                engine.append(layer, rows(rng, length, hkv, d), rows(rng, length, hkv, d)).result()
                made[(d, g, length)] = (s, layer)
    yield made
    for s, _ in made.values():
        engine.release(s).result()


def test_variants_are_registered_with_the_shipped_bindings():
    from attnserve.gpu import shaders as S

    shipped = dict(S.KERNELS)
    added = TV.register()
    try:
        specs = {v.kernel: S.KERNELS[v.kernel] for v in TV.VARIANTS.values()}
    finally:
        for name in added:
            S.KERNELS.pop(name)
    assert S.KERNELS == shipped  # the registry is the service's again
    base = S.KERNELS[TV.BASE_KERNEL].bindings
    for v in TV.VARIANTS.values():
        assert specs[v.kernel].bindings == base
        if v.measurement:
            continue
        # every variant fits the H200's 48 KiB at the shipped split caps
        for g in (1, 2, 4, 8):
            for d in (32, 64, 128):
                cap = v.split_cap(g, d, 49152)
                assert cap in (256, 512) and v.smem_bytes(g, d, cap) <= 49152


def test_variant_params_reads_keep_the_host_names():
    """The kernels' params struct is generated from the host block (TqSplitParams);
    every field they bind keeps its name (as tests/test_core_shaders.py asks of the
    registered kernels)."""
    from attnserve.gpu.shaders import load_wgsl

    for design in TV.DESIGNS:
        src = load_wgsl(f"flash_attention_tq_split_{design}.wgsl", folder=TV.SHADERS)
        assert "struct TqSplitParams {" in src and "var<storage, read> params: array<TqSplitParams>;" in src
        reads = re.findall(r"let (\w+) = prm\.(\w+);", src)
        assert reads and all(a == b for a, b in reads), reads


def _check(engine, layers, d, g, tw, variants, contexts=CONTEXTS):
    saved = engine.policy
    engine.policy = dataclasses.replace(saved, force="split", target_workgroups=tw)
    rng = np.random.default_rng(d * 100 + g * 10 + tw)
    worst = {v: 0.0 for v in variants}
    unfit: set[str] = set()
    try:
        for length in contexts:
            s, layer = layers[(d, g, length)]
            for n, sp, causal, f in _queries(length):
                q = rows(rng, n, layer.n_kv_heads * g, d)
                kw = dict(start_pos=sp, causal=causal, scale=f / np.sqrt(d))
                want = TV.oracle(engine, s, layer, q, **kw)
                base = TV.attend(engine, layer, q, **kw)
                assert rel_err(base, want) <= TOL, ("base", length, n, sp, causal)
                for name in variants:
                    try:
                        split_len, _ = TV.split_of(engine, name, "turboquant", length, layer.n_kv_heads, g, d)
                    except ValueError:  # its workgroup memory passes this adapter's limit (v2, G = 8, d = 128)
                        unfit.add(name)
                        continue
                    out = TV.attend(engine, layer, q, variant=name, **kw)
                    case = (name, length, n, sp, causal, split_len)
                    assert np.isfinite(out).all(), case
                    err_f64, err_base = rel_err(out, want), rel_err(out, base)
                    assert err_f64 <= TOL, (*case, err_f64)
                    assert err_base <= TOL, (*case, err_base)
                    worst[name] = max(worst[name], err_f64)
    finally:
        engine.policy = saved
    print("worst relative error vs the float64 oracle:", worst, "; not run (workgroup memory):", sorted(unfit))
    assert unfit <= {"v2"} or engine.ctx.limits["max-compute-workgroup-storage-size"] < 32768


@pytest.mark.parametrize("target", ["policy", "longest"])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_variant_outputs_match_oracle_and_shipped_kernel(engine, layers, d, g, target):
    _check(engine, layers, d, g, 1 if target == "longest" else engine.policy.target_workgroups, VARIANTS)


@pytest.fixture(scope="module")
def engine128():
    """An engine with pages of 128 rows (the core engine's are 16)."""
    from attnserve.engine import Engine

    eng = Engine.open(os.environ.get("ATTNSERVE_ADAPTER") or None, page_tokens=128)
    yield eng
    eng.close()


@pytest.mark.parametrize("d", [64, 128])
def test_v3_value_rows_in_one_page(engine128, d):
    """Pages of 128 rows: a thread's eight value rows of a step (8 * 256/(d/4) rows
    apart at most) usually share a page, and v3 takes its one-lookup path."""
    rng = np.random.default_rng(d)
    made = {}
    for length in CONTEXTS:
        s = session(engine128, "turboquant", 8, 2, d, layers=1, seed=int(rng.integers(2**53)))
        engine128.append(s.layers[0], rows(rng, length, 2, d), rows(rng, length, 2, d)).result()
        made[(d, 4, length)] = (s, s.layers[0])
    try:
        for tw in (engine128.policy.target_workgroups, 1):
            _check(engine128, made, d, 4, tw, ("v3", "v3-vpf0", "v3-vpf2"))
    finally:
        for s, _ in made.values():
            engine128.release(s).result()
