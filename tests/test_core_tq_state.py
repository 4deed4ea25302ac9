"""TurboQuant's host state (signs, codebook, constant) and the estimator's bias."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnserve.formats import bits_per_element, bytes_per_token
from tools import reference as ref
from attnserve.turboquant import (
    CODEBOOK,
    codebook,
    layer_signs,
    lloyd_max_codebook,
    qjl_scale,
    session_signs,
    splitmix64,
)


def test_splitmix64_reference_values():
    # Published splitmix64 outputs for state 0 (Vigna's reference implementation).
    assert splitmix64(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_signs_are_deterministic_and_pinned():
    # Same seed -> same signs on every machine: pinned values, not just a re-run.
    p, j = layer_signs(42, 3, 32)
    bits = "".join("1" if s > 0 else "0" for s in np.concatenate([p, j]))
    assert bits == PINNED_SIGNS_42_3_32
    assert set(np.unique(p)) <= {-1.0, 1.0}
    p2, j2 = layer_signs(42, 3, 32)
    np.testing.assert_array_equal(p, p2)
    np.testing.assert_array_equal(j, j2)


def test_signs_differ_between_seeds_layers_and_halves():
    a = np.concatenate(layer_signs(1, 0, 128))
    b = np.concatenate(layer_signs(2, 0, 128))
    c = np.concatenate(layer_signs(1, 1, 128))
    assert (a != b).mean() > 0.3 and (a != c).mean() > 0.3
    p, j = layer_signs(1, 0, 128)
    assert (p != j).mean() > 0.3
    assert abs(p.mean()) < 0.3  # balanced-ish


def test_session_signs_layout():
    s = session_signs(9, 3, 64)
    assert s.shape == (3 * 2 * 64,) and s.dtype == np.float32
    for l in range(3):
        p, j = layer_signs(9, l, 64)
        np.testing.assert_array_equal(s[l * 128 : l * 128 + 64], p)
        np.testing.assert_array_equal(s[l * 128 + 64 : (l + 1) * 128], j)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_codebook_table_is_the_lloyd_max_quantizer(d):
    cb = CODEBOOK[d]
    exact = lloyd_max_codebook(d)
    np.testing.assert_allclose(cb.centroids, exact, rtol=2e-7)
    assert list(cb.centroids) == sorted(cb.centroids)
    assert cb.centroids_f32().tobytes() == np.asarray(cb.centroids, np.float32).tobytes()
    for i in range(3):
        assert cb.boundaries[i] == float(np.float32((cb.centroids[i] + cb.centroids[i + 1]) / 2))
    # close to the Gaussian Lloyd-Max levels +-0.4528/sqrt(d), +-1.5104/sqrt(d)
    np.testing.assert_allclose(np.array(cb.centroids[2:]) * math.sqrt(d), [0.4528, 1.5104], rtol=0.02)


def test_codebook_rejects_unsupported_head_dim():
    with pytest.raises(ValueError, match="32, 64, 128"):
        codebook(80)


def test_qjl_constant_is_for_the_orthonormal_rotation():
    assert qjl_scale(128) == pytest.approx(math.sqrt(math.pi / 2) / math.sqrt(128))
    assert qjl_scale(128) != pytest.approx(math.sqrt(math.pi / 2) / 128)


def test_bytes_per_token():
    assert bytes_per_token("f32", 8, 128) == 8 * 128 * 4 * 2
    # d=128: keys 8 + 4 + 1 words, values 8 + 1 words per KV head (52 + 36 bytes)
    assert bytes_per_token("turboquant", 1, 128) == 88
    assert bytes_per_token("f32", 1, 128) / bytes_per_token("turboquant", 1, 128) > 11.6
    assert bytes_per_token("f16", 8, 128) == 8 * 128 * 2 * 2
    assert bytes_per_token("f16", 3, 6) == 3 * 6 * 2 * 2  # an odd row of halves still takes whole words
    assert bytes_per_token("bf16", 8, 128) == bytes_per_token("f16", 8, 128)
    assert bytes_per_token("bf16", 3, 6) == 3 * 6 * 2 * 2
    assert [bits_per_element(f, 128) for f in ("f32", "f16", "bf16", "turboquant")] == [32, 16, 16, 2.75]
    with pytest.raises(ValueError, match="even head_dim"):
        bytes_per_token("f16", 1, 7)
    with pytest.raises(ValueError, match="bf16 supports an even head_dim"):
        bytes_per_token("bf16", 1, 41)


def _slope(est, exact):
    return float((est * exact).sum() / (exact * exact).sum())


def estimator_fit(rng: np.random.Generator, d: int) -> dict[str, float]:
    """40 draws (fresh signs, 200 keys, a query): the regression slope of TurboQuant's
    and of PolarQuant's estimated <q, k> on the exact one, and each one's relative RMS
    error (the test's measurement; ``tools/seed_sweeps.py estimator`` sweeps it)."""
    cb = codebook(d)
    est_all, pol_all, exact_all = [], [], []
    for draw in range(40):
        seed = int(rng.integers(0, 2**53))
        ps, js = layer_signs(seed, 0, d)
        k = rng.standard_normal((200, 1, d))
        q = rng.standard_normal((1, 1, d))
        enc = ref.encode_keys(k, ps, js, cb)
        q_rot, q_jl, _ = ref.rotate_q(q, ps, js)
        est_all.append(ref.tq_scores(q_rot, q_jl, enc.idx, enc.bits, enc.norm, enc.residual_norm, cb).ravel())
        pol_all.append(
            ref.tq_scores(q_rot, q_jl, enc.idx, enc.bits, enc.norm, enc.residual_norm, cb, polar_only=True).ravel()
        )
        exact_all.append((k[:, 0] @ q[0, 0]).ravel())
    est, pol, exact = map(np.concatenate, (est_all, pol_all, exact_all))
    rms = lambda e: float(np.sqrt(((e - exact) ** 2).mean() / (exact**2).mean()))
    return {"slope": _slope(est, exact), "polar_slope": _slope(pol, exact), "rms": rms(est), "polar_rms": rms(pol)}


@pytest.mark.parametrize("d", [32, 64, 128])
def test_estimator_unbiased_and_better_than_polarquant(rng, d):
    """Regression slope of estimated on exact <q, k> within 1 +- 0.02 over many
    random draws (fresh signs per draw), and smaller error than PolarQuant alone."""
    fit = estimator_fit(rng, d)
    # over seeds 0..999 per head_dim (tools/seed_sweeps.py estimator): the slope 1.0065
    # +- 0.0028 at d = 32 (worst 1.0155: 0.02 is 4.8 standard deviations past the mean),
    # within 0.0128 and 0.0115 of 1 at d = 64 and 128 (std 0.0029); PolarQuant's slope
    # at most 0.899, its RMS error at least 1.29 times TurboQuant's
    assert abs(fit["slope"] - 1.0) < 0.02, fit
    assert fit["polar_slope"] < 0.95, fit  # PolarQuant alone is biased toward zero
    assert fit["rms"] < fit["polar_rms"], fit


def wrong_constant_slope(rng: np.random.Generator) -> float:
    """The estimator's slope with the seed comment's sqrt(pi/2)/d in place of
    sqrt(pi/2)/sqrt(d) (d = 128, 4000 keys, one query)."""
    d = 128
    cb = codebook(d)
    ps, js = layer_signs(5, 0, d)
    k = rng.standard_normal((4000, 1, d))
    q = rng.standard_normal((1, 1, d))
    enc = ref.encode_keys(k, ps, js, cb)
    q_rot, q_jl, _ = ref.rotate_q(q, ps, js)
    pol = ref.tq_scores(q_rot, q_jl, enc.idx, enc.bits, enc.norm, enc.residual_norm, cb, polar_only=True)
    full = ref.tq_scores(q_rot, q_jl, enc.idx, enc.bits, enc.norm, enc.residual_norm, cb)
    corr = full - pol  # uses sqrt(pi/2)/sqrt(d)
    wrong = pol + corr / math.sqrt(d)  # what sqrt(pi/2)/d would give
    exact = k[:, 0] @ q[0, 0]
    return _slope(wrong.ravel(), exact)


def test_the_seed_comment_constant_would_be_biased(rng):
    """The 1/d constant from the seed's comment leaves the estimator biased: the
    test above can fail."""
    slope = wrong_constant_slope(rng)
    # |slope - 1| over seeds 0..999 (tools/seed_sweeps.py wrong-constant): mean 0.106,
    # std 0.005, the least 0.090; the bound is 12 standard deviations under the mean
    assert abs(slope - 1.0) > 0.05, slope


# layer_signs(42, 3, 32): polar then JL, '1' for +1 (computed once, pinned forever:
# changing it breaks every stored snapshot).
PINNED_SIGNS_42_3_32 = "0101010110100000110001101000110101111010101000001011110001010100"


def value_fit(rng: np.random.Generator, d: int) -> tuple[float, float]:
    """PolarQuant values reconstructed (fresh signs, 20000 // d * 16 rows): the
    regression slope on the true values, and the relative error."""
    cb = codebook(d)
    ps, _ = layer_signs(int(rng.integers(2**53)), 0, d)
    v = rng.standard_normal((20000 // d * 16, d))
    ev = ref.encode_values(v, ps, cb)
    v_hat = ref.rht_inv(np.asarray(cb.centroids)[ev.idx], ps) * ev.norm[:, None]
    slope = float((v_hat * v).sum() / (v * v).sum())
    rel = float(np.sqrt(((v_hat - v) ** 2).sum() / (v * v).sum()))
    return slope, rel


@pytest.mark.parametrize("d", [32, 64, 128])
def test_value_reconstruction_bias_is_the_documented_one(rng, d):
    """PolarQuant values (an MSE quantizer, no QJL) shrink toward zero: the
    regression slope of reconstructed on true values is ~0.885 for Gaussian
    data (docs/turboquant.md). Measured, not hidden: a change to it is a change
    to the documented error band."""
    slope, rel = value_fit(rng, d)
    # over seeds 0..999 for each head_dim (tools/seed_sweeps.py values): the slope
    # 0.8817..0.8904 (std 0.0007: the bounds are 14 of them past the extremes), rel
    # 0.3328..0.3421 (std 0.0005)
    assert 0.87 < slope < 0.90, slope
    assert 0.32 < rel < 0.36, rel
