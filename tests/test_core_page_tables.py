"""The page tables on the GPU (pool.PageTables): every layer's table lives in one
buffer kept between batches and written by differences; what the GPU holds is
each layer's page list, through appends across page boundaries, moves, rollbacks,
releases and the buffer's growth, and the attends read through it match the
float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.errors import OutOfMemory
from attnserve.kv.config import SessionConfig
from attnserve.pool import PageTables, TableRegion, _runs
from tools import reference as ref

from _core import CORE_PAGE_TOKENS as P, core_engine, rel_err, rows, session, small_slab_engine

F32_TOL = 1e-5


# ── the allocator (host only) ────────────────────────────────────────────────


def test_regions_are_powers_of_two_of_at_least_sixteen_words():
    assert [PageTables.size_for(n) for n in (0, 1, 15, 16, 17, 32, 33, 1000)] == [16, 16, 16, 16, 32, 32, 64, 1024]


def test_a_region_let_go_is_free_only_after_the_batch_and_then_reused_by_size():
    t = PageTables()
    a, b = t.take(3), t.take(20)
    assert (a, b) == (TableRegion(0, 16), TableRegion(16, 32)) and t.in_use_words == 48
    t.drop(a)
    assert t.take(1) == TableRegion(48, 16)  # a is still in limbo: not reused in the same batch
    t.settle()
    assert t.take(5) == a  # free after the batch, taken for a table of its size
    assert t.take(17) == TableRegion(64, 32)  # another size does not take it
    assert t.in_use_words == 32 + 16 + 16 + 32  # b, the region of take(1), a again, the last


def test_a_rolled_back_take_is_free_at_once_and_a_rolled_back_drop_keeps_the_region():
    t = PageTables()
    undo: list = []
    a = t.take(2)
    b = t.take(2, undo.append)
    t.drop(a, undo.append)
    for fn in reversed(undo):
        fn()
    t.settle()
    assert t.in_use_words == 16  # only a: b given back, a's drop undone
    assert t.take(2) == b and t.take(2) == TableRegion(32, 16)  # b free again; a never was


def test_written_spans_upload_as_merged_runs():
    assert _runs([(200, 210), (0, 4), (3, 8), (70, 80)]) == [(0, 80), (200, 210)]
    assert _runs([(0, 4), (500, 501)], gap=64) == [(0, 4), (500, 501)]


def test_past_the_binding_limit_is_a_clear_out_of_memory():
    t = PageTables(max_bytes=4 * 40)
    t.take(16)
    t.take(16)
    with pytest.raises(OutOfMemory, match="page tables"):
        t.take(16)


# ── on the GPU ───────────────────────────────────────────────────────────────


def _gpu_tables(engine) -> np.ndarray:
    tables = engine.pools.tables
    return engine.call(lambda ctx: np.frombuffer(ctx.device.queue.read_buffer(tables.buffer), "<u4").copy()).result()


def check_gpu_tables(engine, layers) -> None:
    """Each of ``layers``' page lists is what the GPU holds in its region."""
    words = _gpu_tables(engine)
    for layer in layers:
        r = layer._region
        assert r is not None and len(layer.pages) <= r.size
        np.testing.assert_array_equal(words[r.offset : r.offset + len(layer.pages)], layer.pages)


def _filled_layer(engine, rng, n, h, hkv, d):
    """A new one-layer f32 session holding ``n`` random rows: (session, layer, k, v)."""
    s = session(engine, "f32", h, hkv, d)
    k, v = rows(rng, n, hkv, d), rows(rng, n, hkv, d)
    engine.append(s.layers[0], k, v).result()
    return s, s.layers[0], k, v


def _oracle(q, k, v, length, d):
    return ref.attention(q, k[:length], v[:length], start_pos=length - q.shape[0], causal=True, scale=1 / np.sqrt(d))


