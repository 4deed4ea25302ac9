"""The GPU's dtype conversions (shaders/convert.wgsl through kernels.plan_upload_as
and kernels.plan_answer) bit for bit against numpy: every float16 and bfloat16 value
widened, and float32 values narrowed (ties, the subnormal range, overflow, zeros and
random bits over every exponent), at awkward item counts and sizes."""

from __future__ import annotations

import numpy as np
import pytest

from _core import bf16_nearest
from attnserve.gpu.batch import Seg
from attnserve.gpu.kernels import plan_answer, plan_uploads_as
from attnserve_client import wire

pytestmark = pytest.mark.gpu

F16, BF16, F32 = np.dtype("<f2"), wire.BFLOAT16, np.dtype("<f4")


def _widened(engine, data: np.ndarray, dtype: str) -> np.ndarray:
    """``data [count, ...]`` converted into the input arena as ``dtype`` on the GPU,
    read back through a copy into the output arena."""

    def plan(batch):
        (items,) = plan_uploads_as(batch, [(data, dtype)])
        out = batch.output(items.stride * items.count)
        batch.copy(Seg("in", items.base, items.stride * items.count), 0, out, 0, items.stride * items.count)

        def finish(mv):
            return items.view(mv[out.offset :], dtype, data.shape[1:], start=0).copy()

        return finish

    return engine.worker.submit_plan(plan).result()


def _narrowed(engine, values: np.ndarray, dtype: np.dtype, lse: bool = False):
    """float32 ``values [count, n, H, d + 1]`` laid out as attend output items (out,
    then the log-sum-exp of n * H rows) converted by plan_answer."""
    count, n, h, d1 = values.shape
    d = d1 - 1
    per = n * h * d
    flat = np.concatenate([values[..., :d].reshape(count, per), values[..., d].reshape(count, n * h)], axis=1)

    def plan(batch):
        src = batch.upload_items(np.ascontiguousarray(flat))
        outs = batch.output_items(count, flat[0].nbytes, read=False)
        batch.copy(Seg("in", src.base, src.stride * count), 0, Seg("out", outs.base, outs.stride * count), 0,
                   src.stride * count)  # fmt: skip
        out_seg, lse_seg = plan_answer(batch, outs, (n, h, d), dtype, lse)

        def finish(mv):
            at = batch.answer_at
            got = np.frombuffer(mv, dtype, count * per, at + out_seg.offset).reshape(count, n, h, d).copy()
            got_lse = None
            if lse_seg is not None:
                got_lse = np.frombuffer(mv, "<f4", count * n * h, at + lse_seg.offset).reshape(count, n, h).copy()
            return got, got_lse

        return finish

    return engine.worker.submit_plan(plan).result()


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view("<u2" if a.dtype.itemsize == 2 else "<u4")


def test_every_half_value_widens_exactly(engine):
    every = np.arange(1 << 16, dtype=np.uint32).astype("<u2")
    for dtype in (F16, BF16):
        halves = every.view(dtype).reshape(4, 16384)  # four items
        got = _widened(engine, halves, "<f4")
        want = wire.to_float32(halves)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(_bits(got)[~nan], _bits(want)[~nan]), dtype


@pytest.mark.parametrize("count,shape", [(1, (3,)), (3, (5, 1, 3)), (2, (7, 2, 4)), (5, (1, 1, 1))])
def test_odd_sized_items_widen_into_their_own_segments(engine, rng, count, shape):
    for dtype in (F16, BF16):
        x = rng.standard_normal((count, *shape)).astype(np.float32)
        halves = x.astype(F16) if dtype == F16 else bf16_nearest(x)
        got = _widened(engine, halves, "<f4")
        assert np.array_equal(_bits(got), _bits(wire.to_float32(halves)))
    # float16 rows for a float16 layer: even items (whole words) from bfloat16
    x = rng.standard_normal((3, 4, 2, 6)).astype(np.float32)
    b = bf16_nearest(x)
    got = _widened(engine, b, "<f2")
    assert np.array_equal(_bits(got), _bits(wire.to_float32(b).astype(F16)))


