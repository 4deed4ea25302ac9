"""Client and AsyncClient against an emulation of the contract (each test runs for both).

The ``client`` fixture is a ``Client``, or an ``AsyncClient`` driven through the same
blocking calls; ``fake`` is the emulated server (see conftest.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re

import httpx
import msgpack
import numpy as np
import pytest

import attnserve_client as ac
from attnserve_client import tensors, wire

BASE_URL = "http://attnserve.test"  # where conftest's make_client points

rng = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def body_of(request: httpx.Request) -> dict:
    return msgpack.unpackb(request.content)


def new_session(client, **kw):
    args = dict(num_qo_heads=8, num_kv_heads=2, head_dim=16, num_layers=2) | kw
    return client.create_session(**args)


# -- sessions ------------------------------------------------------------------------------


def test_create_session_puts_the_config_under_a_fresh_id_and_returns_info(client, fake):
    s = new_session(client, kv_format="turboquant", max_tokens=64, seed=7)
    (request,) = fake.requests
    sid = s.session_id
    assert re.fullmatch(r"[0-9a-f]{32}", sid)  # a UUID4: the server's [A-Za-z0-9_-]{1,64} takes it
    assert request.method == "PUT" and request.url == f"{BASE_URL}/v1/sessions/{sid}"
    assert request.headers["content-type"] == "application/vnd.msgpack"
    assert request.headers["accept"] == "application/vnd.msgpack"
    assert request.headers["user-agent"] == f"attnserve-client/{ac.__version__}"
    assert "authorization" not in request.headers
    assert body_of(request) == {
        "num_layers": 2,
        "num_qo_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 16,
        "kv_format": "turboquant",
        "max_tokens": 64,
        "seed": 7,
    }
    assert s.lengths == (0, 0)
    info = s.info()
    assert info == ac.SessionInfo(sid, 2, 8, 2, 16, "turboquant", 64, 7, (0, 0), 0)
    assert dataclasses.is_dataclass(info)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.head_dim = 3  # type: ignore[misc]


def test_every_create_gets_its_own_id(client, fake):
    ids = {new_session(client).session_id for _ in range(20)}
    assert len(ids) == 20 and fake.count("PUT", "/v1/sessions/") == 20 and fake.count("POST", "") == 0
    assert len({ac.new_session_id() for _ in range(1000)}) == 1000


def test_server_assigned_id_posts(client, fake):
    s = new_session(client, server_assigned_id=True)
    (request,) = fake.requests
    assert request.method == "POST" and request.url == f"{BASE_URL}/v1/sessions"
    assert s.session_id == "s1"  # the fake server's choice
    with pytest.raises(ac.InvalidInput, match=r"^session_id, server_assigned_id: expected at most one"):
        new_session(client, server_assigned_id=True, session_id="mine")
    assert len(fake.requests) == 1


def test_create_session_leaves_server_defaults_out(client, fake):
    new_session(client, num_layers=1)
    assert body_of(fake.requests[0]) == {
        "num_layers": 1,
        "num_qo_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 16,
        "kv_format": "f32",
    }


def test_create_session_with_id_puts(client, fake):
    s = new_session(client, session_id="my-seq_1")
    assert fake.requests[0].method == "PUT"
    assert fake.requests[0].url.path == "/v1/sessions/my-seq_1"
    assert s.session_id == "my-seq_1"
    with pytest.raises(ac.SessionExists) as info:
        new_session(client, session_id="my-seq_1")
    assert info.value.status == 409 and info.value.problem["type"] == "/problems/session-exists"


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "x" * 65, "spa ce", 7, None])
def test_session_ids_are_checked_before_sending(client, fake, bad):
    # as the server answers: 422 where it would create the session, 404 where it would look it up
    for call, cls in (
        (lambda: new_session(client, session_id=bad if bad is not None else 1.5), ac.InvalidRequest),
        (lambda: client.get_session(bad), ac.SessionNotFound),
        (lambda: client.delete_session(bad), ac.SessionNotFound),
    ):
        with pytest.raises(ac.InvalidInput, match=r"^session_id: expected 1 to 64 of \[A-Za-z0-9_-\], got") as info:
            call()
        assert isinstance(info.value, cls)
    assert fake.requests == []


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"num_qo_heads": 8.0}, "num_qo_heads"),
        ({"head_dim": True}, "head_dim"),
        ({"max_tokens": "9"}, "max_tokens"),
        ({"kv_format": 3}, "kv_format"),
    ],
)
def test_create_arguments_are_checked_before_sending(client, fake, kw, name):
    with pytest.raises(ac.InvalidRequest, match=rf"^{name}: expected") as info:
        new_session(client, **kw)
    assert isinstance(info.value, ac.InvalidInput)
    assert fake.requests == []


def test_numpy_ints_are_accepted_as_config(client, fake):
    s = new_session(client, num_qo_heads=np.int64(4), head_dim=np.int32(8))
    assert s.info().num_qo_heads == 4


def test_get_list_delete(client, fake):
    a = new_session(client)
    b = new_session(client, num_layers=1)
    got = client.get_session(b.session_id)
    assert got.session_id == b.session_id and got.lengths == (0,)
    assert [i.session_id for i in client.list_sessions()] == [a.session_id, b.session_id]
    assert all(isinstance(i, ac.SessionInfo) for i in client.list_sessions())
    a.delete()
    client.delete_session(b.session_id)
    assert client.list_sessions() == []
    with pytest.raises(ac.SessionNotFound) as info:
        client.get_session(a.session_id)
    assert info.value.status == 404 and info.value.detail == f"no session {a.session_id}"
    with pytest.raises(ac.SessionNotFound):
        a.append(0, rand(1, 2, 16), rand(1, 2, 16))
    with pytest.raises(ac.SessionNotFound):
        b.delete()


def test_the_end_of_a_session_block_deletes_it_once_gone_is_fine_other_errors_raise(client, fake, mode):
    # the with / async with blocks themselves run against the live server (test_client_live.py)
    def leave(session):
        return session.__exit__(None, None, None) if mode == "sync" else session.__aexit__(None, None, None)

    s = new_session(client)
    assert (s.__enter__() if mode == "sync" else s.__aenter__()).session_id == s.session_id
    leave(s)
    assert fake.sessions == {} and fake.count("DELETE") == 1
    leave(s)  # gone already: its 404 is no error
    assert fake.count("DELETE") == 2
    s = new_session(client)
    fake.fail("answer", method="DELETE", status=507, slug="out-of-memory")
    with pytest.raises(ac.OutOfMemory):
        leave(s)
    assert list(fake.sessions) == [s.session_id]


def test_server_info_and_probes(client, fake):
    assert client.info() == {"version": "fake", "kv_formats": ["f32", "turboquant"]}
    assert client.health() is True and client.ready() is True
    fake.ready = False
    assert client.ready() is False
    assert fake.count("GET", "/readyz") == 2  # not retried


def test_api_key_is_sent_as_bearer(make_client, fake):
    fake.api_key = "sekrit"
    with pytest.raises(ac.Unauthorized) as info:
        new_session(make_client())
    assert info.value.status == 401 and info.value.problem["type"] == "/problems/unauthorized"
    s = new_session(make_client(api_key="sekrit"))
    assert fake.requests[-1].headers["authorization"] == "Bearer sekrit"
    assert s.info().session_id == s.session_id


def test_base_url_may_carry_a_prefix_and_extra_headers(mode):
    seen = []

    def handler(request):
        seen.append(request)
        return httpx.Response(200, json={"version": "x"})

    if mode == "sync":
        with ac.Client("http://h/prefix/", transport=httpx.MockTransport(handler), headers={"X-T": "1"}) as c:
            c.info()
    else:

        async def run():
            async with ac.AsyncClient(
                "http://h/prefix/", transport=httpx.MockTransport(handler), headers={"X-T": "1"}
            ) as c:
                await c.info()

        asyncio.run(run())
    assert seen[0].url == "http://h/prefix/v1/info" and seen[0].headers["x-t"] == "1"


def sent_by(mode, *args, **kw):
    """The request of one ``info()`` by a Client (or AsyncClient) made of ``args``,
    ``kw``, and the client."""
    seen = []

    def handler(request):
        seen.append(request)
        return httpx.Response(200, json={"version": "x"})

    if mode == "sync":
        with ac.Client(*args, transport=httpx.MockTransport(handler), **kw) as c:
            c.info()
    else:

        async def run():
            async with ac.AsyncClient(*args, transport=httpx.MockTransport(handler), **kw) as c:
                await c.info()
            return c

        c = asyncio.run(run())
    (request,) = seen
    return request, c


def test_base_url_and_api_key_come_from_the_environment_when_not_given(mode, monkeypatch):
    request, c = sent_by(mode)  # nothing given, nothing set: the default URL, no key
    assert str(request.url) == "http://127.0.0.1:8421/v1/info" == ac.DEFAULT_BASE_URL + "/v1/info"
    assert "authorization" not in request.headers and c.base_url == ac.DEFAULT_BASE_URL
    monkeypatch.setenv("ATTNSERVE_BASE_URL", "https://env.test:9000/prefix/")
    monkeypatch.setenv("ATTNSERVE_API_KEY", "env-key-3c1")
    request, c = sent_by(mode)
    assert str(request.url) == "https://env.test:9000/prefix/v1/info"
    assert request.headers["authorization"] == "Bearer env-key-3c1"
    assert c.base_url == "https://env.test:9000/prefix" and "env-key-3c1" not in repr(c)
    request, c = sent_by(mode, "http://given.test", api_key="given-key-9d2")  # an argument wins
    assert str(request.url) == "http://given.test/v1/info"
    assert request.headers["authorization"] == "Bearer given-key-9d2"
    assert repr(c) == f"{type(c).__name__}('http://given.test')"
    monkeypatch.setenv("ATTNSERVE_BASE_URL", "")  # set but empty: as if unset
    monkeypatch.setenv("ATTNSERVE_API_KEY", "")
    request, _ = sent_by(mode)
    assert str(request.url) == "http://127.0.0.1:8421/v1/info" and "authorization" not in request.headers
    with pytest.raises(ac.InvalidInput, match="^base_url: expected an http:// or https:// URL, got ''$"):
        sent_by(mode, "")  # an argument is taken as given


@pytest.mark.parametrize("cls", [ac.Client, ac.AsyncClient])
@pytest.mark.parametrize("key", ["two words", "new-line\n", "tab\tbed", "naïve", "x" * 4097])
def test_a_key_no_server_accepts_is_refused_without_showing_it(cls, key, monkeypatch):
    with pytest.raises(ac.InvalidInput) as info:
        cls(api_key=key)
    assert str(info.value).startswith("api_key: expected 1 to 4096 visible ASCII characters without spaces")
    monkeypatch.setenv("ATTNSERVE_API_KEY", key)
    with pytest.raises(ac.InvalidInput) as info:
        cls()
    assert str(info.value).startswith("ATTNSERVE_API_KEY: expected 1 to 4096 visible ASCII")
    assert key.strip() not in str(info.value) and key[:3] not in str(info.value)


@pytest.mark.parametrize("cls", [ac.Client, ac.AsyncClient])
@pytest.mark.parametrize("url", ["127.0.0.1:8421", "localhost", "ws://127.0.0.1:8421", "http://[::1"])
def test_a_base_url_that_is_no_http_url_is_refused(cls, url, monkeypatch):
    with pytest.raises(ac.InvalidInput, match=r"^base_url: expected an http:// or https:// URL, got "):
        cls(url)
    monkeypatch.setenv("ATTNSERVE_BASE_URL", url)
    with pytest.raises(ac.InvalidInput, match=r"^ATTNSERVE_BASE_URL: expected an http:// or https:// URL, got "):
        cls()


# -- append and attend ----------------------------------------------------------------------------


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2), (8, 1), (4, 2)])
def test_prefill_then_fused_decode_matches_reference(client, fake, attention, heads, kv_heads):
    d = 16
    s = new_session(client, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=d)
    k, v = rand(13, kv_heads, d), rand(13, kv_heads, d)
    assert s.append(0, k[:7], v[:7]) == 7
    assert s.append(0, k[7:], v[7:]) == 13
    q = rand(13, heads, d)
    out = s.attend(0, q)
    assert out.dtype == np.float32 and out.shape == (13, heads, d) and out.flags.c_contiguous
    np.testing.assert_allclose(out, attention(q, k, v, 0, True, d**-0.5), rtol=1e-5, atol=1e-6)
    for step in range(3):
        kk, vv, qq = rand(1, kv_heads, d), rand(1, kv_heads, d), rand(1, heads, d)
        out = s.attend(1, qq, k=kk, v=vv)
        assert s.lengths == (13, step + 1)
        K, V = fake.kv(s.session_id, 1)
        np.testing.assert_allclose(out, attention(qq, K, V, step, True, d**-0.5), rtol=1e-5, atol=1e-6)


def test_attend_forwards_start_pos_causal_and_scale(client, fake, attention):
    s = new_session(client, num_layers=1)
    k, v = rand(10, 2, 16), rand(10, 2, 16)
    s.append(0, k, v)
    q = rand(3, 8, 16)
    out = s.attend(0, q, start_pos=2, scale=0.5)
    assert body_of(fake.requests[-1]).keys() == {"q", "causal", "start_pos", "scale"}
    np.testing.assert_allclose(out, attention(q, k, v, 2, True, 0.5), rtol=1e-5, atol=1e-6)
    out = s.attend(0, q, causal=False)
    body = body_of(fake.requests[-1])
    assert body["causal"] is False and "start_pos" not in body and "offset" not in body and "scale" not in body
    np.testing.assert_allclose(out, attention(q, k, v, 7, False, 0.25), rtol=1e-5, atol=1e-6)


def test_append_and_fused_attend_always_send_the_tracked_offset(client, fake):
    s = new_session(client)
    for expected in (0, 3, 5):
        n = s.append(0, rand(3 if expected == 0 else 2, 2, 16), rand(3 if expected == 0 else 2, 2, 16))
        assert body_of(fake.requests[-1])["offset"] == expected
    assert n == 7 and s.lengths == (7, 0)
    s.attend(0, rand(1, 8, 16), k=rand(1, 2, 16), v=rand(1, 2, 16))
    assert body_of(fake.requests[-1])["offset"] == 7 and s.lengths == (8, 0)
    s.attend(0, rand(1, 8, 16))
    assert "offset" not in body_of(fake.requests[-1])


def test_inputs_go_in_their_wire_dtype_others_converted_once_to_little_endian_float32(client, fake):
    s = new_session(client, num_layers=1)
    k64 = rng.standard_normal((4, 2, 16))
    s.append(0, k64.astype(">f8"), k64.astype(">f4"))
    body = body_of(fake.requests[-1])
    assert body["k"] == {"dtype": "<f4", "shape": [4, 2, 16], "data": k64.astype("<f4").tobytes()}
    assert body["v"] == body["k"]
    # float16 and bfloat16 go as they are: nothing converted to float32
    k16, v16 = k64.astype(np.float16), k64[::-1].astype(np.float16)
    s.append(0, k16, v16)
    body = body_of(fake.requests[-1])
    assert body["k"] == {"dtype": "<f2", "shape": [4, 2, 16], "data": k16.tobytes()}
    assert body["v"]["data"] == v16.tobytes()
    kb = wire.to_bfloat16(k64)
    s.append(0, kb, kb)
    assert body_of(fake.requests[-1])["k"] == {"dtype": "bfloat16", "shape": [4, 2, 16], "data": kb.tobytes()}
    # Lists and non-contiguous views are fine too.
    wide = rng.standard_normal((2, 16, 8)).astype(np.float32)
    q = wide.transpose(0, 2, 1)  # [2, 8, 16], not C-contiguous
    s.attend(0, q.tolist())
    s.attend(0, q)
    assert body_of(fake.requests[-1])["q"]["data"] == np.ascontiguousarray(q).tobytes()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: s.attend(0, rand(3, 8, 32)), r"^q: expected shape \(n, 8, 16\) with n >= 1, got \(3, 8, 32\)$"),
        (lambda s: s.attend(0, rand(3, 4, 16)), r"^q: expected shape \(n, 8, 16\) with n >= 1, got \(3, 4, 16\)$"),
        (lambda s: s.attend(0, rand(8, 16)), r"^q: expected shape \(n, 8, 16\) with n >= 1, got \(8, 16\)$"),
        (lambda s: s.attend(0, rand(0, 8, 16)), r"^q: expected shape \(n, 8, 16\) with n >= 1, got \(0, 8, 16\)$"),
        (
            lambda s: s.append(0, rand(2, 8, 16), rand(2, 8, 16)),
            r"^k: expected shape \(m, 2, 16\) with m >= 1, got \(2, 8, 16\)$",
        ),
        (
            lambda s: s.append(0, rand(2, 2, 16), rand(3, 2, 16)),
            r"^v: expected the shape of k \(2, 2, 16\), got \(3, 2, 16\)$",
        ),
        (
            lambda s: s.append(0, rand(2, 2, 16), rand(2, 2, 15)),
            r"^v: expected shape \(m, 2, 16\) with m >= 1, got \(2, 2, 15\)$",
        ),
        (lambda s: s.attend(0, rand(1, 8, 16), k=rand(1, 2, 16)), r"^k, v: expected both or neither, got only k$"),
        (lambda s: s.attend(0, rand(1, 8, 16), v=rand(1, 2, 16)), r"^k, v: expected both or neither, got only v$"),
        (lambda s: s.attend(0, rand(1, 8, 16), k=rand(1, 2, 16), v=rand(2, 2, 16)), r"^v: expected the shape of k"),
        (
            lambda s: s.append(0, np.ones((1, 2, 16), int), rand(1, 2, 16)),
            r"^k: expected a float array, got dtype int64$",
        ),
        (lambda s: s.attend(0, np.ones((1, 8, 16), complex)), r"^q: expected a float array, got dtype complex128$"),
        (lambda s: s.attend(0, np.ones((1, 8, 16), bool)), r"^q: expected a float array, got dtype bool$"),
        (lambda s: s.attend(0, [[1.0], [1.0, 2.0]]), r"^q: expected a float array"),
        (
            lambda s: s.attend(0, np.full((1, 8, 16), np.nan)),
            r"^q: expected finite values, got nan at index \(0, 0, 0\)$",
        ),
        (
            lambda s: s.append(0, rand(1, 2, 16), np.full((1, 2, 16), 1e300)),
            r"^v: expected finite values, got inf at index",
        ),
        (lambda s: s.attend(2, rand(1, 8, 16)), r"^layer: expected an int in 0\.\.1, got 2$"),
        (lambda s: s.attend(-1, rand(1, 8, 16)), r"^layer: expected an int in 0\.\.1, got -1$"),
        (lambda s: s.append(True, rand(1, 2, 16), rand(1, 2, 16)), r"^layer: expected an int in 0\.\.1, got True$"),
        (lambda s: s.append(1.0, rand(1, 2, 16), rand(1, 2, 16)), r"^layer: expected an int in 0\.\.1, got 1\.0$"),
        (lambda s: s.attend(0, rand(1, 8, 16), start_pos=-1), r"^start_pos: expected an int >= 0, got -1$"),
        (lambda s: s.attend(0, rand(1, 8, 16), start_pos=1.0), r"^start_pos: expected an int, got 1\.0$"),
        (lambda s: s.attend(0, rand(1, 8, 16), scale=math.nan), r"^scale: expected a finite float, got nan$"),
        (lambda s: s.attend(0, rand(1, 8, 16), scale=True), r"^scale: expected a finite float, got True$"),
        (lambda s: s.attend(0, rand(1, 8, 16), causal="yes"), r"^causal: expected a bool, got 'yes'$"),
        (
            lambda s: s.append(0, rand(2, 2, 16), rand(2, 2, 16, dtype=np.float16)),
            r"^v: expected the dtype of k \(<f4\), got <f2$",
        ),
        (
            lambda s: s.attend(0, rand(1, 8, 16), k=wire.to_bfloat16(rand(1, 2, 16)), v=rand(1, 2, 16)),
            r"^v: expected the dtype of k \(bfloat16\), got <f4$",
        ),
        (
            lambda s: s.attend(0, rand(1, 8, 16), out_dtype="float64"),
            r"^out_dtype: expected one of \['<f2', '<f4', 'bfloat16'\] \(float32, float16, bfloat16\), "
            r"a numpy or torch dtype of those, or None, got 'float64'$",
        ),
        (lambda s: s.attend(0, rand(1, 8, 16), out_dtype=np.float64), r"^out_dtype: expected .* got <class"),
        (lambda s: s.attend(0, rand(1, 8, 16), out_dtype=">f2"), r"^out_dtype: expected .* got '>f2'$"),
        (lambda s: s.attend(0, rand(1, 8, 16), out_dtype=2), r"^out_dtype: expected .* got 2$"),
    ],
)
def test_bad_inputs_are_refused_before_anything_is_sent(client, fake, call, message):
    s = new_session(client)
    s._lengths[0] = None  # even the GET that would learn the length is not sent
    sent = len(fake.requests)
    with pytest.raises(ac.InvalidInput, match=message) as info:
        call(s)
    assert isinstance(info.value, ValueError) and info.value.status is None
    assert len(fake.requests) == sent
    # one mistake, one exception: the class the server's answer to it maps to
    expected = ac.LayerNotFound if message.startswith("^layer") else ac.InvalidRequest
    assert isinstance(info.value, expected) and info.value.type == f"/problems/{expected.slug}"
    assert info.value.detail == str(info.value) and type(info.value).__name__ == expected.__name__


def test_another_writer_gives_offset_mismatch_and_refreshes_the_length(client, fake):
    s = new_session(client)
    s.append(0, rand(2, 2, 16), rand(2, 2, 16))
    other = client.get_session(s.session_id)
    other.append(0, rand(3, 2, 16), rand(3, 2, 16))
    with pytest.raises(ac.OffsetMismatch) as info:
        s.append(0, rand(1, 2, 16), rand(1, 2, 16))
    assert info.value.length == 5 and info.value.status == 409 and s.lengths == (5, 0)
    assert fake.kv(s.session_id, 0)[0].shape[0] == 5  # nothing appended
    assert s.append(0, rand(1, 2, 16), rand(1, 2, 16)) == 6  # with the refreshed offset
    with pytest.raises(ac.OffsetMismatch) as info:
        other.attend(0, rand(1, 8, 16), k=rand(1, 2, 16), v=rand(1, 2, 16))
    assert info.value.length == 6 and other.lengths == (6, 0)
    assert fake.kv(s.session_id, 0)[0].shape[0] == 6
    assert other.attend(0, rand(1, 8, 16), k=rand(1, 2, 16), v=rand(1, 2, 16)).shape == (1, 8, 16)
    assert other.lengths == (7, 0)


def test_unknown_length_is_fetched_before_a_write(client, fake):
    s = new_session(client)
    s.append(1, rand(4, 2, 16), rand(4, 2, 16))
    s._lengths[1] = None
    sent = len(fake.requests)
    assert s.append(1, rand(1, 2, 16), rand(1, 2, 16)) == 5
    get, post = fake.requests[sent:]
    assert get.method == "GET" and get.url.path == f"/v1/sessions/{s.session_id}"
    assert body_of(post)["offset"] == 4


def test_attend_updates_the_tracked_length(client, fake):
    s = new_session(client)
    client.get_session(s.session_id).append(0, rand(3, 2, 16), rand(3, 2, 16))
    s.attend(0, rand(1, 8, 16))
    assert s.lengths == (3, 0)
    assert s.info().lengths == (3, 0)


def test_json_answers_decode_the_same(client, fake, attention):
    fake.answer_json = True
    s = new_session(client)
    k, v = rand(5, 2, 16), rand(5, 2, 16)
    assert s.append(0, k, v) == 5
    q = rand(2, 8, 16)
    out = s.attend(0, q)
    assert out.dtype == np.float32 and out.shape == (2, 8, 16)
    np.testing.assert_allclose(out, attention(q, k, v, 3, True, 0.25), rtol=1e-5, atol=1e-6)
    assert s.info().lengths == (5, 0)


# -- dtypes: half precision in, answers in out_dtype -------------------------------------------


def in_wire_dtype(out64: np.ndarray, dtype: str) -> np.ndarray:
    """float64 attention as an attend answers it in ``dtype``: float32, rounded once."""
    return tensors.to_wire_dtype(out64.astype(np.float32), dtype)


@pytest.mark.parametrize(
    "given, name",
    [
        (None, None),
        ("<f4", "<f4"),
        ("float32", "<f4"),
        (np.float32, "<f4"),
        ("<f2", "<f2"),
        ("float16", "<f2"),
        (np.dtype("<f2"), "<f2"),
        ("bfloat16", "bfloat16"),
        (wire.BFLOAT16, "bfloat16"),
    ],
)
def test_out_dtype_is_sent_only_when_given_and_the_answer_comes_in_it(client, fake, attention, given, name):
    s = new_session(client, num_layers=1)
    k, v = rand(6, 2, 16), rand(6, 2, 16)
    s.append(0, k, v)
    q = wire.to_bfloat16(rand(2, 8, 16))  # bfloat16 queries: answered in bfloat16 unless asked otherwise
    for fused in (False, True):
        kv = dict(k=k[:1], v=v[:1]) if fused else {}
        out = s.attend(0, q, out_dtype=given, **kv)
        body = body_of(fake.requests[-1])
        assert body["q"]["dtype"] == "bfloat16" and body.get("out_dtype", None) == name
        length = s.lengths[0]
        K, V = fake.kv(s.session_id, 0)
        want = in_wire_dtype(attention(wire.to_float32(q), K, V, length - 2, True, 0.25), name or "bfloat16")
        assert out.dtype == want.dtype and out.shape == (2, 8, 16) and out.tobytes() == want.tobytes()


def test_an_answer_comes_in_q_s_dtype_by_default(client, fake, attention):
    s = new_session(client, num_layers=1)
    k, v = rand(5, 2, 16, dtype=np.float16), rand(5, 2, 16, dtype=np.float16)
    s.append(0, k, v)
    q = rand(3, 8, 16, dtype=np.float16)
    out = s.attend(0, q)
    assert "out_dtype" not in body_of(fake.requests[-1])
    want = in_wire_dtype(attention(q, k.astype(np.float32), v.astype(np.float32), 2, True, 0.25), "<f2")
    assert out.dtype == np.float16 and out.tobytes() == want.tobytes()
    assert s.attend(0, q.astype(np.float64)).dtype == np.float32  # float64 goes, and comes back, as float32


def test_an_out_in_another_dtype_than_asked_is_refused(client, fake):
    s = new_session(client, num_layers=1)
    s.append(0, rand(4, 2, 16), rand(4, 2, 16))
    fake.out_dtype = "<f4"  # a server that answers float32 whatever was asked
    with pytest.raises(ac.InvalidResponse, match=r"^attend: expected out of dtype <f2, got <f4$"):
        s.attend(0, rand(1, 8, 16, dtype=np.float16))
    fake.out_dtype = "<f2"
    with pytest.raises(ac.InvalidResponse, match=r"^attend: expected out of dtype bfloat16, got <f2$"):
        s.attend(0, rand(1, 8, 16), out_dtype="bfloat16")
    with pytest.raises(ac.InvalidResponse, match=r"^attend: expected out of dtype <f4, got <f2$"):
        s.attend(0, rand(1, 8, 16))


def test_json_answers_come_in_the_dtype_asked(client, fake, attention):
    fake.answer_json = True  # numbers: float32 holding the half's values exactly
    s = new_session(client, num_layers=1)
    k, v = rand(5, 2, 16), rand(5, 2, 16)
    s.append(0, k, v)
    q = rand(2, 8, 16)
    want = attention(q, k, v, 3, True, 0.25)
    out = s.attend(0, q, out_dtype="bfloat16")
    assert out.dtype == wire.BFLOAT16 and out.tobytes() == in_wire_dtype(want, "bfloat16").tobytes()
    out = s.attend(0, q.astype(np.float16))
    assert out.dtype == np.float16


def _raw(fake, path: str, doc: dict) -> None:
    """The next request to ``path`` is answered ``doc`` (MessagePack), whatever it asked."""
    fake.fail("raw", path=path, status=200, content=wire.packb(doc), headers={"content-type": wire.MSGPACK})


def test_batched_steps_send_out_dtype_only_when_given_and_refuse_another_dtype(client, fake):
    a, b = new_session(client, num_layers=1), new_session(client, num_layers=1)
    items = [
        ac.AttendItem(a, 0, rand(1, 8, 16, dtype=np.float16)),
        ac.AttendItem(b, 0, rand(1, 8, 16), out_dtype="bfloat16"),
    ]
    half, brain = np.zeros((1, 8, 16), np.float16), wire.to_bfloat16(np.ones((1, 8, 16)))
    results = [{"out": wire.encode_array(half), "length": 0}, {"out": wire.encode_array(brain), "length": 0}]
    _raw(fake, "/v1/batch/attend", {"results": results})
    outs = client.attend_batch(items)
    sent = body_of(fake.requests[-1])["items"]
    assert "out_dtype" not in sent[0] and sent[1]["out_dtype"] == "bfloat16"
    assert outs[0].dtype == np.float16 and outs[1].dtype == wire.BFLOAT16 and outs[1].tobytes() == brain.tobytes()
    _raw(fake, "/v1/batch/attend", {"results": results[::-1]})
    with pytest.raises(ac.InvalidResponse, match=r"^attend_batch item 0: expected out of dtype <f2, got bfloat16$"):
        client.attend_batch(items)

    q = rand(2, 1, 8, 16, dtype=np.float16)
    stacked = {"out": wire.encode_array(np.ones((2, 1, 8, 16), np.float32)), "lengths": [0, 0], "errors": []}
    _raw(fake, "/v1/batch/attend", stacked)
    out = client.attend_stacked([a, b], 0, q, out_dtype=np.float32)
    assert body_of(fake.requests[-1])["out_dtype"] == "<f4" and out.dtype == np.float32
    _raw(fake, "/v1/batch/attend", stacked)
    with pytest.raises(ac.InvalidResponse, match=r"^attend_stacked: expected out of dtype <f2, got <f4$"):
        client.attend_stacked([a, b], 0, q)
    assert "out_dtype" not in body_of(fake.requests[-1])
    with pytest.raises(ac.InvalidInput, match=r"^out_dtype: expected one of"):
        client.attend_stacked([a, b], 0, q, out_dtype="half")
    with pytest.raises(ac.InvalidInput, match=r"^out_dtype: expected one of"):
        client.attend_batch([ac.AttendItem(a, 0, q[0], out_dtype=np.float64)])


# -- errors from the server -------------------------------------------------------------------


def test_contract_errors_from_the_emulated_server(make_client, fake):
    client = make_client(max_retries=0)
    s = new_session(client, max_tokens=6)
    with pytest.raises(ac.CapacityExceeded) as e:
        s.append(0, rand(7, 2, 16), rand(7, 2, 16))
    assert e.value.status == 409 and s.lengths == (0, 0)
    s.append(0, rand(4, 2, 16), rand(4, 2, 16))
    with pytest.raises(ac.InvalidRequest, match="start_pos 3 out of range for length 4") as e:
        s.attend(0, rand(2, 8, 16), start_pos=3)
    assert e.value.status == 422
    ghost = getattr(s, "target", s)  # the session itself, also under the async wrapper
    ghost._config = dataclasses.replace(ghost._config, num_layers=5)  # pretend it had more layers
    ghost._lengths.extend([0, 0, 0])
    with pytest.raises(ac.LayerNotFound) as e:
        s.attend(4, rand(1, 8, 16))
    assert e.value.status == 404 and e.value.problem["type"] == "/problems/layer-not-found"
    with pytest.raises(ac.PayloadTooLarge) as e:
        s.append(1, rand(5000, 2, 16), rand(5000, 2, 16))
    assert e.value.status == 413
    fake.memory_budget = 64
    with pytest.raises(ac.OutOfMemory) as e:
        s.append(1, rand(2, 2, 16), rand(2, 2, 16))
    assert e.value.status == 507


@pytest.mark.parametrize(
    "status, slug, cls",
    [
        (400, "malformed-body", ac.MalformedBody),
        (401, "unauthorized", ac.Unauthorized),
        (404, "session-not-found", ac.SessionNotFound),
        (404, "layer-not-found", ac.LayerNotFound),
        (409, "offset-mismatch", ac.OffsetMismatch),
        (409, "session-exists", ac.SessionExists),
        (409, "capacity-exceeded", ac.CapacityExceeded),
        (413, "payload-too-large", ac.PayloadTooLarge),
        (415, "unsupported-media-type", ac.UnsupportedMediaType),
        (422, "invalid-snapshot", ac.InvalidSnapshot),
        (422, "invalid-request", ac.InvalidRequest),
        (503, "overloaded", ac.Overloaded),
        (503, "not-ready", ac.NotReady),
        (507, "out-of-memory", ac.OutOfMemory),
        (500, "internal", ac.APIStatusError),
    ],
)
def test_every_problem_answer_raises_its_exception(make_client, fake, status, slug, cls):
    client = make_client(max_retries=0)
    s = new_session(client)
    fake.fail("answer", status=status, slug=slug, extra={"length": 0}, headers={"Retry-After": "1"})
    with pytest.raises(cls) as e:
        s.attend(0, rand(1, 8, 16), k=rand(1, 2, 16), v=rand(1, 2, 16))
    err = e.value
    assert type(err) is cls and err.status == status
    assert err.problem == {
        "type": f"/problems/{slug}",
        "title": slug.replace("-", " "),
        "status": status,
        "detail": "injected",
        "length": 0,
    }
    assert err.retry_after == 1.0


def test_malformed_success_answers_raise_invalid_response(make_client, fake):
    client = make_client()
    s = new_session(client)
    cases = [
        (b"\xc1", {"content-type": wire.MSGPACK}, r"undecodable answer"),
        (b"{not json", {"content-type": "application/json"}, r"undecodable answer"),
        (wire.packb({"length": 1}), {"content-type": wire.MSGPACK}, r"attend: out: expected an array"),
        (
            wire.packb({"out": wire.encode_array(np.zeros((1, 8, 16))), "length": "1"}),
            {"content-type": wire.MSGPACK},
            r"attend: expected 'length' as an int in the answer, got '1'",
        ),
        (
            wire.packb({"out": wire.encode_array(np.zeros((2, 8, 16))), "length": 1}),
            {"content-type": wire.MSGPACK},
            r"attend: expected out of shape \(1, 8, 16\), got \(2, 8, 16\)",
        ),
        (
            wire.packb({"out": {"dtype": "<f8", "shape": [1], "data": b"\0" * 8}, "length": 1}),
            {"content-type": wire.MSGPACK},
            r"attend: out: expected dtype one of",
        ),
    ]
    for content, headers, message in cases:
        fake.fail("raw", status=200, content=content, headers=headers)
        with pytest.raises(ac.InvalidResponse, match=message):
            s.attend(0, rand(1, 8, 16), k=rand(1, 2, 16), v=rand(1, 2, 16))
    fake.fail(
        "raw", status=200, content=b'{"session_id": 3, "lengths": []}', headers={"content-type": "application/json"}
    )
    with pytest.raises(ac.InvalidResponse, match=r"session info: expected 'session_id' as str, got 3"):
        s.info()
    fake.fail("raw", status=200, content=b'"nope"', headers={"content-type": "application/json"})
    with pytest.raises(ac.InvalidResponse, match=r"list sessions: expected"):
        client.list_sessions()


def test_session_info_tolerates_extra_members():
    info = ac.SessionInfo.from_dict(
        {
            "session_id": "a",
            "num_layers": 1,
            "num_qo_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 4,
            "kv_format": "f32",
            "max_tokens": None,
            "seed": 3,
            "lengths": [0],
            "bytes": 0,
            "pages": 9,
        }
    )
    assert info.extra == {"pages": 9} and info.max_tokens is None
    with pytest.raises(ac.InvalidResponse, match=r"expected 2 lengths"):
        ac.SessionInfo.from_dict({**dataclasses.asdict(info), "num_layers": 2})
