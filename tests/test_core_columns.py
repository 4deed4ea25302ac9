"""A stacked step planned as columns (``Engine.plan_stacked`` -> ``LayerCache.plan_stacked``):
bit-identical to the same attends sent one by one, in outputs, lengths and the
packed words of every cache, at awkward batches (several formats in one step,
lengths across page boundaries, fused appends of 1 and of several rows, steps
without an append, an item refused before it was planned, layers that take new
pages between the steps of several layers, a layer that moves while the group is
planned), and the cases that go back to item by item (a layer twice, an item the
columns cannot plan) with the same answers."""

from __future__ import annotations

import os

import numpy as np
import pytest

from attnserve.engine import Engine
from attnserve.gpu.step_plan import PLAN_REASONS, StepPlans
from attnserve.kv.config import SessionConfig
from attnserve.kv.layer import LayerCache
from attnserve.kv.windowed import WindowedLayerCache

from _core import CORE_PAGE_TOKENS as P, core_engine, item_path, read_words, rows
from attnserve.metrics import counted as count

pytestmark = pytest.mark.gpu

H, HKV, D = 4, 2, 32


@pytest.fixture
def columns(monkeypatch):
    """Counts the items that ``LayerCache.plan_stacked`` planned as columns."""
    planned = []
    original = LayerCache.plan_stacked

    def spy(batch, layers, *args, **kw):
        planned.append(len(layers))
        return original(batch, layers, *args, **kw)

    monkeypatch.setattr(LayerCache, "plan_stacked", staticmethod(spy))
    return planned


@pytest.fixture
def replays(monkeypatch):
    """The replays ``Batch.replay`` made, and any that raised: a replay that raised
    would go unseen in the answers (the step is then planned item by item, which
    gives them too), so the tests check there was none."""
    from attnserve.gpu.batch import Batch

    done: list[int] = []
    failed: list[BaseException] = []
    original = Batch.replay

    def spy(self, plan, tables):
        try:
            original(self, plan, tables)
        except BaseException as e:
            failed.append(e)
            raise
        done.append(len(plan.ops))

    monkeypatch.setattr(Batch, "replay", spy)
    return done, failed


def _pairs(engine, formats, lengths, rng, layers=2, heads=(H, HKV)):
    """For each (format, length): a session and its twin, both prefilled alike."""
    out = []
    h, hkv = heads
    for i, (fmt, length) in enumerate(zip(formats, lengths)):
        pair = [engine.session_kv(SessionConfig(layers, h, hkv, D, fmt, 4096, 100 + i)) for _ in range(2)]
        for li in range(layers):
            if length:
                k, v = rows(rng, length, hkv, D), rows(rng, length, hkv, D)
                with item_path():
                    for s in pair:
                        engine.append(s.layers[li], k, v).result()
        out.append(pair)
    return out


def _missed(events):
    """The misses an engine's ``step_plans`` counted, by reason."""
    return {r: count(events, "missed", r) for r in PLAN_REASONS if count(events, "missed", r)}


def _check_step(engine, pairs, li, q, k, v, skip=(), plans=None):
    """One stacked step on the sessions' layer ``li`` against their twins' one by
    one (``plans``: the sessions' step plans, as the store keeps them)."""
    b = len(pairs)
    layers = [None if i in skip else pairs[i][0].layers[li] for i in range(b)]
    plan = engine.plan_stacked(layers, q, k=k, v=v, start_pos=[None] * b, plans=plans)
    got = engine.worker.submit_plan(plan).result()
    assert not got.errors
    for i in range(b):
        if i in skip:
            assert got.lengths[i] == -1 and not got.out[i].any() and not got.lse[i].any()
            continue
        fused = {} if k is None else {"k": k[i], "v": v[i]}
        with item_path():
            one = engine.attend(pairs[i][1].layers[li], q[i], **fused).result()
        assert got.lengths[i] == one.length
        np.testing.assert_array_equal(got.out[i], one.out)
        np.testing.assert_array_equal(got.lse[i], one.lse)  # the columns' log-sum-exp too
    return got


