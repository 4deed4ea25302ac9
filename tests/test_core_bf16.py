"""The bf16 kv format: the packed cache is the rows' bfloat16, bit for bit, page by
page: a bfloat16 row kept as sent, a float32 (or float16) one rounded to nearest
even as ``wire.to_bfloat16`` rounds (checked against ``_core.bf16_nearest``, an
oracle independent of its integer formula), ties, subnormals and signed zeros
included; its attention, through every kernel family, within the f32 bound of the
float64 oracle over the stored rows at awkward head dims (40, 72). (It also runs
with the other plain formats in test_core_attention.py, test_core_paging.py and
test_core_columns.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.errors import InvalidRequest
from attnserve.formats import BF16_INF_FROM, bytes_per_token
from attnserve.step.rules import kv_rows_problem
from attnserve_client import wire
from tools import reference as ref

from _core import bf16_nearest, lse_err, read_words, rel_err, reserve, rows, session, stored

pytestmark = pytest.mark.gpu

# test_core_attention.py's bound for the plain formats. Measured spread of the attention
# test below (ATTNSERVE_TEST_SEED=0..24, every kernel path and both head dims, 300 runs,
# lavapipe): median 7.3e-7, worst 2.0e-6 (tiled-rb); the output's own rounding, not
# bfloat16's (the oracle holds the stored rows).
F32_TOL = 1e-5


def _awkward(rng, n: int, hkv: int, d: int) -> np.ndarray:
    """float32 rows with the values rounding must get right: exact ties to an even
    and to an odd bfloat16, one bit past a tie, float32 subnormals, signed zeros,
    bfloat16's largest finite value and values just under the point that rounds it up."""
    x = rows(rng, n, hkv, d)
    flat = x.reshape(-1).view("<u4")
    special = np.array(
        [
            0x3F808000,  # 1 + 2^-8: a tie, rounds down to the even 0x3F80
            0x3F818000,  # a tie above the odd 0x3F81: rounds up to 0x3F82
            0x3F808001,  # one bit past a tie: up
            0xBF807FFF,  # one bit under a tie (negative): down
            0x00000001,  # the smallest float32 subnormal: to zero
            0x00008000,  # a subnormal tie: to the even zero
            0x00018000,  # a subnormal tie above an odd: up to 0x0002
            0x80000000,  # -0
            0x7F7F0000,  # bfloat16's largest finite value
            0x7F7F7FFF,  # just under its rounding point: stays finite
            0x3F7FFFFF,  # 1 - 2^-24: carries into the exponent, 1.0
        ],
        np.uint32,
    )
    at = rng.choice(flat.size, size=len(special), replace=False)
    flat[at] = special
    return x


@pytest.mark.parametrize("hkv, d", [(3, 40), (2, 72), (1, 2), (5, 34), (2, 128)])
def test_packed_cache_is_the_rows_bfloat16_bit_for_bit(engine, rng, hkv, d):
    s = session(engine, "bf16", hkv * 2, hkv, d, layers=2)
    layer = s.layers[1]
    reserve(engine, layer, 90)  # capacity past the length: the rows after it stay zero
    sent = [
        _awkward(rng, 7, hkv, d),
        rows(rng, 17, hkv, d, scale=300.0),  # odd counts that cross page edges (16 a page)
        rows(rng, 23, hkv, d, scale=1e-39),  # float32 subnormals: bfloat16 subnormals
        _awkward(rng, 11, hkv, d),
        bf16_nearest(rows(rng, 9, hkv, d)),  # bfloat16 rows: kept as sent
        rows(rng, 3, hkv, d).astype(np.float16),  # float16 rows: rounded once, as float32 values
    ]
    for k in sent:
        engine.append(layer, k, k if k.dtype == wire.BFLOAT16 else -k).result()
    want_k = np.concatenate([wire.to_bfloat16(wire.to_float32(k)) for k in sent])
    # the independent oracle agrees with wire.to_bfloat16 on every row sent
    assert want_k.tobytes() == np.concatenate([bf16_nearest(wire.to_float32(k)) for k in sent]).tobytes()
    want_v = np.concatenate([k if k.dtype == wire.BFLOAT16 else bf16_nearest(-wire.to_float32(k)) for k in sent])
    length, cap = len(want_k), layer.capacity
    assert cap > length
    kw, vw = read_words(engine, layer)
    for got, want in ((kw, want_k), (vw, want_v)):
        full = np.zeros((cap, hkv, d), "<u2")
        full[:length] = want.view("<u2")
        assert got.tobytes() == full.tobytes()
    assert layer.nbytes == layer.pool.pages_for(cap) * layer.pool.page_tokens * hkv * d * 2 * 2
    assert bytes_per_token("bf16", hkv, d) * 2 == bytes_per_token("f32", hkv, d)


