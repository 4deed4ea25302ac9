"""Hypothesis properties of the wire codec and of request validation (no server).

Whatever the bytes or the document: the codec answers with a value or a
WireError, and request parsing with a checked request or a 400/422 ApiError,
never with any other exception (which would be a 500); what is accepted is
exactly what was sent; and parsing stays cheap whatever the input declares."""

from __future__ import annotations

import contextlib
import json
import math
import struct
import tracemalloc
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attnserve.codec import decode_document
from attnserve.errors import ApiError
from attnserve.step.parse import parse_append, parse_attend
from attnserve.session_spec import parse_create
from attnserve_client import wire
from attnserve_client.wire import WireError

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX = 1 << 20

# ── documents ────────────────────────────────────────────────────────────────

KEYS = st.sampled_from(
    [
        "k",
        "v",
        "q",
        "offset",
        "start_pos",
        "causal",
        "scale",
        "dtype",
        "shape",
        "data",
        "num_layers",
        "num_qo_heads",
        "num_kv_heads",
        "head_dim",
        "kv_format",
        "max_tokens",
        "seed",
        "x",
        "",
    ]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=64),
    st.sampled_from(["<f4", "<f8", ">f4", "f32", "turboquant"]),
)
DOCS = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(KEYS, inner, max_size=6)),
    max_leaves=30,
)


def array_maps():
    """Maps that look like wire arrays, valid or slightly not."""
    return st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["<f4", "<f4", "<f4", "<f8", ">f4", "f4", ""]),
            "shape": st.lists(
                st.one_of(st.integers(0, 6), st.integers(-3, 1 << 65), st.booleans(), st.floats(0, 4)), max_size=9
            ),
            "data": st.binary(max_size=600),
        }
    )


FLOATS = st.floats(-(2.0**100), 2.0**100, width=32)


def arrays3(heads=st.integers(1, 4), d=st.integers(1, 8)):
    return st.tuples(st.integers(1, 4), heads, d).flatmap(lambda s: hnp.arrays("<f4", s, elements=FLOATS))


# ── the codec ────────────────────────────────────────────────────────────────


@SETTINGS
@given(st.binary(max_size=2048))
@example(b"\xdd\xff\xff\xff\xff")
@example(b"\x91" * 5000)
@example(b"\xc7\x01\x05\x00")
def test_unpackb_gives_a_value_or_a_wire_error(data):
    try:
        wire.unpackb(data, max_bytes=MAX)
    except WireError as e:
        assert str(e).startswith("body: expected")


@SETTINGS
@given(DOCS)
def test_unpackb_reads_back_what_packb_wrote(doc):
    try:
        packed = wire.packb(doc)
    except (OverflowError, ValueError, TypeError):
        assume(False)  # not representable in MessagePack (e.g. a bin map key)
    try:
        back = wire.unpackb(packed, max_bytes=MAX)
    except WireError as e:  # only for documents msgpack can write but the wire refuses
        assert "map" in str(e) or "key" in str(e), e
        return
    assert _same(back, doc)


def _same(a, b) -> bool:
    if isinstance(b, float) and math.isnan(b):
        return isinstance(a, float) and math.isnan(a)
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


@SETTINGS
@given(st.integers(0, 3000), st.sampled_from([b"\x80", b"\x90", b"\x91\xc0", b"\x81\xa1a\x80"]))
def test_containers_are_capped_by_size(n, item):
    """At most 1024 + size // 32 arrays and maps: real documents pass, bombs stop early."""
    packed = b"\xdd" + struct.pack(">I", n) + item * n
    cap = 1024 + len(packed) // 32
    containers = 1 + n * {b"\x80": 1, b"\x90": 1, b"\x91\xc0": 1, b"\x81\xa1a\x80": 2}[item]
    if containers <= cap:
        assert len(wire.unpackb(packed, max_bytes=MAX)) == n
    else:
        with pytest.raises(WireError, match="arrays and maps"):
            wire.unpackb(packed, max_bytes=MAX)


