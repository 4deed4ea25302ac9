"""What a finished request leaves behind: nothing that only the cyclic garbage
collector frees. The server collects rarely (gc_policy: the youngest generation
every 50,000 allocations, what is alive at start frozen), so a reference cycle
through a request's job would keep its result (the reply's arrays) alive long past
the reply, and a busy server's resident set would grow with the requests it has
served. Counted with the collector off: what reference counting alone frees."""

from __future__ import annotations

import asyncio
import gc
import types
import weakref
from concurrent.futures import Future

import numpy as np
import pytest

from attnserve.runtime import Runtime
from attnserve.store import StepReservation
from attnserve_client import Client
from svc_helpers import rows


@pytest.fixture
def collector_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class _Result:
    """A job's result (weakly referable, as the arrays of a real one are not)."""

    errors: dict[int, BaseException] = {}


class _Reservation(StepReservation):
    """A reservation of no item (weakly referable: StepReservation has slots)."""

    def __init__(self):
        super().__init__([], [], 0, [], [], [], 0)


class _Store:
    def __init__(self):
        self.finished = []

    def finish_step(self, res, errors):
        self.finished.append(errors)

    def cancellable(self, res):
        return True


def _watch(timeout_s: float, *, cancel: bool) -> tuple[list[weakref.ref], list]:
    """Runtime.watch_all over two jobs, run to the end (each completes, or with
    ``cancel`` the request timeout cancels it before it starts); returns weak
    references to the futures, their results and the reservations, and what the
    store was told."""
    store = _Store()
    rt = types.SimpleNamespace(
        loop=None, store=store, settings=types.SimpleNamespace(request_timeout_s=timeout_s),
        metrics=types.SimpleNamespace(timeouts=types.SimpleNamespace(inc=lambda n: None)),
    )  # fmt: skip

    async def run() -> list[weakref.ref]:
        futs = [Future(), Future()]
        reservations = [_Reservation() for _ in futs]
        results = [_Result() for _ in futs]
        done = Runtime.watch_all(rt, futs, reservations, [lambda r: None] * len(futs))  # type: ignore[arg-type]
        if not cancel:
            for f, r in zip(futs, results):
                f.set_running_or_notify_cancel()
                f.set_result(r)
        await asyncio.wait_for(done, 10)
        return [weakref.ref(o) for o in (*futs, *results, *reservations)]

    refs = asyncio.run(run())
    return refs, store.finished


@pytest.mark.usefixtures("collector_off")
@pytest.mark.parametrize("timeout_s", [0.0, 60.0])
def test_a_settled_job_is_freed_by_reference_counting(timeout_s):
    """Once settled, a job's future, its result and its reservation are freed as
    soon as the request lets go of them: done's callback in the future named the
    job, which named the future (a cycle that held every result until a collection)."""
    refs, finished = _watch(timeout_s, cancel=False)
    assert finished == [None, None]
    assert [r() for r in refs] == [None] * len(refs)


@pytest.mark.usefixtures("collector_off")
def test_a_job_the_timeout_cancelled_is_freed_by_reference_counting():
    refs, finished = _watch(0.01, cancel=True)
    assert len(finished) == 2 and all(isinstance(e[0], asyncio.CancelledError) for e in finished if e)
    assert [r() for r in refs] == [None] * len(refs)


def _alive(kind: type) -> int:
    return sum(type(o) is kind for o in gc.get_objects())


@pytest.mark.usefixtures("collector_off")
def test_served_requests_leave_no_reservation_or_result_behind(server, rng):
    """50 attends and appends over HTTP and 50 over the WebSocket stream of a live
    server, the collector off: the jobs' reservations and futures (which hold their
    results) are all gone once the replies are read."""
    with Client(server.url) as client:
        s = client.create_session(num_qo_heads=4, num_kv_heads=2, head_dim=16)
        s.append(0, rows(rng, 8, 2, 16), rows(rng, 8, 2, 16))
        reservations, futures = _alive(StepReservation), _alive(Future)
        for i in range(50):
            if i % 10 == 0:
                s.append(0, rows(rng, 1, 2, 16), rows(rng, 1, 2, 16))
            else:
                out = s.attend(0, rows(rng, 8, 4, 16), causal=False)
                assert np.asarray(out).shape == (8, 4, 16)
        with client.stream() as st:
            for _ in range(50):
                st.attend(s.session_id, 0, rows(rng, 8, 4, 16), causal=False)
        assert _alive(StepReservation) - reservations < 5
        assert _alive(Future) - futures < 5
        s.delete()