@pytest.mark.gpu
def test_the_gpu_holds_every_layer_table_through_interleaved_appends(engine, rng):
    h, hkv, d = 4, 2, 32
    sessions = [session(engine, "f32", h, hkv, d, layers=2) for _ in range(3)]
    data = {(i, li): ([], []) for i in range(3) for li in range(2)}
    for _ in range(4):
        for i, s in enumerate(sessions):
            for li in range(2):
                n = int(rng.integers(1, 2 * P + 2))
                k, v = rows(rng, n, hkv, d), rows(rng, n, hkv, d)
                engine.append(s.layers[li], k, v).result()
                data[i, li][0].append(k)
                data[i, li][1].append(v)
    layers = [layer for s in sessions for layer in s.layers]
    check_gpu_tables(engine, layers)
    for (i, li), (ks, vs) in data.items():
        k, v = np.concatenate(ks), np.concatenate(vs)
        q = rows(rng, 1, h, d)
        out, length = engine.attend(sessions[i].layers[li], q).result()
        assert length == len(k) and rel_err(out, _oracle(q, k, v, length, d)) <= F32_TOL
    for s in sessions:
        engine.release(s).result()


@pytest.mark.gpu
def test_a_decode_step_writes_only_a_new_page_entry(engine, rng):
    h, hkv, d = 2, 1, 16
    s, layer, k, v = _filled_layer(engine, rng, P - 1, h, hkv, d)
    tables = engine.pools.tables
    region = layer._region
    written = []
    for step in range(P + 2):  # lengths P .. 2P + 1: pages 2 and 3 open at P + 1 and 2P + 1
        before = tables.written_words
        q, kr, vr = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
        out, length = engine.attend(layer, q, k=kr, v=vr).result()
        written.append(tables.written_words - before)
        k, v = np.concatenate([k, kr]), np.concatenate([v, vr])
        assert rel_err(out, _oracle(q, k, v, length, d)) <= F32_TOL
    # one word when a step opens a page, none otherwise; the region stays
    assert written == [0, 1] + [0] * (P - 1) + [1] and layer._region == region
    before = tables.written_words
    engine.attend(layer, rows(rng, 1, h, d)).result()
    assert tables.written_words == before
    check_gpu_tables(engine, [layer])
    engine.release(s).result()


@pytest.mark.gpu
def test_a_rolled_back_job_leaves_the_table_as_it_was(engine, rng):
    h, hkv, d = 2, 1, 16
    s, layer, k, v = _filled_layer(engine, rng, P, h, hkv, d)
    tables = engine.pools.tables
    state = (layer._region, layer._synced, list(layer.pages), tables.in_use_words)
    # the append takes a page (a new table entry), then its attend fails: all undone
    fut = engine.attend(layer, rows(rng, 1, h, d), k=rows(rng, 1, hkv, d), v=rows(rng, 1, hkv, d), start_pos=10**6)
    with pytest.raises(ValueError):
        fut.result()
    assert (layer._region, layer._synced, layer.pages, tables.in_use_words) == state
    kr, vr = rows(rng, 3, hkv, d), rows(rng, 3, hkv, d)  # the next append writes the entry for real
    q = rows(rng, 1, h, d)
    out, length = engine.attend(layer, q, k=kr, v=vr).result()
    k, v = np.concatenate([k, kr]), np.concatenate([v, vr])
    assert rel_err(out, _oracle(q, k, v, length, d)) <= F32_TOL
    check_gpu_tables(engine, [layer])
    engine.release(s).result()


@pytest.mark.gpu
def test_a_released_layer_region_goes_to_the_next_session(engine, rng):
    h, hkv, d = 2, 1, 16
    a = session(engine, "f32", h, hkv, d)
    engine.append(a.layers[0], rows(rng, 3, hkv, d), rows(rng, 3, hkv, d)).result()
    region = a.layers[0]._region
    engine.release(a).result()
    b = session(engine, "f32", h, hkv, d)
    k, v = rows(rng, 2 * P, hkv, d), rows(rng, 2 * P, hkv, d)
    engine.append(b.layers[0], k, v).result()
    assert b.layers[0]._region == region  # the same size of table: its region reused
    q = rows(rng, 1, h, d)
    out, length = engine.attend(b.layers[0], q).result()
    assert rel_err(out, _oracle(q, k, v, length, d)) <= F32_TOL
    check_gpu_tables(engine, [b.layers[0]])
    engine.release(b).result()


@pytest.fixture
def new_engine():
    """An engine of its own, whose table buffer is still the first one (the shared
    engine's may have grown already, by the tests run before)."""
    eng = core_engine()
    yield eng
    eng.close()