def _same_words(engine, pairs):
    for mine, twin in pairs:
        for a, b in zip(mine.layers, twin.layers):
            assert a.length == b.length
            for x, y in zip(read_words(engine, a), read_words(engine, b)):
                np.testing.assert_array_equal(x, y)


@pytest.fixture(params=["gathered", "direct"])
def uploads(request, monkeypatch):
    """Inputs gathered into one host buffer (the default for small arrays), or every
    array written to the GPU straight from its own memory (as large ones are)."""
    if request.param == "direct":
        monkeypatch.setattr("attnserve.gpu.batch.DIRECT_UPLOAD_BYTES", 1)
    return request.param


@pytest.mark.usefixtures("uploads")
@pytest.mark.parametrize("heads", [(H, HKV), (9, 3)], ids=["gqa2", "gqa3"])  # 3: a workgroup per query head
def test_columns_are_bit_identical_to_attends_one_by_one(engine, rng, columns, heads):
    formats = ["f32", "turboquant", "f16", "tq4", "f32", "turboquant", "tq2o", "f32", "f16", "bf16"]
    lengths = [P - 1, P, 1, 2 * P + 3, P + 1, 0, 3 * P - 2, 5, 2 * P - 1, P + 3]
    pairs = _pairs(engine, formats, lengths, rng, heads=heads)
    b = len(pairs)
    h, hkv = heads
    for step, m in enumerate((1, 3, 1, 0, P + 2)):  # rows appended per item (0: no append)
        for li in range(2):  # every layer of the step: pages opened by the appends before
            q = rng.standard_normal((b, 1, h, D)).astype(np.float32)
            k = v = None
            if m:
                k = rng.standard_normal((b, m, hkv, D)).astype(np.float32)
                v = rng.standard_normal((b, m, hkv, D)).astype(np.float32)
            skip = {4} if step == 2 else ()  # an item refused before it was planned
            _check_step(engine, pairs, li, q, k, v, skip)
    # every item went through the columns (one group per pool): none planned alone
    assert sum(columns) == 2 * (5 * b - 1)
    _same_words(engine, pairs)


def test_windowed_layers_are_columns_bit_identical_to_one_by_one(engine, rng, columns):
    """Windowed TurboQuant layers (exact sinks and a recent window, issue 27) in
    stacked steps beside plain and TurboQuant ones, with several sink and window
    sizes in one group: planned as columns, and bit for bit what each gets attended
    alone, step after step as the sinks fill, the windows pass page boundaries and
    let their old pages go; codes and exact rows alike at the end."""
    h, hkv = 9, 3  # a GQA group of 3: a workgroup per query head
    configs = [("tq4", 3, 5), ("tq4", 0, P + 3), ("turboquant", 4, 0), ("tq4", 2, 2 * P), ("f32", 0, 0), ("tq4", 0, 0)]
    lengths = [2, P - 1, 2 * P + 3, 1, P, 7]
    pairs = []
    for i, ((fmt, sinks, window), length) in enumerate(zip(configs, lengths)):
        config = SessionConfig(2, h, hkv, D, fmt, 4096, 100 + i, sinks=sinks, window=window)
        pair = [engine.session_kv(config) for _ in range(2)]
        for li in range(2):
            k, v = rows(rng, length, hkv, D), rows(rng, length, hkv, D)
            with item_path():
                for s in pair:
                    engine.append(s.layers[li], k, v).result()
        pairs.append(pair)
    b = len(pairs)
    steps = [(1, 1), (1, 1), (3, 3), (1, 1), (1, P + 2), (1, 0), (2, 1), (1, 1)]  # (query rows, appended rows)
    for n, m in steps:
        for li in range(2):
            q = rng.standard_normal((b, n, h, D)).astype(np.float32)
            k = None if not m else rng.standard_normal((b, m, hkv, D)).astype(np.float32)
            v = None if not m else rng.standard_normal((b, m, hkv, D)).astype(np.float32)
            _check_step(engine, pairs, li, q, k, v)
    assert sum(columns) == 2 * len(steps) * b  # every item went through the columns
    _same_words(engine, pairs)
    for mine, twin in pairs:
        for a, t in zip(mine.layers, twin.layers):
            if not isinstance(a, WindowedLayerCache):
                continue
            assert (a.recent_base, a.held_from, len(a.recent.pages)) == (
                t.recent_base,
                t.held_from,
                len(t.recent.pages),
            )
            assert a.recent_base > 0 or not a.window or a.length < 2 * P  # the window let pages go
            exact = [engine.call(lambda ctx, layer=layer: layer.read_exact(ctx.device)).result() for layer in (a, t)]
            assert exact[0] == exact[1]


