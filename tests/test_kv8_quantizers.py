"""The 8-bit kv candidates of bench/probes/kv8_fidelity.py (issue 54, item 2): the OCP
FP8 E4M3FN encoder checked exhaustively (every code's value from the spec's table, a
sweep of float32s against a brute-force nearest-code search with ties to even), and
the int8 / scaled e4m3 round trips' error bounds."""

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
