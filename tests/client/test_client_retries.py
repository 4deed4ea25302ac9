"""Retries, and the recovery of writes whose answer was lost (sync and async alike).

Faults are injected into the emulated server (see conftest.py): "refuse" (the
request never arrives), "drop" and "late" (the server does the work, the answer is
lost or comes too late), "answer" (a problem answer, nothing done).
"""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import msgpack
import numpy as np
import pytest

import attnserve_client as ac

rng = np.random.default_rng(1)


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def new_session(client, **kw):
    return client.create_session(**(dict(num_qo_heads=4, num_kv_heads=2, head_dim=8, num_layers=2) | kw))


def methods(fake, since=0):
    return [(r.method, r.url.path.rsplit("/", 1)[-1]) for r in fake.requests[since:]]


# -- what is retried ----------------------------------------------------------------------------


def test_post_create_is_retried_when_the_request_never_left(client, fake, sleeps):
    fake.fail("refuse")
    s = new_session(client, server_assigned_id=True)
    assert s.session_id == "s1" and len(fake.sessions) == 1
    assert len(fake.requests) == 2 and len(sleeps) == 1 and 0.375 <= sleeps[0] <= 0.5


@pytest.mark.parametrize("kind, error", [("drop", ac.APIConnectionError), ("late", ac.APITimeoutError)])
def test_post_create_is_not_retried_once_sent(client, fake, sleeps, kind, error):
    fake.fail(kind)
    with pytest.raises(error) as info:
        new_session(client, server_assigned_id=True)
    assert type(info.value) is error and isinstance(info.value.__cause__, httpx.TransportError)
    assert info.value.status is None
    assert len(fake.requests) == 1 and sleeps == []


@pytest.mark.parametrize("kind", ["drop", "late", "refuse"])
def test_default_create_is_retried_and_makes_one_session(client, fake, sleeps, kind):
    # the default create is a PUT under a fresh id: a lost answer is retried, and the
    # session the lost attempt made is adopted, not made twice
    fake.fail(kind)
    s = new_session(client)
    assert list(fake.sessions) == [s.session_id] and fake.count("POST") == 0
    assert fake.count("PUT", s.session_id) == 2 and len(sleeps) == 1


@pytest.mark.parametrize("kind", ["drop", "late", "refuse"])
def test_reads_are_retried(client, fake, kind):
    s = new_session(client)
    fake.fail(kind, method="GET")
    fake.fail(kind, method="GET")
    assert s.info().session_id == s.session_id
    assert fake.count("GET") == 3


def test_unsent_requests_are_retried_at_most_max_retries_times(make_client, fake, sleeps):
    client = make_client(max_retries=3)
    s = new_session(client)
    for _ in range(4):
        fake.fail("refuse")
    with pytest.raises(ac.APIConnectionError) as info:
        s.info()
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert fake.count("GET") == 4 and len(sleeps) == 3
    for attempt, delay in enumerate(sleeps):  # exponential, less up to 25 % jitter
        assert 0.75 * 0.5 * 2**attempt <= delay <= 0.5 * 2**attempt


def test_no_retries_when_max_retries_is_zero(make_client, fake, sleeps):
    s = new_session(make_client(max_retries=0))
    fake.fail("answer", status=503, slug="overloaded", headers={"Retry-After": "1"})
    with pytest.raises(ac.Overloaded):
        s.info()
    assert fake.count("GET") == 1 and sleeps == []


def test_503_honours_retry_after_and_429_backs_off(client, fake, sleeps):
    s = new_session(client)
    fake.fail("answer", status=503, slug="overloaded", headers={"Retry-After": "2"})
    fake.fail("answer", status=429, slug="too-many-requests")
    assert s.append(0, rand(3, 2, 8), rand(3, 2, 8)) == 3
    assert sleeps[0] == 2.0 and 0.75 <= sleeps[1] <= 1.0
    assert fake.kv(s.session_id, 0)[0].shape[0] == 3


def test_retry_after_is_capped(client, fake, sleeps):
    s = new_session(client)
    fake.fail("answer", status=503, slug="not-ready", headers={"Retry-After": "86400"})
    s.info()
    assert sleeps == [60.0]


