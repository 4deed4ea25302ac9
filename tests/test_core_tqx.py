"""The TurboQuant variants (formats.TQ_VARIANTS: b-bit keys with or without QJL,
b-bit values) on the GPU: the packed cache against the float64 oracle's encoding
word for word, and attention on every kernel path against the oracle computed
from the GPU's own codes.

As for ``turboquant`` (test_core_turboquant.py), a word may differ from the
oracle's only where float32 arithmetic can land on the other side of a decision
the float64 oracle made (a rotated coordinate within rounding of a codebook
boundary, a JL projection within rounding of zero, a norm within rounding of an
f16 midpoint): every mismatch is checked to be one of these, and the rest of
the vector is replayed with the GPU's choice.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from attnserve.formats import TQ_SPECS, TQ_VARIANTS, bits_per_element, bytes_per_token, outlier_words
from tools import reference as ref
from attnserve.turboquant import codebook, layer_signs

from _core import lse_err, read_words, rel_err, reserve, rows, session
from test_core_turboquant import NORM_RTOL, Y_TOL, _near_f16_midpoint, _slots

pytestmark = pytest.mark.gpu

TQ_TOL = 1e-4  # attention vs the oracle from the GPU's codes: max abs error / max abs value


def _near_f16_midpoint_abs(x, atol):
    """Is float64 x within atol of a rounding midpoint between two f16 values?"""
    h = np.asarray(x, np.float64).astype(np.float16)
    lo = np.nextafter(h, np.float16(-np.inf)).astype(np.float64)
    hi = np.nextafter(h, np.float16(np.inf)).astype(np.float64)
    hv = h.astype(np.float64)
    return (np.abs(np.stack([(lo + hv) / 2, (hv + hi) / 2]) - x) <= atol).any(axis=0)


def check_tqx_words(kw, vw, k, v, spec, ps, js, cap):
    """Compare a variant's GPU key and value words with the oracle; return the number
    of justified mismatches (codes, JL bits, norm halves)."""
    L, hkv, d = k.shape
    vecs = hkv * cap
    kcb, vcb = ref.tqx_codebooks(spec, d)
    ek, ev = ref.tqx_encode(k, v, spec, ps, js)
    justified = 0

    def codes(words, cw, enc, cb, bits):
        nonlocal justified
        g = ref.unpack_codes(_slots(words[: vecs * cw], hkv, cap, cw, L), d, bits)
        diff = g != np.where(enc.live[..., None], enc.idx, 0)
        if diff.any():
            dist = np.abs(enc.y[..., None] - np.asarray(cb.boundaries)).min(axis=-1)
            assert (dist[diff] <= Y_TOL).all(), f"code mismatch far from a boundary: {dist[diff].max()}"
            assert (np.abs(g.astype(int) - enc.idx.astype(int))[diff] == 1).all()
            justified += int(diff.sum())
        return g

    kcw, vcw = spec.key_bits * d // 32, spec.value_bits * d // 32
    jw = d // 32 if spec.qjl else 0
    g_idx = codes(kw, kcw, ek, kcb, spec.key_bits)
    g_vidx = codes(vw, vcw, ev, vcb, spec.value_bits)
    rn = np.zeros(ek.norm.shape)
    if spec.qjl:  # replay the residual with the GPU's codes; a JL bit may differ only near 0
        rn, z, bits = ref.residual_bits(ek.y, g_idx, ek.live, js, kcb)
        g_bits = ref._unpack_bits(_slots(kw[vecs * kcw : vecs * (kcw + jw)], hkv, cap, jw, L), d)
        diff = g_bits != bits
        if diff.any():
            zs = z / np.sqrt(d)
            assert (np.abs(zs[diff]) <= Y_TOL).all(), f"JL bit mismatch far from zero: {np.abs(zs[diff]).max()}"
            justified += int(diff.sum())
    kow, vow = outlier_words(spec.key_outliers), outlier_words(spec.value_outliers)
    for words, off, enc, res, ow, x, gi, cb in (
        (kw, vecs * (kcw + jw), ek, rn, kow, k, g_idx, kcb),
        (vw, vecs * vcw, ev, np.zeros(ev.norm.shape), vow, v, g_vidx, vcb),
    ):
        g = _slots(words[off : off + vecs], hkv, cap, 1, L)[..., 0]
        want = np.where(enc.live, ref.f16_bits(enc.norm) | (ref.f16_bits(res) << 16), 0)
        if ow:  # outliers: the channels exactly; the values replayed from the GPU's codes and norm
            n = enc.outliers.ch.shape[-1]
            _, o0 = ref.select_outliers(x, n, ps)
            o = ref.correct_outliers(o0, x, ps, gi, g & 0xFFFF, cb)
            region = _slots(words[off + vecs : off + vecs * (1 + ow)], hkv, cap, ow, L)
            got = ref._unpack_outliers(region, g, n)
            np.testing.assert_array_equal(got.ch, o.ch)
            bad = got.half != o.half
            if bad.any():  # only within float32 rounding (of the codes' reconstruction) of a midpoint
                scale = np.abs(np.asarray(x, np.float64)).max(axis=-1, keepdims=True) * np.ones(o.value.shape)
                assert _near_f16_midpoint_abs(o.value[bad], 4e-6 * scale[bad]).all(), "outlier half mismatch"
                justified += int(bad.sum())
            want = np.where(enc.live, ref.f16_bits(enc.norm), 0) | (got.half[..., 0] << 16)
        diff = g != want
        if diff.any():
            lo_bad = (g & 0xFFFF) != (want & 0xFFFF)
            hi_bad = (g >> 16) != (want >> 16)
            assert _near_f16_midpoint(enc.norm, NORM_RTOL)[lo_bad].all(), "norm half mismatch"
            assert _near_f16_midpoint(res, NORM_RTOL)[hi_bad].all(), "residual norm half mismatch"
            justified += int(diff.sum())
    # words past the length stay untouched (zero)
    for words, regions in ((kw, (kcw, jw, 1, kow)), (vw, (vcw, 1, vow))):
        base = 0
        for w in regions:
            assert not words[base : base + vecs * w].reshape(hkv, cap, w)[:, L:].any(), "words past the length"
            base += vecs * w
    return justified


def test_layout_and_sizes():
    """b bits a coordinate: b * d / 32 code words, d / 32 JL words (QJL), one norm word;
    at (2 bits, QJL, 2 bits) the layout is turboquant's, word for word."""
    assert bytes_per_token("tq4", 1, 128) == 136 and bits_per_element("tq4", 128) == 4.25
    assert bits_per_element("tq4q", 128) == 4.25
    assert [bits_per_element(f, 128) for f in ("tq3", "tq4v2", "tq3q")] == [3.25] * 3
    assert bits_per_element("tq4v3", 128) == 3.75
    # tq4o: keys 8 code words + norm (and outlier 0) + 6 outlier words, values 16 + 1 + 2
    assert bits_per_element("tq4o", 128) == 4.25 and bytes_per_token("tq4o", 1, 128) == 136
    assert outlier_words(8) == 6 and outlier_words(2) == 2 and outlier_words(1) == 1
    assert bits_per_element("tq3o", 128) == 3.5  # keys 15 words, values 13
    # tq2o: keys 8 code words + norm (and outlier 0) + 2 outlier words (outliers 1, 2 and
    # the channel bytes: 3 outliers cost what 2 do), values 8 + 1
    assert outlier_words(3) == 2 and bits_per_element("tq2o", 128) == 2.5 and bytes_per_token("tq2o", 1, 128) == 80
    rng = np.random.default_rng(5)
    for d in (32, 64, 128):
        k, v = rng.standard_normal((7, 2, d)), rng.standard_normal((7, 2, d))
        ps, js = layer_signs(3, 1, d)
        ek, ev = ref.tqx_encode(k, v, TQ_SPECS["turboquant"], ps, js)
        np.testing.assert_array_equal(ref.pack_tqx_key_cache(ek, 9, TQ_SPECS["turboquant"]), ref.pack_key_cache(ek, 9))
        np.testing.assert_array_equal(
            ref.pack_tqx_value_cache(ev, 9, TQ_SPECS["turboquant"]), ref.pack_value_cache(ev, 9)
        )
        for bits in (2, 3, 4):
            idx = rng.integers(0, 2**bits, (5, d)).astype(np.uint32)
            words = ref.pack_codes(idx, bits)
            assert words.shape == (5, bits * d // 32)
            np.testing.assert_array_equal(ref.unpack_codes(words, d, bits), idx)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_distortion_is_the_papers(bits):
    """E||x - x_hat||^2 of a unit vector, the b-bit codebook after the rotation: the
    TurboQuant paper's ~0.117, 0.03, 0.009 for b = 2, 3, 4 (its Theorem 1 table)."""
    rng = np.random.default_rng(bits)
    d = 128
    x = rng.standard_normal((2000, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ps, _ = layer_signs(7, 0, d)
    cb = codebook(d, bits)
    enc = ref.encode_values(x, ps, cb)
    err = ((enc.y - np.asarray(cb.centroids)[enc.idx]) ** 2).sum(axis=1).mean()
    want = {2: 0.117, 3: 0.0345, 4: 0.0095}[bits]
    assert abs(err - want) < 0.1 * want, err


@pytest.mark.parametrize("fmt", list(TQ_VARIANTS))
def test_encoded_words_match_oracle(engine, rng, fmt):
    spec = TQ_SPECS[fmt]
    hkv = 3
    for d, length in ((32, 97), (64, 7), (128, 300)):
        s = session(engine, fmt, 6, hkv, d, layers=3, seed=int(rng.integers(2**53)))
        layer = s.layers[2]
        scale = float(rng.choice([0.01, 1.0, 30.0]))
        k, v = rows(rng, length, hkv, d, scale), rows(rng, length, hkv, d, scale)
        k[length // 2, 1] = 0.0  # zero vectors give zero words
        v[length // 2, 0] = 0.0
        half = max(1, length // 2)
        engine.append(layer, k[:half], v[:half]).result()
        engine.append(layer, k[half:], v[half:]).result()
        kw, vw = read_words(engine, layer)
        ps, js = layer_signs(s.config.seed, 2, d)
        cap = layer.capacity
        n = check_tqx_words(kw, vw, k, v, spec, ps, js, cap)
        assert n <= max(2, 0.003 * (k.size + v.size)), n  # rare events, never the rule
        if n == 0:
            ek, ev = ref.tqx_encode(k, v, spec, ps, js)
            np.testing.assert_array_equal(kw, ref.pack_tqx_key_cache(ek, cap, spec))
            np.testing.assert_array_equal(vw, ref.pack_tqx_value_cache(ev, cap, spec))
        kcw, vcw, vecs = spec.key_bits * d // 32, spec.value_bits * d // 32, hkv * cap
        slot_k, slot_v = 1 * cap + length // 2, 0 * cap + length // 2
        assert not kw[slot_k * kcw : (slot_k + 1) * kcw].any()
        # (the upper half of a norm word with outliers is outlier 0: +-0 for a zero vector)
        hi = 0x7FFF0000 if spec.key_outliers else 0xFFFFFFFF
        assert kw[vecs * (kcw + (d // 32 if spec.qjl else 0)) + slot_k] & hi == 0
        hi = 0x7FFF0000 if spec.value_outliers else 0xFFFFFFFF
        assert not vw[slot_v * vcw : (slot_v + 1) * vcw].any() and vw[vecs * vcw + slot_v] & hi == 0


def test_the_word_check_can_fail(rng):
    """A corrupted code far from any boundary is caught by the checker above."""
    d, hkv, L, cap = 32, 1, 5, 8
    spec = TQ_SPECS["tq4"]
    ps, js = layer_signs(1, 0, d)
    k, v = rows(rng, L, hkv, d), rows(rng, L, hkv, d)
    ek, ev = ref.tqx_encode(k, v, spec, ps, js)
    kw, vw = ref.pack_tqx_key_cache(ek, cap, spec), ref.pack_tqx_value_cache(ev, cap, spec)
    assert check_tqx_words(kw.copy(), vw.copy(), k, v, spec, ps, js, cap) == 0
    bad = kw.copy()
    bad[d // 16 + d // 32] ^= np.uint32(1 << 3)  # bit 3 (plane 3) of element 3 of key 0
    with pytest.raises(AssertionError):
        check_tqx_words(bad, vw, k, v, spec, ps, js, cap)


PATHS = ("split", "split-long", "tiled", "single")
LENGTHS = (1, 54, 97, 300, 600)


@pytest.fixture
def path(request, engine):
    import dataclasses

    p = request.param
    saved = engine.policy
    engine.policy = dataclasses.replace(
        saved,
        force="tiled" if p == "tiled" else p if p == "single" else "split",
        target_workgroups=1 if p.endswith("long") else saved.target_workgroups,
    )
    yield p
    engine.policy = saved


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("fmt", ["tq4", "tq3", "tq4v2", "tq3q", "tq4q", "tq4o", "tq3o", "tq2o"])
def test_attention_matches_its_oracle(engine, rng, fmt, path):
    """Every kernel path, GQA 1/2/4/8, d 32/64/128 (one per case, in turn), causal and
    not, start_pos inside, capacity > length; many cases in one coalesced batch."""
    spec = TQ_SPECS[fmt]
    pending = []
    dims = itertools.cycle((32, 64, 128))
    for length, ratio in itertools.product(LENGTHS, (1, 2, 4, 8)):
        d = next(dims)
        hkv = {1: 3, 2: 2, 4: 2, 8: 1}[ratio]
        h = hkv * ratio
        s = session(engine, fmt, h, hkv, d, layers=2, max_tokens=2048, seed=int(rng.integers(2**53)))
        layer = s.layers[1]  # sign_off != 0
        reserve(engine, layer, length + 37)
        k, v = rows(rng, length, hkv, d), rows(rng, length, hkv, d)
        engine.append(layer, k, v)
        n = min(3, length)
        for sp, causal in ((length - n, True), (length // 3, True), (length - n, False)):
            nq = n if sp == length - n else min(2, length)
            q = rows(rng, nq, h, d)
            scale = 1.0 / np.sqrt(d) if causal else 0.7 / np.sqrt(d)
            fut = engine.attend(layer, q, start_pos=sp, causal=causal, scale=scale)
            pending.append((s, layer, q, sp, causal, scale, fut, (length, ratio, d)))
    worst = 0.0
    for s, layer, q, sp, causal, scale, fut, case in pending:
        res = fut.result()
        out, length = res
        assert layer.capacity > length
        kw, vw = read_words(engine, layer)
        d = q.shape[2]
        ps, js = layer_signs(s.config.seed, layer.layer, d)
        want, want_lse = ref.tqx_attention(
            q, kw, vw, spec, n_kv_heads=layer.n_kv_heads, cap=layer.capacity, length=length,
            polar_signs=ps, jl_signs=js, start_pos=sp, causal=causal, scale=scale, return_lse=True,
        )  # fmt: skip
        err = rel_err(out, want)
        worst = max(worst, err)
        assert err <= TQ_TOL, (case, sp, causal, err)
        # the log-sum-exp of the format's estimated scores, to the same bound
        assert lse_err(res.lse, want_lse) <= TQ_TOL, (case, sp, causal, lse_err(res.lse, want_lse))
    print(f"worst {fmt} {path} relative error vs own oracle", worst)


@pytest.mark.parametrize("path", ("split", "tiled", "single"), indirect=True)
def test_chunked_prefill_equals_one_call(engine, rng, path):
    """tq4: bit for bit on the single-pass and tiled kernels, to float rounding on split."""
    h, hkv, d, L = 8, 2, 64, 301
    q, k, v = rows(rng, L, h, d), rows(rng, L, hkv, d), rows(rng, L, hkv, d)
    whole, _ = engine.attend(session(engine, "tq4", h, hkv, d, seed=77).layers[0], q, k=k, v=v).result()
    many = session(engine, "tq4", h, hkv, d, seed=77)
    parts, start = [], 0
    for size in (1, 63, 64, 100, 73):
        out, _ = engine.attend(many.layers[0], q[start : start + size], k=k[start : start + size],
                               v=v[start : start + size]).result()  # fmt: skip
        parts.append(np.array(out))
        start += size
    if path == "split":
        assert rel_err(np.concatenate(parts), whole) <= 2e-6
    else:
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    # and close to exact attention: 4-bit keys and values (over seeds 0..499, tq4
    # emulated by the oracle of its codes, tools/seed_sweeps.py tq4-cos: 0.9905..0.9930,
    # std 0.0004: 0.98 is 28 of them under the least)
    cos = float((whole * (want := ref.attention(q, k, v))).sum() / np.linalg.norm(whole) / np.linalg.norm(want))
    assert cos > 0.98, cos


def test_outlier_channels_are_kept(engine):
    """tq4o on bench/fidelity.py's LLM-shaped data (keys with outlier channels, peaked
    attention): the outliers are stored as they are (float16), so attention is much
    closer to exact than tq4's at the same 4.25 bits (docs/fidelity.md)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import fidelity

    L, n = 1024, 4  # fidelity.py --quick's LLM-shaped 1k case
    q, k, v = fidelity.make_data("llm", L, n, np.random.default_rng([0, L, 1]))
    h, hkv, d = q.shape[1], k.shape[1], k.shape[2]
    want = ref.attention(q, k, v)
    cos = {}
    for fmt in ("tq4", "tq4o"):
        s = session(engine, fmt, h, hkv, d, seed=11)
        out, _ = engine.attend(s.layers[0], q, k=k, v=v).result()
        c = (out * want).sum(-1) / np.linalg.norm(out, axis=-1) / np.linalg.norm(want, axis=-1)
        cos[fmt] = float(c.mean())
    print(cos)
    assert cos["tq4o"] > 0.99 and 1 - cos["tq4o"] < 0.25 * (1 - cos["tq4"]), cos


OUTLIER_FORMATS = [f for f, s in TQ_VARIANTS.items() if s.key_outliers or s.value_outliers]


def _overflowing_row(d: int, n: int, polar_signs: np.ndarray, rest_share: float = 0.3) -> np.ndarray:
    """A row of norm just under MAX_NORM whose outlier 0 (channel 5) is stored past
    float16's range by a format keeping ``n`` channels of 2-bit codes: its rest is 0 at
    channels 5 ^ m for m < n (n <= 8: blocks of 8 in the rotated basis), and in the
    rotated basis, times H[5], one positive block and everything else slightly
    negative, so that the 2-bit codes reconstruct about -0.3 of the rest's norm at
    channel 5, where x is large and positive (times its sign)."""
    ch = 5
    blk = 4 if n <= 4 else 8
    w = np.full(d // blk, -1.0)
    w[0] = d // blk - 1
    w = np.repeat(w, blk) / np.linalg.norm(np.repeat(w, blk))
    hn = ref.hadamard(d) / np.sqrt(d)
    rest = hn @ (hn[ch] * np.sqrt(d) * w) * polar_signs  # rht_inv of the rotated rest
    others = [ch ^ m for m in range(1, n)]
    assert np.abs(rest[[ch, *others]]).max() < 1e-12
    total = 65504.0 * 0.9999
    rn = rest_share * total
    b = 1.05 * np.abs(rest).max() * rn  # the other outliers: just above the rest's channels
    x = rest * rn
    x[others] = b
    x[ch] = np.sqrt(total**2 - rn**2 - (n - 1) * b**2) * polar_signs[ch]
    return x


@pytest.mark.parametrize("fmt", OUTLIER_FORMATS)
def test_outlier_bound_holds(rng, fmt):
    """turboquant.outlier_bound bounds every outlier the oracle stores (Gaussian rows,
    LLM-shaped rows with big channels, and rows built to make the codes reconstruct
    much at an outlier channel), and the threat is real: those last rows have norms
    under MAX_NORM, and the oracle stores an outlier of theirs as inf (at d = 64 and 128;
    at 32 they come within 2% of it)."""
    import warnings

    from attnserve.turboquant import MAX_NORM, OUTLIER_SLACK, outlier_bound

    spec = TQ_SPECS[fmt]
    for d in (32, 64, 128):
        ps, js = layer_signs(9, 0, d)
        x = rows(rng, 200, 2, d, 100.0).astype(np.float64)
        x[:100, :, rng.choice(d, 4, replace=False)] *= rng.uniform(10, 60, size=4)
        adv = np.stack([_overflowing_row(d, max(spec.key_outliers, spec.value_outliers), ps, share)
                        for share in (0.1, 0.2, 0.3, 0.4)])  # fmt: skip
        assert (np.linalg.norm(adv, axis=-1) < MAX_NORM).all()
        x = np.concatenate([x, np.stack([adv, adv], axis=1)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # float16 overflow of the stored outliers
            ek, ev = ref.tqx_encode(x, x, spec, ps, js)
        for enc, n, bits in ((ek, spec.key_outliers, spec.key_bits), (ev, spec.value_outliers, spec.value_bits)):
            if not n:
                assert enc.outliers is None
                continue
            stored = np.abs(enc.outliers.value).max(axis=-1)
            bound = outlier_bound(x, n, bits)
            assert (stored <= bound / OUTLIER_SLACK).all(), (stored / bound).max()
            assert (stored[:100] > 0.1 * bound[:100]).all()  # LLM-shaped: the outliers are the bound's bulk
            if bits == 2 and d >= 64:  # the built rows overflow (their codes' levels are 2-bit ones)
                assert not np.isfinite(ref.f16_value(enc.outliers.half[200:, 0, 0])).all(), d


@pytest.mark.parametrize("fmt", OUTLIER_FORMATS)
def test_rows_whose_outliers_float16_cannot_hold_are_refused(engine, rng, fmt):
    """A key (or, with value outliers, value) row whose outlier bound is over 65504 is
    an InvalidRequest before anything is queued, though its norm is under MAX_NORM; the
    same row scaled to just under the bound is stored, its words are the oracle's and
    attention from them is the oracle's."""
    from attnserve.errors import InvalidRequest
    from attnserve.step.rules import kv_rows_problem
    from attnserve.turboquant import MAX_OUTLIER, outlier_bound

    spec = TQ_SPECS[fmt]
    h, hkv, d, L = 4, 2, 128, 9
    s = session(engine, fmt, h, hkv, d, seed=21)
    layer = s.layers[0]
    ps, js = layer_signs(21, 0, d)
    bad = _overflowing_row(d, spec.key_outliers, ps)
    k, v = rows(rng, L, hkv, d, 100.0), rows(rng, L, hkv, d, 100.0)
    for name, n, bits in (("k", spec.key_outliers, spec.key_bits), ("v", spec.value_outliers, spec.value_bits)):
        kk, vv = k.copy(), v.copy()
        (kk if name == "k" else vv)[3, 1] = bad
        if n:
            assert outlier_bound(bad[None, None], n, bits)[0, 0] > MAX_OUTLIER
            problem = kv_rows_problem(engine.max_binding, s.config, kk, vv, fmt)
            assert isinstance(problem, InvalidRequest)
            assert problem.detail.startswith(f"{name}[3, 1]: {fmt} keeps its {n} largest channels")
        else:  # values without outliers: codes and a norm under MAX_NORM hold it
            assert kv_rows_problem(engine.max_binding, s.config, kk, vv, fmt) is None
    assert layer.length == 0
    # just under the bound: stored, as the oracle stores it
    k[3, 1] = bad * (0.9999 * MAX_OUTLIER / outlier_bound(bad[None, None], spec.key_outliers, spec.key_bits)[0, 0])
    if spec.value_outliers:
        v[4, 0] = bad * (
            0.9999 * MAX_OUTLIER / outlier_bound(bad[None, None], spec.value_outliers, spec.value_bits)[0, 0]
        )
    k, v = k.astype(np.float32), v.astype(np.float32)
    assert kv_rows_problem(engine.max_binding, s.config, k, v, fmt) is None
    engine.append(layer, k, v).result()
    kw, vw = read_words(engine, layer)
    assert check_tqx_words(kw, vw, k, v, spec, ps, js, layer.capacity) <= 2
    o = ref.unpack_tqx_outliers(kw, spec, True, n_kv_heads=hkv, cap=layer.capacity, d=d, length=L)
    assert np.isfinite(ref.f16_value(o.half)).all() and np.abs(ref.f16_value(o.half[3, 1])).max() > 30000
    q = rows(rng, 2, h, d)
    out, _ = engine.attend(layer, q).result()
    want = ref.tqx_attention(q, kw, vw, spec, n_kv_heads=hkv, cap=layer.capacity, length=L, polar_signs=ps,
                             jl_signs=js)  # fmt: skip
    assert np.isfinite(out).all() and rel_err(out, want) <= TQ_TOL