def test_several_query_rows_and_a_step_without_appends(engine, rng, columns):
    pairs = _pairs(engine, ["f32", "turboquant", "f16", "bf16"], [3 * P + 1, 2 * P, P + 7, 2 * P - 3], rng, layers=1)
    q = rng.standard_normal((4, 4, H, D)).astype(np.float32)  # 4 query rows: still the split path
    k = rng.standard_normal((4, 4, HKV, D)).astype(np.float32)
    _check_step(engine, pairs, 0, q, k, k)
    _check_step(engine, pairs, 0, q, None, None)
    assert sum(columns) == 2 * len(pairs)  # every item of both steps as columns
    _same_words(engine, pairs)


def test_a_layer_twice_is_planned_item_by_item(engine, rng, columns):
    pairs = _pairs(engine, ["f32", "turboquant"], [P - 1, P], rng, layers=1)
    a, b = pairs[0][0].layers[0], pairs[1][0].layers[0]
    q = rng.standard_normal((3, 1, H, D)).astype(np.float32)
    k = rng.standard_normal((3, 1, HKV, D)).astype(np.float32)
    got = engine.worker.submit_plan(engine.plan_stacked([a, b, a], q, k=k, v=k, start_pos=[None] * 3)).result()
    assert not got.errors and columns == []  # items of one layer apply in order: one by one
    for i, twin in ((0, pairs[0][1]), (1, pairs[1][1]), (2, pairs[0][1])):
        want, length = engine.attend(twin.layers[0], q[i], k=k[i], v=k[i]).result()
        assert got.lengths[i] == length
        np.testing.assert_array_equal(got.out[i], want)
    _same_words(engine, pairs)


def test_an_item_the_columns_cannot_plan_fails_alone(engine, rng, columns):
    pairs = _pairs(engine, ["f32", "f32", "turboquant"], [P, 2 * P + 1, P + 3], rng, layers=1)
    layers = [p[0].layers[0] for p in pairs]
    q = rng.standard_normal((3, 2, H, D)).astype(np.float32)
    k = rng.standard_normal((3, 1, HKV, D)).astype(np.float32)
    # item 1's start_pos passes its length: the columns raise, the step goes item by item
    plan = engine.plan_stacked(layers, q, k=k, v=k, start_pos=[None, 2 * P + 1, None])
    got = engine.worker.submit_plan(plan).result()
    assert list(got.errors) == [1] and isinstance(got.errors[1], ValueError)
    assert got.lengths[1] == -1 and not got.out[1].any() and layers[1].length == 2 * P + 1  # unchanged
    assert columns == [2]  # the f32 group raised (item 1's start_pos) before it planned anything
    for i in (0, 2):
        want, length = engine.attend(pairs[i][1].layers[0], q[i], k=k[i], v=k[i]).result()
        assert got.lengths[i] == length
        np.testing.assert_array_equal(got.out[i], want)
    np.testing.assert_array_equal(read_words(engine, layers[1])[0], read_words(engine, pairs[1][1].layers[0])[0])


