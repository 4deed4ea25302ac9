"""TurboQuant sessions over a real socket: outputs within the error band of exact
attention, bit-identical for identical seeds and inputs, different for another seed."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from tools import reference as ref
from svc_helpers import Api, Model, rows

# 2-bit values and 3-bit keys on random Gaussian data: the relative (Frobenius) error
# of the output and its correlation with exact attention. Over seeds 0..1999 for each
# shape (tools/seed_sweeps.py turboquant-band: the session emulated by the oracle of
# its codes): the workload's error 0.349..0.412 (std <= 0.010), correlation at least
# 0.912; the peaked attend's (one query row: the widest spread) error 0.244..0.479
# (mean 0.333, std 0.030 at head_dim 32: 0.6 is 8.9 of them above the mean),
# correlation at least 0.883 (mean 0.943, std 0.011).
MAX_REL = 0.6
MIN_CORR = 0.8


def band(out: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    out, exact = np.asarray(out, np.float64), np.asarray(exact, np.float64)
    rel = float(np.linalg.norm(out - exact) / np.linalg.norm(exact))
    corr = float(np.corrcoef(out.ravel(), exact.ravel())[0, 1])
    return rel, corr


def _workload(api: Api, sid: str, rng: np.random.Generator, h: int, hkv: int, d: int, enc: str = "msgpack"):
    """Prefill 60 rows on each of 2 layers, then 12 fused decode steps; every output."""
    m = Model(h, hkv, d, 2)
    outs = []
    for layer in range(2):
        q, k, v = rows(rng, 60, h, d), rows(rng, 60, hkv, d), rows(rng, 60, hkv, d)
        r = api.attend(sid, layer, q, k=k, v=v, offset=0, enc=enc)
        assert r.status == 200, r.body
        m.add(layer, k, v)
        outs.append((r.body["out"], m.attention(layer, q)))
    for step in range(12):
        layer = step % 2
        q, k, v = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
        r = api.attend(sid, layer, q, k=k, v=v, offset=m.lengths[layer], enc=enc)
        assert r.status == 200 and r.body["length"] == m.lengths[layer] + 1
        m.add(layer, k, v)
        outs.append((r.body["out"], m.attention(layer, q)))
    return outs, m


@pytest.mark.parametrize("h, hkv, d", [(8, 2, 32), (4, 4, 64), (8, 1, 128)])
def test_turboquant_within_the_band_of_exact_attention(api, rng, enc, h, hkv, d):
    sid = api.create(
        num_qo_heads=h,
        num_kv_heads=hkv,
        head_dim=d,
        num_layers=2,
        kv_format="turboquant",
        seed=int(rng.integers(2**53)),
    )["session_id"]
    (rel, corr), (peak_rel, peak_corr), outs, m = bands(api, sid, rng, h, hkv, d, enc)
    assert rel < MAX_REL and corr > MIN_CORR, (rel, corr)
    for o, w in outs:
        assert np.isfinite(o).all() and o.shape == w.shape
    info = api.info(sid)
    assert info["lengths"] == m.lengths and info["kv_format"] == "turboquant"
    # peaked attention (one key far more similar than the rest) is recovered closely
    assert peak_rel < MAX_REL and peak_corr > MIN_CORR, (peak_rel, peak_corr)
    api.delete(sid)


def bands(api: Any, sid: str, rng: np.random.Generator, h: int, hkv: int, d: int, enc: str = "msgpack"):
    """The test's measurement: (rel, corr) of the workload's outputs, and of a peaked
    attend (a query 4 times a stored key); the outputs, and the model. ``api`` is only
    asked to attend (``tools/seed_sweeps.py turboquant-band`` emulates it)."""
    outs, m = _workload(api, sid, rng, h, hkv, d, enc)
    got = np.concatenate([o.reshape(-1) for o, _ in outs])
    want = np.concatenate([w.reshape(-1) for _, w in outs])
    q = np.repeat(m.k[0][17:18], h // hkv, axis=1) * 4.0
    r = api.attend(sid, 0, q, causal=False, enc=enc)
    exact = ref.attention(q, m.k[0], m.v[0], causal=False)
    return band(got, want), band(r.body["out"], exact), outs, m


def test_identical_seeds_and_inputs_give_identical_bits(api, server):
    h, hkv, d = 8, 2, 64
    results = []
    for seed in (1234, 1234, 99):
        sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2, kv_format="turboquant", seed=seed)[
            "session_id"
        ]
        outs, _ = _workload(api, sid, np.random.default_rng(5), h, hkv, d)
        results.append([o for o, _ in outs])
        info = api.info(sid)
        api.delete(sid)
        assert info["seed"] == seed
    same, other = results[1], results[2]
    for a, b in zip(results[0], same):
        assert a.tobytes() == b.tobytes()
    assert any(a.tobytes() != c.tobytes() for a, c in zip(results[0], other))


def test_turboquant_refuses_rows_whose_norm_float16_cannot_hold(server):
    """Norms are stored as float16: a row over 65504 is a 422 (nothing appended),
    one just under it is stored and answers finite values. A snapshot carrying a
    non-finite norm is refused too."""
    import attnserve_client as ac
    from attnserve_client import wire

    rng = np.random.default_rng(3)
    hkv, d = 2, 32
    with ac.Client(server.url, max_retries=0) as c:
        s = c.create_session(num_qo_heads=4, num_kv_heads=hkv, head_dim=d, kv_format="turboquant")
        try:
            k = rng.standard_normal((3, hkv, d)).astype(np.float32)
            v = rng.standard_normal((3, hkv, d)).astype(np.float32)
            big = k.copy()
            big[1, 0] *= 7e4 / np.linalg.norm(big[1, 0])
            for kk, vv, name in ((big, v, "k[1, 0]"), (k, big, "v[1, 0]")):
                with pytest.raises(ac.InvalidRequest, match=re.escape(name)):
                    s.append(0, kk, vv)
                with pytest.raises(ac.InvalidRequest):
                    s.attend(0, rng.standard_normal((1, 4, d)), k=kk[:2], v=vv[:2])
            assert s.info().lengths == (0,)
            ok = k.copy()
            ok[1, 0] *= 6e4 / np.linalg.norm(ok[1, 0])
            assert s.append(0, ok, v) == 3
            out = s.attend(0, rng.standard_normal((2, 4, d)))
            assert np.isfinite(out).all()
            # a snapshot whose norm word says NaN is refused and creates nothing
            import httpx

            blob = wire.unpackb(
                httpx.get(f"{server.url}/v1/sessions/{s.session_id}/snapshot").content, max_bytes=1 << 26
            )
            layer = blob["layers"][0]
            vecs = hkv * layer["capacity"]
            kb = bytearray(layer["k"])
            off = 4 * (vecs * (d // 16 + d // 32))  # first norm word: head 0, timestep 0
            kb[off : off + 2] = np.array([np.nan], np.float16).tobytes()
            layer["k"] = bytes(kb)
            from attnserve.snapshot_format import digest

            blob["checksum"] = digest(blob["format"], blob["version"], blob["config"], blob["layers"])
            r = httpx.put(
                f"{server.url}/v1/sessions/nan-norms/snapshot",
                content=wire.packb(blob),
                headers={"content-type": wire.MSGPACK},
            )
            assert r.status_code == 422 and r.json()["type"] == "/problems/invalid-snapshot", r.text
            assert "norm" in r.json()["detail"]
            assert httpx.get(f"{server.url}/v1/sessions/nan-norms").status_code == 404
        finally:
            s.delete()


@pytest.mark.parametrize("fmt, name", [("tq2o", "k"), ("tq4o", "v")])
def test_outlier_formats_refuse_rows_whose_outliers_float16_cannot_hold(server, fmt, name):
    """An outlier format stores its outliers as float16: a row whose outlier bound
    (turboquant.outlier_bound) is over 65504 is a 422 naming the row and head (append
    and fused attend; nothing appended), though its norm is under 65504; the same row
    scaled to just under the bound is stored and answers finite values."""
    import attnserve_client as ac
    from attnserve.formats import TQ_SPECS
    from attnserve.turboquant import MAX_NORM, MAX_OUTLIER, outlier_bound

    spec = TQ_SPECS[fmt]
    n, bits = (spec.key_outliers, spec.key_bits) if name == "k" else (spec.value_outliers, spec.value_bits)
    rng = np.random.default_rng(4)
    hkv, d = 2, 32
    big = np.zeros(d)
    big[0], big[1:n], big[n:] = 40000.0, 5000.0, 20000.0 / np.sqrt(d - n)  # one channel, the rest of norm 20000
    assert np.linalg.norm(big) < MAX_NORM and outlier_bound(big[None, None], n, bits)[0, 0] > MAX_OUTLIER
    with ac.Client(server.url, max_retries=0) as c:
        s = c.create_session(num_qo_heads=4, num_kv_heads=hkv, head_dim=d, kv_format=fmt)
        try:
            k = rng.standard_normal((3, hkv, d)).astype(np.float32)
            v = rng.standard_normal((3, hkv, d)).astype(np.float32)
            kk, vv = k.copy(), v.copy()
            (kk if name == "k" else vv)[1, 0] = big
            with pytest.raises(ac.InvalidRequest, match=re.escape(f"{name}[1, 0]: {fmt} keeps its {n} largest")):
                s.append(0, kk, vv)
            with pytest.raises(ac.InvalidRequest, match=re.escape(f"{name}[1, 0]")):
                s.attend(0, rng.standard_normal((1, 4, d)), k=kk[:2], v=vv[:2])
            assert s.info().lengths == (0,)
            ok = big * (0.999 * MAX_OUTLIER / outlier_bound(big[None, None], n, bits)[0, 0])
            (kk if name == "k" else vv)[1, 0] = ok
            assert s.append(0, kk, vv) == 3
            out = s.attend(0, rng.standard_normal((2, 4, d)))
            assert np.isfinite(out).all()
        finally:
            s.delete()
