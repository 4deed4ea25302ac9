"""``attnserve_client.merge`` against the float64 oracle: attention over disjoint
sets of keys merged equals attention over their union (numpy and torch), a part
that saw no key weighs nothing, and mismatched parts are refused. (Against live
servers: tests/service/test_lse.py, tests/client/test_sharded.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch  # installed by the test command

from tools import reference as ref
from attnserve_client import Attention, merge, wire


def _split_oracle(rng, cuts, n=5, h=6, hkv=2, d=16, scale=0.4):
    """q over keys [0, L) split at ``cuts``: each part's float32 (out, lse) from the
    oracle (as a server answers it), and the oracle of the whole."""
    length = cuts[-1]
    q = rng.standard_normal((n, h, d))
    k, v = rng.standard_normal((length, hkv, d)), rng.standard_normal((length, hkv, d))
    parts = []
    for lo, hi in zip((0, *cuts[:-1]), cuts):
        out, lse = ref.attention(q, k[lo:hi], v[lo:hi], causal=False, scale=scale, return_lse=True)
        parts.append(Attention(out.astype(np.float32), lse.astype(np.float32)))
    return parts, ref.attention(q, k, v, causal=False, scale=scale, return_lse=True)


@pytest.mark.parametrize("cuts", [(7,), (3, 40), (1, 2, 50, 51), (10, 11, 12, 300)])
def test_merged_parts_are_attention_over_the_union(rng, cuts):
    parts, (want, want_lse) = _split_oracle(rng, cuts)
    got = merge(parts)
    assert got.out.dtype == np.float32 and got.lse.dtype == np.float32
    # each part carries float32 rounding (~6e-8 relative); the merge adds float64 work only
    np.testing.assert_allclose(got.out, want, atol=2e-6, rtol=0)
    np.testing.assert_allclose(got.lse, want_lse, atol=2e-6, rtol=1e-6)
    # the order of the parts does not matter
    np.testing.assert_allclose(merge(parts[::-1]).out, got.out, atol=1e-7, rtol=0)


def test_half_parts_merge_as_their_float32_values(rng):
    """Attends of float16 or bfloat16 queries answer out in that dtype: merged as
    the values they hold (bfloat16 as numpy holds it, wire.BFLOAT16)."""
    parts, _ = _split_oracle(rng, (6, 19))
    for narrow in (lambda a: a.astype(np.float16), wire.to_bfloat16):
        half = [Attention(narrow(out), lse) for out, lse in parts]
        widened = [Attention(wire.to_float32(out), lse) for out, lse in half]
        got, want = merge(half), merge(widened)
        assert got.out.dtype == np.float32 and got.out.tobytes() == want.out.tobytes()
        assert got.lse.tobytes() == want.lse.tobytes()


def test_a_part_with_no_key_weighs_nothing(rng):
    parts, (want, want_lse) = _split_oracle(rng, (5, 20))
    empty = Attention(np.zeros_like(parts[0].out), np.full_like(parts[0].lse, -np.inf))
    got = merge([parts[0], empty, parts[1]])
    np.testing.assert_allclose(got.out, want, atol=2e-6, rtol=0)
    nothing = merge([empty, empty])
    assert not nothing.out.any() and np.isneginf(nothing.lse).all()
    # a row that saw keys in one part only, none in the other (a causal border)
    lse = parts[0].lse.copy()
    lse[0] = -np.inf
    half = merge([Attention(parts[0].out, lse), parts[1]])
    np.testing.assert_array_equal(half.out[0], parts[1].out[0])
    assert np.isfinite(half.lse).all()


def test_large_scores_do_not_overflow(rng):
    """lse far past float32's exp range (huge scores): the merge stays finite."""
    parts, (want, want_lse) = _split_oracle(rng, (9, 30), scale=60.0)
    assert np.abs(want_lse).max() > 100.0  # exp of it would overflow float32
    got = merge(parts)
    assert np.isfinite(got.out).all()
    # each part's lse carries float32 rounding, half an ulp: eps/2 x |lse| absolute,
    # which moves the weights by up to eps x |lse| relative; the output, a convex
    # combination of the parts', by that times the spread of their values
    eps = float(np.finfo(np.float32).eps)
    tol = 2e-6 + eps * np.abs(want_lse).max() * 2 * np.abs(want).max()
    np.testing.assert_allclose(got.out, want, atol=tol, rtol=0)


def test_mismatched_parts_are_refused(rng):
    parts, _ = _split_oracle(rng, (4, 8))
    with pytest.raises(ValueError, match="at least one"):
        merge([])
    with pytest.raises(ValueError, match="shape"):
        merge([parts[0], Attention(parts[1].out[:2], parts[1].lse[:2])])
    with pytest.raises(ValueError, match="shape"):
        merge([parts[0], Attention(parts[1].out, parts[1].lse[..., :1])])


def _merge64(parts):
    """The merge in float64 of parts given exactly as they are (the oracle of a merge
    whose inputs were rounded to a narrower dtype)."""
    outs = np.stack([np.asarray(o, np.float64) for o, _ in parts])
    lses = np.stack([np.asarray(s, np.float64) for _, s in parts])
    w = np.exp(lses - lses.max(axis=0))
    return (w[..., None] * outs).sum(axis=0) / w.sum(axis=0)[..., None], lses.max(axis=0) + np.log(w.sum(axis=0))


def test_torch_parts_merge_on_their_device_in_their_dtype(rng):
    parts, (want, _) = _split_oracle(rng, (6, 33))
    for dtype in (torch.float32, torch.float64, torch.float16):
        tparts = [Attention(torch.from_numpy(o).to(dtype), torch.from_numpy(s).to(dtype)) for o, s in parts]
        got = merge(tparts)
        assert isinstance(got.out, torch.Tensor) and got.out.dtype == dtype and got.lse.dtype == dtype
        # the oracle merges the parts as the dtype holds them; the merge works in float32
        # (float64 for float64) and rounds its answer to the dtype: within the dtype's eps
        # relative (half an ulp of rounding, with margin; a merge done in float16 misses it)
        given = [(o.double().numpy(), s.double().numpy()) for o, s in tparts]
        want_out, want_lse = _merge64(given)
        eps = float(torch.finfo(dtype).eps)
        np.testing.assert_allclose(got.out.double().numpy(), want_out, atol=1e-6, rtol=max(eps, 2e-7))
        np.testing.assert_allclose(got.lse.double().numpy(), want_lse, atol=1e-6, rtol=max(eps, 2e-7))
        if dtype != torch.float16:  # float32 parts as the server sends them: the union's oracle
            np.testing.assert_allclose(got.out.double().numpy(), want, atol=2e-6, rtol=0)
