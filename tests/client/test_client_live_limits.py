"""The exceptions that need a differently configured real server: a small body
limit, a session limit, a full GPU queue, a draining server and API keys, each
mapped from a real answer by the sync and the async client."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import attnserve_client as ac

H, KV, D = 4, 2, 32
KEY, OTHER_KEY = "k-live-limits-1", "k-live-limits-2"
rng = np.random.default_rng(11)


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def tight_server(start_live_server):
    """A real server with a 16 KiB body limit and at most 2 sessions: (url, runtime)."""
    server = start_live_server(max_body_bytes=16 * 1024, max_sessions=2, api_keys=f"{KEY},{OTHER_KEY}")
    try:
        yield server.url, server.runtime
    finally:
        server.stop()


def _check(err: ac.AttnServeError, cls: type, status: int, slug: str) -> None:
    assert type(err) is cls, type(err)
    assert err.status == status
    assert err.problem["type"] == f"/problems/{slug}"
    assert err.detail


def test_limits_map_to_exceptions_sync(tight_server):
    url, rt = tight_server
    with ac.Client(url, max_retries=0, api_key=KEY) as c:
        s = c.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
        try:
            # 413: 2 x 64 rows x 2 x 32 floats is 32 KiB, over the 16 KiB limit
            with pytest.raises(ac.PayloadTooLarge) as e:
                s.append(0, rand(64, KV, D), rand(64, KV, D))
            _check(e.value, ac.PayloadTooLarge, 413, "payload-too-large")
            assert s.append(0, rand(4, KV, D), rand(4, KV, D)) == 4  # nothing was applied
            # 507: the session limit
            other = c.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
            with pytest.raises(ac.OutOfMemory) as e:
                c.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
            _check(e.value, ac.OutOfMemory, 507, "out-of-memory")
            other.delete()
            # 503 overloaded: a full GPU queue, with Retry-After
            worker = rt.engine.worker
            old = worker.max_queue
            worker.max_queue = 0
            try:
                with pytest.raises(ac.Overloaded) as e:
                    s.attend(0, rand(1, H, D))
            finally:
                worker.max_queue = old
            _check(e.value, ac.Overloaded, 503, "overloaded")
            assert e.value.retry_after is not None and e.value.retry_after >= 1
            # 503 not-ready: draining
            rt.begin_drain()
            try:
                with pytest.raises(ac.NotReady) as e:
                    s.info()
            finally:
                rt.draining = False
            _check(e.value, ac.NotReady, 503, "not-ready")
            assert s.info().lengths == (4,)
        finally:
            s.delete()


def test_limits_map_to_exceptions_async(tight_server):
    url, rt = tight_server

    async def body():
        async with ac.AsyncClient(url, max_retries=0, api_key=KEY) as c:
            s = await c.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
            try:
                with pytest.raises(ac.PayloadTooLarge) as e:
                    await s.append(0, rand(64, KV, D), rand(64, KV, D))
                _check(e.value, ac.PayloadTooLarge, 413, "payload-too-large")
                other = await c.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
                with pytest.raises(ac.OutOfMemory) as e:
                    await c.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
                _check(e.value, ac.OutOfMemory, 507, "out-of-memory")
                await other.delete()
                assert await s.append(0, rand(2, KV, D), rand(2, KV, D)) == 2
                worker = rt.engine.worker
                old = worker.max_queue
                worker.max_queue = 0
                try:
                    with pytest.raises(ac.Overloaded) as e:
                        await s.attend(0, rand(1, H, D))
                finally:
                    worker.max_queue = old
                _check(e.value, ac.Overloaded, 503, "overloaded")
                rt.begin_drain()
                try:
                    with pytest.raises(ac.NotReady) as e:
                        await s.info()
                finally:
                    rt.draining = False
                _check(e.value, ac.NotReady, 503, "not-ready")
            finally:
                await s.delete()

    asyncio.run(body())


def test_unauthorized_and_tenants_sync_and_async(tight_server):
    url, _ = tight_server
    with ac.Client(url, max_retries=0, api_key=KEY) as owner:
        s = owner.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D)
        try:
            for key in (None, "wrong-key"):
                with ac.Client(url, max_retries=0, api_key=key) as c:
                    with pytest.raises(ac.Unauthorized) as e:
                        c.list_sessions()
                _check(e.value, ac.Unauthorized, 401, "unauthorized")
                assert "bearer" in e.value.headers.get("www-authenticate", "").lower()
            with ac.Client(url, max_retries=0, api_key=OTHER_KEY) as other:
                with pytest.raises(ac.SessionNotFound):
                    other.get_session(s.session_id)
                assert s.session_id not in [i.session_id for i in other.list_sessions()]

            async def body():
                async with ac.AsyncClient(url, max_retries=0, api_key="wrong-key") as c:
                    with pytest.raises(ac.Unauthorized) as e:
                        await c.get_session(s.session_id)
                    _check(e.value, ac.Unauthorized, 401, "unauthorized")

            asyncio.run(body())
        finally:
            s.delete()
