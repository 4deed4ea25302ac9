"""A 200-step fused decode loop over a real socket: every step equals the float64 oracle."""

from __future__ import annotations

import pytest

from svc_helpers import F32_TOL, PAGE, Model, rel_err, rows

STEPS = 200


@pytest.mark.parametrize("h, hkv, d, layers", [(8, 2, 64, 2), (4, 4, 128, 1)])
def test_fused_decode_loop_equals_the_oracle_at_every_step(api, rng, enc, h, hkv, d, layers):
    sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=layers, max_tokens=STEPS + 16)[
        "session_id"
    ]
    m = Model(h, hkv, d, layers)
    # prefill: one fused call per layer with 16 rows of q, k and v
    for layer in range(layers):
        q, k, v = rows(rng, 16, h, d), rows(rng, 16, hkv, d), rows(rng, 16, hkv, d)
        r = api.attend(sid, layer, q, k=k, v=v, offset=0, enc=enc)
        m.add(layer, k, v)
        assert r.status == 200 and rel_err(r.body["out"], m.attention(layer, q)) <= F32_TOL
    worst = 0.0
    for step in range(STEPS):
        for layer in range(layers):
            q, k, v = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
            r = api.attend(sid, layer, q, k=k, v=v, offset=m.lengths[layer], enc=enc)
            assert r.status == 200, (step, layer, r.body)
            m.add(layer, k, v)
            assert r.body["length"] == m.lengths[layer] == 17 + step
            err = rel_err(r.body["out"], m.attention(layer, q))
            assert err <= F32_TOL, (step, layer, err)
            worst = max(worst, err)
    info = api.info(sid)
    assert info["lengths"] == [16 + STEPS] * layers
    pages = -(-(16 + STEPS) // PAGE)  # whole pages of the pool, never a copy to grow
    assert info["bytes"] == layers * 2 * pages * PAGE * hkv * d * 4
    print(f"worst relative error over {STEPS} steps: {worst:.2e}")
    api.delete(sid)
