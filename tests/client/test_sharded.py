"""ShardedSession: one logical session over several servers by timestep ranges.

* The plan (which query rows go to which shard, at which local ``start_pos``,
  causal or whole) is checked without a server: every shard call simulated with the
  float64 oracle and merged must give the oracle's attention over all the keys,
  and every call must keep the server's rules.
* Against two and three live servers (in-process, on the shared test engine, whose
  pages are 16 timesteps: shards of 21 cross pages unevenly), one sharded session
  runs the same work as one unsharded session: prefill chunks straddling the shard
  borders, attends with an explicit ``start_pos``, non-causal ones, decode steps
  that open a new shard; f32 is compared with the unsharded session and the
  float64 oracle, a compressed format with its unsharded session of the same seed.
* ``open`` finds a sharded session again from its id alone, with new clients in
  either order: the same shards and spans, attends bit for bit the original
  object's, appends going on in the last shard and then a new one; an unknown id,
  a replica that does not answer, a shard on two replicas, a shard missing before
  a present one or one of another shape are refused.
* A replica out of memory closes its shard; a shard whose server is stopped, or
  that lost its session, makes the attend raise ``ShardLost`` naming it.
* Half queries (float16, bfloat16; numpy and torch): every shard is asked for
  float32 parts, and the merge is rounded once: bit for bit the float32 attend of
  the same values, rounded.

Tolerances (rel_err: max |error| over max |reference|), 1e-5 but for a compressed
format against the oracle (TQ4_ORACLE_TOL). f32: the
sharded and the unsharded outputs are the same float32 attention summed in another
order (each shard's partial softmax in float32, merged in float64 and rounded once,
where one session's kernel merges its own splits), a few float32 ulps apart; every
float32 kernel is within 1e-5 of the float64 oracle in the service tests too. A
compressed format (tq4) holds the same codes in the shards as in the unsharded
session (same seed; a row's code does not depend on its position), so again only
the order of the float32 sums differs, while one code that differed would miss by
the format's error (about 0.1). Measured on lavapipe: at most 7e-7 (f32, against
both) and 5e-7 (tq4 against its unsharded session; 8.9e-7 the worst of seeds 0..144,
``tools/seed_sweeps.py sharded-tq4``). tq4 against the float64 oracle of the exact
rows: see TQ4_ORACLE_TOL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from attnserve_client import (
    AsyncClient,
    CapacityExceeded,
    Client,
    InvalidInput,
    InvalidResponse,
    Session,
    SessionNotFound,
    ShardedSession,
    tensors,
    wire,
)
from attnserve_client.merge import merge
from attnserve_client.sharded import AsyncShardedSession, ShardLost, plan_attend
from tools.common import free_port, rel_err

try:
    from attnserve.config import Settings
    from tools import reference as ref
    from live_server import LiveServer
except ImportError as exc:  # the client alone: the live part cannot run
    if os.environ.get("CI"):
        raise
    pytest.skip(f"attnserve server not importable ({exc})", allow_module_level=True)

H, HKV, D = 6, 2, 64  # GQA group 3, head_dim 64
LAYERS = 2
SHARD = 21  # timesteps per shard: not a multiple of the engine's 16-timestep pages
SPEC = dict(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=LAYERS)
TOL = 1e-5
# tq4 against the float64 oracle of the rows as sent: lossy, but attention. The error
# is measured norm-wise (norm_err), over every element of an attend: rel_err's largest
# element over the largest value has a long tail (over seeds 0..1999 of this workload,
# median 0.23, p99 0.39, worst 0.59; ATTNSERVE_TEST_SEED=3588551583 gave 0.508 and
# failed the 0.5 bound it had). norm_err of an attend, the worst of the 19 per seed,
# over the same 2000 seeds (tools/seed_sweeps.py sharded-tq4-oracle: tq4 emulated by
# the oracle of its codes, which matched the live sharded run's rel_err to 5e-5 on
# seeds 0..144): mean 0.160, std 0.010, p99 0.198, worst 0.239 (a one-row decode
# step). The bound is 1.46 times that worst, 19 standard deviations above the mean;
# all zeros would be 1.0, attention over other rows about 1.4.
TQ4_ORACLE_TOL = 0.35


def norm_err(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| (Frobenius, in float64): a lossy format's error
    over every element, not its largest one (see TQ4_ORACLE_TOL)."""
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def rows(rng: np.random.Generator, n: int, heads: int) -> np.ndarray:
    return rng.standard_normal((n, heads, D)).astype(np.float32)


