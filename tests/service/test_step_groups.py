"""Store.step_group: the sessions a stacked step names, resolved once and kept while
no session is added or removed (what every layer of an engine's step, and the steps
after it, reuse); host only."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from attnserve.store import Store


def _store() -> Store:
    return Store(max_sessions=100, memory_budget_bytes=0)


def _kv():
    return SimpleNamespace(config=SimpleNamespace(num_layers=0), layers=[])


def test_a_group_is_resolved_once_and_kept_while_no_session_comes_or_goes():
    store = _store()
    a, b, c = (store.create(_kv(), owner="k", session_id=sid) for sid in "abc")
    g = store.step_group(["a", "b"], "k")
    assert g is not None and g.sessions == [a, b]
    g.memo["x"] = 1
    assert store.step_group(["a", "b"], "k") is g  # every layer's request of the step
    assert store.step_group(["b", "a"], "k").sessions == [b, a]  # another order: another group
    store.remove(c)
    # another session left: resolved again, to the very same sessions (memo and plans kept)
    assert store.step_group(["a", "b"], "k") is g and g.memo == {"x": 1}
    store.remove(b)
    assert store.step_group(["a", "b"], "k") is None  # not there: the caller names the problem
    b2 = store.create(_kv(), owner="k", session_id="b")
    g2 = store.step_group(["a", "b"], "k")
    assert g2 is not g and g2.sessions == [a, b2] and g2.memo == {}  # the new session under the id


def test_a_group_is_none_for_a_session_twice_or_another_owner():
    store = _store()
    store.create(_kv(), owner="k", session_id="a")
    store.create(_kv(), owner="j", session_id="b")
    assert store.step_group(["a", "a"], "k") is None
    assert store.step_group(["a", "b"], "k") is None  # j's session is not k's to name


def test_every_use_of_a_group_counts_as_a_use_of_its_sessions():
    store = _store()
    a = store.create(_kv(), owner=None, session_id="a")
    store.step_group(["a"], None)
    a.last_used = 0.0
    store.step_group(["a"], None)  # kept, and still a use (the TTL sees it)
    assert a.last_used >= time.monotonic() - 60


def test_groups_kept_are_bounded():
    store = _store()
    for i in range(Store.STEP_GROUPS + 10):
        store.create(_kv(), owner=None, session_id=f"s{i}")
    for i in range(Store.STEP_GROUPS + 10):
        assert store.step_group([f"s{i}"], None) is not None
    assert len(store._steps) == Store.STEP_GROUPS


# ── a stacked step's reservations as columns (StepReservation) ──────────────

P, PAGE_BYTES = 4, 100


class _Cache:
    """A layer cache as the store sees it: length and capacity as the GPU left them."""

    def __init__(self, length: int = 0):
        self.length, self.capacity = length, -(-length // P) * P
        self.max_tokens, self.page_tokens, self.kv_format = 64, P, "f32"
        self.pool = SimpleNamespace(page_bytes=PAGE_BYTES)

    def bytes_for(self, capacity: int) -> int:
        return capacity // P * PAGE_BYTES

    def applied(self, rows: int) -> None:  # what the GPU thread does when the job runs
        self.length += rows
        self.capacity = max(self.capacity, -(-self.length // P) * P)


def _session_kv(length: int):
    cache = _Cache(length)
    kv = SimpleNamespace(config=SimpleNamespace(num_layers=1), layers=[cache])
    kv.nbytes = 0
    return kv


def _sessions(store: Store, lengths: list[int]):
    sessions = []
    for i, n in enumerate(lengths):
        s = store.create(_session_kv(n), owner=None, session_id=f"s{i}")
        s.kv.nbytes = s.reserved_bytes = s.kv.layers[0].capacity // P * PAGE_BYTES
        store.reserved_bytes += s.reserved_bytes
        s.layers[0].length, s.layers[0].capacity = s.kv.layers[0].length, s.kv.layers[0].capacity
        sessions.append(s)
    return sessions


def _plan(store: Store, sessions, rows: int, offsets):
    """A step's store rules (``step_lengths``, then ``reserve_step`` of the items that
    pass them): its reservation (not committed) and each refused item's problem."""
    states = [s.layers[0] for s in sessions]
    new_length, problems = store.step_lengths(states, rows, offsets)
    keep = [i for i in range(len(states)) if i not in problems]
    step, over = store.reserve_step([sessions[i] for i in keep], [states[i] for i in keep], rows, new_length[keep])
    problems.update({keep[j]: p for j, p in over.items()})
    return step, problems