@pytest.mark.parametrize("fmt", ["f32", "turboquant"])
def test_a_layer_that_moves_while_its_group_is_planned(fmt, rng, columns):
    """The slab is full at its largest: one item of the group moves its layer to
    another slab (a copy deferred after the writes before it); the others write
    into the old slab. Against twins appended one by one, words and outputs."""
    from attnserve.pool import PageLayout

    adapter = os.environ.get("ATTNSERVE_ADAPTER") or None
    slab_bytes = max(PageLayout(fmt, HKV, D).buffer_bytes(8 * P))
    eng = Engine.open(adapter, page_tokens=P, pool_slab_bytes=slab_bytes)
    try:
        sessions = [eng.session_kv(SessionConfig(1, H, HKV, D, fmt, 8 * P, 7)) for _ in range(4)]
        a, other, twin_a, twin_other = sessions
        ka, kb = rows(rng, 5 * P, HKV, D), rows(rng, 3 * P - 1, HKV, D)
        with item_path():
            for s, kk in ((a, ka), (other, kb), (twin_a, ka), (twin_other, kb)):
                eng.append(s.layers[0], kk, kk).result()
        assert a.layers[0].slab is other.layers[0].slab and a.layers[0].slab.free_pages == 0
        slab = a.layers[0].slab
        q = rng.standard_normal((2, 1, H, D)).astype(np.float32)
        k = rng.standard_normal((2, 1, HKV, D)).astype(np.float32)
        layers = [other.layers[0], a.layers[0]]  # other writes its partial page; a needs a new page: it moves
        got = eng.worker.submit_plan(eng.plan_stacked(layers, q, k=k, v=k, start_pos=[None, None])).result()
        assert not got.errors and columns == [2] and a.layers[0].slab is not slab
        for i, twin in enumerate((twin_other, twin_a)):
            with item_path():
                want, length = eng.attend(twin.layers[0], q[i], k=k[i], v=k[i]).result()
            assert got.lengths[i] == length
            np.testing.assert_array_equal(got.out[i], want)
        for mine, twin in ((a, twin_a), (other, twin_other)):
            for x, y in zip(read_words(eng, mine.layers[0]), read_words(eng, twin.layers[0])):
                np.testing.assert_array_equal(x, y)
    finally:
        eng.close()