@pytest.mark.gpu
def test_tables_outgrowing_their_buffer_keep_every_layer(new_engine, rng):
    """More regions than the first buffer holds (4,096 words: 256 regions): the
    buffer is replaced by a larger one written whole, and every table survives."""
    engine = new_engine
    h, hkv, d = 2, 1, 8
    tables = engine.pools.tables
    first = len(tables.words)
    free = sum(len(offs) for size, offs in tables.free.items() if size == PageTables.MIN_WORDS)
    n_layers = free + (first - tables.top) // PageTables.MIN_WORDS + 8  # 8 regions more than fit
    s = engine.session_kv(SessionConfig(n_layers, h, hkv, d, "f32", 4 * P, 7))
    data = []
    futures = []
    for layer in s.layers:
        n = int(rng.integers(1, 3 * P))
        k, v = rows(rng, n, hkv, d), rows(rng, n, hkv, d)
        futures.append(engine.append(layer, k, v))
        data.append((k, v))
    for f in futures:
        f.result()
    assert len(tables.words) > first and tables.buffer.size >= 4 * len(tables.words)
    check_gpu_tables(engine, s.layers)
    for li in (0, n_layers // 2, n_layers - 1):
        q = rows(rng, 1, h, d)
        out, length = engine.attend(s.layers[li], q).result()
        assert rel_err(out, _oracle(q, *data[li], length, d)) <= F32_TOL
    engine.release(s).result()


@pytest.fixture
def small_slabs():
    """A new engine whose slabs hold 8 pages (``_core.small_slab_engine``)."""
    eng = small_slab_engine()
    yield eng
    eng.close()


@pytest.mark.gpu
def test_small_slabs_do_not_bound_the_page_tables(small_slabs):
    """``pool_slab_bytes`` bounds the slabs; the tables are bound by the binding limit."""
    slab_bytes = small_slabs.pools.max_slab_bytes
    assert slab_bytes <= 4096 and small_slabs.pools.tables.max_words * 4 >= (1 << 27)  # WebGPU's least limit


@pytest.mark.gpu
@pytest.mark.parametrize("first", ["moved", "other"])
def test_a_moved_layer_table_is_rewritten_only_where_it_changed(small_slabs, rng, first):
    """A full slab moves a layer to a new slab, where its pages take new indices. When
    they are the old ones plus more (it took the slab's first pages before), only
    the new entries are written into its region; else the table is written whole
    into a new region and the old one is let go after the batch. Either way an
    attend planned before the move in the same batch reads the table it was planned
    with, and every answer matches the oracle."""
    eng, h, hkv, d = small_slabs, 2, 1, 8
    tables = eng.pools.tables
    a, b = (eng.session_kv(SessionConfig(1, h, hkv, d, "f32", 8 * P, i)) for i in range(2))
    ka, va = rows(rng, 5 * P - 3, hkv, d), rows(rng, 5 * P - 3, hkv, d)
    kb, vb = rows(rng, 3 * P, hkv, d), rows(rng, 3 * P, hkv, d)
    order = [(a, ka, va), (b, kb, vb)] if first == "moved" else [(b, kb, vb), (a, ka, va)]
    for s, k, v in order:
        eng.append(s.layers[0], k, v).result()
    la = a.layers[0]
    old_pages, region, slab = list(la.pages), la._region, la.slab
    assert slab.free_pages == 0
    more_k, more_v = rows(rng, P + 5, hkv, d), rows(rng, P + 5, hkv, d)  # two more pages: a moves
    q = rows(rng, 1, h, d)
    before = tables.written_words
    earlier = eng.attend(la, q)  # planned into the same batch as the move, when the worker coalesces them
    eng.append(la, more_k, more_v).result()
    assert la.slab is not slab
    k, v = np.concatenate([ka, more_k]), np.concatenate([va, more_v])
    out, length = earlier.result()
    assert length == len(ka) and rel_err(out, _oracle(q, ka, va, length, d)) <= F32_TOL
    if la.pages[: len(old_pages)] == old_pages:
        assert first == "moved" and la._region == region and tables.written_words - before == 2
    else:
        assert first == "other" and la._region != region and tables.written_words - before >= len(la.pages)
    check_gpu_tables(eng, [la, b.layers[0]])
    out, length = eng.attend(la, q).result()
    assert length == len(k) and rel_err(out, _oracle(q, k, v, length, d)) <= F32_TOL
    eng.release(a).result()
    eng.release(b).result()