def test_a_step_reserves_commits_and_finishes_as_columns_with_one_object():
    store = _store()
    sessions = _sessions(store, [3, 4, 0])  # the first and last open a page with one row, the second not
    before = store.reserved_bytes
    step, problems = _plan(store, sessions, 1, [3, None, 0])
    assert not problems and len(step) == 3
    assert step.new_length == [4, 5, 1] and step.new_capacity == [4, 8, 4]
    assert step.delta_bytes == [0, PAGE_BYTES, PAGE_BYTES] and step.total_bytes == 2 * PAGE_BYTES
    assert [ls.length for s in sessions for ls in s.layers] == [3, 4, 0]  # nothing until committed
    store.commit_step(step)
    assert step.committed and store.reserved_bytes == before + 2 * PAGE_BYTES
    for s, n in zip(sessions, [4, 5, 1]):
        assert s.layers[0].length == n and s.pending == 1 and s.layers[0].inflight == [step]
    for s in sessions:
        s.kv.layers[0].applied(1)
        s.kv.nbytes = s.kv.layers[0].capacity // P * PAGE_BYTES
    store.finish_step(step, None)
    for s, n, c in zip(sessions, [4, 5, 1], [4, 8, 4]):
        assert s.pending == 0 and s.layers[0].inflight == [] and (s.layers[0].length, s.layers[0].capacity) == (n, c)
        assert s.reserved_bytes == s.kv.nbytes
    assert store.reserved_bytes == before + 2 * PAGE_BYTES


def test_a_step_refuses_each_item_by_its_own_rule_and_reserves_the_rest():
    store = _store()
    sessions = _sessions(store, [3, 64, 5])
    step, problems = _plan(store, sessions, 1, [None, None, 4])
    assert {i: p.slug for i, p in problems.items()} == {1: "capacity-exceeded", 2: "offset-mismatch"}
    assert problems[1].detail == "appending 1 rows to length 64 would pass max_tokens 64"
    assert problems[2].detail == "offset 4 is not the layer's length 5; nothing was appended"
    assert step.sessions == sessions[:1] and step.new_length == [4]
    read, problems = _plan(store, sessions[2:], 0, [4])  # an attend without rows: its offset alone
    assert problems[0].detail == "offset 4 is not the layer's length 5" and len(read) == 0
    # the budget: each item against the bytes of those before it that pass
    tight = Store(max_sessions=10, memory_budget_bytes=0)
    three = _sessions(tight, [4, 8, 4])
    tight.memory_budget_bytes = tight.used_bytes + PAGE_BYTES  # room for one new page
    step, problems = _plan(tight, three, 1, [None] * 3)
    assert step.sessions == three[:1] and sorted(problems) == [1, 2]
    assert problems[1].slug == "out-of-memory" and problems[1].extra["used_bytes"] == tight.used_bytes + PAGE_BYTES


