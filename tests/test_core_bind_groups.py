"""Bind groups are made once and reused (Arenas.bind_group): a decode loop reuses
them step after step, and reuse never changes a result, also across a layer's
growth (new buffers) and a released session whose buffers are gone."""

from __future__ import annotations

import numpy as np
import pytest

from tools import reference as ref

from _core import rel_err, rows, session

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", ["f32", "turboquant"])
def test_decode_loop_reuses_bind_groups_and_stays_exact(engine, rng, fmt):
    arenas = engine.worker.arenas
    h, hkv, d = 4, 2, 32
    kv = session(engine, fmt, h, hkv, d, max_tokens=4096)
    layer = kv.layers[0]
    k, v = rows(rng, 5, hkv, d), rows(rng, 5, hkv, d)
    engine.append(layer, k, v).result()
    q = rows(rng, 1, h, d)
    first = engine.attend(layer, q).result().out
    misses = arenas.bind_group_misses
    hits = arenas.bind_group_hits
    again = engine.attend(layer, q).result().out
    assert arenas.bind_group_misses == misses, "the same attend made new bind groups"
    assert arenas.bind_group_hits > hits
    assert again.tobytes() == first.tobytes()
    if fmt == "f32":
        assert rel_err(first, ref.attention(q, k, v, start_pos=4)) <= 1e-5
    # grow past the capacity many times (new buffers each time): still exact
    for n in (40, 200, 700):
        k2, v2 = rows(rng, n, hkv, d), rows(rng, n, hkv, d)
        k, v = np.concatenate([k, k2]), np.concatenate([v, v2])
        out = engine.attend(layer, q, k=k2, v=v2).result().out
        if fmt == "f32":
            assert rel_err(out, ref.attention(q, k, v, start_pos=len(k) - 1)) <= 1e-5
    # bit for bit what a session built in one append (its own new bind groups) gives
    fresh = session(engine, fmt, h, hkv, d, max_tokens=4096)
    engine.append(fresh.layers[0], k, v).result()
    assert engine.attend(fresh.layers[0], q).result().out.tobytes() == out.tobytes()
    engine.release(fresh).result()
    engine.release(kv).result()
    # a new session after the release: fresh buffers, right answers
    kv2 = session(engine, fmt, h, hkv, d, max_tokens=4096)
    k3, v3 = rows(rng, 9, hkv, d), rows(rng, 9, hkv, d)
    out = engine.attend(kv2.layers[0], q, k=k3, v=v3).result().out
    if fmt == "f32":
        assert rel_err(out, ref.attention(q, k3, v3, start_pos=8)) <= 1e-5
    engine.release(kv2).result()


def test_the_cache_is_bounded(engine, rng, monkeypatch):
    arenas = engine.worker.arenas
    monkeypatch.setattr(type(arenas), "BIND_GROUPS", 4)
    kv = session(engine, "f32", 2, 1, 8)
    engine.append(kv.layers[0], rows(rng, 3, 1, 8), rows(rng, 3, 1, 8)).result()
    for n in range(1, 4):  # different query row counts: different arena offsets
        engine.attend(kv.layers[0], rows(rng, n, 2, 8)).result()
    assert arenas.cached_bind_groups <= 4
    engine.release(kv).result()
