"""The half-precision decode split-kernel variants of bench/probes/half_decode_variants.py
(the shipped wide kernel, bench/probes/shaders/half_split_flash.wgsl, and the vec4
split kernel over a bfloat16 slab) against the float64 oracle of the cache as stored and
against the shipped kernel, at awkward sizes, on the tests' adapter (lavapipe in CI).

Each variant replaces only the split kernel's dispatches (same params, bindings and
partials; attention_merge finishes it), so its output must match the oracle's and the
shipped kernel's to <= 1e-4 of the output's max abs value (``TOL``; the observed
worst is printed, ~5e-7). Cases: head_dim 40, 72, 128 (the flash kernel's lane groups:
on lavapipe's 8-lane subgroups 5 pieces a row on 8 lanes with 3 idle, 9 and 16 pieces
two a lane); G in 1, 2, 4, 8; contexts 1, 37, 1000, 5000 (no multiple of a split, pages
of 16 rows: every split crosses pages); the policy's splits and the longest (target 1);
one decode row, three causal rows, two rows in the middle of the context (splits past
their window are empty) and a non-causal row with another scale; f16, bf16 and f32
slabs. The flash kernel needs the ``subgroup`` feature: on an adapter without it the
tests fail (they do not skip), as on an adapter whose subgroups it cannot use.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from _core import CORE_PAGE_TOKENS, rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "probes"))
import half_decode_variants as HV  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = 1e-4  # max abs error over the reference's max abs value
CONTEXTS = (1, 37, 1000, 5000)
MAIN = ("base", "wide", "flash")  # at every shape
MORE = ("flash-t2", "flash-long")  # tiles of 2 keys, longer splits: at some shapes
WORST: dict[str, float] = {}


@pytest.fixture(scope="module")
def eng():
    """An engine with the subgroup feature asked for (the core tests' engine may have
    been opened without it), pages of 16 rows, and the probe's kernels registered."""
    from attnserve.engine import Engine
    from attnserve.gpu.device import DeviceError

    from attnserve.gpu import device as DEV

    features = DEV.OPTIONAL_FEATURES
    HV.request_subgroups()
    added = HV.register()
    try:
        e = Engine.open(os.environ.get("ATTNSERVE_ADAPTER") or None, page_tokens=CORE_PAGE_TOKENS)
    except DeviceError as err:
        DEV.OPTIONAL_FEATURES = features
        HV.unregister(added)
        from _core import no_adapter

        no_adapter(str(err))
    DEV.OPTIONAL_FEATURES = features  # the engines opened after this one ask for what they did
    yield e
    e.close()
    HV.unregister(added)
    print("worst relative error vs the float64 oracle:", {k: f"{v:.1e}" for k, v in sorted(WORST.items())})


@pytest.fixture(scope="module")
def sg(eng):
    size = HV.subgroup_size(eng)
    assert size, f"adapter {eng.ctx.name} ({eng.ctx.backend}) has no subgroup feature: the flash variants cannot run"
    return size


