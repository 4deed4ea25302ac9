"""The 8-bit kv candidates of bench/probes/kv8_fidelity.py (issue 54, item 2): the OCP
FP8 E4M3FN encoder checked exhaustively (every code's value from the spec's table, a
sweep of float32s against a brute-force nearest-code search with ties to even), and
the int8 / scaled e4m3 round trips' error bounds; the key codes for outlier channels:
the fast Hadamard against tools.reference's matrix, the rotations orthogonal to 1e-12
(TurboQuant's signs; a dense Haar one at d 72), the rotated, per-channel and centered
round trips within their stated steps at awkward sizes (13 rows, d 72), seeds swept."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kv8_fidelity", ROOT / "bench" / "probes" / "kv8_fidelity.py")
kv8 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv8)


def ocp_e4m3_values() -> np.ndarray:
    """The OCP 8-bit FP spec's E4M3 table, written out by binade: subnormals k/8 * 2^-6,
    normals 2^(E-7) * {1, 1.125, ..., 1.875} for E = 1..15, S.1111.111 NaN."""
    pos = [k / 8 * 2.0**-6 for k in range(8)]
    for e in range(1, 16):
        pos += [2.0 ** (e - 7) * (8 + m) / 8 for m in range(8)]
    pos = np.array(pos)
    pos[0x7F] = np.nan
    return np.concatenate([pos, -pos])


def test_e4m3_table_is_ocp():
    got, want = kv8.e4m3_decode_table(), ocp_e4m3_values()
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).sum() == 2
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok], want[ok])
    # landmarks named in the spec
    assert got[0x7E] == 448 and got[0xFE] == -448  # max normal
    assert got[0x08] == 2.0**-6 and got[0x01] == 2.0**-9 and got[0x07] == 7 * 2.0**-9  # min normal, subnormals
    assert got[0x38] == 1.0 and got[0x80] == 0 and np.signbit(got[0x80])


def brute_force(x: np.ndarray) -> np.ndarray:
    """Nearest finite code by distance to every value, ties to the even code, |x| >= 448 -> max."""
    table = ocp_e4m3_values()[:0x7F]  # non-negative finite values, codes 0..126
    a = np.abs(x.astype(np.float64))
    dist = np.abs(a[:, None] - table[None, :])
    best = dist.min(1, keepdims=True)
    tied = dist == best
    n_tied = tied.sum(1)
    first = tied.argmax(1)
    code = np.where(n_tied == 1, first, np.where(first % 2 == 0, first, first + 1))
    code = np.where(a >= 448, 0x7E, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def test_e4m3_decode_encode_round_trip():
    codes = np.arange(256, dtype=np.uint8)
    finite = ~np.isnan(kv8.e4m3_decode(codes))
    assert np.array_equal(kv8.e4m3_encode(kv8.e4m3_decode(codes[finite])), codes[finite])
    assert (kv8.e4m3_encode(np.array([np.nan])) & 0x7F) == 0x7F


def test_e4m3_encoder_matches_brute_force():
    table = ocp_e4m3_values()[:0x7F]
    mids = (table[1:] + table[:-1]) / 2  # exact ties (all representable in float32)
    edges = [448, 464, 480, 1e6, 3e38, 1e-12, 2.0**-10, 2.0**-10 + 2.0**-30]
    below = np.nextafter(mids.astype(np.float32), np.float32(0))
    above = np.nextafter(mids.astype(np.float32), np.float32(1e9))
    specials = np.concatenate([table, mids, below, above, edges])
    # every float32 whose magnitude lies in [2^-12, 2^10], with a stride over the bit patterns
    lo, hi = np.float32(2.0**-12).view(np.uint32), np.float32(2.0**10).view(np.uint32)
    sweep = np.arange(lo, hi, 97, dtype=np.uint32).view(np.float32)
    x = np.concatenate([specials.astype(np.float32), sweep]).astype(np.float32)
    x = np.concatenate([x, -x, [0.0, -0.0]]).astype(np.float32)
    got = kv8.e4m3_encode(x)
    for at in range(0, x.size, 8192):
        assert np.array_equal(got[at : at + 8192], brute_force(x[at : at + 8192]))
    # the ties went to the even code both ways
    t = kv8.e4m3_encode(mids.astype(np.float32))
    assert np.all(t % 2 == 0)


@pytest.mark.parametrize("seed", range(5))
def test_int8_and_scaled_e4m3_error_bounds(seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((64, 3, 128)) * rng.uniform(0.01, 100, (64, 3, 1))).astype(np.float32)
    x[:, :, :4] *= 30  # outlier channels
    m = np.abs(x).max(-1, keepdims=True)
    # symmetric int8: half a step (the f16 scale within 2^-11) everywhere, the max kept to the scale's rounding
    err = np.abs(kv8.int8_sym(x) - x)
    assert np.all(err <= m / 127 * (0.5 + 2.0**-10) + 1e-30)
    # asymmetric: half a step of (max - min) / 254, plus the f16 offset's rounding
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    err = np.abs(kv8.int8_asym(x) - x)
    assert np.all(err <= (hi - lo) / 254 * (0.5 + 2.0**-9) + np.abs(lo) * 2.0**-11 * 2)
    # scaled e4m3: relative error <= 2^-4 above the smallest normal of the scaled range
    y = kv8.e4m3_scaled(x)
    normal = np.abs(x) >= m / 448 * 2.0**-6 * 1.01
    assert np.all(np.abs(y - x)[normal] <= np.abs(x)[normal] * (2.0**-4 + 2.0**-10))
    assert np.all(np.abs(y - x) <= m / 448 * 2.0**-10 * 1.01 + np.abs(x) * (2.0**-4 + 2.0**-10))


def test_int8_codes_round_to_even_and_zero_rows():
    # x / scale exactly k + 0.5 goes to the even k
    scale = np.float32(np.float16(127 / 127))  # max 127 -> scale 1
    x = np.array([[[127, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5]]], np.float32) * scale
    assert np.array_equal(kv8.int8_sym(x)[0, 0], [127, 0, 2, 2, -0, -2, -126])
    z = np.zeros((2, 1, 8), np.float32)
    for fn in kv8.QUANTIZERS.values():
        assert np.array_equal(fn(z), z)


def test_bits_per_element():
    assert kv8.bits_per_element("int8", 64) == 8.25 and kv8.bits_per_element("int8", 128) == 8.125
    assert kv8.bits_per_element("int8a", 64) == 8.5 and kv8.bits_per_element("e4m3", 128) == 8


# -- the key codes for outlier channels: rotations, per-channel, centered --------------------

import sys  # noqa: E402

for _p in (ROOT / "service", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from attnserve.turboquant import layer_signs  # noqa: E402
from tools import reference as ref  # noqa: E402


def _rows(seed: int, n: int, d: int, hkv: int = 2) -> np.ndarray:
    """LLM-like rows: mixed magnitudes, a few large channels, a per-channel offset."""
    rng = np.random.default_rng([seed, n, d])
    x = rng.standard_normal((n, hkv, d)) * rng.uniform(0.05, 20, (n, hkv, 1))
    x[..., rng.choice(d, 3, replace=False)] *= 25
    x += rng.standard_normal(d) * 3
    return x.astype(np.float32)


def _int8a_bound(y: np.ndarray, axis: int = -1) -> np.ndarray:
    """int8a's worst error on vectors along ``axis``: half a step of (max - min) / 254
    with the float16 scale's rounding, plus the float16 offset's rounding."""
    lo, hi = y.min(axis, keepdims=True).astype(np.float64), y.max(axis, keepdims=True).astype(np.float64)
    return (hi - lo) / 254 * (0.5 + 2.0**-9) + np.abs(lo) * 2.0**-11 * 2 + 1e-30


def _int8_bound(y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.abs(y).max(axis, keepdims=True).astype(np.float64) / 127 * (0.5 + 2.0**-10) + 1e-30


@pytest.mark.parametrize("d", [1, 2, 4, 8, 32, 64, 128, 256])
def test_fwht_is_sylvester_hadamard(d):
    x = np.random.default_rng(d).standard_normal((5, 3, d))
    want = x @ ref.hadamard(d).T
    assert np.allclose(kv8.fwht(x), want, rtol=0, atol=1e-12 * np.abs(want).max())
    assert np.array_equal(kv8.fwht(x), kv8.fwht(x.copy())) and not np.shares_memory(kv8.fwht(x), x)


def test_fwht_needs_a_power_of_two():
    for d in (72, 3, 96):
        with pytest.raises(ValueError, match="power-of-two"):
            kv8.fwht(np.zeros((2, d)))


@pytest.mark.parametrize("seed", [0, 1, 7, 2**40 + 3])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_rht_rotation_is_turboquants_and_orthogonal(seed, d):
    for layer in (0, 5):
        rot, unrot = kv8.rotation("rht", seed, layer, d)
        m = rot(np.eye(d))  # row i: the image of e_i, i.e. the matrix R.T
        assert np.abs(m @ m.T - np.eye(d)).max() < 1e-12
        s = layer_signs(seed, layer, d)[0].astype(np.float64)
        x = np.random.default_rng([seed, layer]).standard_normal((13, 2, d))
        assert np.abs(rot(x) - ref.rht(x, s)).max() < 1e-12 * np.abs(x).max() * np.sqrt(d)
        assert np.abs(unrot(ref.rht(x, s)) - x).max() < 1e-12 * np.abs(x).max() * np.sqrt(d)
        # q . k is kept: the query rotated once at attend
        q = np.random.default_rng([seed, layer, 1]).standard_normal(d)
        assert np.allclose(rot(x) @ rot(q), x @ q, rtol=0, atol=1e-12 * np.abs(x @ q).max() + 1e-12)
    # the layer and the seed pick the signs
    assert not np.array_equal(kv8.rht_signs(seed, 0, d), kv8.rht_signs(seed, 1, d))
    assert not np.array_equal(kv8.rht_signs(seed, 0, d), kv8.rht_signs(seed + 1, 0, d))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("d", [13, 64, 72, 128])
def test_haar_rotation_is_orthogonal(seed, d):
    r = kv8.haar_rotation(seed, 3, d)
    assert np.abs(r @ r.T - np.eye(d)).max() < 1e-12 and np.abs(r.T @ r - np.eye(d)).max() < 1e-12
    assert np.array_equal(r, kv8.haar_rotation(seed, 3, d))  # deterministic
    assert not np.allclose(r, kv8.haar_rotation(seed + 1, 3, d))
    rot, unrot = kv8.rotation("haar", seed, 3, d)
    x = np.random.default_rng(seed).standard_normal((13, 2, d))
    assert np.abs(unrot(rot(x)) - x).max() < 1e-12 * np.abs(x).max() * np.sqrt(d)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("name", "d"), [("rint8", 64), ("rint8a", 64), ("rint8", 128), ("rint8a", 128), ("oint8", 72), ("oint8a", 72)]
)
def test_rotated_round_trip_within_the_rotated_step(seed, name, d):
    x = _rows(seed, 13, d)
    fk, fv = kv8.quantizer(name, seed, 2)
    got = fk(x)
    assert got.dtype == np.float64 and got.shape == x.shape and np.array_equal(fv(x), got)
    rot, _ = kv8.rotation("rht" if name[0] == "r" else "haar", seed, 2, d)
    y = rot(x).astype(np.float32)  # the row as the kernel would store it, before its code
    err = np.abs(rot(got) - y)  # the code's error, in the rotated space
    bound = (_int8a_bound(y) if name.endswith("a") else _int8_bound(y)) + 1e-12 * np.abs(y).max()
    assert np.all(err <= bound)
    # orthonormal: the row's error norm is the rotated one's (within float32 rounding of y)
    e = np.linalg.norm(got - x, axis=-1)
    assert np.all(e <= np.sqrt(d) * bound[..., 0] + 1e-6 * np.linalg.norm(x, axis=-1))
    # the rotation spreads the outlier channels: a finer code than int8 / int8a's
    plain = kv8.int8_asym(x) if name.endswith("a") else kv8.int8_sym(x)
    assert np.linalg.norm(got - x) < np.linalg.norm(plain - x)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("group", [1, 4, 5, 13, 64])
@pytest.mark.parametrize("d", [72, 64])
def test_per_channel_round_trip_against_float64_groups(seed, group, d):
    x = _rows(seed, 13, d)
    for base, bound_of in (("int8", _int8_bound), ("int8a", _int8a_bound)):
        got = kv8.quantizer(f"c{base}{group}")[0](x)
        assert got.shape == x.shape and got.dtype == np.float32
        for at in range(0, 13, group):  # the groups as float64 runs of rows, per channel
            blk = x[at : at + group].astype(np.float64)
            assert np.all(np.abs(got[at : at + group] - blk) <= bound_of(blk, axis=0))
        # a group's scales see its own rows only
        y = x.copy()
        y[min(group, 12) :] *= 7
        if group < 13:
            assert np.array_equal(kv8.quantizer(f"c{base}{group}")[0](y)[:group], got[:group])


def test_per_channel_beats_per_vector_on_channel_scales():
    # KIVI's case: rows of one size, channels of very different scales and offsets
    rng = np.random.default_rng(3)
    scale = np.exp(rng.uniform(-2, 3, 64))
    x = (rng.standard_normal((64, 2, 64)) * scale + rng.standard_normal(64) * 5).astype(np.float32)
    small = scale < np.median(scale)  # the channels a per-vector step is too coarse for
    pc, pv = kv8.quantizer("cint8a")[0](x), kv8.int8_asym(x)
    assert np.linalg.norm((pc - x)[..., small]) < np.linalg.norm((pv - x)[..., small]) / 10
    assert np.linalg.norm(pc - x) < np.linalg.norm(pv - x)


@pytest.mark.parametrize("seed", range(3))
def test_centered_codes_the_rows_less_the_first_page_mean(seed):
    x = _rows(seed, 80, 64)
    mu = x[:64].astype(np.float64).mean(0).astype(np.float32)
    got = kv8.quantizer("zint8a")[0](x)
    assert np.allclose(got, kv8.int8_asym((x - mu).astype(np.float32)) + mu.astype(np.float64), rtol=0, atol=1e-6)
    assert np.all(np.abs(got - x) <= _int8a_bound(x - mu) + 1e-5 * np.abs(x).max())
    # keys: softmax ignores the shift (every score of a query moves by q . mu)
    q = np.random.default_rng(seed).standard_normal(64)
    s1, s2 = x[:, 0] @ q, (x[:, 0] - mu[0]) @ q
    p1, p2 = np.exp(s1 - s1.max()), np.exp(s2 - s2.max())
    assert np.allclose(p1 / p1.sum(), p2 / p2.sum(), rtol=1e-9, atol=1e-12)
    # centred then rotated: rint8a of x - mu, plus mu
    zr = kv8.quantizer("zrint8a", seed, 1)[0](x)
    assert np.allclose(zr, kv8.quantizer("rint8a", seed, 1)[0]((x - mu).astype(np.float32)) + mu, rtol=0, atol=1e-6)


def test_new_candidates_seeds_bits_and_zero_rows():
    assert kv8.seeded("rint8a") and kv8.seeded("zrint8a:int8a") and kv8.seeded("f16:oint8")
    assert not kv8.seeded("cint8a:int8a") and not kv8.seeded("zint8a") and not kv8.seeded("int8a")
    x = _rows(0, 13, 64)
    assert not np.array_equal(kv8.quantizer("rint8a", 0)[0](x), kv8.quantizer("rint8a", 1)[0](x))
    assert np.array_equal(kv8.quantizer("cint8a", 0)[0](x), kv8.quantizer("cint8a", 1)[0](x))
    assert kv8.bits_per_element("rint8", 64) == 8.25 and kv8.bits_per_element("rint8a", 128) == 8.25
    assert kv8.bits_per_element("oint8a", 64) == 8.5 and kv8.bits_per_element("zrint8a", 64) == 8.5
    assert kv8.bits_per_element("cint8a", 128) == 8.5 and kv8.bits_per_element("cint8", 64) == 8.25
    assert kv8.bits_per_element("cint8a16", 64) == 10 and kv8.bits_per_element("cint8a:int8a", 64) == 8.5
    z = np.zeros((13, 2, 64), np.float32)
    for name in ("rint8", "rint8a", "oint8", "oint8a", "cint8", "cint8a", "cint8a5", "zint8a", "zrint8a"):
        assert np.array_equal(kv8.quantizer(name, 3, 1)[0](z), z), name
