"""GPU attention (every format) against float64 oracles at awkward sizes.

f32, f16 and bf16: max abs error <= 1e-5 of the max abs value of the oracle over the
rows as the format stores them (f16: rounded to float16; bf16: to bfloat16).
TurboQuant: against its own oracle computed from the GPU's packed cache
(same signs, same codebook) to <= 1e-4 of the max abs value.
The log-sum-exp every attend answers beside its output (``lse``) to the same
bounds, per value over max(1, |lse|) (``_core.lse_err``).
Every case uses capacity > length (the cache is preallocated past it), and
many cases are queued together so they also exercise coalesced batches.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tools import reference as ref
from attnserve.formats import TQ_SPECS
from attnserve.turboquant import layer_signs

from _core import filled, lse_err, read_words, rel_err, reserve, rows, session, stored

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_path")]

LENGTHS = (1, 7, 54, 97, 300, 600)
GQA = (1, 2, 4, 8)
# the split kernels take any group (a workgroup per query head where it is not 1, 2,
# 4 or 8: SmolLM2's 3, and 6); the tiled ones only those four (others: single)
ANY_GQA = (1, 2, 3, 4, 6, 8)
F32_TOL = 1e-5
TQ_TOL = 1e-4


def _case_queries(length, n_max=3):
    """(n, start_pos) pairs: decode-like, prefill-like, and start_pos > 0 inside."""
    n = min(n_max, length)
    cases = [(n, length - n)]
    if length > 4:
        cases.append((2, length // 3))  # start_pos > 0, queries in the middle
    return cases


def _run_cases(engine, fmt, head_dims, rng):
    pending = []
    for length, ratio, d in itertools.product(LENGTHS, ANY_GQA, head_dims):
        hkv = {1: 3, 2: 2, 3: 3, 4: 2, 6: 2, 8: 1}[ratio]  # 3 heads: odd head counts (partials not a whole vec4)
        h = hkv * ratio
        s = session(engine, fmt, h, hkv, d, layers=2, max_tokens=2048, seed=int(rng.integers(2**53)))
        layer = s.layers[1]  # layer 1: sign_off != 0 for TurboQuant
        reserve(engine, layer, length + 37)  # capacity > length
        k, v = rows(rng, length, hkv, d), rows(rng, length, hkv, d)
        engine.append(layer, k, v)
        for (n, sp), causal in itertools.product(_case_queries(length), (True, False)):
            q = rows(rng, n, h, d)
            scale = 1.0 / np.sqrt(d) if causal else 0.7 / np.sqrt(d)
            fut = engine.attend(layer, q, start_pos=sp, causal=causal, scale=scale)
            pending.append((s, layer, q, k, v, sp, causal, scale, fut, (length, ratio, d)))
    return pending


@pytest.mark.parametrize("head_dims", [(32,), (64,), (128,), (80,), (6,)], ids=lambda x: f"d{x[0]}")
@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_plain_attention_matches_oracle(engine, rng, fmt, head_dims):
    worst = 0.0
    for s, layer, q, k, v, sp, causal, scale, fut, case in _run_cases(engine, fmt, head_dims, rng):
        res = fut.result()
        out, length = res
        assert layer.capacity > length
        want, want_lse = ref.attention(
            q, stored(fmt, k), stored(fmt, v), start_pos=sp, causal=causal, scale=scale, return_lse=True
        )
        err = rel_err(out, want)
        worst = max(worst, err)
        assert err <= F32_TOL, (case, sp, causal, err)
        assert lse_err(res.lse, want_lse) <= F32_TOL, (case, sp, causal, lse_err(res.lse, want_lse))
    print(f"worst {fmt} relative error", worst)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_turboquant_attention_matches_its_oracle(engine, rng, d):
    worst = 0.0
    for s, layer, q, k, v, sp, causal, scale, fut, case in _run_cases(engine, "turboquant", (d,), rng):
        res = fut.result()
        out, length = res
        kw, vw = read_words(engine, layer)
        ps, js = layer_signs(s.config.seed, layer.layer, d)
        want, want_lse = ref.tqx_attention(
            q,
            kw,
            vw,
            TQ_SPECS["turboquant"],
            n_kv_heads=layer.n_kv_heads,
            cap=layer.capacity,
            length=length,
            polar_signs=ps,
            jl_signs=js,
            start_pos=sp,
            causal=causal,
            scale=scale,
            return_lse=True,
        )
        err = rel_err(out, want)
        worst = max(worst, err)
        assert err <= TQ_TOL, (case, sp, causal, err)
        assert lse_err(res.lse, want_lse) <= TQ_TOL, (case, sp, causal, lse_err(res.lse, want_lse))
    print("worst turboquant relative error vs own oracle", worst)


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "turboquant"])
def test_chunked_prefill_equals_one_call(engine, rng, fmt, kernel_path):
    """Bit for bit on the single-pass and tiled kernels (each query row's
    arithmetic does not depend on the batch: tiles sit at fixed timesteps, and a
    tile past a row's window adds exact zeros); the split kernels size their
    splits by context and row count, so chunks sum in another order: equal to
    float rounding."""
    h, hkv, d, L = 8, 2, 64, 301
    q, k, v = rows(rng, L, h, d), rows(rng, L, hkv, d), rows(rng, L, hkv, d)
    one = session(engine, fmt, h, hkv, d, seed=77)
    whole, _ = engine.attend(one.layers[0], q, k=k, v=v).result()
    many = session(engine, fmt, h, hkv, d, seed=77)
    parts, start = [], 0
    for size in (1, 63, 64, 100, 73):  # chunks that cross growth boundaries
        out, length = engine.attend(
            many.layers[0], q[start : start + size], k=k[start : start + size], v=v[start : start + size]
        ).result()
        assert length == start + size
        parts.append(np.array(out))
        start += size
    assert start == L
    if not kernel_path.startswith("split"):
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    else:
        assert rel_err(np.concatenate(parts), whole) <= 2e-6
    if fmt != "turboquant":
        assert rel_err(whole, ref.attention(q, stored(fmt, k), stored(fmt, v))) <= F32_TOL


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "turboquant", "tq4"])
def test_growth_past_capacity_equals_preallocation(engine, rng, fmt):
    """A layer that took its pages 50 rows at a time (the pool's slab growing under
    it) answers bit for bit like one whose pages were all taken up front."""
    h, hkv, d = 4, 4, 32
    L = 700
    k, v = rows(rng, L, hkv, d), rows(rng, L, hkv, d)
    q = rows(rng, 5, h, d)
    grown = session(engine, fmt, h, hkv, d, seed=5)
    caps = []
    for i in range(0, L, 50):
        engine.append(grown.layers[0], k[i : i + 50], v[i : i + 50]).result()
        caps.append(grown.layers[0].capacity)
    assert len(set(caps)) >= 3, caps  # it really took pages several times
    big = session(engine, fmt, h, hkv, d, seed=5)
    reserve(engine, big.layers[0], 2048)
    engine.append(big.layers[0], k, v).result()
    assert big.layers[0].capacity == 2048 != grown.layers[0].capacity
    for causal in (True, False):
        a, _ = engine.attend(grown.layers[0], q, start_pos=400, causal=causal).result()
        b, _ = engine.attend(big.layers[0], q, start_pos=400, causal=causal).result()
        np.testing.assert_array_equal(a, b)
    if fmt in ("turboquant", "tq4"):  # same words per slot, in a differently strided layout
        ga, gb = read_words(engine, grown.layers[0]), read_words(engine, big.layers[0])
        for words_g, words_b, regions in zip(
            ga, gb, (grown.layers[0].pool.layout.key_regions, grown.layers[0].pool.layout.value_regions)
        ):
            og = ob = 0
            for w in regions:
                cg, cb_ = grown.layers[0].capacity, 2048
                rg = words_g[og : og + hkv * cg * w].reshape(hkv, cg, w)[:, :L]
                rb = words_b[ob : ob + hkv * cb_ * w].reshape(hkv, cb_, w)[:, :L]
                np.testing.assert_array_equal(rg, rb)
                og += hkv * cg * w
                ob += hkv * cb_ * w


def test_an_attend_queued_before_an_append_does_not_see_it(engine, rng):
    """Ordering inside one coalesced batch: appends are recorded in the stream."""
    h, hkv, d = 2, 1, 32
    s = session(engine, "f32", h, hkv, d)
    k, v = rows(rng, 20, hkv, d), rows(rng, 20, hkv, d)
    engine.append(s.layers[0], k[:10], v[:10]).result()
    q = rows(rng, 1, h, d)
    f1 = engine.attend(s.layers[0], q, start_pos=9, causal=False)
    f2 = engine.append(s.layers[0], k[10:], v[10:])
    f3 = engine.attend(s.layers[0], q, start_pos=19, causal=False)
    out1, len1 = f1.result()
    assert f2.result() == 20
    out3, len3 = f3.result()
    assert (len1, len3) == (10, 20)
    assert rel_err(out1, ref.attention(q, k[:10], v[:10], start_pos=9, causal=False)) <= F32_TOL
    assert rel_err(out3, ref.attention(q, k, v, start_pos=19, causal=False)) <= F32_TOL


def test_batches_coalesce_many_jobs(engine, rng):
    h, hkv, d = 4, 2, 32
    sessions = [session(engine, "f32", h, hkv, d) for _ in range(12)]
    datas = []
    before = engine.worker.batches
    futs = []
    for s in sessions:
        k, v, q = rows(rng, 9, hkv, d), rows(rng, 9, hkv, d), rows(rng, 2, h, d)
        datas.append((q, k, v))
        futs.append(engine.attend(s.layers[0], q, k=k, v=v))
    for (q, k, v), f in zip(datas, futs):
        out, _ = f.result()
        assert rel_err(out, ref.attention(q, k, v)) <= F32_TOL
    assert engine.worker.batches - before < len(sessions)  # some jobs shared a submit


def test_failed_plan_fails_only_its_job(engine, rng):
    h, hkv, d = 2, 1, 32
    s = session(engine, "f32", h, hkv, d, max_tokens=10)
    k, v = rows(rng, 8, hkv, d), rows(rng, 8, hkv, d)
    ok = engine.append(s.layers[0], k, v)
    bad = engine.append(s.layers[0], k, v)  # passes max_tokens at plan time
    q = rows(rng, 1, h, d)
    after = engine.attend(s.layers[0], q)
    assert ok.result() == 8
    with pytest.raises(Exception, match="max_tokens"):
        bad.result()
    out, length = after.result()
    assert length == 8
    assert rel_err(out, ref.attention(q, k, v)) <= F32_TOL


def test_a_failed_fused_attend_leaves_the_layer_as_it_was(engine, rng):
    h, hkv, d = 4, 2, 32
    s, layer, k, v = filled(engine, rng, "f32", h, hkv, d, 60)
    before = layer.state()
    q = rows(rng, 1, h, d)
    # the fused append (which would also grow the buffers past 64) plans, then
    # the attend's start_pos check fails: nothing of the job may remain
    bad = engine.attend(layer, q, k=rows(rng, 10, hkv, d), v=rows(rng, 10, hkv, d), start_pos=1000)
    with pytest.raises(ValueError, match="start_pos"):
        bad.result()
    assert layer.state() == before and layer.length == 60
    out, length = engine.attend(layer, q).result()
    assert length == 60
    assert rel_err(out, ref.attention(q, k, v)) <= F32_TOL


def _filled_sessions(engine, rng, h, hkv, d, n=6):
    """``n`` one-layer f32 sessions holding 40 random rows each, and their rows."""
    sessions = [session(engine, "f32", h, hkv, d) for _ in range(n)]
    data = []
    for s in sessions:
        k, v = rows(rng, 40, hkv, d), rows(rng, 40, hkv, d)
        engine.append(s.layers[0], k, v).result()
        data.append((k, v))
    return sessions, data


def _fused_attends(engine, rng, sessions, h, hkv, d):
    """A fused attend of 30 query rows (and 2 appended rows) per session, queued
    together; their queries and (out, length) results."""
    qs = [rows(rng, 30, h, d) for _ in sessions]
    futs = [engine.attend(s.layers[0], q, k=rows(rng, 2, hkv, d), v=rows(rng, 2, hkv, d)) for s, q in zip(sessions, qs)]
    return qs, [f.result() for f in futs]


def _check_fused(engine, sessions, data, qs, outs, hkv, d):
    """Each session holds its 40 rows and 2 more, and its fused attend's output is
    right against the oracle; returns each session's 42 rows (k, v) as read back."""
    held = []
    for s, (k, v), q, (out, length) in zip(sessions, data, qs, outs):
        assert length == 42 == s.layers[0].length
        kw, vw = engine.call(lambda ctx, l=s.layers[0]: l.read_words(ctx.device)).result()
        kall = np.frombuffer(kw, np.float32).reshape(-1, hkv, d)[:42]
        vall = np.frombuffer(vw, np.float32).reshape(-1, hkv, d)[:42]
        np.testing.assert_array_equal(kall[:40], k)
        assert rel_err(out, ref.attention(q, kall, vall)) <= F32_TOL
        held.append((kall, vall))
    return held


def test_a_batch_stays_within_the_binding_limit(engine, rng):
    """Jobs that would push an arena past the binding limit wait for the next
    submission (a job alone may still use it all); results stay exact."""
    h, hkv, d = 8, 2, 64
    limits = engine.ctx.limits
    saved = limits["max-storage-buffer-binding-size"]
    sessions, data = _filled_sessions(engine, rng, h, hkv, d)
    try:
        limits["max-storage-buffer-binding-size"] = 40 * h * d * 4  # ~2 jobs' queries
        before = engine.worker.batches
        qs, outs = _fused_attends(engine, rng, sessions, h, hkv, d)
    finally:
        limits["max-storage-buffer-binding-size"] = saved
    assert engine.worker.batches - before >= 3
    _check_fused(engine, sessions, data, qs, outs, hkv, d)


def test_a_batch_stays_within_the_arena_budget_and_a_larger_job_lets_its_arenas_go(engine, rng):
    """batch_arena_bytes: jobs that would push an arena past the budget wait for the
    next submission, so the arenas stay at the budget however many jobs are queued;
    a job larger than the budget runs alone in arenas made for it, let go before the
    next batch. Results stay exact."""
    h, hkv, d = 8, 2, 64
    arenas = engine.worker.arenas
    saved = arenas.budget
    sessions, data = _filled_sessions(engine, rng, h, hkv, d)
    budget = 160 * 1024  # one job (its split partials: 124 KiB), not two
    try:
        engine.call(lambda ctx: arenas.trim()).result()  # the fixture's earlier batches may have grown them
        arenas.budget = budget
        engine.call(lambda ctx: arenas.trim()).result()
        before = engine.worker.batches
        qs, outs = _fused_attends(engine, rng, sessions, h, hkv, d)
        assert engine.worker.batches - before >= 3
        assert all(b.size <= budget for b in arenas.buffers.values()), (
            str(sorted((a, b.size) for a, b in arenas.buffers.items())) + f" budget {budget}"
        )
        budget = arenas.budget = 1 << 16  # the smallest arena: a 1-row attend needs no more
        big = rows(rng, 42, h, d)  # alone past the budget: arenas of its own size
        out_big, _ = engine.attend(sessions[0].layers[0], big).result()
        assert max(b.size for b in arenas.buffers.values()) > budget
        small, _ = engine.attend(sessions[1].layers[0], qs[1][:1]).result()  # the next batch lets them go
        assert all(b.size <= budget for b in arenas.buffers.values())
        assert all(b is None or b.size <= 2 * budget for b in arenas.staging)
    finally:
        arenas.budget = saved
    held = _check_fused(engine, sessions, data, qs, outs, hkv, d)
    assert rel_err(out_big, ref.attention(big, *held[0])) <= F32_TOL
    assert rel_err(small, ref.attention(qs[1][:1], *held[1])) <= F32_TOL


@pytest.mark.parametrize("kernel_path", ["tiled", "tiled-rb", "tiled-rb-generic", "single"], indirect=True)
@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "turboquant"])
def test_many_query_rows_at_awkward_sizes(engine, rng, fmt, kernel_path):
    """Prefill-sized attends (the tiled kernels' blocks of 64 rows = 64 / G query
    positions x G heads): a last block partly past the queries, key tiles (32)
    partly past a row's causal window and past the length, start_pos > 0, G = 8
    with 8 positions per block, head_dim 80 (a partial 32-dim chunk), causal
    and non-causal, capacity > length, peaked and flat softmax. (The split
    kernels serve up to 16 query rows and are covered above.)"""
    dims = (32, 64, 128) if fmt == "turboquant" else (80, 128)
    pending = []
    for d, ratio, (n, sp) in itertools.product(dims, GQA, ((131, 45), (70, 0), (9, 300))):
        hkv = 2 if ratio < 8 else 1
        h = hkv * ratio
        s = session(engine, fmt, h, hkv, d, layers=2, seed=int(rng.integers(2**53)))
        layer = s.layers[1]
        length = sp + n
        reserve(engine, layer, length + 37)
        k, v = rows(rng, length, hkv, d), rows(rng, length, hkv, d)
        engine.append(layer, k, v)
        for causal, qscale in ((True, 1.0), (False, 1.0), (True, 4.0)):
            q = rows(rng, n, h, d, scale=qscale)
            scale = 1.0 / np.sqrt(d) if causal else 0.7 / np.sqrt(d)
            fut = engine.attend(layer, q, start_pos=sp, causal=causal, scale=scale)
            pending.append((s, layer, q, k, v, sp, causal, scale, fut, (d, ratio, n, sp, qscale)))
    for s, layer, q, k, v, sp, causal, scale, fut, case in pending:
        res = fut.result()
        out, length = res
        assert layer.capacity > length
        if fmt != "turboquant":
            want, want_lse = ref.attention(
                q, stored(fmt, k), stored(fmt, v), start_pos=sp, causal=causal, scale=scale, return_lse=True
            )
            tol = F32_TOL
        else:
            kw, vw = read_words(engine, layer)
            ps, js = layer_signs(s.config.seed, layer.layer, case[0])
            want, want_lse = ref.tqx_attention(
                q,
                kw,
                vw,
                TQ_SPECS["turboquant"],
                n_kv_heads=layer.n_kv_heads,
                cap=layer.capacity,
                length=length,
                polar_signs=ps,
                jl_signs=js,
                start_pos=sp,
                causal=causal,
                scale=scale,
                return_lse=True,
            )
            tol = TQ_TOL
        err = rel_err(out, want)
        assert err <= tol, (case, causal, err)
        assert lse_err(res.lse, want_lse) <= tol, (case, causal, lse_err(res.lse, want_lse))


