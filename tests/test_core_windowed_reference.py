"""The oracles of exact sinks and a recent window over a compressed cache (issue 27),
checked against first principles: the decoded rows give the compressed oracle's
attention, and the windowed attention is a per-row choice of rows under one softmax."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.formats import TQ_SPECS
from tools import reference as ref
from attnserve.turboquant import layer_signs


def packed(rng, fmt: str, length: int, hkv: int, d: int, cap: int, seed: int = 7):
    """Random rows encoded in ``fmt`` by the oracle and packed with ``cap`` slots."""
    spec = TQ_SPECS[fmt]
    ps, js = layer_signs(seed, 2, d)
    k = rng.standard_normal((length, hkv, d)) * (1.0 + 3.0 * (rng.random((length, hkv, 1)) < 0.1))
    v = rng.standard_normal((length, hkv, d))
    ek, ev = ref.tqx_encode(k, v, spec, ps, js)
    kw, vw = ref.pack_tqx_key_cache(ek, cap, spec), ref.pack_tqx_value_cache(ev, cap, spec)
    return spec, k, v, kw, vw, ps, js


@pytest.mark.parametrize("fmt", sorted(TQ_SPECS))
@pytest.mark.parametrize("d", [32, 64])
def test_decoded_rows_give_the_compressed_oracle(rng, fmt, d):
    length, hkv, h, cap = 37, 3, 9, 48
    spec, _, _, kw, vw, ps, js = packed(rng, fmt, length, hkv, d, cap)
    q = rng.standard_normal((5, h, d))
    dims = dict(n_kv_heads=hkv, cap=cap, length=length, polar_signs=ps, jl_signs=js)
    k_hat, v_hat = ref.tqx_decoded_rows(kw, vw, spec, d=d, **dims)
    assert k_hat.shape == v_hat.shape == (length, hkv, d)
    for start_pos, causal in ((32, True), (3, True), (0, False)):
        want = ref.tqx_attention(q, kw, vw, spec, start_pos=start_pos, causal=causal, scale=0.21, **dims)
        got = ref.attention(q, k_hat, v_hat, start_pos=start_pos, causal=causal, scale=0.21)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


def naive_windowed(q, k, v, k_hat, v_hat, start_pos, sinks, exact_from, causal, scale):
    """Row by row and head by head: the keys and values each query row reads."""
    n, h, d = q.shape
    length, hkv, _ = k.shape
    out = np.zeros((n, h, d))
    for i in range(n):
        end = start_pos + i + 1 if causal else length
        exact = [t < sinks or t >= exact_from for t in range(end)]
        for hh in range(h):
            g = hh // (h // hkv)
            ks = np.array([k[t, g] if exact[t] else k_hat[t, g] for t in range(end)])
            vs = np.array([v[t, g] if exact[t] else v_hat[t, g] for t in range(end)])
            s = ks @ q[i, hh] * scale
            p = np.exp(s - s.max())
            out[i, hh] = p @ vs / p.sum()
    return out


@pytest.mark.parametrize(
    "sinks,exact_from,start_pos,causal",
    [(0, ref.NO_WINDOW, 14, True), (3, ref.NO_WINDOW, 14, True), (0, 10, 14, True), (2, 11, 14, True),
     (4, 4, 0, True), (30, 0, 14, True), (2, 12, 14, False), (5, 5, 9, True), (0, 19, 14, True)],
)  # fmt: skip
def test_windowed_attention_matches_rows_chosen_one_by_one(rng, sinks, exact_from, start_pos, causal):
    n, h, hkv, d, length = 5, 6, 2, 8, 19
    q = rng.standard_normal((n, h, d))
    k, v, k_hat, v_hat = (rng.standard_normal((length, hkv, d)) for _ in range(4))
    got = ref.windowed_attention(
        q, k, v, k_hat, v_hat, sinks=sinks, exact_from=exact_from, start_pos=start_pos, causal=causal, scale=0.4
    )
    want = naive_windowed(q, k, v, k_hat, v_hat, start_pos, sinks, exact_from, causal, 0.4)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_windowed_attention_limits(rng):
    n, h, hkv, d, length = 4, 4, 2, 16, 23
    q = rng.standard_normal((n, h, d))
    k, v, k_hat, v_hat = (rng.standard_normal((length, hkv, d)) for _ in range(4))
    none = ref.windowed_attention(q, k, v, k_hat, v_hat, sinks=0, exact_from=ref.NO_WINDOW)
    np.testing.assert_allclose(none, ref.attention(q, k_hat, v_hat), rtol=1e-12, atol=1e-12)
    every = ref.windowed_attention(q, k, v, k_hat, v_hat, sinks=0, exact_from=0)
    np.testing.assert_allclose(every, ref.attention(q, k, v), rtol=1e-12, atol=1e-12)
    every = ref.windowed_attention(q, k, v, k_hat, v_hat, sinks=length, exact_from=ref.NO_WINDOW)
    np.testing.assert_allclose(every, ref.attention(q, k, v), rtol=1e-12, atol=1e-12)
    assert not np.allclose(none, every, atol=1e-3)  # the two kinds of rows differ: the limits say something


def test_exact_from():
    # a decode step at 99 with a window of 8 reads 92..99 exactly; a chunk from 96 reads
    # 89.. (8 back from its first row) and all of its own rows
    assert ref.exact_from(99, 4, 8) == 92 and ref.exact_from(96, 4, 8) == 89
    assert ref.exact_from(5, 4, 8) == 4  # the window reaches into the sinks: from the sinks on
    assert ref.exact_from(99, 4, 8, held_from=95) == 95  # rows the layer no longer holds exactly: codes
    assert ref.exact_from(99, 4, 0) == ref.NO_WINDOW  # no window: only the sinks