@pytest.mark.gpu
def test_a_steps_layer_signs_are_one_upload_shared_with_single_attends(engine):
    """``Batch.upload_once_each``: the keys not in the batch yet go up in one copy, each
    its own aligned segment; a key named twice, or uploaded before by ``upload_once``,
    gets the segment it has; a rolled-back job's segments are forgotten."""
    from attnserve.gpu.batch import Batch

    w = engine.worker
    batch = Batch(engine.ctx.device, engine.ctx.pipelines, w.arenas, engine.ctx.offset_align, engine.policy)
    data = {k: bytes([k]) * 64 for k in range(4)}
    first = batch.upload_once(3, data[3])
    mark = batch.mark()
    segs = batch.upload_once_each([0, 1, 0, 3, 2], data.__getitem__)
    assert segs[0] is segs[2] and segs[3] is first
    fresh = [segs[i] for i in (0, 1, 4)]
    stride = -(-64 // batch.align) * batch.align
    assert [s.offset - fresh[0].offset for s in fresh] == [0, stride, 2 * stride]  # one upload, in key order
    assert all(s.offset % batch.align == 0 and s.size == 64 for s in fresh)
    assert batch.upload_once(1, b"x" * 64) is segs[1]
    upload = batch._uploads.image()
    for k, s in zip((0, 1, 2), fresh):
        assert upload[s.offset : s.offset + 64] == data[k]
    batch.rollback(mark)
    assert batch.upload_once_each([3], data.__getitem__) == [first]
    again = batch.upload_once_each([0], data.__getitem__)[0]
    assert batch._uploads.image()[again.offset : again.offset + 64] == data[0]


def test_uploads_gather_small_arrays_and_keep_large_ones_as_they_are(monkeypatch):
    """``batch._Uploads``: small uploads share one host buffer, zero-padded to their
    offsets; a large one is the caller's memory itself, never copied; a rollback
    drops what came after its mark, in a gathered run and across direct ones."""
    from attnserve.gpu import batch as B

    monkeypatch.setattr(B, "DIRECT_UPLOAD_BYTES", 16)
    up = B._Uploads()
    up.add(0, memoryview(b"abc"))
    up.add(8, memoryview(b"defg"))  # gathered, after 5 zero bytes
    big = np.arange(8, dtype="<f4")
    up.add(16, memoryview(big).cast("B"))  # 32 bytes: its own run
    mark = up.mark()
    up.add(48, memoryview(b"hi"))
    assert [off for off, _ in up.runs] == [0, 16, 48]
    assert up.runs[1][1].obj is big  # the array's memory, not a copy
    assert up.image() == b"abc" + bytes(5) + b"defg" + bytes(4) + big.tobytes() + b"hi"
    up.rollback(mark)
    assert up.image() == b"abc" + bytes(5) + b"defg" + bytes(4) + big.tobytes()
    up.add(48, memoryview(b"jk"))
    first = up.mark()
    up.add(52, memoryview(b"lm"))  # gathered into the same run as "jk"
    up.add(64, memoryview(big).cast("B"))
    up.rollback(first)
    assert up.image()[48:] == b"jk" and len(up.runs) == 3


def _stacked(engine, pairs, li, q, k, v, plans=None):
    return engine.plan_stacked(
        [p[0].layers[li] for p in pairs], q, k=k, v=k if v is None else v, start_pos=[None] * len(pairs), plans=plans
    )


def test_a_steps_plan_recorded_on_one_layer_is_replayed_on_the_others(rng, columns, replays):
    """Issue 25's plan once per step: an engine's step attends the same sessions at
    the same lengths on every layer, so the commands recorded on its first layer
    are run on the others (``gpu/step_plan.py``), each layer's own page tables
    put in. Several formats, lengths across page boundaries, appends of 1 and of
    several rows that open new pages, a step of several query rows, one without an
    append, and two layers' steps in one batch: bit for bit what each item gets
    alone, and every layer after the first of a step replayed (an engine of its own:
    no other test's sessions in its slabs, so that no layer's page moves its slab
    between two layers of a step, which would make that layer record anew)."""
    engine = core_engine()
    try:
        _replayed_steps(engine, rng, columns)
    finally:
        engine.close()
    assert replays[0] and not replays[1]


def _replayed_steps(engine, rng, columns):
    num_layers = 4
    formats = ["f32", "tq4", "f16", "turboquant", "tq4", "f32", "bf16"]
    lengths = [P - 1, P, 2 * P + 3, 1, 3 * P - 1, 2 * P, P + 5]
    pairs = _pairs(engine, formats, lengths, rng, layers=num_layers)
    plans, events = StepPlans(), engine.step_plans
    b, groups = len(pairs), len(set(formats))  # one group (pool) per format: one plan each per layer
    steps = [(1, 1), (1, 1), (2, P + 1), (1, 0), (3, 2), (1, 1)]  # (query rows, appended rows)
    for n, m in steps:
        runs, made = count(events, "run", ""), count(events, "made", "")
        for li in range(num_layers):  # every layer of the step, as a model runs them
            q = rng.standard_normal((b, n, H, D)).astype(np.float32)
            k = None if not m else rng.standard_normal((b, m, HKV, D)).astype(np.float32)
            v = None if not m else rng.standard_normal((b, m, HKV, D)).astype(np.float32)
            _check_step(engine, pairs, li, q, k, v, plans=plans)
        assert count(events, "run", "") - runs == (num_layers - 1) * groups  # layers 1.. of the step: run
        assert count(events, "made", "") - made == groups  # made on layer 0 alone
    assert not _missed(events)
    _same_words(engine, pairs)
    assert sum(columns) == len(steps) * num_layers * b

    # layers 2 and 3 of a step in one batch: the first job replays, the second (not
    # its batch's first) is planned and flushed with the batch; layers 0 and 1 first
    q = rng.standard_normal((b, 1, H, D)).astype(np.float32)
    kv = [rng.standard_normal((b, 1, HKV, D)).astype(np.float32) for _ in range(num_layers)]
    for li in (0, 1):
        _check_step(engine, pairs, li, q, kv[li], kv[li], plans=plans)
    runs = count(events, "run", "")
    futures = engine.worker.submit_plans([_stacked(engine, pairs, li, q, kv[li], kv[li], plans) for li in (2, 3)])
    got = [f.result() for f in futures]
    assert count(events, "run", "") - runs == groups
    # the second job, not its batch's first, misses visibly: its first group's arrays
    # are elsewhere in the arenas, and the later groups follow that group's deferred kernels
    assert _missed(events) == {"arrays": 1, "deferred": groups - 1}
    for li, step in zip((2, 3), got):
        assert not step.errors
        for i in range(b):
            one = engine.attend(pairs[i][1].layers[li], q[i], k=kv[li][i], v=kv[li][i]).result()
            assert step.lengths[i] == one.length
            np.testing.assert_array_equal(step.out[i], one.out)
            np.testing.assert_array_equal(step.lse[i], one.lse)
    _same_words(engine, pairs)


def test_windowed_layers_steps_are_replayed_on_every_layer(rng, columns, replays):
    """The same for windowed layers: their codes, sinks and recent rows each name
    their own page tables, a layer without sinks or without a window names none
    (a placeholder the replay keeps), and the recent rows' append is recorded with
    the codes'; windows pass page edges and let pages go between the steps."""
    engine = core_engine()
    try:
        num_layers, h, hkv = 3, 9, 3
        # slabs grown first (and their pages given back): a slab that grows between two
        # layers of a step has new buffers, so the later layer records anew
        warm = engine.session_kv(SessionConfig(num_layers, h, hkv, D, "tq4", 4096, 299, sinks=4, window=4096))
        with item_path():
            for layer in warm.layers:
                engine.append(layer, rows(rng, 40 * P, hkv, D), rows(rng, 40 * P, hkv, D)).result()
        engine.release(warm).result()
        configs = [("tq4", 3, P + 3), ("tq4", 0, 2 * P), ("tq4", 2, 0), ("tq4", 4, 5)]
        lengths = [P + 1, 2 * P - 1, 5, 3 * P]  # past every sink: no sink is written by the steps
        pairs = []
        for i, ((fmt, sinks, window), length) in enumerate(zip(configs, lengths)):
            config = SessionConfig(num_layers, h, hkv, D, fmt, 4096, 300 + i, sinks=sinks, window=window)
            pair = [engine.session_kv(config) for _ in range(2)]
            for li in range(num_layers):
                k, v = rows(rng, length, hkv, D), rows(rng, length, hkv, D)
                with item_path():
                    for s in pair:
                        engine.append(s.layers[li], k, v).result()
            pairs.append(pair)
        plans, events, b = StepPlans(), engine.step_plans, len(pairs)
        steps = [(1, 1), (1, P + 1), (2, 1), (1, 0), (1, 2 * P), (1, 1)]  # (query rows, appended rows)
        for n, m in steps:
            runs = count(events, "run", "")
            for li in range(num_layers):
                q = rng.standard_normal((b, n, h, D)).astype(np.float32)
                k = None if not m else rng.standard_normal((b, m, hkv, D)).astype(np.float32)
                v = None if not m else rng.standard_normal((b, m, hkv, D)).astype(np.float32)
                _check_step(engine, pairs, li, q, k, v, plans=plans)
            assert count(events, "run", "") - runs == num_layers - 1  # one group (the tq4 pool): layers 1.. run
        assert not _missed(events)
        assert sum(columns) == len(steps) * num_layers * b
        _same_words(engine, pairs)
        for mine, twin in pairs:
            for a, t in zip(mine.layers, twin.layers):
                assert (a.recent_base, a.held_from, len(a.recent.pages)) == (
                    t.recent_base,
                    t.held_from,
                    len(t.recent.pages),
                )
                exact = [
                    engine.call(lambda ctx, layer=layer: layer.read_exact(ctx.device)).result() for layer in (a, t)
                ]
                assert exact[0] == exact[1]
    finally:
        engine.close()
    assert len(replays[0]) == len(steps) * (num_layers - 1) and not replays[1]


def test_a_recorded_plan_is_replayed_with_each_layers_page_tables(engine):
    """``Batch.record`` / ``recorded`` / ``replay``: a recording keeps the commands
    and params a job planned into an empty batch; a replay into a batch of the same
    layout plans them again with each ``table_off`` of the params that named the
    recorded tables' offsets set to the new ones (by position, other fields as they
    were). A recording that uploaded data or changed host state, or whose tables are
    not distinct, gives no plan; a batch holding commands records nothing."""
    from attnserve.gpu import params as PR
    from attnserve.gpu.batch import Batch, whole

    def new_batch():
        return Batch(engine.ctx.device, engine.ctx.pipelines, engine.worker.arenas, engine.ctx.offset_align,
                     engine.policy)  # fmt: skip

    block = PR.KV_WRITE_PARAMS
    rows = PR.pack_array(block, 3, table_off=[40, 7, 40], t=[1, 2, 3], row_words=5)
    batch = new_batch()
    q = batch.upload(np.arange(4, dtype="<f4"))  # the job's data: before the recording
    layout = batch.layout()
    assert batch.record()
    prm = batch.upload_params(rows)
    batch.dispatch("kv_write_rows", {0: whole("in"), 3: prm}, (1, 3, 1))
    plan = batch.recorded(np.array([40, 7]))
    assert plan is not None and plan.n_dispatches == 1 and len(plan.ops) == 1

    again = new_batch()
    again.upload(np.arange(4, dtype="<f4"))
    assert again.layout() == layout
    again.replay(plan, np.array([9, 1000]))
    assert again.ops == batch.ops[1 - len(plan.ops) :] and again.layout() == batch.layout()
    image = np.frombuffer(again._uploads.image()[prm.offset : prm.offset + prm.size], block)
    np.testing.assert_array_equal(image["table_off"], [9, 1000, 9])
    np.testing.assert_array_equal(image["t"], [1, 2, 3])
    np.testing.assert_array_equal(image["row_words"], [5, 5, 5])
    assert again._uploads.image()[: q.size] == np.arange(4, dtype="<f4").tobytes()

    for spoil in (
        lambda b: b.upload(b"data"),
        lambda b: b.upload_items(np.zeros((2, 4), np.float32)),
        lambda b: b.on_rollback(lambda: None),
    ):
        other = new_batch()
        assert other.record()
        other.upload_params(rows)
        spoil(other)
        assert other.recorded(np.array([40, 7])) is None
    kept = new_batch()
    kept.upload(np.arange(4, dtype="<f4"))
    assert kept.record()
    with_none = PR.pack_array(block, 3, table_off=[40, 0, 7])  # 0: an item without that table
    prm = kept.upload_params(with_none)
    plan = kept.recorded(np.array([40, 7]), placeholders=(0,))
    assert plan is not None
    again = new_batch()
    again.upload(np.arange(4, dtype="<f4"))
    again.replay(plan, np.array([8, 9]))
    image = np.frombuffer(again._uploads.image()[prm.offset : prm.offset + prm.size], block)
    np.testing.assert_array_equal(image["table_off"], [8, 0, 9])  # the placeholder stays
    clash = new_batch()
    assert clash.record()
    clash.upload_params(with_none)
    assert clash.recorded(np.array([0, 7]), placeholders=(0,)) is None  # a table at the placeholder's offset
    twice = new_batch()
    assert twice.record()
    twice.upload_params(rows)
    assert twice.recorded(np.array([40, 40])) is None  # two items' tables at one offset: no map back
    stray = new_batch()
    assert stray.record()
    stray.upload_params(with_none)
    assert stray.recorded(np.array([40, 7])) is None  # 0 names no table and is no placeholder: no map back
    busy = new_batch()
    busy.records = False  # a batch's later job (Engine.plan_stacked sets it): its dispatches shared
    assert not busy.record()


def test_only_a_layer_with_a_later_layer_of_its_format_records(engine, rng, monkeypatch):
    """A step records its plan only where a later layer of a session may replay it:
    a one-layer session's steps, and a session's last layer of a format, record
    nothing (a recording costs the step that makes it)."""
    from attnserve.gpu.batch import Batch

    recorded: list[int] = []
    original = Batch.recorded

    def spy(self, tables, placeholders=()):
        plan = original(self, tables, placeholders)
        recorded.append(plan is not None)
        return plan

    monkeypatch.setattr(Batch, "recorded", spy)
    one, plans = _pairs(engine, ["f32", "tq4"], [P + 1, 3], rng, layers=1), StepPlans()
    for _ in range(2):
        q = rng.standard_normal((2, 1, H, D)).astype(np.float32)
        k = rng.standard_normal((2, 1, HKV, D)).astype(np.float32)
        _check_step(engine, one, 0, q, k, k, plans=plans)
    assert recorded == []
    mixed = [engine.session_kv(SessionConfig(3, H, HKV, D, ["f32", "tq4", "f32"], 4096, 5)) for _ in range(2)]
    for li in range(3):
        k, v = rows(rng, P, HKV, D), rows(rng, P, HKV, D)
        for s in mixed:  # the session and its twin alike
            engine.append(s.layers[li], k, v).result()
    assert [layer.format_follows for layer in mixed[0].layers] == [True, False, False]
    q = rng.standard_normal((1, 1, H, D)).astype(np.float32)
    k = rng.standard_normal((1, 1, HKV, D)).astype(np.float32)
    plans = StepPlans()
    for li in range(3):
        _check_step(engine, [mixed], li, q, k, k, plans=plans)
    assert recorded == [True]  # layer 0 (f32, with layer 2 after it) only


def test_columns_that_fail_fall_back_visibly_to_the_same_answers(engine, rng, monkeypatch, caplog):
    """A stacked step whose columns raise is planned item by item and gives the same
    answers, and is never silent: counted by reason in engine.step_fallbacks
    (attnserve_step_fallbacks_total) and logged with the traceback."""
    pairs = _pairs(engine, ["f32", "turboquant", "f16", "bf16"], [P + 1, 3, 2 * P, P - 1], rng)
    b = len(pairs)

    def broken(*args, **kw):
        raise RuntimeError("a bug in the columns")

    before = count(engine.step_fallbacks, "error")
    monkeypatch.setattr(LayerCache, "plan_stacked", staticmethod(broken))
    q = rng.standard_normal((b, 1, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((b, 2, HKV, D)).astype(np.float32) for _ in range(2))
    with caplog.at_level("WARNING", logger="attnserve"):
        _check_step(engine, pairs, 0, q, k, v)
    assert count(engine.step_fallbacks, "error") == before + 1
    logged = [r for r in caplog.records if "planned item by item" in r.getMessage()]
    assert logged and logged[0].exc_info and "a bug in the columns" in str(logged[0].exc_info[1])
    _same_words(engine, pairs)