@contextlib.contextmanager
def peak_bytes() -> Iterator[list[int]]:
    """The most bytes Python held at once inside the block, above what it held before
    (tracemalloc: every allocation of the interpreter and of C extensions' objects).
    What a parse builds, counted, not timed: a clock on a shared 2-core machine can
    stall past any bound for reasons of its own."""
    tracemalloc.start()
    got = [0]
    try:
        before = tracemalloc.get_traced_memory()[0]
        yield got
        got[0] = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_declared_lengths_are_bounded_by_the_bytes_there_are():
    """A declared length is refused from the 50 bytes that follow it: nothing of its
    size is allocated (measured: at most 3.5 kB, below 64 KiB, where an array of 2^20
    would take 8 MiB of pointers and one of 2^32 - 1, 32 GiB)."""
    for head in (b"\xdd", b"\xdf", b"\xc6", b"\xdb"):
        for n in (100, 1 << 20, (1 << 32) - 1):
            data = head + struct.pack(">I", n) + b"\x00" * 50
            with peak_bytes() as peak, pytest.raises(WireError):
                wire.unpackb(data, max_bytes=1 << 30)
            assert peak[0] < 64 << 10, (head, n, peak[0])


def test_a_megabyte_of_empty_maps_is_refused_before_they_are_built():
    """The container cap (1024 + 1 MiB // 32 = 33792) stops the parse at a thirtieth of
    the maps: measured 2.5 MB at its peak, where parsing all 1M maps takes 76 MB (the
    same body with max_containers=2**30)."""
    n = (1 << 20) - 5
    data = b"\xdd" + struct.pack(">I", n) + b"\x80" * n
    with peak_bytes() as peak, pytest.raises(WireError, match="at most 33792 arrays and maps"):
        wire.unpackb(data, max_bytes=1 << 30)
    assert peak[0] < 16 << 20, peak[0]
    # a real document of the same size: one array of a megabyte
    a = np.zeros((1, 1, n // 4 - 20), np.float32)
    doc = wire.unpackb(wire.packb({"k": wire.encode_array(a)}), max_bytes=1 << 30)
    assert wire.decode_array(doc["k"], name="k").shape == a.shape


@SETTINGS
@given(array_maps())
def test_decode_array_checks_every_member(m):
    try:
        arr = wire.decode_array(m, name="k", ndim=3, finite=False)
    except WireError as e:
        assert str(e).startswith("k: expected")
        return
    assert m["dtype"] == "<f4" and len(m["shape"]) == 3
    assert all(type(x) is int and x >= 0 for x in m["shape"])
    assert arr.shape == tuple(m["shape"]) and arr.dtype == np.float32 and arr.nbytes == len(m["data"])


@SETTINGS
@given(arrays3(), st.integers(0, 200), st.integers(1, 255), st.sampled_from(["truncate", "flip", "insert"]))
def test_damaged_msgpack_arrays_never_decode_to_something_else(a, pos, byte, how):
    packed = wire.packb({"k": wire.encode_array(a)})
    pos = pos % len(packed)
    if how == "truncate":
        bad = packed[:pos]
    elif how == "flip":
        bad = packed[:pos] + bytes([packed[pos] ^ byte]) + packed[pos + 1 :]
    else:
        bad = packed[:pos] + bytes([byte]) + packed[pos:]
    try:
        doc = wire.unpackb(bad, max_bytes=MAX)
        got = wire.decode_array(doc["k"], name="k", ndim=3, finite=False)
    except (WireError, KeyError, TypeError):
        return
    # what decodes is a consistent array: its bytes are exactly the bin that was sent
    assert got.dtype == np.float32 and got.nbytes == len(doc["k"]["data"])


@SETTINGS
@given(
    st.recursive(
        st.one_of(st.floats(allow_nan=True), st.integers(), st.booleans(), st.none(), st.text(max_size=2)),
        lambda inner: st.lists(inner, max_size=4),
        max_leaves=40,
    )
)
def test_json_nested_lists_decode_or_are_refused(doc):
    try:
        arr = wire.decode_array(doc, name="q", finite=True)
    except WireError as e:
        assert str(e).startswith("q: expected")
        return
    assert arr.dtype == np.float32 and np.isfinite(arr).all()
    assert np.array_equal(arr, np.asarray(doc, dtype=np.float64).astype(np.float32))


# ── request validation ───────────────────────────────────────────────────────

PARSERS = {"append": parse_append, "attend": parse_attend}


def _encode(doc, kind: str) -> bytes:
    if kind == "msgpack":
        return msgpack.packb(doc, use_bin_type=True)
    return json.dumps(doc).encode()


def _jsonable(doc) -> bool:
    try:
        json.dumps(doc, allow_nan=True)
        return True
    except (TypeError, ValueError):
        return False


@SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(["k", "v", "q", "offset", "start_pos", "causal", "scale", "z"]),
        st.one_of(DOCS, array_maps(), arrays3().map(wire.encode_array)),
        max_size=6,
    ),
    st.sampled_from(["append", "attend"]),
    st.sampled_from(["msgpack", "json"]),
)
def test_parsers_give_a_checked_request_or_a_client_error(doc, what, kind):
    if kind == "json" and not _jsonable(doc):
        kind = "msgpack"
    try:
        raw = _encode(doc, kind)
    except (OverflowError, ValueError, TypeError):
        return
    try:
        req = PARSERS[what](raw, kind, MAX)
    except ApiError as e:
        assert e.status in (400, 422), e
        return
    for name in ("k", "v", "q"):
        a = getattr(req, name, None)
        if a is not None:
            assert a.dtype == np.float32 and a.ndim == 3 and np.isfinite(a).all()
    assert req.offset is None or (type(req.offset) is int and req.offset >= 0)
    if what == "attend":
        assert req.start_pos is None or (type(req.start_pos) is int and req.start_pos >= 0)
        assert type(req.causal) is bool
        assert req.scale is None or np.isfinite(np.float32(req.scale))


