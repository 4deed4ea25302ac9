"""The decode-native 4-bit (and 3-bit) kv candidates of bench/probes/kv4_fidelity.py
(issue 54, item 3): uniform codes with a float16 scale and offset per vector or group,
checked against float64 oracles: codes in range and each the nearest level (a
brute-force search over every level), every element within half a step of its level,
the float16 offset and scale the tightest that cover the group, the decode one
multiply-add per element; TurboQuant's rotation orthogonal to 1e-12 and equal to the
explicit H diag(s) / sqrt(d); awkward sizes (13 rows, d 72, groups that do not divide
d) handled or refused with a clear error; seeds swept."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kv4_fidelity", ROOT / "bench" / "probes" / "kv4_fidelity.py")
kv4 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv4)

SEEDS = range(6)


def rows(seed: int, n: int = 13, heads: int = 3, d: int = 64) -> np.ndarray:
    """K/V-like float32 rows: Gaussian, a few large channels, an offset, scales spread
    over four decades."""
    rng = np.random.default_rng([seed, n, heads, d])
    x = rng.standard_normal((n, heads, d))
    x[..., rng.integers(0, d, 3)] *= 12.0
    x += rng.standard_normal(d) * 2.0
    x *= 10.0 ** rng.uniform(-2, 2, (n, heads, 1))
    return x.astype(np.float32)


def group_index(d: int, group: int) -> np.ndarray:
    return np.arange(d) // (group or d)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize(("d", "group"), [(64, 0), (64, 32), (64, 16), (72, 0), (72, 32), (72, 16), (72, 7), (5, 2)])
def test_codes_nearest_level_within_half_step(seed, bits, d, group):
    x = rows(seed, d=d)
    codes, scale, offset = kv4.encode(x, bits, group)
    top = (1 << bits) - 1
    ng = -(-d // (group or d))
    assert codes.dtype == np.uint8 and codes.shape == x.shape and codes.max() <= top
    assert scale.dtype == np.float16 and offset.dtype == np.float16 and scale.shape == (*x.shape[:-1], ng)
    at = group_index(d, group)
    s, o = scale.astype(np.float64)[..., at], offset.astype(np.float64)[..., at]
    x64 = x.astype(np.float64)
    # float64 oracle: every level of the element's group, the nearest one
    levels = o[..., None] + s[..., None] * np.arange(top + 1)
    dist = np.abs(levels - x64[..., None])
    chosen = np.take_along_axis(dist, codes[..., None].astype(np.int64), -1)[..., 0]
    assert np.all(chosen <= dist.min(-1) + 1e-12 * np.abs(x64).max())
    # within half a step, exactly (the offset rounded down and the scale up: no clamping)
    assert np.all(np.abs(o + s * codes - x64) <= s / 2 * (1 + 1e-12) + 1e-300)
    # the float32 decode (one FMA per element) adds only float32 rounding
    got = kv4.decode(codes, scale, offset, group)
    assert got.dtype == np.float32
    assert np.all(np.abs(got - x64) <= s / 2 + 4 * np.finfo(np.float32).eps * (np.abs(x64) + np.abs(o) + 1e-30))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("d", "group"), [(64, 0), (64, 32), (72, 32), (72, 5)])
def test_scale_and_offset_are_the_tightest_float16(seed, d, group):
    bits, x = 4, rows(seed, d=d).astype(np.float64)
    codes, scale, offset = kv4.encode(x, bits, group)
    ng = scale.shape[-1]
    for g in range(ng):
        xs = x[..., g * (group or d) : (g + 1) * (group or d)]
        lo, hi = xs.min(-1), xs.max(-1)
        o = offset[..., g].astype(np.float64)
        assert np.all(o <= lo)
        assert np.all(np.nextafter(offset[..., g], np.float16(np.inf)).astype(np.float64) > lo)
        s = scale[..., g].astype(np.float64)
        assert np.all(s * 15 >= hi - o)
        tighter = np.nextafter(scale[..., g], np.float16(-np.inf)).astype(np.float64)
        assert np.all((tighter * 15 < hi - o) | (s == 0))


def test_decode_is_one_fma_per_element_by_group():
    codes = np.array([[0, 15, 3, 7, 1]], np.uint8)
    scale = np.array([[0.5, 2.0, 0.25]], np.float16)
    offset = np.array([[-1.0, 3.0, 10.0]], np.float16)
    want = [0 * 0.5 - 1, 15 * 0.5 - 1, 3 * 2 + 3, 7 * 2 + 3, 1 * 0.25 + 10]  # groups of 2: (0,1), (2,3), (4)
    assert np.array_equal(kv4.decode(codes, scale, offset, 2)[0], np.array(want, np.float32))
    with pytest.raises(ValueError, match="scales for d"):
        kv4.decode(codes, scale, offset, 3)  # 2 groups of 3, not 3 scales


def test_constant_and_zero_rows():
    x = np.zeros((2, 1, 64), np.float32)
    x[1] = 0.3
    codes, scale, offset = kv4.encode(x, 4, 32)
    assert np.all(codes[0] == 0) and np.all(scale[0] == 0) and np.all(kv4.decode(codes, scale, offset, 32)[0] == 0)
    # 0.3 is not a float16: the offset sits below it and the scale covers it
    assert np.all(np.abs(kv4.decode(codes, scale, offset, 32)[1] - 0.3) <= scale[1].astype(np.float32).max() / 2 + 1e-7)


def sylvester(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_rotation_orthogonal_and_the_projects(seed, d):
    layer = seed % 5
    rot, unrot = kv4.kv8.rotation("rht", seed, layer, d)
    eye = np.eye(d)
    r = rot(eye)  # row i: the rotation of e_i, so r = R.T
    assert np.abs(r @ r.T - eye).max() < 1e-12
    s = kv4.kv8.rht_signs(seed, layer, d)
    explicit = sylvester(d) * s / math.sqrt(d)  # R = H diag(s) / sqrt(d)
    assert np.abs(r - explicit.T).max() < 1e-12
    assert np.abs(unrot(rot(eye)) - eye).max() < 1e-12
    assert set(np.unique(s)) <= {-1.0, 1.0}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["r4", "r4g32", "r4g16", "r3", "r3g32", "r3g16"])
def test_rotated_round_trip_error_is_the_rotated_codes(seed, name):
    """The rotated candidate's error is the codes' error in the rotated space, rotated back
    (orthogonal: the same norm), so bounded by half a step per rotated element."""
    _, bits, group = kv4.parse(name)
    layer = seed % 3
    x = rows(seed)
    got = kv4.one(name, seed, layer)(x)
    rot, _ = kv4.kv8.rotation("rht", seed, layer, 64)
    y = rot(x).astype(np.float32)
    codes, scale, offset = kv4.encode(y, bits, group)
    half = scale.astype(np.float64)[..., group_index(64, group)] / 2
    err = np.linalg.norm(got - x.astype(np.float64), axis=-1)
    assert np.all(err <= np.linalg.norm(half, axis=-1) * (1 + 1e-6) + 1e-6 * np.linalg.norm(x, axis=-1))
    # and the rotated codes' decode, rotated back, is the candidate's output
    _, unrot = kv4.kv8.rotation("rht", seed, layer, 64)
    back = unrot(kv4.decode(codes, scale, offset, group).astype(np.float64))
    assert np.abs(back - got).max() < 1e-9 * np.abs(x).max()


def test_unrotated_and_split_candidates():
    x = rows(7)
    assert np.array_equal(kv4.one("u4g32")(x), kv4.decode(*kv4.encode(x, 4, 32), 32))
    fk, fv = kv4.quantizer("r4:u3g16", 1, 2)
    assert np.array_equal(fv(x), kv4.decode(*kv4.encode(x, 3, 16), 16))
    assert np.allclose(fk(x), kv4.one("r4", 1, 2)(x))
    assert kv4.seeded("r4:u3g16") and not kv4.seeded("u4g32") and kv4.seeded("tq4v3") and not kv4.seeded("f16")


def test_bits_per_element():
    b = kv4.bits_per_element
    assert b("r4", 64) == 4.5 and b("r4", 128) == 4.25
    assert b("r4g32", 64) == 5.0 and b("r4g16", 64) == 6.0 and b("r3g32", 128) == 4.0
    assert b("r4:r3g32", 64) == (4.5 + 4.0) / 2
    assert b("u4g32", 72) == 4 + 32 * 3 / 72  # groups of 32, 32 and 8


def test_awkward_sizes_refused_clearly():
    x72 = rows(0, d=72)
    with pytest.raises(ValueError, match="power-of-two"):
        kv4.one("r4g32")(x72)  # the Hadamard rotation needs d a power of two
    with pytest.raises(ValueError, match="larger than the row"):
        kv4.encode(x72, 4, 128)
    with pytest.raises(ValueError, match="positive"):
        kv4.encode(x72, 4, -1)
    with pytest.raises(ValueError, match="bits"):
        kv4.encode(x72, 9, 32)
    with pytest.raises(ValueError, match="float16"):
        kv4.encode(np.full((1, 1, 8), 1e6, np.float32), 4, 0)
    with pytest.raises(ValueError, match="not a uniform-code"):
        kv4.one("q4g32")
    assert kv4.parse("tq4v3") is None and kv4.parse("r4g") is None
    # unrotated codes take d 72 with groups that do not divide it
    got = kv4.one("u4g32")(x72)
    assert got.shape == x72.shape and np.isfinite(got).all()