def test_a_stacked_step_past_the_binding_limit_fails_its_tail_cleanly(engine, rng):
    """A stacked step is one job: the items that would push an arena past the binding
    limit (after the first) are refused with a problem that says so, from there on,
    and change nothing; the items before stay exact."""
    from attnserve.errors import InvalidRequest

    h, hkv, d = 8, 2, 64
    limits = engine.ctx.limits
    saved = limits["max-storage-buffer-binding-size"]
    sessions = [session(engine, "f32", h, hkv, d) for _ in range(6)]
    for s in sessions:
        engine.append(s.layers[0], rows(rng, 40, hkv, d), rows(rng, 40, hkv, d)).result()
    q = np.stack([rows(rng, 30, h, d) for _ in sessions])
    k, v = np.stack([rows(rng, 2, hkv, d) for _ in sessions]), np.stack([rows(rng, 2, hkv, d) for _ in sessions])
    layers = [s.layers[0] for s in sessions]
    try:
        limits["max-storage-buffer-binding-size"] = 40 * h * d * 4  # ~2 items' queries
        plan = engine.plan_stacked(layers, q, k=k, v=v, start_pos=[None] * 6)
        got = engine.worker.submit_plan(plan).result()
    finally:
        limits["max-storage-buffer-binding-size"] = saved
    done = [i for i in range(6) if i not in got.errors]
    assert done == list(range(len(done))) and 1 <= len(done) < 6, got.errors
    for i in range(len(done), 6):
        assert isinstance(got.errors[i], InvalidRequest) and "binding limit" in str(got.errors[i])
        assert layers[i].length == 40 and got.lengths[i] == -1 and not got.out[i].any()
    for i in done:
        assert layers[i].length == 42 == got.lengths[i]
        kw, vw = engine.call(lambda ctx, l=layers[i]: l.read_words(ctx.device)).result()
        kall = np.frombuffer(kw, np.float32).reshape(-1, hkv, d)[:42]
        vall = np.frombuffer(vw, np.float32).reshape(-1, hkv, d)[:42]
        assert rel_err(got.out[i], ref.attention(q[i], kall, vall)) <= F32_TOL
