"""The GPU worker's pipeline: a batch is recorded and submitted while the one before
it still runs, and read back after; the answers and the caches are bit for bit those
of the same jobs run one at a time."""

from __future__ import annotations

import threading

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
    for (out, length), (want_out, want_length) in zip(got, want):
        assert length == want_length and out.tobytes() == want_out.tobytes()
    for a, b in zip(piped, alone):
        assert a.layers[0].length == b.layers[0].length
        for wa, wb in zip(read_words(engine, a.layers[0]), read_words(engine, b.layers[0])):
            assert np.array_equal(wa, wb)
    for s in piped + alone:
        engine.release(s).result()