# -- the plan, without a server ---------------------------------------------------


def _simulate(spans, q, k, v, start_pos, causal, scale):
    """The plan's calls answered by the float64 oracle over each shard's keys, merged."""
    calls = plan_attend(spans, start_pos, q.shape[0], causal)
    parts = {}
    for c in calls:
        a, b = spans[c.shard]
        count = c.rows_stop - c.rows_start
        assert 0 <= c.start_pos and c.start_pos + count <= b - a, (c, spans)  # the server's rule
        if c.causal:  # a causal call's rows sit where the logical rows do
            assert a + c.start_pos == start_pos + c.rows_start, c
        out, lse = ref.attention(
            q[c.rows_start : c.rows_stop], k[a:b], v[a:b], start_pos=c.start_pos, causal=c.causal,
            scale=scale, return_lse=True,
        )  # fmt: skip
        part = parts.setdefault(c.shard, (np.zeros(q.shape), np.full(q.shape[:2], -np.inf)))
        assert np.all(np.isneginf(part[1][c.rows_start : c.rows_stop])), "a row twice on one shard"
        part[0][c.rows_start : c.rows_stop], part[1][c.rows_start : c.rows_stop] = out, lse
    return calls, merge(list(parts.values()))


def test_the_plan_merges_to_attention_over_all_keys(rng):
    for _ in range(300):
        sizes = rng.integers(0, 8, size=rng.integers(1, 6))
        if sizes.sum() == 0:
            sizes[0] = 1
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        spans = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        length = int(bounds[-1])
        n = int(rng.integers(1, length + 1))
        start_pos = int(rng.integers(0, length - n + 1))
        causal, scale = bool(rng.integers(2)), float(rng.uniform(0.05, 0.5))
        q, k, v = (
            rng.standard_normal((n, 3, 4)),
            rng.standard_normal((length, 1, 4)),
            rng.standard_normal((length, 1, 4)),
        )
        calls, (out, lse) = _simulate(spans, q, k, v, start_pos, causal, scale)
        want, want_lse = ref.attention(q, k, v, start_pos=start_pos, causal=causal, scale=scale, return_lse=True)
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-5, err_msg=f"{spans} {start_pos} {n} {causal}")
        np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)
        # no call to a shard no row sees: causal rows see up to their position
        last_seen = start_pos + n - 1 if causal else length - 1
        assert all(spans[c.shard][0] <= last_seen for c in calls), calls


def test_the_plan_of_a_decode_step_and_of_a_chunk_across_borders():
    spans = [(0, 21), (21, 42), (42, 50)]
    # decode (the last timestep): every earlier shard whole, the last one causal
    assert [(c.shard, c.rows_start, c.rows_stop, c.start_pos, c.causal) for c in plan_attend(spans, 49, 1, True)] == [
        (0, 0, 1, 20, False),
        (1, 0, 1, 20, False),
        (2, 0, 1, 7, True),
    ]
    # rows 15..34: shard 0 causal for rows 15..20, whole for 21..34 (14 rows <= 21);
    # shard 1 causal for 21..34; shard 2 seen by nobody
    got = [(c.shard, c.rows_start, c.rows_stop, c.start_pos, c.causal) for c in plan_attend(spans, 15, 20, True)]
    assert got == [(0, 0, 6, 15, True), (0, 6, 20, 7, False), (1, 6, 20, 0, True)]
    # non-causal: every shard whole; 30 rows over a shard of 8 go as calls of <= 8
    got = plan_attend(spans, 5, 30, False)
    assert [(c.shard, c.rows_stop - c.rows_start) for c in got] == [(0, 21), (0, 9), (1, 21), (1, 9)] + [
        (2, 8), (2, 8), (2, 8), (2, 6)
    ]  # fmt: skip
    assert all(not c.causal and c.start_pos == spans[c.shard][1] - spans[c.shard][0] - (c.rows_stop - c.rows_start)
               for c in got)  # fmt: skip


