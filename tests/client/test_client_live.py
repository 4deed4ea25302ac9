"""The client against the real server, run in-process (``live_server_url`` in conftest.py).

Skipped while the server package cannot be imported, except under CI, where that
fails. The exceptions that need a differently configured server (a tiny body limit,
a session limit, a full queue, a draining server) are in test_client_live_limits.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import httpx
import numpy as np
import pytest

import attnserve_client as ac
from attnserve_client import wire

rng = np.random.default_rng(7)
H, KV, D = 8, 2, 32


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def reference(q, k, v, start_pos, causal=True, scale=None):
    """float64 attention: q [n, H, D], k/v [L, KV, D] -> [n, H, D]."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    kk = np.repeat(k.astype(np.float64), group, axis=1)
    vv = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("nhd,lhd->nhl", q.astype(np.float64), kk) * scale
    if causal:
        rows = start_pos + np.arange(q.shape[0])[:, None, None]
        scores = np.where(np.arange(k.shape[0])[None, None, :] <= rows, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("nhl,lhd->nhd", w / w.sum(-1, keepdims=True), vv)


def run_workload(session, inputs):
    """Prefill in two chunks, attend over it, then decode fused; return every output."""
    k, v, q, steps = inputs
    outs = []
    session.append(0, k[:5], v[:5])
    session.append(0, k[5:], v[5:])
    outs.append(session.attend(0, q))
    outs.append(session.attend(0, q[:3], start_pos=2, causal=False, scale=0.1))
    for qq, kk, vv in steps:
        outs.append(session.attend(0, qq, k=kk, v=vv))
    return outs


def workload_inputs():
    steps = [(rand(1, H, D), rand(1, KV, D), rand(1, KV, D)) for _ in range(4)]
    return rand(11, KV, D), rand(11, KV, D), rand(11, H, D), steps


def test_sync_and_async_give_the_same_results(live_server_url):
    inputs = workload_inputs()
    with ac.Client(live_server_url) as client:
        s = client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
        sync_outs = run_workload(s, inputs)
        assert s.info().lengths == (15,)
        s.delete()

    async def run_async():
        async with ac.AsyncClient(live_server_url) as client:
            s = await client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
            k, v, q, steps = inputs
            outs = []
            await s.append(0, k[:5], v[:5])
            await s.append(0, k[5:], v[5:])
            outs.append(await s.attend(0, q))
            outs.append(await s.attend(0, q[:3], start_pos=2, causal=False, scale=0.1))
            for qq, kk, vv in steps:
                outs.append(await s.attend(0, qq, k=kk, v=vv))
            assert (await s.info()).lengths == (15,)
            await s.delete()
            return outs

    async_outs = asyncio.run(run_async())
    for a, b in zip(sync_outs, async_outs):
        np.testing.assert_array_equal(a, b)
    k, v, q, steps = inputs
    np.testing.assert_allclose(sync_outs[0], reference(q, k, v, 0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sync_outs[1], reference(q[:3], k, v, 2, False, 0.1), rtol=1e-4, atol=1e-5)
    K, V = k, v
    for i, (qq, kk, vv) in enumerate(steps):
        K, V = np.concatenate([K, kk]), np.concatenate([V, vv])
        np.testing.assert_allclose(sync_outs[2 + i], reference(qq, K, V, 11 + i), rtol=1e-4, atol=1e-5)


def test_sessions_lifecycle(live_client):
    s = live_client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D, num_layers=3, max_tokens=64)
    info = s.info()
    assert (info.num_layers, info.num_qo_heads, info.num_kv_heads, info.head_dim) == (3, H, KV, D)
    assert info.kv_format == "f32" and info.max_tokens == 64 and info.lengths == (0, 0, 0)
    assert s.session_id in [i.session_id for i in live_client.list_sessions()]
    same = live_client.get_session(s.session_id)
    assert same.append(2, rand(3, KV, D), rand(3, KV, D)) == 3
    assert s.info().lengths == (0, 0, 3) and s.info().bytes > 0
    s.delete()
    with pytest.raises(ac.SessionNotFound):
        same.info()
    assert live_client.health() is True and live_client.ready() is True
    assert isinstance(live_client.info(), dict)


def test_with_a_session_deletes_it_at_the_end_of_the_block(live_server_url):
    spec = dict(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
    with ac.Client(live_server_url) as client:

        def alive() -> set[str]:
            return {i.session_id for i in client.list_sessions()}

        before = alive()
        with client.create_session(**spec) as s:
            assert s.append(0, rand(2, KV, D), rand(2, KV, D)) == 2
            assert alive() == before | {s.session_id}
        assert alive() == before
        with pytest.raises(ZeroDivisionError):  # an exception in the block: deleted, and it goes on unchanged
            with client.create_session(**spec) as s:
                assert s.session_id in alive()
                1 / 0
        assert alive() == before
        with client.create_session(**spec) as s:
            s.delete()  # deleted in the block: leaving it is no error
        with client.create_session(**spec) as s:
            client.delete_session(s.session_id)  # or by anyone else
        with pytest.raises(ac.SessionNotFound):
            s.delete()  # the explicit delete stays strict
        assert alive() == before


def test_async_with_a_session_deletes_it_at_the_end_of_the_block(live_server_url):
    spec = dict(num_qo_heads=H, num_kv_heads=KV, head_dim=D)

    async def run() -> None:
        async with ac.AsyncClient(live_server_url) as client:

            async def alive() -> set[str]:
                return {i.session_id for i in await client.list_sessions()}

            before = await alive()
            async with await client.create_session(**spec) as s:
                assert await s.append(0, rand(2, KV, D), rand(2, KV, D)) == 2
                assert await alive() == before | {s.session_id}
            assert await alive() == before
            with pytest.raises(ZeroDivisionError):
                async with await client.create_session(**spec) as s:
                    assert s.session_id in await alive()
                    1 / 0
            assert await alive() == before
            async with await client.create_session(**spec) as s:
                await s.delete()
            async with await client.create_session(**spec) as s:
                await client.delete_session(s.session_id)
            assert await alive() == before

    asyncio.run(run())


def test_exceptions_from_real_answers(live_client, live_server_url):
    with pytest.raises(ac.SessionNotFound) as e:
        live_client.get_session("no-such-session")
    assert e.value.status == 404
    s = live_client.create_session(
        num_qo_heads=H, num_kv_heads=KV, head_dim=D, max_tokens=4, session_id=f"live-{rng.integers(1 << 30)}"
    )
    with pytest.raises(ac.SessionExists) as e:
        live_client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D, session_id=s.session_id)
    assert e.value.status == 409
    with pytest.raises(ac.CapacityExceeded) as e:
        s.append(0, rand(5, KV, D), rand(5, KV, D))
    assert e.value.status == 409
    s.append(0, rand(2, KV, D), rand(2, KV, D))
    live_client.get_session(s.session_id).append(0, rand(1, KV, D), rand(1, KV, D))
    with pytest.raises(ac.OffsetMismatch) as e:
        s.append(0, rand(1, KV, D), rand(1, KV, D))
    assert e.value.status == 409 and e.value.length == 3 and s.lengths == (3,)
    with pytest.raises(ac.InvalidRequest) as e:
        s.attend(0, rand(2, H, D), start_pos=2)
    assert e.value.status == 422
    target = getattr(s, "target", s)
    target._config = dataclasses.replace(target._config, num_layers=2)  # pretend a second layer
    target._lengths.append(0)
    with pytest.raises(ac.LayerNotFound) as e:
        s.attend(1, rand(1, H, D))
    assert e.value.status == 404
    with pytest.raises(ac.InvalidRequest):
        live_client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=48, kv_format="turboquant")
    with pytest.raises(ac.InvalidRequest):
        live_client.create_session(num_qo_heads=H, num_kv_heads=3, head_dim=D)

    # What the client never sends, sent by hand: the answer still maps to its class.
    path = f"{live_server_url}/v1/sessions/{s.session_id}/layers/0/kv"
    with httpx.Client() as raw:
        r = raw.post(path, content=b"\xc1\xc1", headers={"content-type": wire.MSGPACK})
        assert type(ac.parse_problem(r.status_code, r.content, r.headers)) is ac.MalformedBody
        r = raw.post(path, content=b"k=1", headers={"content-type": "text/plain"})
        assert type(ac.parse_problem(r.status_code, r.content, r.headers)) is ac.UnsupportedMediaType
        r = raw.put(
            f"{live_server_url}/v1/sessions/restored-x/snapshot",
            content=b"\x80",
            headers={"content-type": wire.MSGPACK},
        )
        assert type(ac.parse_problem(r.status_code, r.content, r.headers)) is ac.InvalidSnapshot
        body = wire.packb(
            {"k": wire.encode_array(rand(1, KV, D)), "v": {"dtype": "<f4", "shape": [1, KV, D], "data": b"\0" * 7}}
        )
        r = raw.post(path, content=body, headers={"content-type": wire.MSGPACK})
        assert type(ac.parse_problem(r.status_code, r.content, r.headers)) is ac.InvalidRequest
    s.delete()