def _awkward_f32(rng) -> np.ndarray:
    """float32 values where rounding is hard: ties and near-ties of both half
    formats, the float16 subnormal range and its underflow, both overflows, zeros,
    and random bit patterns over every exponent."""
    f16_max, f16_tiny = 65504.0, 2.0**-24
    special = [0.0, -0.0, 1.0, -1.0, f16_max, 65519.996, 65520.0, -65520.0, 1e30, -1e38, 3.4e38,
               f16_tiny, f16_tiny / 2, f16_tiny * 0.5000001, f16_tiny * 1.5, f16_tiny * 2.5, 2.0**-25 * 0.999,
               2.0**-14, 2.0**-14 * (1 - 2.0**-11), 6.1e-5, 1e-40, -1e-45]  # fmt: skip
    special = np.array(special, np.float32)
    # exact ties: a half value plus half its spacing (float16: 13 dropped bits; bfloat16: 16)
    base = rng.integers(0x00800000, 0x7F000000, 2000, dtype=np.uint32)
    ties16 = ((base & ~np.uint32(0x1FFF)) | 0x1000).view(np.float32)
    ties_bf = ((base & ~np.uint32(0xFFFF)) | 0x8000).view(np.float32)
    near = ((base & ~np.uint32(0xFFFF)) | 0x7FFF).view(np.float32)
    random = rng.integers(0, 1 << 32, 6000, dtype=np.uint64).astype(np.uint32)
    random = random[(random & 0x7F800000) != 0x7F800000].view(np.float32)  # finite bits
    small = (rng.standard_normal(3000) * 1e-5).astype(np.float32)  # float16 subnormals
    return np.concatenate([special, ties16, -ties16, ties_bf, near, random, small])


def test_float32_narrows_to_nearest_even_like_numpy(engine, rng):
    x = _awkward_f32(rng)
    n = x.size // 6 * 6
    vals = x[:n].reshape(3, 2, 1, n // 6)  # three items of (n=2, H=1, d=n/6 - 1) and a log-sum-exp
    for dtype, oracle in ((F16, lambda a: a.astype(F16)), (BF16, bf16_nearest)):
        with np.errstate(over="ignore"):
            got, got_lse = _narrowed(engine, vals, dtype, lse=True)
            want = oracle(np.ascontiguousarray(vals[..., :-1]))
        assert np.array_equal(_bits(got), _bits(want)), dtype
        assert np.array_equal(got_lse, vals[..., -1])  # the log-sum-exp as it was, float32


def test_bf16_oracle_agrees_with_the_float64_definition():
    """The test oracle itself, on values whose bfloat16 is known."""
    cases = {1.0: 0x3F80, 1.00390625: 0x3F80, 1.01171875: 0x3F82, 1.0117188: 0x3F82, -2.0: 0xC000,
             3.3895314e38: 0x7F7F, 3.4e38: 0x7F80, 1e-40: 0x0001}  # fmt: skip
    got = bf16_nearest(np.array(list(cases), np.float32)).view("<u2")
    assert [hex(g) for g in got] == [hex(v) for v in cases.values()]


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "turboquant", "tq4v3"])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_layer_fed_half_arrays_answers_as_fed_their_float32_values(engine, rng, fmt, dtype):
    """Twin layers, one fed half arrays (converted on the GPU), one the same values
    as float32: every output bit-identical (float32 asked), and the half answer the
    float32 one rounded."""
    from attnserve.kv.config import SessionConfig

    cfg = SessionConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=64, kv_format=fmt,
                        max_tokens=512, seed=3)  # fmt: skip
    fed_half, fed_f32 = engine.session_kv(cfg), engine.session_kv(cfg)
    for n, m in [(5, 70), (1, 1), (3, 2)]:  # past a page border
        x = [rng.standard_normal(s).astype(np.float32) for s in ((n, 4, 64), (m, 2, 64), (m, 2, 64))]
        q, k, v = (a.astype(F16) if dtype == F16 else bf16_nearest(a) for a in x)
        a = engine.attend(fed_half.layers[0], q, k=k, v=v, out_dtype=F32).result()
        b = engine.attend(fed_f32.layers[0], *(wire.to_float32(t) for t in (q,)), k=wire.to_float32(k),
                          v=wire.to_float32(v)).result()  # fmt: skip
        assert a[1] == b[1] and a[0].tobytes() == b[0].tobytes()
        c = engine.attend(fed_half.layers[0], q).result()  # the answer in q's dtype
        want = b[0].astype(F16) if dtype == F16 else bf16_nearest(b[0])
        assert c[0].dtype == dtype and c[0].tobytes() == want.tobytes()
