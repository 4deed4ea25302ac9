"""The f16 kv format: the packed cache is numpy's float16 rounding of the rows,
bit for bit, page by page; values past float16's range are refused before
anything is queued. (Its attention against the float64 oracle runs with the other
formats in test_core_attention.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.errors import InvalidRequest
from attnserve.step.rules import kv_rows_problem

from _core import read_words, reserve, rows, session

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("hkv, d", [(3, 6), (2, 128), (1, 2), (5, 34)])
def test_packed_cache_is_numpys_float16_bit_for_bit(engine, rng, hkv, d):
    s = session(engine, "f16", hkv * 2, hkv, d, layers=2)
    layer = s.layers[1]
    reserve(engine, layer, 70)  # capacity past the length: the rows after it stay zero
    parts = [rows(rng, n, hkv, d, scale=s) for n, s in ((1, 1.0), (16, 300.0), (40, 1e-6))]
    for k in parts:  # page-crossing appends; a tiny scale: float16 subnormals
        engine.append(layer, k, -k).result()
    k = np.concatenate(parts)
    length, cap = len(k), layer.capacity
    assert cap > length
    kw, vw = read_words(engine, layer)
    want = np.zeros((cap, hkv, d), np.float16)
    want[:length] = k.astype(np.float16)
    assert kw.tobytes() == want.tobytes()
    want[:length] = (-k).astype(np.float16)
    assert vw.tobytes() == want.tobytes()
    assert layer.nbytes == layer.pool.pages_for(cap) * layer.pool.page_tokens * hkv * d * 2 * 2


def test_values_past_float16_range_are_refused(engine, rng):
    s = session(engine, "f16", 2, 1, 8)
    k = rows(rng, 3, 1, 8)
    v = k.copy()
    v[2, 0, 5] = -70000.0
    problem = kv_rows_problem(engine.max_binding, s.config, k, v, "f16")
    assert isinstance(problem, InvalidRequest) and problem.detail.startswith("v[2, 0, 5]: -70000 is past 65504")
    v[2, 0, 5] = -65504.0  # the largest float16 is taken
    assert kv_rows_problem(engine.max_binding, s.config, k, v, "f16") is None
    assert s.layers[0].length == 0


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_split_attends_read_half_slabs_in_pieces_where_head_dim_allows(engine, rng, fmt, monkeypatch):
    """A split attend over a half-precision slab takes the wide kernel (16-byte pieces,
    ``kernels.wide_split``) at head_dim % 8 == 0 and the vec4 one otherwise (f32:
    always the vec4 one), both within the float64 oracle's tolerance over the rows as
    stored: decode rows and a causal block, at lengths across pages and splits, with
    short splits (many per attend) and the longest."""
    import dataclasses

    from attnserve.gpu.batch import Batch
    from attnserve.gpu.kernels import wide_split
    from tools import reference as ref

    from _core import rel_err, stored

    seen: list[str] = []
    dispatch = Batch.dispatch

    def spy(self, kernel, *args, **kw):
        seen.append(kernel)
        return dispatch(self, kernel, *args, **kw)

    monkeypatch.setattr(Batch, "dispatch", spy)
    saved = engine.policy
    worst = 0.0
    try:
        for target in (saved.target_workgroups, 1):
            engine.policy = dataclasses.replace(saved, force="split", target_workgroups=target)
            for d, (hkv, g), length, n in (
                (8, (2, 2), 50, 1), (36, (1, 4), 301, 1), (36, (2, 1), 97, 3),
                (40, (2, 2), 130, 1), (72, (1, 8), 77, 2), (128, (2, 4), 600, 1),
            ):  # fmt: skip
                seen.clear()
                s = session(engine, fmt, hkv * g, hkv, d, seed=int(rng.integers(2**53)))
                k, v = rows(rng, length, hkv, d, scale=2.0), rows(rng, length, hkv, d)
                engine.append(s.layers[0], k, v).result()
                q = rows(rng, n, hkv * g, d)
                out = engine.attend(s.layers[0], q, start_pos=length - n).result().out
                want = ref.attention(q, stored(fmt, k), stored(fmt, v), start_pos=length - n, causal=True)
                err = rel_err(out, want)
                worst = max(worst, err)
                assert err <= 1e-5, (fmt, d, length, n, target, err)
                wide = fmt != "f32" and d % 8 == 0
                assert wide_split(fmt, d) == wide
                kernel = f"attention_split_wide.{fmt}" if wide else f"attention_split.{fmt}"
                splits = {x for x in seen if x.startswith("attention_split")}
                assert splits == {kernel}, (fmt, d, seen)
    finally:
        engine.policy = saved
    print(f"worst {fmt} relative error through the split kernels", worst)
