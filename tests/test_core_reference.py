"""The float64 oracles themselves, checked against first principles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tools import reference as ref
from attnserve.turboquant import codebook, layer_signs


def naive_attention(q, k, v, start_pos, causal, scale):
    n, h, d = q.shape
    length, hkv, _ = k.shape
    out = np.zeros((n, h, d))
    for i in range(n):
        for hh in range(h):
            kv = hh // (h // hkv)
            end = start_pos + i + 1 if causal else length
            s = np.array([q[i, hh] @ k[t, kv] for t in range(end)]) * scale
            p = np.exp(s - s.max())
            out[i, hh] = (p[:, None] * v[:end, kv]).sum(0) / p.sum()
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_attention_oracle_matches_loops(rng, causal):
    q = rng.standard_normal((3, 4, 8))
    k = rng.standard_normal((11, 2, 8))
    v = rng.standard_normal((11, 2, 8))
    got = ref.attention(q, k, v, start_pos=5, causal=causal, scale=0.3)
    want = naive_attention(q, k, v, 5, causal, 0.3)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_attention_default_start_pos_is_length_minus_n(rng):
    q, k, v = rng.standard_normal((2, 2, 4)), rng.standard_normal((6, 1, 4)), rng.standard_normal((6, 1, 4))
    np.testing.assert_array_equal(ref.attention(q, k, v), ref.attention(q, k, v, start_pos=4, scale=0.5))


@pytest.mark.parametrize("d", [32, 64, 128])
def test_rht_is_orthonormal_and_inverts(rng, d):
    s = np.where(rng.random(d) < 0.5, -1.0, 1.0)
    x = rng.standard_normal((5, d))
    y = ref.rht(x, s)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(ref.rht_inv(y, s), x, atol=1e-12)
    h = ref.hadamard(d)
    np.testing.assert_array_equal(h @ h.T, d * np.eye(d))


def test_f16_bits_round_to_nearest_even():
    assert ref.f16_bits(np.array([1.0]))[0] == 0x3C00
    # 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties go to even (1.0)
    assert ref.f16_bits(np.array([1.0 + 2.0**-11]))[0] == 0x3C00
    assert ref.f16_bits(np.array([1.0 + 3 * 2.0**-11]))[0] == 0x3C02
    np.testing.assert_array_equal(ref.f16_value(ref.f16_bits(np.array([0.5, 2.0]))), [0.5, 2.0])


@pytest.mark.parametrize("d", [32, 64, 128])
def test_pack_unpack_round_trip(rng, d):
    ps, js = layer_signs(7, 0, d)
    cb = codebook(d)
    k = rng.standard_normal((9, 3, d))
    k[4, 1] = 0.0  # a zero vector
    enc = ref.encode_keys(k, ps, js, cb)
    words = ref.pack_key_cache(enc, cap=13)
    idx, bits, norm, rn = ref.unpack_key_cache(words, n_kv_heads=3, cap=13, d=d, length=9)
    np.testing.assert_array_equal(idx, np.where(enc.live[..., None], enc.idx, 0))
    np.testing.assert_array_equal(bits, enc.bits)
    np.testing.assert_allclose(norm, enc.norm, rtol=1e-3)
    np.testing.assert_allclose(rn, enc.residual_norm, rtol=1e-3)
    assert norm[4, 1] == 0 and not bits[4, 1].any() and not idx[4, 1].any()
    vw = ref.pack_value_cache(ref.encode_values(k, ps, cb), cap=13)
    vidx, vnorm = ref.unpack_value_cache(vw, n_kv_heads=3, cap=13, d=d, length=9)
    np.testing.assert_array_equal(vidx, idx)
    np.testing.assert_allclose(vnorm, norm, rtol=0)


def test_encode_follows_the_definition(rng):
    d = 64
    ps, js = layer_signs(3, 2, d)
    cb = codebook(d)
    k = rng.standard_normal(d) * 3
    enc = ref.encode_keys(k[None], ps, js, cb)
    norm = np.linalg.norm(k)
    y = ref.hadamard(d) @ (ps * k / norm) / math.sqrt(d)
    b = np.array(cb.boundaries)
    idx = np.array([(yy >= b).sum() for yy in y])
    r = y - np.array(cb.centroids)[idx]
    z = ref.hadamard(d) @ (js * r / np.linalg.norm(r))
    np.testing.assert_allclose(enc.norm[0], norm)
    np.testing.assert_array_equal(enc.idx[0], idx)
    np.testing.assert_allclose(enc.residual_norm[0], np.linalg.norm(r))
    np.testing.assert_array_equal(enc.bits[0], (z >= 0).astype(np.uint32))


def test_tq_attention_with_exact_codes_is_exact_attention_limit(rng):
    # With the quantizer's reconstruction, the oracle is softmax over estimated
    # scores: check it against attention over the *reconstructed* keys/values
    # when the QJL term is dropped (polar_only) by comparing the scores.
    d, hkv, h, L = 32, 2, 4, 10
    ps, js = layer_signs(11, 0, d)
    cb = codebook(d)
    k = rng.standard_normal((L, hkv, d))
    enc = ref.encode_keys(k, ps, js, cb)
    q = rng.standard_normal((2, h, d))
    q_rot, q_jl, _ = ref.rotate_q(q, ps, js)
    polar = ref.tq_scores(q_rot, q_jl, enc.idx, enc.bits, enc.norm, enc.residual_norm, cb, polar_only=True)
    k_hat = ref.rht_inv(np.array(cb.centroids)[enc.idx], ps) * enc.norm[..., None]  # [L, hkv, d]
    want = np.einsum("nhd,lhd->hnl", q, np.repeat(k_hat, h // hkv, axis=1))
    np.testing.assert_allclose(polar, want, rtol=1e-10, atol=1e-10)


def test_the_oracles_are_not_in_the_product():
    """The oracles live in the repository's tools/, not in the server's package:
    importing every module of attnserve loads none of them, and the package holds
    no oracle."""
    import subprocess
    import sys

    code = (
        "import importlib, pathlib, sys, attnserve\n"
        "root = pathlib.Path(attnserve.__file__).parent\n"
        "for path in sorted(root.rglob('*.py')):\n"
        "    parts = path.relative_to(root).with_suffix('').parts\n"
        "    if parts[0] in ('__main__', 'loadtest'):\n"
        "        continue\n"
        "    importlib.import_module('.'.join(('attnserve',) + parts).removesuffix('.__init__'))\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('tools', 'attnserve.testing')))\n"
        "assert 'attnserve.app' in sys.modules and not bad, bad\n"
        "assert not list(root.glob('testing/*.py'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