# -- live servers -------------------------------------------------------------------


def replica(engine: Any, name: str, **settings: Any) -> LiveServer:
    """The real app under uvicorn on a thread, on the shared test engine, started."""
    return LiveServer(Settings(instance_name=name, **settings), engine=engine).start()


@pytest.fixture(scope="module")
def replicas(engine) -> Iterator[list[LiveServer]]:
    servers = [replica(engine, f"r{i}") for i in range(3)]
    yield servers
    for s in servers:
        s.stop()


def _clients(urls: list[str], **kw: Any) -> list[Client]:
    return [Client(url, **kw) for url in urls]


def _id_on(first: int, count: int, prefix: str) -> str:
    """A logical session id whose shard 0 goes to replica ``first`` of ``count``."""
    return next(f"{prefix}{i}" for i in range(1000) if zlib.crc32(f"{prefix}{i}".encode()) % count == first)


def _workload(rng: np.random.Generator, prefill: int = 58, chunk: int = 12, decode: int = 8) -> dict:
    """Per layer: prefill chunks (fused attends), then decode steps; and the extra
    attends over the prefilled cache."""
    k, v = rows(rng, prefill + decode, HKV), rows(rng, prefill + decode, HKV)
    return {
        "chunks": [(s, min(s + chunk, prefill)) for s in range(0, prefill, chunk)],
        "k": [k, rows(rng, prefill + decode, HKV)],
        "v": [v, rows(rng, prefill + decode, HKV)],
        "q": [rows(rng, prefill + decode, H) for _ in range(LAYERS)],
        "prefill": prefill,
        "decode": decode,
        "extra_q": rows(rng, 30, H),
    }


