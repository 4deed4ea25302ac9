"""The paged KV pool (pool.py, kv/layer.py): attention through page tables whose
pages are out of order in the pool, at every awkward boundary (lengths 1, P-1,
P, P+1, many pages), slabs that grow and layers that move, jobs rolled back, and
the bytes a layer holds."""

from __future__ import annotations

import os

import numpy as np
import pytest

from attnserve.engine import Engine
from attnserve.kv.config import SessionConfig
from tools import reference as ref
from attnserve.turboquant import codebook, layer_signs

from _core import CORE_PAGE_TOKENS as P, read_words, rel_err, rows, session, small_slab_engine, stored
from test_core_turboquant import check_key_words, check_value_words
from test_core_tqx import check_tqx_words
from test_core_page_tables import check_gpu_tables
from attnserve.formats import TQ_SPECS

pytestmark = pytest.mark.gpu

F32_TOL = 1e-5
TQ_TOL = 1e-4
BOUNDARIES = (1, P - 1, P, P + 1, 2 * P + 3)


def _oracle(fmt, engine, s, layer, q, k, v, length):
    """Attention of q's last row at ``length - 1`` over ``length`` rows: float64 oracle
    (f32), or the TurboQuant oracle on the words the GPU holds."""
    sp = length - q.shape[0]
    scale = 1.0 / np.sqrt(q.shape[2])
    if fmt == "f32":
        return ref.attention(q, k[:length], v[:length], start_pos=sp, causal=True, scale=scale)
    kw, vw = read_words(engine, layer)
    ps, js = layer_signs(s.config.seed, layer.layer, q.shape[2])
    return ref.tqx_attention(
        q, kw, vw, TQ_SPECS[fmt], n_kv_heads=layer.n_kv_heads, cap=layer.capacity, length=length,
        polar_signs=ps, jl_signs=js, start_pos=sp, causal=True, scale=scale,
    )  # fmt: skip


def _interleave(engine, rng, sessions, data, rounds, who):
    for _ in range(rounds):
        for i in who:
            s = sessions[i]
            n = int(rng.integers(1, 2 * P + 1))
            hkv, d = s.config.num_kv_heads, s.config.head_dim
            k, v = rows(rng, n, hkv, d), rows(rng, n, hkv, d)
            engine.append(s.layers[0], k, v).result()
            data[i][0].append(k)
            data[i][1].append(v)