def test_a_float32_row_of_bfloat16_values_is_stored_as_its_bfloat16(engine, rng):
    """Twin layers fed the same values, one as bfloat16 and one as float32: the same
    words (the GPU's rounding of an exact value is the value)."""
    hkv, d = 2, 40
    a, b = (session(engine, "bf16", 4, hkv, d) for _ in range(2))
    k = bf16_nearest(rows(rng, 19, hkv, d))
    engine.append(a.layers[0], k, k).result()
    engine.append(b.layers[0], wire.to_float32(k), wire.to_float32(k)).result()
    for x, y in zip(read_words(engine, a.layers[0]), read_words(engine, b.layers[0])):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("d", [40, 72])
def test_attention_at_awkward_head_dims_matches_the_oracle(engine, rng, kernel_path, d):
    """Decode and prefill-sized attends (1, 3 and 37 query rows; G 1, 2 and 4) over
    odd lengths across page edges, causal and not, against the float64 oracle over the
    rows as stored; the log-sum-exp too."""
    worst = 0.0
    pending = []
    for hkv, g in ((2, 1), (1, 2), (2, 4)):
        for length, n, causal in ((1, 1, True), (33, 3, True), (97, 37, True), (70, 5, False)):
            s = session(engine, "bf16", hkv * g, hkv, d, seed=int(rng.integers(2**53)))
            k, v = rows(rng, length, hkv, d, scale=3.0), rows(rng, length, hkv, d)
            engine.append(s.layers[0], k, v).result()
            q = rows(rng, n, hkv * g, d)
            sp = length - n
            pending.append((q, k, v, sp, causal, engine.attend(s.layers[0], q, start_pos=sp, causal=causal)))
    for q, k, v, sp, causal, fut in pending:
        res = fut.result()
        want, want_lse = ref.attention(
            q, stored("bf16", k), stored("bf16", v), start_pos=sp, causal=causal, return_lse=True
        )
        err = rel_err(res.out, want)
        worst = max(worst, err)
        assert err <= F32_TOL, (q.shape, len(k), causal, err)
        assert lse_err(res.lse, want_lse) <= F32_TOL
    print(f"worst bf16 relative error ({kernel_path}, d {d})", worst)


def test_float32_values_that_round_to_infinity_are_refused(engine, rng):
    """A float32 value of magnitude 2^128 - 2^119 or more rounds to infinity in
    bfloat16 (the midpoint past the largest bfloat16 rounds up to the even
    infinity): refused naming it; the largest that rounds to a finite bfloat16 is
    taken, and stored as the largest bfloat16."""
    s = session(engine, "bf16", 2, 1, 8)
    k = rows(rng, 3, 1, 8)
    v = k.copy()
    below = np.nextafter(np.float32(BF16_INF_FROM), np.float32(0))
    assert wire.to_bfloat16(np.array([BF16_INF_FROM], np.float32)).view(np.uint16)[0] == 0x7F80  # inf
    assert wire.to_bfloat16(np.array([below], np.float32)).view(np.uint16)[0] == 0x7F7F  # the largest finite
    v[2, 0, 5] = -BF16_INF_FROM
    problem = kv_rows_problem(engine.max_binding, s.config, k, v, "bf16")
    assert isinstance(problem, InvalidRequest) and problem.detail.startswith("v[2, 0, 5]: -3.396")
    assert "rounds to infinity in bfloat16" in problem.detail
    v[2, 0, 5] = -below
    assert kv_rows_problem(engine.max_binding, s.config, k, v, "bf16") is None
    assert s.layers[0].length == 0