def _run(session: Any, w: dict, fused: bool = True) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Drive ``session`` (sharded or not) through ``w``; return (what, out, oracle) per
    attend. ``fused=False``: the rows of a fused attend are appended first, on their own."""
    results = []

    def attend(what: str, layer: int, q, length: int, **kw: Any) -> None:
        if not fused and "k" in kw:
            session.append(layer, kw.pop("k"), kw.pop("v"))
        out = session.attend(layer, q, **kw)
        start = kw.get("start_pos", length - q.shape[0])
        want = ref.attention(q, w["k"][layer][:length], w["v"][layer][:length], start_pos=start,
                             causal=kw.get("causal", True), scale=kw.get("scale"))  # fmt: skip
        results.append((what, np.asarray(out), want))

    for a, b in w["chunks"]:
        for layer in range(LAYERS):
            kv = dict(k=w["k"][layer][a:b], v=w["v"][layer][a:b])
            attend(f"prefill [{a}, {b}) layer {layer}", layer, w["q"][layer][a:b], b, **kv)
    p, q = w["prefill"], w["extra_q"]
    attend("causal rows 15..34", 0, q[:20], p, start_pos=15)
    attend("non-causal, more rows than a shard", 1, q, p, start_pos=5, causal=False)
    attend("every row, scaled", 0, np.concatenate([q, q])[: p - 2], p, start_pos=1, scale=0.3)
    for t in range(p, p + w["decode"]):
        for layer in range(LAYERS):
            kv = dict(k=w["k"][layer][t : t + 1], v=w["v"][layer][t : t + 1])
            attend(f"decode {t} layer {layer}", layer, w["q"][layer][t : t + 1], t + 1, **kv)
    return results


@pytest.mark.parametrize("count", [2, 3])
def test_sharded_f32_matches_the_unsharded_session_and_the_oracle(replicas, rng, count):
    urls = [r.url for r in replicas[:count]]
    clients = _clients(urls)
    w = _workload(rng)
    try:
        plain = clients[0].create_session(**SPEC)
        expected = _run(plain, w)
        plain.delete()
        with ShardedSession.create(clients, shard_tokens=SHARD, **SPEC) as sharded:
            got = _run(sharded, w)
            total = w["prefill"] + w["decode"]
            assert sharded.lengths == (total,) * LAYERS
            shards = sharded.shards
            # 66 timesteps in shards of 21: four shards, the last opened by a decode step
            assert [view.spans for view in shards] == [((a, min(a + SHARD, total)),) * LAYERS for a in range(0, 64, 21)]
            assert {view.capacity for view in shards} == {SHARD}
            # round robin: consecutive shards on consecutive replicas, from the id's hash
            first = urls.index(shards[0].base_url)
            assert first == zlib.crc32(sharded.session_id.encode()) % count
            assert [view.base_url for view in shards] == [urls[(first + j) % count] for j in range(len(shards))]
            # each shard an ordinary session on its server, named after the logical id
            for view in shards:
                held = {s.session_id: s for s in clients[urls.index(view.base_url)].list_sessions()}
                assert view.session_id == f"{sharded.session_id}-s{view.index}"
                assert held[view.session_id].lengths == tuple(b - a for a, b in view.spans)
            # the last decode step again with its lse: the merged lse is the oracle's
            t = total - 1
            q = w["q"][1][t : t + 1]
            out, lse = sharded.attend(1, q, return_lse=True)
            want, want_lse = ref.attention(q, w["k"][1][:total], w["v"][1][:total], return_lse=True)
            assert rel_err(out, want) < TOL
            np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)
        for client in clients:  # the context manager deleted every shard
            assert not [s for s in client.list_sessions() if s.session_id.startswith(sharded.session_id)]
    finally:
        for client in clients:
            client.close()
    assert len(got) == len(expected)
    for (what, out, want), (_, plain_out, _) in zip(got, expected):
        assert rel_err(out, plain_out) < TOL, what
        assert rel_err(out, want) < TOL, what


def compressed_runs(clients: list[Client], rng: np.random.Generator) -> list[tuple[str, Any, Any, Any]]:
    """A tq4 workload on an unsharded session, then on a sharded one of the same seed
    over the first two of ``clients``: per attend, (what, the sharded output, the
    unsharded one, the float64 oracle of the rows as sent). The test's, and
    ``tools/seed_sweeps.py sharded-tq4``'s over many seeds."""
    spec = dict(SPEC, kv_format="tq4")
    w = _workload(rng, prefill=40, chunk=16, decode=5)
    plain = clients[0].create_session(seed=1234, **spec)
    expected = _run(plain, w)
    plain.delete()
    with ShardedSession.create(clients[:2], shard_tokens=SHARD, seed=1234, **spec) as sharded:
        got = _run(sharded, w)
        assert len(sharded.shards) == 3
        seeds = {s.seed for c in clients for s in c.list_sessions() if s.session_id.startswith(sharded.session_id)}
        assert seeds == {1234}
    return [(what, out, plain_out, want) for (what, out, want), (_, plain_out, _) in zip(got, expected)]


def test_a_compressed_format_matches_its_unsharded_session(replicas, rng):
    clients = _clients([r.url for r in replicas[:2]])
    try:
        runs = compressed_runs(clients, rng)
    finally:
        for client in clients:
            client.close()
    for what, out, plain_out, want in runs:
        assert rel_err(out, plain_out) < TOL, what
        assert norm_err(out, want) < TQ4_ORACLE_TOL, what  # lossy, but attention


