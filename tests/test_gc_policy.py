"""The serving process's garbage-collector policy (attnserve.gc_policy)."""

from __future__ import annotations

import gc

import pytest

from attnserve.gc_policy import apply_gc_policy


@pytest.fixture
def collector():
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


@pytest.mark.usefixtures("collector")
def test_freezes_what_is_alive_and_raises_the_youngest_threshold():
    older = gc.get_threshold()[1:]
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    kept = [[i] for i in range(1000)]  # alive at start-up: frozen with the rest
    assert apply_gc_policy(40_000) == (40_000, *older)
    assert gc.get_threshold() == (40_000, *older)
    assert gc.get_freeze_count() >= len(kept)
    # cycles made after it are still collected
    cycle = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1


@pytest.mark.usefixtures("collector")
def test_zero_leaves_the_collector_as_it_is():
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    assert apply_gc_policy(0) == (700, 10, 10)
    assert gc.get_freeze_count() == 0