def _windowed(length: int, sinks: int, window: int, exact_page_bytes: int = 30):
    """A windowed layer (kv.windowed.WindowedLayerCache) as its sizing methods see it:
    its pool's page size and bytes, its exact rows' pool's page bytes."""
    from attnserve.kv.windowed import WindowedLayerCache

    cache = object.__new__(WindowedLayerCache)
    cache.pool = SimpleNamespace(page_tokens=P, page_bytes=PAGE_BYTES, pages_for=lambda rows: -(-rows // P))
    cache.recent = SimpleNamespace(pool=SimpleNamespace(page_bytes=exact_page_bytes))
    cache.sinks, cache.window, cache.max_tokens, cache.length = sinks, window, 64, length
    cache.pages = [0] * -(-length // P)
    return cache


def test_a_windowed_layers_bytes_grow_as_columns_as_one_by_one():
    """kv.session.bytes_growth, what a stacked step reserves: each layer's bytes_for at
    its new capacity less at its old, windowed layers (their exact rows' pages, which
    grow with the capacity up to the window's) beside plain ones, at every capacity."""
    from attnserve.kv.session import bytes_growth

    caches = [_windowed(0, s, w) for s in (0, 1, 4, 6) for w in (0, 1, 3, 4, 9)] + [_Cache(0)]
    for cap in range(0, 13 * P, P):
        for more in (0, P, 3 * P):
            old, new = np.full(len(caches), cap), np.full(len(caches), cap + more)
            want = [c.bytes_for(cap + more) - c.bytes_for(cap) for c in caches]
            assert bytes_growth(caches, old, new).tolist() == want, (cap, more)


def test_a_step_of_windowed_layers_is_reserved_as_columns_as_one_by_one():
    store = _store()
    sessions = []
    for i, (n, sinks, window) in enumerate([(3, 2, 5), (4, 0, 9), (0, 6, 0), (8, 1, 1)]):
        s = store.create(SimpleNamespace(config=SimpleNamespace(num_layers=1), layers=[_windowed(n, sinks, window)],
                                         nbytes=0), owner=None, session_id=f"w{i}")  # fmt: skip
        s.layers[0].length, s.layers[0].capacity = n, -(-n // P) * P
        sessions.append(s)
    step, problems = _plan(store, sessions, 2, [None] * 4)
    assert not problems
    alone = [_plan(store, [s], 2, [None])[0] for s in sessions]
    assert step.delta_bytes == [r.delta_bytes[0] for r in alone] and any(step.delta_bytes)
    assert step.new_capacity == [r.new_capacity[0] for r in alone]
    assert step.delta_bytes == [s.layers[0].cache.bytes_for(c) - s.layers[0].cache.bytes_for(s.layers[0].capacity)
                                for s, c in zip(sessions, step.new_capacity)]  # fmt: skip


def test_a_failed_item_of_a_step_gives_its_rows_back_and_the_others_keep_theirs():
    store = _store()
    sessions = _sessions(store, [2, 2])
    step = _plan(store, sessions, 1, [None, None])[0]
    store.commit_step(step)
    later = _plan(store, sessions[1:], 1, [None])[0]  # a step of one queued behind the step
    store.commit_step(later)
    assert sessions[1].layers[0].inflight == [step, later]
    assert not store.cancellable(step)  # another job was checked against it
    assert store.cancellable(later)
    sessions[0].kv.layers[0].applied(1)  # item 0 ran; item 1 failed while planned
    store.finish_step(step, [None, RuntimeError("planned badly")])
    assert sessions[0].pending == 0 and sessions[0].layers[0].length == 3
    assert sessions[1].pending == 1 and sessions[1].layers[0].inflight == [later]
    assert sessions[1].layers[0].length == 3 and sessions[1].dirty  # its reserved row given back, under `later`'s
    sessions[1].kv.layers[0].applied(1)  # `later` ran
    store.finish_step(later, None)
    assert sessions[1].pending == 0 and sessions[1].layers[0].length == 3  # resynced from the cache
    assert not sessions[1].dirty and not sessions[1].failed


def test_a_step_dropped_by_the_timeout_is_cancellable_when_last_in_every_layer():
    store = _store()
    sessions = _sessions(store, [1, 1, 1])
    step = _plan(store, sessions, 1, [None] * 3)[0]
    store.commit_step(step)
    assert store.cancellable(step)
    store.finish_step(step, [TimeoutError()] * 3)  # cancelled: nothing applied
    assert [s.layers[0].length for s in sessions] == [1, 1, 1] and all(s.pending == 0 for s in sessions)
    read = _plan(store, sessions, 0, [1, 1, 1])[0]  # an attend without rows: no bytes, no capacity
    assert read.new_length == [1, 1, 1] and read.total_bytes == 0