def test_shards_share_the_first_shards_seed_and_the_logical_cap_holds(replicas):
    urls = [r.url for r in replicas[:2]]
    clients = _clients(urls)
    ones = np.ones((48, HKV, D))
    try:
        with ShardedSession.create(clients, kv_format="tq4", **SPEC) as s:  # no seed: the server picks shard 0's
            s.append(0, ones, ones)
            (only,) = s.shards
            info = clients[urls.index(only.base_url)].get_session(only.session_id).info()
            assert only.capacity == info.max_tokens > 48  # default shard_tokens: the server's max_tokens
        with ShardedSession.create(clients, kv_format="tq4", shard_tokens=SHARD, max_tokens=50, **SPEC) as s:
            s.append(0, ones, ones)
            infos = [clients[urls.index(v.base_url)].get_session(v.session_id).info() for v in s.shards]
            assert len(infos) == 3 and len({i.seed for i in infos}) == 1
            with pytest.raises(CapacityExceeded) as caught:  # the logical cap, refused before sending
                s.append(0, ones[:3], ones[:3])
            assert isinstance(caught.value, InvalidInput) and s.lengths == (48, 0)
    finally:
        for client in clients:
            client.close()


def test_the_async_session_and_torch_tensors(replicas, rng):
    torch = pytest.importorskip("torch")
    w = _workload(rng, prefill=30, chunk=10, decode=3)
    urls = [r.url for r in replicas]

    async def main() -> list:
        clients = [AsyncClient(url) for url in urls]
        try:
            async with await AsyncShardedSession.create(clients, shard_tokens=SHARD, **SPEC) as s:
                outs = []
                for a, b in w["chunks"]:
                    await s.append(0, w["k"][0][a:b], w["v"][0][a:b])
                q = torch.from_numpy(w["extra_q"][:12]).to(torch.float64)
                got = await s.attend(0, q, start_pos=14, return_lse=True)
                outs.append(got)
                assert len(s.shards) == 2 and s.lengths[0] == 30
            return outs
        finally:
            for c in clients:
                await c.close()

    ((out, lse),) = asyncio.run(main())
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64 and isinstance(lse, torch.Tensor)
    want, want_lse = ref.attention(w["extra_q"][:12], w["k"][0][:30], w["v"][0][:30], start_pos=14, return_lse=True)
    assert rel_err(out.numpy(), want) < TOL
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "appended"])
def test_a_replica_out_of_memory_closes_its_shard(engine, replicas, rng, fused):
    # f32 at 2 KV heads of 64: 16 KiB per 16-timestep page and layer; the tight
    # replica holds 3 pages: layer 0 takes its second page, layer 1's is refused
    tight = replica(engine, "tight", memory_budget_bytes=3 * 16 * 1024)
    urls = [tight.url, replicas[0].url]
    clients = _clients(urls)
    w = _workload(rng, prefill=48, chunk=12, decode=2)
    try:
        session = ShardedSession.create(clients, shard_tokens=1000, session_id=_id_on(0, 2, "oom"), **SPEC)
        got = _run(session, w, fused)
        views = session.shards
        assert views[0].base_url == tight.url and views[0].closed and views[1].base_url == replicas[0].url
        # borders per layer: layer 0 filled 24 timesteps there, layer 1 only 12
        assert views[0].spans == ((0, 24), (0, 12)) and views[1].spans == ((24, 50), (12, 50))
        session.delete()
    finally:
        for client in clients:
            client.close()
        tight.stop()
    for what, out, want in got:
        assert rel_err(out, want) < TOL, what


def test_a_decode_step_is_one_call_per_shard_with_the_append_on_the_last(replicas, rng):
    sent: list[str] = []
    urls = [r.url for r in replicas[:2]]
    pools = [httpx.Client(event_hooks={"request": [lambda r: sent.append(f"{r.method} {r.url.path}")]}) for _ in urls]
    clients = [Client(url, http_client=pool) for url, pool in zip(urls, pools)]
    try:
        with ShardedSession.create(clients, shard_tokens=SHARD, **SPEC) as s:
            s.append(0, rows(rng, 30, HKV), rows(rng, 30, HKV))
            ids = [view.session_id for view in s.shards]
            sent.clear()
            s.attend(0, rows(rng, 1, H), k=rows(rng, 1, HKV), v=rows(rng, 1, HKV))
            assert sorted(sent) == sorted(f"POST /v1/sessions/{sid}/layers/0/attend" for sid in ids)
            assert s.lengths == (31, 0)
    finally:
        for client, pool in zip(clients, pools):
            client.close()
            pool.close()