def _queries(length):
    """(n, start_pos, causal, scale factor) of the cases at one context."""
    cases = [(1, length - 1, True, 1.0), (1, 0, False, 0.7)]
    if length >= 3:
        cases += [(3, length - 3, True, 1.0), (2, length // 3, True, 1.0)]
    return cases


def _check(eng, sg, fmt, d, g, variants, contexts=CONTEXTS, targets=None):
    hkv = 1 if g == 8 else 2
    h = hkv * g
    rng = np.random.default_rng(d * 1000 + g * 10 + len(fmt))
    saved = eng.policy
    for length in contexts:
        k = rng.standard_normal((length, hkv, d), dtype=np.float32)
        v = rng.standard_normal((length, hkv, d), dtype=np.float32)
        s = HV.make_session(eng, fmt, h, hkv, d, length)
        layer = s.layers[0]
        HV.fill(eng, layer, fmt, k, v)
        try:
            for tw in targets or (saved.target_workgroups, 1):
                eng.policy = dataclasses.replace(saved, force="split", target_workgroups=tw)
                for n, sp, causal, f in _queries(length):
                    q = rng.standard_normal((n, h, d), dtype=np.float32)
                    kw = dict(start_pos=sp, causal=causal, scale=f / np.sqrt(d))
                    want = HV.oracle(fmt, q, k, v, **kw)
                    base = HV.attend(eng, layer, q, fmt, "base", sg, **kw)
                    assert rel_err(base, want) <= TOL, ("base", fmt, length, n, sp, causal)
                    for name in variants:
                        assert HV.supports(name, fmt, d, sg) is None, (name, fmt, d, sg)
                        out = HV.attend(eng, layer, q, fmt, name, sg, **kw)
                        case = (name, fmt, d, g, length, n, sp, causal, tw)
                        assert np.isfinite(out).all(), case
                        e_f64, e_base = rel_err(out, want), rel_err(out, base)
                        assert e_f64 <= TOL, (*case, e_f64)
                        assert e_base <= TOL, (*case, e_base)
                        WORST[f"{fmt} {name}"] = max(WORST.get(f"{fmt} {name}", 0.0), e_f64)
        finally:
            eng.policy = saved
            eng.release(s).result()


@pytest.mark.parametrize("g", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [40, 72, 128])
@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_half_variants_match_oracle_and_shipped_kernel(eng, sg, fmt, d, g):
    _check(eng, sg, fmt, d, g, MAIN + (MORE if (d, g) in ((128, 4), (72, 8)) else ()))


@pytest.mark.parametrize("g,d", [(1, 40), (4, 128), (8, 72)])
def test_flash_over_f32_matches_oracle(eng, sg, g, d):
    """Variant (d): the flash kernel over an f32 slab (two 16-byte loads a piece)."""
    _check(eng, sg, "f32", d, g, ("flash",) + (MORE if g == 4 else ()))


def test_stored_words_are_what_the_oracle_reads(eng):
    """The oracle's cache values are the slab's: f16 rows rounded as numpy rounds
    (the service's appends), bf16 bits loaded as bench/probes rounds them."""
    rng = np.random.default_rng(7)
    k = rng.standard_normal((53, 2, 72), dtype=np.float32) * 3
    v = rng.standard_normal((53, 2, 72), dtype=np.float32)
    for fmt, bits in (("f16", lambda x: x.astype(np.float16).view(np.uint16)), ("bf16", HV.bf16_bits)):
        s = HV.make_session(eng, fmt, 8, 2, 72, 64)
        try:
            HV.fill(eng, s.layers[0], fmt, k, v)
            kb, vb = eng.call(lambda ctx: s.layers[0].read_words(ctx.device)).result()
            for got, x in ((kb, k), (vb, v)):
                words = np.frombuffer(got, np.uint16)[: x.size]
                assert np.array_equal(words, bits(x).reshape(-1)), fmt
        finally:
            eng.release(s).result()


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 1.0 + 2**-8 + 2**-20, 3.0e38], np.float32)
    want = np.array([1.0, 1.0, 1.0 + 2**-6, -2.5, 1.0 + 2**-7, 3.0e38], np.float64)
    got = HV.bf16_value(HV.bf16_bits(x)).astype(np.float64)
    assert np.allclose(got[:5], want[:5], rtol=0, atol=0)
    assert abs(got[5] / want[5] - 1) < 2**-8


def test_flash_refuses_to_be_silently_wrong(eng, sg):
    """A GROUP constant that disagrees with the params poisons the partials: the
    output is NaN, not a plausible wrong answer."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((100, 2, 64), dtype=np.float32)
    s = HV.make_session(eng, "f16", 8, 2, 64, 128)
    try:
        HV.fill(eng, s.layers[0], "f16", k, k)
        q = rng.standard_normal((1, 8, 64), dtype=np.float32)
        with HV.routed(eng, "flash", "f16", 2, 64, sg):  # the layer's G is 4
            out, _ = eng.attend(s.layers[0], q).result()
        assert np.isnan(np.array(out)).all()
    finally:
        eng.release(s).result()


def test_flash_shapes():
    assert HV.flash_shape(128, 32) == (16, 16, 1)
    assert HV.flash_shape(128, 8) == (16, 8, 2)
    assert HV.flash_shape(72, 32) == (9, 16, 1)
    assert HV.flash_shape(72, 8) == (9, 8, 2)
    assert HV.flash_shape(40, 8) == (5, 8, 1)
    with pytest.raises(ValueError):
        HV.flash_shape(128, 4)  # 4 pieces a lane
    with pytest.raises(ValueError):
        HV.flash_shape(36, 32)  # no whole 16-byte pieces
    with pytest.raises(ValueError):
        HV.flash_shape(128, None)


def test_probe_smoke_runs(tmp_path):
    """The probe's command line end to end, tiny: every default variant's output
    passes its checks (exit status 0) and the JSON says so."""
    import json

    out = tmp_path / "r.json"
    rc = HV.main(["--contexts", "300", "--formats", "f16,bf16,f32", "--budget", "0.002", "--batched", "2x100",
                  "--no-torch", "--no-split-only", "--json-out", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0, doc["failures"]
    assert not doc["failures"]
    got = {(r["kv_format"], r["variant"]) for r in doc["rows"]}
    for fmt in ("f16", "bf16"):
        assert {(fmt, v) for v in HV.DEFAULT} <= got
    assert {("f32", v) for v in HV.DEFAULT if v != "wide"} <= got
    assert all(r["ok"] and r["err_vs_oracle"] <= TOL for r in doc["rows"])
    assert {(r["kv_format"], r["variant"]) for r in doc["batched"]} == got