@pytest.mark.parametrize("fmt", ["f32", "turboquant", "tq4"])
def test_attention_through_scrambled_pages_matches_the_oracle(engine, rng, fmt, kernel_path):
    h, hkv, d = 4, 2, 32
    sessions = [session(engine, fmt, h, hkv, d, seed=int(rng.integers(2**53))) for _ in range(3)]
    data = {i: ([], []) for i in range(3)}
    _interleave(engine, rng, sessions, data, 5, (0, 1, 2))  # the three take pages in turns
    engine.release(sessions[1]).result()  # its pages go back to the pool...
    _interleave(engine, rng, sessions, data, 4, (0, 2))  # ...and the others take them
    tables = [sessions[i].layers[0].pages for i in (0, 2)]
    # really out of order (one of the two: either alone can come out sorted by chance,
    # from the free pages the module's earlier tests left in the pool)
    assert any(pages != sorted(pages) for pages in tables), tables
    for i in (0, 2):
        s, layer = sessions[i], sessions[i].layers[0]
        k, v = (np.concatenate(x) for x in data[i])
        assert layer.length == len(k) and len(layer.pages) == -(-len(k) // P)
        if fmt != "f32":  # the packed words, gathered from the pages, match the oracle's
            kw, vw = read_words(engine, layer)
            ps, js = layer_signs(s.config.seed, 0, d)
            if fmt == "turboquant":
                assert check_key_words(kw, k, ps, js, codebook(d), layer.capacity) <= 4
                assert check_value_words(vw, v, ps, codebook(d), layer.capacity) <= 4
            else:
                assert check_tqx_words(kw, vw, k, v, TQ_SPECS[fmt], ps, js, layer.capacity) <= 8
        for length in BOUNDARIES + (len(k),):
            for n in {1, min(3, length)}:
                q = rows(rng, n, h, d)
                out, _ = engine.attend(layer, q, start_pos=length - n).result()
                err = rel_err(out, _oracle(fmt, engine, s, layer, q, k, v, length))
                assert err <= (F32_TOL if fmt == "f32" else TQ_TOL), (length, n, err)
    engine.release(sessions[0]).result()
    engine.release(sessions[2]).result()


@pytest.mark.parametrize("fmt", ["f32", "turboquant", "tq4", "tq3q", "tq4o"])
def test_every_boundary_length_matches_the_oracle(engine, rng, fmt):
    """A layer of exactly 1, P-1, P, P+1 and 2P+3 rows, appended in one call."""
    h, hkv, d = 8, 2, 64
    for length in BOUNDARIES:
        s = session(engine, fmt, h, hkv, d, seed=int(rng.integers(2**53)))
        k, v = rows(rng, length, hkv, d), rows(rng, length, hkv, d)
        engine.append(s.layers[0], k, v).result()
        assert s.layers[0].capacity == -(-length // P) * P
        q = rows(rng, 1, h, d)
        out, _ = engine.attend(s.layers[0], q).result()
        err = rel_err(out, _oracle(fmt, engine, s, s.layers[0], q, k, v, length))
        assert err <= (F32_TOL if fmt == "f32" else TQ_TOL), (length, err)
        engine.release(s).result()


@pytest.fixture(scope="module")
def small_slabs():
    eng = small_slab_engine()
    yield eng
    eng.close()


def test_a_full_slab_moves_the_layer_and_nothing_changes(small_slabs, rng):
    eng = small_slabs
    h, hkv, d = 2, 1, 8
    assert eng.max_tokens_limit("f32", hkv, d) == 8 * P
    a, b = (eng.session_kv(SessionConfig(1, h, hkv, d, "f32", 8 * P, i)) for i in range(2))
    ka, va = rows(rng, 5 * P - 3, hkv, d), rows(rng, 5 * P - 3, hkv, d)
    kb, vb = rows(rng, 3 * P, hkv, d), rows(rng, 3 * P, hkv, d)
    eng.append(a.layers[0], ka, va).result()
    eng.append(b.layers[0], kb, vb).result()
    slab = a.layers[0].slab
    assert b.layers[0].slab is slab and slab.free_pages == 0  # one slab, full
    q = rows(rng, 2, h, d)
    before, _ = eng.attend(a.layers[0], q).result()
    more_k, more_v = rows(rng, P + 5, hkv, d), rows(rng, P + 5, hkv, d)  # two more pages: a must move
    eng.append(a.layers[0], more_k, more_v).result()
    assert a.layers[0].slab is not slab and len(eng.pools.get(a.config.layer_layout(0)).slabs) == 2
    check_gpu_tables(eng, [a.layers[0], b.layers[0]])
    k, v = np.concatenate([ka, more_k]), np.concatenate([va, more_v])
    out, length = eng.attend(a.layers[0], q, start_pos=len(ka) - 2).result()
    np.testing.assert_array_equal(out, before)  # the moved rows answer bit for bit as before
    for layer, kk, vv in ((a.layers[0], k, v), (b.layers[0], kb, vb)):
        out, length = eng.attend(layer, q).result()
        want = ref.attention(q, kk, vv, start_pos=length - 2, causal=True, scale=1 / np.sqrt(d))
        assert rel_err(out, want) <= F32_TOL
    assert slab.free_pages == 5  # a's old pages are free again (after the batch that moved it)
    eng.release(a).result()
    eng.release(b).result()


def test_a_rolled_back_job_gives_its_pages_back(engine, rng):
    h, hkv, d = 2, 1, 16
    s = session(engine, "f32", h, hkv, d)
    layer = s.layers[0]
    engine.append(layer, rows(rng, P, hkv, d), rows(rng, P, hkv, d)).result()
    pool = layer.pool
    used, pages = pool.used_pages, list(layer.pages)
    # a fused step whose attend fails after its append took a page: all of it undone
    fut = engine.attend(layer, rows(rng, 1, h, d), k=rows(rng, 1, hkv, d), v=rows(rng, 1, hkv, d), start_pos=10**6)
    with pytest.raises(ValueError):
        fut.result()
    assert (layer.length, layer.pages, pool.used_pages) == (P, pages, used)
    engine.release(s).result()


def test_bytes_held_are_the_tokens_plus_at_most_one_page_per_layer(engine, rng):
    """After a churn of appends and deletes, every layer holds whole pages only as
    many as its rows need: GPU bytes <= tokens x bytes per token + one page."""
    h, hkv, d = 4, 2, 32
    live = []
    for step in range(12):
        fmt = ("f32", "turboquant")[step % 2]
        s = session(engine, fmt, h, hkv, d, layers=2, seed=step)
        for layer in s.layers:
            for _ in range(int(rng.integers(1, 4))):
                n = int(rng.integers(1, 3 * P))
                engine.append(layer, rows(rng, n, hkv, d), rows(rng, n, hkv, d)).result()
        live.append(s)
        if step % 3 == 2:
            engine.release(live.pop(int(rng.integers(len(live))))).result()
    for s in live:
        for layer in s.layers:
            per_token = layer.pool.layout.bytes_per_token
            # the count the pool keeps is the pages whose payer it is (none shared here: all of them)
            assert layer.paid_pages == sum(1 for p in layer.pages if layer.slab.payer[p] is layer) == len(layer.pages)
            assert layer.nbytes == len(layer.pages) * P * per_token
            assert layer.length * per_token <= layer.nbytes < layer.length * per_token + P * per_token
        engine.release(s).result()


@pytest.mark.parametrize("fmt", ["f32", "turboquant"])
@pytest.mark.parametrize("n_rows", [1, 40], ids=["decode-split", "prefill-tiled"])
def test_a_batch_of_attends_is_one_dispatch_per_phase_and_bit_identical(engine, rng, fmt, n_rows):
    """Attends of five sessions of one shape, planned together (a batched step), run
    as one dispatch per kernel phase and answer bit for bit as when sent alone."""
    h, hkv, d = 8, 2, 64
    lengths = (3 * P + 2, 100, 41, 2 * P + 9, 4 * P)  # awkward, and past 40: one kernel path
    sessions = [session(engine, fmt, h, hkv, d, seed=int(rng.integers(2**53))) for _ in lengths]
    qs = []
    for s, length in zip(sessions, lengths):
        engine.append(s.layers[0], rows(rng, length, hkv, d), rows(rng, length, hkv, d)).result()
        qs.append(rows(rng, min(n_rows, length), h, d))
    alone = [engine.attend(s.layers[0], q).result()[0] for s, q in zip(sessions, qs)]
    before = engine.worker.dispatches
    together = [
        f.result()[0] for f in engine.submit_group([engine.plan_attend(s.layers[0], q) for s, q in zip(sessions, qs)])
    ]
    phases = {
        ("f32", 1): 2,
        ("turboquant", 1): 3,
        ("f32", 40): 1,
        ("turboquant", 40): 2,
    }  # (rotate,) split/tiled (, merge)
    assert engine.worker.dispatches - before == phases[fmt, n_rows]
    for a, b in zip(alone, together):
        assert a.tobytes() == b.tobytes()
    for s in sessions:
        engine.release(s).result()


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_the_longest_plain_split_reads_every_page_of_its_window(engine, rng, fmt):
    """At G = 1 a plain split holds PLAIN_MAX_SCORES keys: MAX_SCORES / P pages of
    its window in workgroup memory (split_plain_decls.wgsl's pg_sh), the most there are."""
    import dataclasses

    from attnserve.gpu.kernels import PLAIN_MAX_SCORES, split_sizes

    h = hkv = 1
    d, length = 8, PLAIN_MAX_SCORES + 37
    split_len, n_splits = split_sizes(fmt, np.asarray([length]), hkv, 1, 1, 1)
    assert (int(split_len[0]), int(n_splits[0])) == (PLAIN_MAX_SCORES, 2)  # one full split, one short
    assert PLAIN_MAX_SCORES // P == 256  # pg_sh's size at the shortest page (P = 16)
    s = session(engine, fmt, h, hkv, d, max_tokens=length, seed=3)
    k, v = rows(rng, length, hkv, d), rows(rng, length, hkv, d)
    engine.append(s.layers[0], k, v).result()
    q = rows(rng, 2, h, d)
    saved = engine.policy
    engine.policy = dataclasses.replace(saved, force="split", target_workgroups=1)
    try:
        out, _ = engine.attend(s.layers[0], q, start_pos=length - 2).result()
    finally:
        engine.policy = saved
    want = ref.attention(q, stored(fmt, k), stored(fmt, v), start_pos=length - 2, causal=True)
    assert rel_err(out, want) <= F32_TOL
    engine.release(s).result()


@pytest.mark.parametrize("fmt", ["f32", "turboquant"])
def test_a_layer_moved_mid_batch_keeps_the_rows_an_earlier_item_wrote(fmt, rng):
    """One batch appends to a layer twice (a session twice in a stacked step); the
    second append finds its slab full at its largest and moves the layer: the move
    must carry the row the first item wrote in the same batch (TurboQuant's encodes
    are recorded after the batch's commands). Against a twin appended step by step."""
    from attnserve.pool import PageLayout

    h, hkv, d = 2, 1, 32
    adapter = os.environ.get("ATTNSERVE_ADAPTER") or None
    slab_bytes = max(PageLayout(fmt, hkv, d).buffer_bytes(8 * P))
    eng = Engine.open(adapter, page_tokens=P, pool_slab_bytes=slab_bytes)
    try:
        assert eng.max_tokens_limit(fmt, hkv, d) == 8 * P
        a, other, twin = (eng.session_kv(SessionConfig(1, h, hkv, d, fmt, 8 * P, 7)) for _ in range(3))
        k0, v0 = rows(rng, 5 * P - 1, hkv, d), rows(rng, 5 * P - 1, hkv, d)
        eng.append(a.layers[0], k0, v0).result()
        eng.append(other.layers[0], rows(rng, 3 * P, hkv, d), rows(rng, 3 * P, hkv, d)).result()
        eng.append(twin.layers[0], k0, v0).result()
        slab = a.layers[0].slab
        assert other.layers[0].slab is slab and slab.free_pages == 0 and slab.pages == 8  # full, at its largest
        q, k, v = rows(rng, 2, h, d)[:, None], rows(rng, 2, hkv, d)[:, None], rows(rng, 2, hkv, d)[:, None]
        layer = a.layers[0]
        plan = eng.plan_stacked([layer, layer], q, k=k, v=v, start_pos=[None, None])
        got = eng.worker.submit_plan(plan).result()
        assert not got.errors and layer.slab is not slab and list(got.lengths) == [5 * P, 5 * P + 1]
        for i in range(2):
            want, length = eng.attend(twin.layers[0], q[i], k=k[i], v=v[i]).result()
            assert length == got.lengths[i]
            np.testing.assert_array_equal(got.out[i], want)
        for mine, theirs in zip(read_words(eng, a.layers[0]), read_words(eng, twin.layers[0])):
            np.testing.assert_array_equal(mine, theirs)
        # the second append of a batch starts in the partial last page it then moves
        # (its first rows land in the moved copy of that page): a group of jobs
        b, twin_b = (eng.session_kv(SessionConfig(1, h, hkv, d, fmt, 8 * P, 9)) for _ in range(2))
        k0, v0 = rows(rng, 3 * P - 3, hkv, d), rows(rng, 3 * P - 3, hkv, d)
        for s in (b, twin_b):
            eng.append(s.layers[0], k0, v0).result()
        slab = b.layers[0].slab
        assert other.layers[0].slab is slab and other.layers[0].length % P == 0
        fill = slab.free_pages * P  # other takes the slab's last free pages
        eng.append(other.layers[0], rows(rng, fill, hkv, d), rows(rng, fill, hkv, d)).result()
        assert slab.free_pages == 0 and slab.pages == 8
        parts = [(rows(rng, n, hkv, d), rows(rng, n, hkv, d)) for n in (1, 3)]
        q = rows(rng, 1, h, d)
        layer = b.layers[0]
        futs = eng.submit_group([*(eng.plan_append(layer, kk, vv) for kk, vv in parts), eng.plan_attend(layer, q)])
        assert [f.result() for f in futs[:2]] == [3 * P - 2, 3 * P + 1] and layer.slab is not slab
        for kk, vv in parts:
            eng.append(twin_b.layers[0], kk, vv).result()
        want, _ = eng.attend(twin_b.layers[0], q).result()
        np.testing.assert_array_equal(futs[2].result()[0], want)
        for mine, theirs in zip(read_words(eng, layer), read_words(eng, twin_b.layers[0])):
            np.testing.assert_array_equal(mine, theirs)
    finally:
        eng.close()