@pytest.mark.parametrize("how", ["server stopped", "session gone"])
def test_a_lost_shard_is_named_and_nothing_is_answered(engine, replicas, rng, how):
    doomed = replica(engine, "doomed")
    urls = [replicas[1].url, doomed.url]
    clients = _clients(urls, max_retries=0)
    try:
        session = ShardedSession.create(clients, shard_tokens=SHARD, session_id=_id_on(0, 2, "lost"), **SPEC)
        k, v = rows(rng, 30, HKV), rows(rng, 30, HKV)
        session.append(0, k, v)  # [0, 21) on replicas[1], [21, 30) on the doomed one
        lost = session.shards[1]
        assert lost.base_url == doomed.url and lost.spans[0] == (21, 30)
        if how == "server stopped":
            doomed.stop()
        else:  # as after a restart without a snapshot directory
            clients[1].delete_session(lost.session_id)
        calls = [
            lambda: session.attend(0, rows(rng, 1, H)),  # every shard
            lambda: session.attend(0, rows(rng, 4, H), start_pos=25),
            lambda: session.attend(0, rows(rng, 1, H), k=k[:1], v=v[:1]),  # the lost shard appends
            lambda: session.attend(0, rows(rng, 2, H)),  # its length may be unknown now: asked first
        ]
        for i, call in enumerate(calls):
            with pytest.raises(ShardLost) as caught:
                call()
            error = caught.value
            assert [ref.index for ref in error.shards] == [1]
            message = str(error)
            for part in (lost.session_id, doomed.url, "timesteps [21, 30) of layer 0"):
                assert part in message, message
            if i == 1:  # a causal attend that reads shard 0 only still answers
                assert session.attend(0, rows(rng, 3, H), start_pos=2).shape == (3, H, D)
        if how == "server stopped":
            with pytest.raises(ShardLost):
                session.delete()  # shard 0 is deleted all the same
        else:
            session.delete()  # a shard already gone counts as deleted
        with Client(replicas[1].url) as c:
            assert not [s for s in c.list_sessions() if s.session_id.startswith(session.session_id)]
    finally:
        for client in clients:
            client.close()
        doomed.stop()


# -- re-opening a sharded session from its id ----------------------------------------


def _held(clients: list[Client], session_id: str) -> list[str]:
    """The shard sessions of ``session_id`` on the servers of ``clients``."""
    return sorted(s.session_id for c in clients for s in c.list_sessions() if s.session_id.startswith(session_id))


def _placed(views: Any) -> list[tuple]:
    """The views without ``closed`` (a re-opened session closes all but the last)."""
    return [(v.index, v.session_id, v.base_url, v.capacity, v.spans) for v in views]