@SETTINGS
@given(arrays3(), arrays3(), st.one_of(st.none(), st.integers(0, 1 << 40)), st.sampled_from(["msgpack", "json"]))
def test_valid_appends_are_taken_exactly(k, v, offset, kind):
    doc = {"k": k, "v": v, "offset": offset}
    wire_doc = {
        n: (wire.encode_array(x) if kind == "msgpack" else x.tolist()) if isinstance(x, np.ndarray) else x
        for n, x in doc.items()
    }
    req = parse_append(_encode(wire_doc, kind), kind, MAX)
    assert req.k.tobytes() == k.tobytes() and req.v.tobytes() == v.tobytes() and req.offset == offset


@SETTINGS
@given(arrays3(), st.one_of(st.none(), st.floats(-3e38, 3e38)), st.booleans(), st.sampled_from(["msgpack", "json"]))
def test_valid_attends_are_taken_exactly(q, scale, causal, kind):
    body = {"q": wire.encode_array(q) if kind == "msgpack" else q.tolist(), "scale": scale, "causal": causal}
    req = parse_attend(_encode(body, kind), kind, MAX)
    assert req.q.tobytes() == q.tobytes() and req.causal is causal and req.scale == scale


@pytest.mark.parametrize("scale", [1e39, -1e39, 3.5e38, float("inf"), float("nan")])
def test_a_scale_past_float32_is_refused(scale):
    q = np.ones((1, 1, 4), np.float32)
    for kind in ("msgpack", "json"):
        body = {"q": wire.encode_array(q) if kind == "msgpack" else q.tolist(), "scale": scale}
        with pytest.raises(ApiError) as e:
            parse_attend(_encode(body, kind), kind, MAX)
        assert e.value.status == 422 and "scale" in e.value.detail


@SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(
            ["num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "kv_format", "max_tokens", "seed", "owner"]
        ),
        st.one_of(st.integers(-5, 300), st.integers(-(1 << 63), (1 << 64) - 1), SCALARS),
        max_size=8,
    ),
    st.sampled_from(["msgpack", "json"]),
)
def test_create_gives_a_checked_config_or_a_client_error(doc, kind):
    if kind == "json" and not _jsonable(doc):
        kind = "msgpack"
    try:
        raw = _encode(doc, kind)
    except (OverflowError, ValueError, TypeError):
        return
    try:
        req = parse_create(decode_document(raw, kind, MAX))
    except ApiError as e:
        assert e.status in (400, 422), e
        return
    assert 1 <= req.num_layers <= 256 and req.num_qo_heads % req.num_kv_heads == 0
    assert req.kv_format in ("f32", "turboquant")
    assert (1 <= req.head_dim <= 128) if req.kv_format == "f32" else req.head_dim in (32, 64, 128)
    assert req.max_tokens is None or req.max_tokens >= 1
    assert req.seed is None or 0 <= req.seed < 1 << 64


@SETTINGS
@given(st.binary(max_size=512), st.sampled_from(["msgpack", "json"]))
def test_arbitrary_bodies_are_client_errors(raw, kind):
    for parse in (parse_append, parse_attend):
        try:
            parse(raw, kind, MAX)
        except ApiError as e:
            assert e.status in (400, 422)
