"""The GPU worker's pipeline: a batch is recorded and submitted while the one before
it still runs, and read back after; the answers and the caches are bit for bit those
of the same jobs run one at a time."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from _core import CORE_PAGE_TOKENS as P, read_words, rows, session


@pytest.mark.parametrize("fmt", ["f32", "turboquant"])
def test_pipelined_batches_answer_as_one_at_a_time(engine, rng, fmt):
    h, hkv, d = 4, 2, 32
    seeds = [int(rng.integers(2**53)) for _ in range(3)]
    piped = [session(engine, fmt, h, hkv, d, seed=s) for s in seeds]
    alone = [session(engine, fmt, h, hkv, d, seed=s) for s in seeds]
    for a, b in zip(piped, alone):
        k, v = rows(rng, 2 * P + 3, hkv, d), rows(rng, 2 * P + 3, hkv, d)
        engine.append(a.layers[0], k, v).result()
        engine.append(b.layers[0], k, v).result()
    # fused steps cycling over the sessions (each step's append lands after the
    # previous step's read of that layer), with a read-only attend and a prefill chunk
    steps = []
    for i in range(12):
        n = 5 if i == 4 else 1
        kv = None if i == 7 else (rows(rng, n, hkv, d), rows(rng, n, hkv, d))
        steps.append((i % 3, rows(rng, n, h, d), kv))
    want = []
    for j, q, kv in steps:
        fused = {} if kv is None else {"k": kv[0], "v": kv[1]}
        want.append(engine.attend(alone[j].layers[0], q, **fused).result())
    worker = engine.worker
    saved, overlapped = worker.max_batch_jobs, worker.overlapped
    gate, held = threading.Event(), threading.Event()
    worker.max_batch_jobs = 1  # one job per batch: every step its own submission
    try:
        hold = engine.call(lambda ctx: (held.set(), gate.wait(30)))
        assert held.wait(10)
        futures = []
        for j, q, kv in steps:
            fused = {} if kv is None else {"k": kv[0], "v": kv[1]}
            futures.append(engine.submit_group([engine.plan_attend(piped[j].layers[0], q, **fused)])[0])
        gate.set()
        hold.result(30)
        got = [f.result(60) for f in futures]
    finally:
        worker.max_batch_jobs = saved
    assert worker.overlapped - overlapped >= len(steps) - 1  # each submitted while the one before ran
    deadline = time.monotonic() + 10
    while worker.queue_depth and time.monotonic() < deadline:  # the last batch read back: idle again
        time.sleep(0.01)
    assert worker.queue_depth == 0
    for (out, length), (want_out, want_length) in zip(got, want):
        assert length == want_length and out.tobytes() == want_out.tobytes()
    for a, b in zip(piped, alone):
        assert a.layers[0].length == b.layers[0].length
        for wa, wb in zip(read_words(engine, a.layers[0]), read_words(engine, b.layers[0])):
            assert np.array_equal(wa, wb)
    for s in piped + alone:
        engine.release(s).result()


def test_a_failing_job_between_pipelined_batches_fails_alone(engine, rng):
    """A job that raises while the batch before it is in flight fails only itself
    (rolled back: its layer is as before), and the batches around it answer right."""
    h, hkv, d = 4, 2, 32
    s = session(engine, "f32", h, hkv, d)
    k0 = rows(rng, P + 5, hkv, d)
    engine.append(s.layers[0], k0, k0).result()
    worker = engine.worker
    saved = worker.max_batch_jobs
    gate, held = threading.Event(), threading.Event()

    def bad(batch):  # an append planned (as the engine plans it: undone on rollback), then a failure
        engine.plan_append(s.layers[0], rows(rng, 3, hkv, d), rows(rng, 3, hkv, d))(batch)
        raise RuntimeError("this job fails after planning an append")

    q = [rows(rng, 1, h, d) for _ in range(3)]
    worker.max_batch_jobs = 1
    try:
        hold = engine.call(lambda ctx: (held.set(), gate.wait(30)))
        assert held.wait(10)
        futures = [
            engine.submit_group([engine.plan_attend(s.layers[0], q[0])])[0],
            engine.submit_group([bad])[0],
            engine.submit_group([engine.plan_attend(s.layers[0], q[1])])[0],
        ]
        gate.set()
        hold.result(30)
        with pytest.raises(RuntimeError, match="fails after planning"):
            futures[1].result(60)
        first, third = futures[0].result(60), futures[2].result(60)
    finally:
        worker.max_batch_jobs = saved
    assert first.length == third.length == P + 5 == s.layers[0].length  # the failed append left nothing
    want = engine.attend(s.layers[0], q[1]).result()
    assert third.out.tobytes() == want.out.tobytes()
    engine.release(s).result()