# One mistake, one exception: each mistake the client catches before sending is sent
# raw to the real server too; the server's answer must map to the class the client raised.
MISTAKES = [
    # (client call on a one-layer session, the same mistake as a raw request)
    (
        lambda s: s.append(3, rand(1, KV, D), rand(1, KV, D)),
        lambda sid: ("POST", f"/v1/sessions/{sid}/layers/3/kv", {"k": [[[0.0] * D] * KV], "v": [[[0.0] * D] * KV]}),
    ),
    (
        lambda s: s.attend(1, rand(1, H, D)),
        lambda sid: ("POST", f"/v1/sessions/{sid}/layers/1/attend", {"q": [[[0.0] * D] * H]}),
    ),
    (
        lambda s: s.append(0, rand(1, KV, D - 1), rand(1, KV, D - 1)),
        lambda sid: (
            "POST",
            f"/v1/sessions/{sid}/layers/0/kv",
            {"k": [[[0.0] * (D - 1)] * KV], "v": [[[0.0] * (D - 1)] * KV]},
        ),
    ),
    (
        lambda s: s.attend(0, rand(1, H, D), start_pos=-1),
        lambda sid: ("POST", f"/v1/sessions/{sid}/layers/0/attend", {"q": [[[0.0] * D] * H], "start_pos": -1}),
    ),
    (
        lambda s: s.attend(0, rand(1, H, D), k=rand(1, KV, D)),
        lambda sid: ("POST", f"/v1/sessions/{sid}/layers/0/attend", {"q": [[[0.0] * D] * H], "k": [[[0.0] * D] * KV]}),
    ),
]