def test_overloaded_after_the_last_retry_carries_retry_after(client, fake, sleeps):
    s = new_session(client)
    for _ in range(3):
        fake.fail("answer", status=503, slug="overloaded", headers={"Retry-After": "0.5"})
    with pytest.raises(ac.Overloaded) as info:
        s.attend(0, rand(1, 4, 8), k=rand(1, 2, 8), v=rand(1, 2, 8))
    assert info.value.retry_after == 0.5 and info.value.status == 503
    assert sleeps == [0.5, 0.5] and fake.count("POST", "attend") == 3
    assert s.lengths == (0, 0)  # an answer came: the length is still known


def test_other_errors_are_not_retried(client, fake, sleeps):
    s = new_session(client)
    fake.fail("answer", status=500, slug="internal")
    with pytest.raises(ac.APIStatusError):
        s.info()
    assert sleeps == []


# -- writes whose answer was lost -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["drop", "late"])
def test_append_whose_answer_was_lost_is_not_appended_twice(client, fake, sleeps, kind):
    s = new_session(client)
    s.append(0, rand(2, 2, 8), rand(2, 2, 8))
    k, v = rand(3, 2, 8), rand(3, 2, 8)
    fake.fail(kind, path="/kv$")
    assert s.append(0, k, v) == 5
    K, V = fake.kv(s.session_id, 0)
    assert K.shape[0] == 5
    np.testing.assert_array_equal(K[2:], k)
    np.testing.assert_array_equal(V[2:], v)
    assert s.lengths == (5, 0) and len(sleeps) == 1
    # Both attempts sent the same offset; the second was refused with 409.
    offsets = [msgpack.unpackb(r.content)["offset"] for r in fake.requests if r.url.path.endswith("/kv")]
    assert offsets == [0, 2, 2]


@pytest.mark.parametrize("start_pos", [None, 1])
@pytest.mark.parametrize("kind", ["drop", "late"])
def test_fused_attend_whose_answer_was_lost_returns_the_output_it_would_have(client, fake, attention, kind, start_pos):
    s = new_session(client)
    s.append(1, rand(4, 2, 8), rand(4, 2, 8))
    q, k, v = rand(2, 4, 8), rand(2, 2, 8), rand(2, 2, 8)
    sent = len(fake.requests)
    fake.fail(kind, path="/attend$")
    out = s.attend(1, q, k=k, v=v, start_pos=start_pos)
    K, V = fake.kv(s.session_id, 1)
    assert K.shape[0] == 6 and s.lengths == (0, 6)  # appended once
    np.testing.assert_array_equal(K[4:], k)
    expected = attention(q, K, V, 4 if start_pos is None else start_pos, True, 8**-0.5)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    first, retry, again = (msgpack.unpackb(r.content) for r in fake.requests[sent:])
    assert first["offset"] == retry["offset"] == 4 and "k" in retry
    assert again.keys() == {"q", "causal", "start_pos"}  # no k, v, offset: nothing appended
    assert again["start_pos"] == (4 if start_pos is None else start_pos)


