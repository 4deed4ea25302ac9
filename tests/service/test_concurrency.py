"""Many clients at once: no cross-talk between sessions, atomic concurrent appends to one
session, coalesced GPU submissions, and probes that stay fast while the GPU is busy."""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tools import reference as ref
from svc_helpers import F32_TOL, Api, Model, rel_err, rows

THREADS = 16


def _drive_one_session(url: str, seed: int, steps: int) -> list[float]:
    """One client thread: its own session and data; returns every step's error."""
    rng = np.random.default_rng(seed)
    h, hkv, d = (8, 2, 32) if seed % 2 else (4, 4, 16)
    api = Api(url)
    enc = "msgpack" if seed % 3 else "json"
    try:
        sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2, session_id=f"conc-{seed}")[
            "session_id"
        ]
        m = Model(h, hkv, d, 2)
        errs = []
        n0 = 3 + seed % 5
        for layer in range(2):
            k, v = rows(rng, n0, hkv, d), rows(rng, n0, hkv, d)
            assert api.append(sid, layer, k, v, offset=0, enc=enc).status == 200
            m.add(layer, k, v)
        for step in range(steps):
            layer = step % 2
            q, k, v = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
            r = api.attend(sid, layer, q, k=k, v=v, offset=m.lengths[layer], enc=enc)
            assert r.status == 200, r.body
            m.add(layer, k, v)
            assert r.body["length"] == m.lengths[layer]
            errs.append(rel_err(r.body["out"], m.attention(layer, q)))
        assert api.info(sid)["lengths"] == m.lengths
        assert api.delete(sid).status == 204
        return errs
    finally:
        api.close()


def test_16_threads_16_sessions_no_cross_talk(server):
    def submissions() -> tuple[float, float]:  # (those of one job, all)
        value, name = server.runtime.metrics.registry.get_sample_value, "attnserve_gpu_jobs_per_submission"
        return value(name + "_bucket", {"le": "1"}) or 0.0, value(name + "_count") or 0.0

    before = submissions()
    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(lambda s: _drive_one_session(server.url, s, 40), range(THREADS)))
    for seed, errs in enumerate(results):
        assert len(errs) == 40 and max(errs) <= F32_TOL, (seed, max(errs))
    after = submissions()
    single, total = after[0] - before[0], after[1] - before[1]  # submissions with exactly one job, all
    assert total > 0 and single < total, "concurrent requests were never coalesced into one submission"


def test_concurrent_appends_to_one_session_are_atomic(api, server, rng):
    h, hkv, d = 2, 1, 8
    sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, max_tokens=200)["session_id"]
    data = [(rows(rng, i + 1, hkv, d), rows(rng, i + 1, hkv, d)) for i in range(THREADS)]
    clients = [Api(server.url) for _ in range(THREADS)]
    barrier = threading.Barrier(THREADS)

    def go(i: int):
        barrier.wait()
        return clients[i].append(sid, 0, *data[i], offset=0)

    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(go, range(THREADS)))
    winners = [i for i, r in enumerate(answers) if r.status == 200]
    assert len(winners) == 1, [r.status for r in answers]  # exactly one append at offset 0 lands
    w = winners[0]
    for i, r in enumerate(answers):
        if i != w:
            assert r.status == 409 and r.body["type"] == "/problems/offset-mismatch"
            assert r.body["length"] == w + 1
    # without offsets, every append lands, each whole, in some order
    barrier.reset()

    def go_free(i: int):
        barrier.wait()
        return clients[i].append(sid, 0, *data[i])

    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(go_free, range(THREADS)))
    assert all(r.status == 200 for r in answers)
    total = w + 1 + sum(i + 1 for i in range(THREADS))
    lengths = sorted(r.body["length"] for r in answers)
    assert lengths[-1] == total and len(set(lengths)) == THREADS
    # the order of the lengths is the order of the rows in the cache: rebuild it and check
    order = sorted(range(THREADS), key=lambda i: answers[i].body["length"])
    k = np.concatenate([data[w][0]] + [data[i][0] for i in order])
    v = np.concatenate([data[w][1]] + [data[i][1] for i in order])
    prev = w + 1
    for i in order:  # each append landed whole, right after the one before it
        assert answers[i].body["length"] == prev + data[i][0].shape[0]
        prev = answers[i].body["length"]
    q = rows(rng, 3, h, d)
    r = api.attend(sid, 0, q)
    assert r.body["length"] == total and rel_err(r.body["out"], ref.attention(q, k, v)) <= F32_TOL
    assert api.info(sid)["lengths"] == [total]
    for c in clients:
        c.close()
    api.delete(sid)


def test_probes_stay_fast_while_the_gpu_is_busy(api, server, rng):
    """A long attend (a second or more on lavapipe) in flight: /livez, /readyz and
    /metrics still answer at once (the event loop never waits on the GPU)."""
    h = hkv = 8
    d = 128
    sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)["session_id"]
    k, v = rows(rng, 2048, hkv, d), rows(rng, 2048, hkv, d)
    assert api.append(sid, 0, k, v).status == 200
    q_slow = rows(rng, 24, h, d)
    done = threading.Event()
    results = {}

    def slow():
        c = Api(server.url)
        t0 = time.perf_counter()
        results["slow"] = c.attend(sid, 0, q_slow, causal=False)
        results["slow_s"] = time.perf_counter() - t0
        c.close()
        done.set()

    worst = 0.0
    probes = 0
    # The server runs in this test process, whose heap (every test module, torch, the
    # fuzzers) a full garbage collection walks for hundreds of ms late in the suite,
    # stopping the event loop with it: frozen first, as `attnserve serve` freezes its
    # own after start (gc_policy.py), so what is timed is the loop's own behaviour.
    gc.freeze()
    th = threading.Thread(target=slow)
    th.start()
    probe = Api(server.url)
    try:
        while not done.is_set():
            for path in ("/livez", "/readyz", "/metrics"):
                t0 = time.perf_counter()
                assert probe.call("GET", path).status == 200
                worst = max(worst, time.perf_counter() - t0)
                probes += 1
            time.sleep(0.005)
    finally:
        th.join()
        probe.close()
        gc.unfreeze()
    assert results["slow"].status == 200
    assert rel_err(results["slow"].body["out"], ref.attention(q_slow, k, v, causal=False)) <= F32_TOL
    print(f"slow attend {results['slow_s']:.2f}s; {probes} probes, slowest {worst * 1000:.1f} ms")
    assert probes >= 6, probes
    assert worst < max(0.25, results["slow_s"] / 5), (worst, results["slow_s"])
    # a large JSON body (~4 MB, decoded and its answer encoded on a worker thread) is right too
    q = rows(rng, 300, h, d)
    r = api.attend(sid, 0, q, start_pos=0, enc="json")
    assert r.status == 200 and rel_err(r.body["out"], ref.attention(q, k, v, start_pos=0)) <= F32_TOL
    api.delete(sid)
