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