@pytest.mark.parametrize("count", [2, 3])
def test_open_finds_the_shards_again_and_answers_the_same(replicas, rng, count):
    urls = [r.url for r in replicas[:count]]
    clients = _clients(urls)
    k = [rows(rng, 70, HKV) for _ in range(LAYERS)]
    v = [rows(rng, 70, HKV) for _ in range(LAYERS)]
    q = rows(rng, 10, H)
    original = ShardedSession.create(clients, shard_tokens=SHARD, **SPEC)
    sid = original.session_id
    try:
        for layer in range(LAYERS):  # 50 rows: [0, 21), [21, 42), [42, 50)
            original.append(layer, k[layer][:30], v[layer][:30])
            original.append(layer, k[layer][30:50], v[layer][30:50])
        asks = [  # a decode step; a causal chunk at rows 15..24 across the border at 21; non-causal
            (0, q[:1], {}),
            (1, q[:1], {"start_pos": 49}),
            (0, q, {"start_pos": 15}),
            (1, q, {"start_pos": 38, "return_lse": True}),
            (0, q, {"start_pos": 3, "causal": False}),
        ]
        expected = [original.attend(layer, qq, **kw) for layer, qq, kw in asks]
        for order in (urls, urls[::-1]):  # new clients, in the order given and reversed
            again_clients = _clients(order)
            again = ShardedSession.open(again_clients, sid)
            try:
                assert again.session_id == sid and again.lengths == original.lengths == (50, 50)
                assert _placed(again.shards) == _placed(original.shards)
                assert [view.closed for view in again.shards] == [True, True, False]
                assert len(again.shards) == 3
                for (layer, qq, kw), want in zip(asks, expected):
                    got = again.attend(layer, qq, **kw)
                    pairs = zip(got, want) if kw.get("return_lse") else [(got, want)]
                    assert all(np.array_equal(a, b) for a, b in pairs), (layer, kw)  # bit for bit
            finally:
                again.close()
                for client in again_clients:
                    client.close()

        # appends through a re-opened session (clients reversed) go on in the last shard,
        # then open the next one on the replica after it, in the new order
        order = urls[::-1]
        again_clients = _clients(order)
        with ShardedSession.open(again_clients, sid) as again:
            for layer in range(LAYERS):
                again.attend(layer, q[:1], k=k[layer][50:51], v=v[layer][50:51])  # a fused decode step
            assert [view.spans[0] for view in again.shards] == [(0, 21), (21, 42), (42, 51)]
            for layer in range(LAYERS):
                assert again.append(layer, k[layer][51:65], v[layer][51:65]) == 65
            views = again.shards
            assert [view.spans for view in views] == [((a, min(a + SHARD, 65)),) * LAYERS for a in (0, 21, 42, 63)]
            assert views[3].session_id == f"{sid}-s3" and views[3].capacity == SHARD
            assert views[3].base_url == order[(order.index(views[2].base_url) + 1) % count]
            for layer in range(LAYERS):
                out = again.attend(layer, q, start_pos=40)
                want = ref.attention(q, k[layer][:65], v[layer][:65], start_pos=40)
                assert rel_err(out, want) < TOL
        assert _held(clients, sid) == []  # leaving the block deleted every shard, the new one too
    finally:
        original.close()
        for client in clients:
            for shard_id in _held([client], sid):
                client.delete_session(shard_id)
            client.close()


def test_open_refuses_what_is_not_one_whole_sharded_session(replicas, rng):
    urls = [r.url for r in replicas[:2]]
    clients = _clients(urls)
    try:
        with pytest.raises(SessionNotFound) as caught:
            ShardedSession.open(clients, "never-made")
        assert "never-made" in str(caught.value) and caught.value.status == 404

        with ShardedSession.create(clients, shard_tokens=SHARD, session_id=_id_on(0, 2, "gap"), **SPEC) as s:
            s.append(0, rows(rng, 50, HKV), rows(rng, 50, HKV))  # three shards
            # a replica that does not answer might hold a shard: never a partial answer
            dead = f"http://127.0.0.1:{free_port()}"
            with Client(dead, max_retries=0) as nobody, pytest.raises(ShardLost) as lost:
                ShardedSession.open([*clients, nobody], s.session_id)
            assert dead in str(lost.value) and lost.value.shard.index == 0
            # a shard on two replicas
            spare = Client(replicas[2].url)
            try:
                spare.create_session(session_id=f"{s.session_id}-s1", **SPEC)
                with pytest.raises(InvalidResponse) as twice:
                    ShardedSession.open([*clients, spare], s.session_id)
                for url in (s.shards[1].base_url, replicas[2].url):
                    assert url in str(twice.value)
                spare.delete_session(f"{s.session_id}-s1")
            finally:
                spare.close()
            # a shard lost in the middle (a restart without snapshots): the next one says so
            middle = s.shards[1]
            clients[urls.index(middle.base_url)].delete_session(middle.session_id)
            with pytest.raises(ShardLost) as gap:
                ShardedSession.open(clients, s.session_id)
            assert gap.value.shard.session_id == middle.session_id
            clients[urls.index(middle.base_url)].create_session(session_id=middle.session_id, **dict(SPEC, head_dim=32))
            with pytest.raises(InvalidResponse, match="head_dim 32"):  # a shard not like shard 0
                ShardedSession.open(clients, s.session_id)
    finally:
        for client in clients:
            client.close()