@pytest.mark.parametrize("i", range(len(MISTAKES)))
def test_a_local_refusal_is_the_class_of_the_servers_answer(live_client, live_server_url, i):
    local, raw = MISTAKES[i]
    s = live_client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D, num_layers=1)
    with pytest.raises(ac.InvalidInput) as caught:
        local(s)
    method, path, body = raw(s.session_id)
    r = httpx.request(method, live_server_url + path, json=body)
    server = ac.parse_problem(r.status_code, r.content, r.headers)
    assert type(server) in type(caught.value).__mro__  # e.g. LayerNotFound both ways
    assert caught.value.type == server.type
    s.delete()


def test_async_local_refusals_are_the_same_classes(live_server_url):
    async def run():
        async with ac.AsyncClient(live_server_url) as client:
            s = await client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
            with pytest.raises(ac.LayerNotFound):
                await s.append(3, rand(1, KV, D), rand(1, KV, D))
            with pytest.raises(ac.InvalidRequest):
                await s.attend(0, rand(1, H, D), start_pos=-1)
            with pytest.raises(ac.SessionNotFound):
                await client.get_session("no such id")
            assert len(s.session_id) == 32  # PUT under a fresh id
            await s.delete()

    asyncio.run(run())


def test_default_create_is_a_put_the_server_accepts(live_client):
    s = live_client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
    t = live_client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D, server_assigned_id=True)
    assert s.session_id != t.session_id and len(s.session_id) == 32
    ids = {i.session_id for i in live_client.list_sessions()}
    assert {s.session_id, t.session_id} <= ids
    s.delete()
    t.delete()
