"""The client's batched steps over several replicas, without nginx: two real
servers behind a stand-in router (an httpx transport that routes as
deploy/nginx/attnserve.conf does: the path's session id, else X-Attnserve-Route,
else any replica). The client splits a step by replica, one request each, puts the
answers back in item order bit for bit as one server would give them, and a
replica that does not answer fails only its own items. tests/deploy runs the
same through the real nginx."""

from __future__ import annotations

import asyncio
import re
import zlib
from itertools import count

import httpx
import numpy as np
import pytest

from attnserve.config import Settings
from attnserve_client import APIConnectionError, AsyncClient, AttendItem, BatchError, Client
from svc_helpers import LiveServer, rows

H, HKV, D = 4, 2, 16
_PATH_ID = re.compile(r"^/v1/sessions/([A-Za-z0-9_-]{1,64})(?:/|$)")


class Router:
    """Routes like the nginx map: path id, else the route header, else round robin."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.down: set[int] = set()
        self.sent: list[tuple[str, int]] = []  # (path, replica) of every request passed on
        self._turn = count()

    def pick(self, request: httpx.Request) -> int:
        m = _PATH_ID.match(request.url.path)
        key = m.group(1) if m else request.headers.get("x-attnserve-route")
        if key is None:
            return next(self._turn) % len(self.urls)
        return zlib.crc32(key.encode()) % len(self.urls)

    def forward(self, request: httpx.Request, http: httpx.Client) -> httpx.Response:
        i = self.pick(request)
        self.sent.append((request.url.path, i))
        if i in self.down:
            raise httpx.ConnectError("replica down", request=request)
        r = http.request(request.method, self.urls[i] + request.url.raw_path.decode(), content=request.content,
                         headers=request.headers)  # fmt: skip
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)


@pytest.fixture(scope="module")
def replicas(engine):
    servers = [LiveServer(Settings(instance_name=f"replica-{i}"), engine=engine).start() for i in range(2)]
    yield Router([s.url for s in servers])
    for s in servers:
        s.stop()


@pytest.fixture
def routed(replicas):
    http = httpx.Client(timeout=60)
    transport = httpx.MockTransport(lambda request: replicas.forward(request, http))
    with Client("http://router.test", transport=transport, max_retries=0) as client:
        yield client
    http.close()
    replicas.down.clear()


def _sessions(client, router: Router, seed: int, per_replica: int = 3) -> list:
    """Sessions (seeds seed, seed + 1, ...) until each replica holds ``per_replica``,
    in creation order; ids hashed like the router does."""
    made, held = [], [0] * len(router.urls)
    while min(held) < per_replica:
        sid = f"s{seed}-{len(made)}"
        where = router.pick(httpx.Request("GET", f"http://x/v1/sessions/{sid}"))
        if held[where] >= per_replica:
            seed += 1
            continue
        held[where] += 1
        made.append(client.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, seed=seed, session_id=sid))
        seed += 1
    return made


def test_a_step_is_one_request_per_replica_and_answers_in_item_order(replicas, routed, rng):
    sessions = _sessions(routed, replicas, 1)
    twins = [  # the same steps one by one, on sessions of the same seeds
        routed.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, seed=s.info().seed) for s in sessions
    ]
    owners = {replicas.pick(httpx.Request("GET", f"http://x/v1/sessions/{s.session_id}")) for s in sessions}
    assert owners == {0, 1}, "the sessions should spread over both replicas"
    for layer_rows in (5, 1):
        q, k = (
            np.stack([rows(rng, layer_rows, H, D) for _ in sessions]),
            np.stack([rows(rng, layer_rows, HKV, D) for _ in sessions]),
        )
        want = np.stack([t.attend(0, q[i], k=k[i], v=k[i]) for i, t in enumerate(twins)])
        before = len(replicas.sent)
        got = routed.attend_stacked(sessions, 0, q, k, k)
        assert got.tobytes() == want.tobytes()
        batches = [i for path, i in replicas.sent[before:] if path == "/v1/batch/attend"]
        assert sorted(batches) == [0, 1]
    q = np.stack([rows(rng, 1, H, D) for _ in sessions])
    want = [t.attend(0, q[i]) for i, t in enumerate(twins)]
    got = routed.attend_batch([AttendItem(s, 0, q[i]) for i, s in enumerate(sessions)])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want))
    assert [s.lengths for s in sessions] == [t.lengths for t in twins] == [(6,)] * len(sessions)

    async def fresh_async_client() -> np.ndarray:  # ids it never saw: looked up, then split
        http = httpx.AsyncClient(timeout=60)
        sync_http = httpx.Client(timeout=60)

        async def handler(request: httpx.Request) -> httpx.Response:
            return await asyncio.to_thread(replicas.forward, request, sync_http)

        async with AsyncClient("http://router.test", transport=httpx.MockTransport(handler), max_retries=0) as ac:
            out = await ac.attend_stacked([s.session_id for s in sessions], 0, q)
        await http.aclose()
        sync_http.close()
        return out

    assert asyncio.run(fresh_async_client()).tobytes() == np.stack(want).tobytes()
    for s in sessions + twins:
        s.delete()


def test_a_replica_without_answer_fails_only_its_items(replicas, routed, rng):
    sessions = _sessions(routed, replicas, 100)
    lost = replicas.pick(httpx.Request("GET", f"http://x/v1/sessions/{sessions[0].session_id}"))
    replicas.down.add(lost)
    q, k = np.stack([rows(rng, 1, H, D) for _ in sessions]), np.stack([rows(rng, 1, HKV, D) for _ in sessions])
    with pytest.raises(BatchError) as e:
        routed.attend_stacked(sessions, 0, q, k, k, offsets=[0] * len(sessions))
    on_lost = {
        i
        for i, s in enumerate(sessions)
        if replicas.pick(httpx.Request("GET", f"http://x/v1/sessions/{s.session_id}")) == lost
    }
    assert set(e.value.errors) == on_lost and on_lost != set(range(len(sessions)))
    assert all(isinstance(err, APIConnectionError) for err in e.value.errors.values())
    assert all(e.value.results[i].shape == (1, H, D) for i in range(len(sessions)) if i not in on_lost)
    replicas.down.clear()
    for i, s in enumerate(sessions):
        assert s.info().lengths == ((0,) if i in on_lost else (1,))
        s.delete()