def test_the_async_open(replicas, rng):
    urls = [r.url for r in replicas]
    k, v, q = rows(rng, 40, HKV), rows(rng, 40, HKV), rows(rng, 8, H)
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(Client(url)) for url in urls]
        original = ShardedSession.create(clients, shard_tokens=SHARD, **SPEC)
        stack.callback(original.close)
        original.append(0, k[:30], v[:30])
        want = original.attend(0, q, start_pos=16)

        async def main() -> None:
            again_clients = [AsyncClient(url) for url in urls[1:] + urls[:1]]
            try:
                with pytest.raises(SessionNotFound):
                    await AsyncShardedSession.open(again_clients, "never-made")
                async with await AsyncShardedSession.open(again_clients, original.session_id) as again:
                    assert _placed(again.shards) == _placed(original.shards) and again.lengths == (30, 0)
                    assert np.array_equal(await again.attend(0, q, start_pos=16), want)
                    assert await again.append(0, k[30:40], v[30:40]) == 40
                    assert [view.spans[0] for view in again.shards] == [(0, 21), (21, 40)]
                    out = await again.attend(0, q)
                    assert rel_err(out, ref.attention(q, k, v, start_pos=32)) < TOL
            finally:
                for c in again_clients:
                    await c.close()

        asyncio.run(main())
        assert _held(clients, original.session_id) == []


def test_half_queries_are_merged_in_float32_and_rounded_once(replicas, rng, monkeypatch):
    torch = pytest.importorskip("torch")
    asked = []
    attend = Session.attend

    def shard_attend(self, *args, **kw):
        asked.append(kw.get("out_dtype"))
        return attend(self, *args, **kw)

    monkeypatch.setattr(Session, "attend", shard_attend)
    clients = _clients([r.url for r in replicas[:2]])
    try:
        with ShardedSession.create(clients, shard_tokens=SHARD, **SPEC) as s:
            s.append(0, rows(rng, 50, HKV), rows(rng, 50, HKV))  # three shards: rows at 30.. see two
            q32 = rows(rng, 4, H)
            for name, q in (("<f2", q32.astype(np.float16)), ("bfloat16", wire.to_bfloat16(q32))):
                merged = s.attend(0, wire.to_float32(q), start_pos=30)  # float32 of the same values
                got = s.attend(0, q, start_pos=30)
                assert got.dtype == wire.DTYPES[name] and got.tobytes() == tensors.to_wire_dtype(merged, name).tobytes()
                assert s.attend(0, q, start_pos=30, out_dtype="float32").tobytes() == merged.tobytes()
            t = torch.from_numpy(q32).bfloat16()
            out, lse = s.attend(0, t, start_pos=30, return_lse=True)
            merged = s.attend(0, t.float().numpy(), start_pos=30)
            assert out.dtype == torch.bfloat16 and torch.equal(out, torch.from_numpy(merged.copy()).bfloat16())
            assert s.attend(0, t, start_pos=30, out_dtype=torch.float32).dtype == torch.float32
            with pytest.raises(InvalidInput, match=r"^out_dtype: expected one of"):
                s.attend(0, q32, out_dtype=np.float64)
        assert asked and set(asked) == {"<f4"}  # every shard call: float32 parts
    finally:
        for client in clients:
            client.close()