def test_fused_decode_loop_survives_lost_answers(client, fake, attention):
    s = new_session(client, num_layers=1)
    for step in range(6):
        if step % 2:
            fake.fail("drop", path="/attend$")
        q, k, v = rand(1, 4, 8), rand(1, 2, 8), rand(1, 2, 8)
        out = s.attend(0, q, k=k, v=v)
        K, V = fake.kv(s.session_id, 0)
        assert K.shape[0] == step + 1
        np.testing.assert_allclose(out, attention(q, K, V, step, True, 8**-0.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first", ["refuse", "answer"])
def test_a_mismatch_after_an_attempt_that_surely_did_not_land_is_raised(client, fake, first):
    # Another writer appended exactly as many rows as we send: length == offset + m,
    # but our first attempt never reached the server (or was refused with 503), so
    # the 409 is not ours to take as success.
    s = new_session(client)
    client.get_session(s.session_id).append(0, rand(3, 2, 8), rand(3, 2, 8))
    fake.fail(first, path="/kv$")
    with pytest.raises(ac.OffsetMismatch) as info:
        s.append(0, rand(3, 2, 8), rand(3, 2, 8))
    assert info.value.length == 3 and s.lengths == (3, 0)
    fake.fail(first, path="/attend$")
    client.get_session(s.session_id).append(0, rand(1, 2, 8), rand(1, 2, 8))
    with pytest.raises(ac.OffsetMismatch):
        s.attend(0, rand(1, 4, 8), k=rand(1, 2, 8), v=rand(1, 2, 8))
    assert fake.kv(s.session_id, 0)[0].shape[0] == 4 and s.lengths == (4, 0)


def test_a_mismatch_of_another_size_after_a_lost_answer_is_raised(client, fake):
    s = new_session(client)
    client.get_session(s.session_id).append(0, rand(2, 2, 8), rand(2, 2, 8))
    fake.fail("drop", path="/kv$")  # the server refuses this one (offset 0 != 2); answer lost
    with pytest.raises(ac.OffsetMismatch) as info:
        s.append(0, rand(3, 2, 8), rand(3, 2, 8))
    assert info.value.length == 2 and s.lengths == (2, 0)


def test_a_write_without_any_answer_forgets_the_length_and_asks_next_time(client, fake):
    s = new_session(client)
    for _ in range(3):
        fake.fail("drop", path="/kv$")
    with pytest.raises(ac.APIConnectionError):
        s.append(0, rand(2, 2, 8), rand(2, 2, 8))
    assert s.lengths == (None, 0)  # it did land (once), but the client cannot know
    sent = len(fake.requests)
    assert s.append(0, rand(1, 2, 8), rand(1, 2, 8)) == 3
    assert methods(fake, sent) == [("GET", s.session_id), ("POST", "kv")]


def test_put_create_whose_answer_was_lost_adopts_the_session(client, fake):
    fake.fail("drop", method="PUT")
    s = new_session(client, session_id="seq-1", seed=5, max_tokens=100)
    assert s.session_id == "seq-1" and s.lengths == (0, 0)
    assert methods(fake) == [("PUT", "seq-1"), ("PUT", "seq-1"), ("GET", "seq-1")]
    assert len(fake.sessions) == 1


def test_put_create_conflict_with_another_config_is_raised(client, fake):
    new_session(client, session_id="seq-2", head_dim=16)
    fake.fail("drop", method="PUT")
    with pytest.raises(ac.SessionExists):
        new_session(client, session_id="seq-2", head_dim=8)
    # Same config, but already written to: not ours either.
    new_session(client, session_id="seq-3").append(0, rand(1, 2, 8), rand(1, 2, 8))
    fake.fail("drop", method="PUT")
    with pytest.raises(ac.SessionExists):
        new_session(client, session_id="seq-3")


def test_put_create_conflict_without_a_lost_answer_is_raised_at_once(client, fake):
    new_session(client, session_id="seq-4")
    fake.fail("refuse", method="PUT")
    with pytest.raises(ac.SessionExists):
        new_session(client, session_id="seq-4")
    assert fake.count("GET") == 0


def test_delete_whose_answer_was_lost_succeeds(client, fake):
    s = new_session(client)
    fake.fail("drop", method="DELETE")
    s.delete()
    assert fake.sessions == {} and fake.count("DELETE") == 2


# -- real sockets -------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(mode, make, call):
    if mode == "sync":
        with make(ac.Client) as client:
            return call(client)

    async def go():
        async with make(ac.AsyncClient) as client:
            return await call(client)

    return asyncio.run(go())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_connection_refused_is_wrapped_after_retries(mode):
    url = f"http://127.0.0.1:{_closed_port()}"
    sleeps = []

    def make(cls):
        client = cls(url, max_retries=2)
        if cls is ac.Client:
            client._sleep = sleeps.append
        else:

            async def record(s):
                sleeps.append(s)

            client._sleep = record
        return client

    with pytest.raises(ac.APIConnectionError) as info:
        _run(mode, make, lambda c: c.get_session("nobody"))
    assert type(info.value) is ac.APIConnectionError and isinstance(info.value.__cause__, httpx.ConnectError)
    assert len(sleeps) == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_server_that_never_answers_times_out(mode):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])  # keep it open, say nothing
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = "http://127.0.0.1:%d" % listener.getsockname()[1]

    def make(cls):
        client = cls(url, timeout=0.2, max_retries=1)
        if cls is ac.Client:
            client._sleep = lambda s: None
        else:

            async def no_sleep(s):
                return None

            client._sleep = no_sleep
        return client

    try:
        with pytest.raises(ac.APITimeoutError) as info:
            _run(mode, make, lambda c: c.info())
        assert isinstance(info.value.__cause__, httpx.ReadTimeout)
        assert len(accepted) == 2  # retried once: a GET is idempotent
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()
