"""Negotiation and decoding, without a server: Accept/Content-Type rules, and arrays
decoded from MessagePack without a copy past the parser's one."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.codec import accept_kind, media_kind
from attnserve.config import Settings
from attnserve.engine import _as_rows
from attnserve.errors import InvalidRequest, MalformedBody
from attnserve.step.parse import parse_append, parse_attend
from attnserve_client import wire


@pytest.mark.parametrize(
    "value, kind",
    [
        ("application/vnd.msgpack", "msgpack"),
        ("application/x-msgpack", "msgpack"),
        ("application/msgpack", "msgpack"),
        ("application/json", "json"),
        ("application/json; charset=utf-8", "json"),
        (" APPLICATION/JSON ", "json"),
        ("application/problem+json", None),
        ("text/plain", None),
        ("", None),
        (None, None),
    ],
)
def test_media_kind(value, kind):
    assert media_kind(value) == kind


@pytest.mark.parametrize(
    "accept, kind",
    [
        (None, None),
        ("*/*", None),
        ("text/html", None),
        ("application/json", "json"),
        ("application/vnd.msgpack", "msgpack"),
        ("application/json;q=0.2, application/msgpack;q=0.9", "msgpack"),
        ("application/msgpack;q=0, application/json", "json"),
        ("application/json, application/vnd.msgpack", "json"),  # equal q: the first named
        ("application/json;q=bad, application/x-msgpack;q=0.1", "msgpack"),
    ],
)
def test_accept_kind(accept, kind):
    assert accept_kind(accept) == kind


def _find_bytes_base(a: np.ndarray) -> object:
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def test_msgpack_arrays_are_views_of_the_parsed_bin():
    k = np.arange(2 * 3 * 4, dtype="<f4").reshape(2, 3, 4)
    body = wire.packb({"k": wire.encode_array(k), "v": wire.encode_array(-k), "offset": 0})
    req = parse_append(body, "msgpack", 1 << 20)
    for got, want in ((req.k, k), (req.v, -k)):
        np.testing.assert_array_equal(got, want)
        assert not got.flags.owndata and not got.flags.writeable
        base = _find_bytes_base(got)
        assert isinstance(base, bytes) and len(base) == want.nbytes  # the bin itself, not the body
        assert _as_rows(got, "k") is got  # and the engine takes it as it is
    assert req.offset == 0


def test_parse_errors_are_typed():
    with pytest.raises(MalformedBody):
        parse_attend(b"\xc1", "msgpack", 1 << 20)
    with pytest.raises(MalformedBody):
        parse_attend(b"{", "json", 1 << 20)
    with pytest.raises(InvalidRequest, match="finite"):
        parse_attend(b'{"q": [[[NaN]]]}', "json", 1 << 20)
    with pytest.raises(InvalidRequest, match="unknown field"):
        parse_attend(b'{"q": [[[1]]], "Q": 1}', "json", 1 << 20)
    req = parse_attend(b'{"q": [[[1, 2]]], "k": null, "v": null, "scale": 2, "causal": false}', "json", 1 << 20)
    assert req.k is None and req.scale == 2.0 and req.causal is False and req.q.dtype == np.float32


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("ATTNSERVE_MAX_BODY_BYTES", "2048")
    monkeypatch.setenv("ATTNSERVE_MEMORY_BUDGET_BYTES", "0")
    monkeypatch.setenv("ATTNSERVE_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("ATTNSERVE_ADAPTER", "")
    s = Settings()
    assert (s.max_body_bytes, s.memory_budget_bytes, s.log_level, s.adapter) == (2048, 0, "debug", None)
    monkeypatch.setenv("ATTNSERVE_MAX_BODY_BYTES", "12")
    with pytest.raises(ValueError):
        Settings()


def _read(chunks: list[bytes], declared: int | None, limit: int = 1 << 24):
    """read_body over a request whose body arrives in ``chunks``."""
    import asyncio

    from starlette.requests import Request

    from attnserve.codec import read_body

    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    request = Request({"type": "http", "method": "POST", "headers": headers}, receive)
    return asyncio.run(read_body(request, limit))


def test_a_body_is_read_with_no_copy_when_it_comes_whole_and_once_when_in_pieces():
    """The copy budget (issue 43): a declared body the server hands over whole is kept
    as it came (no copy); one that arrives in pieces is received into one buffer of
    its length; a body longer or shorter than declared is still answered whole."""
    rng = np.random.default_rng(0)
    whole = rng.bytes(300_000)
    assert _read([whole], len(whole)) is whole  # the very bytes: not copied
    pieces = [whole[:70_000], whole[70_000:200_000], whole[200_000:]]
    got = _read(pieces, len(whole))
    assert isinstance(got, bytearray) and got == whole
    assert bytes(_read([whole, b"tail"], len(whole))) == whole + b"tail"
    assert bytes(_read(pieces[:2], len(whole))) == whole[:200_000]
    small = rng.bytes(1000)
    assert _read([small], len(small)) is small and bytes(_read([small[:10], small[10:]], None)) == small
