"""Store.step_group: the sessions a stacked step names, resolved once and kept while
no session is added or removed (what every layer of an engine's step, and the steps
after it, reuse); host only."""

from __future__ import annotations

import time
from types import SimpleNamespace

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
    g2 = store.step_group(["a", "b"], "k")
    assert g2 is not g and g2.sessions == [a, b] and g2.memo == {}  # a session left: resolved again
    store.remove(b)
    assert store.step_group(["a", "b"], "k") is None  # not there: the caller names the problem
    b2 = store.create(_kv(), owner="k", session_id="b")
    assert store.step_group(["a", "b"], "k").sessions == [a, b2]  # the new session under the id


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
