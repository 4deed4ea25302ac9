"""The array codec and MessagePack helpers of attnserve_client.wire."""

from __future__ import annotations

import json
import math
import struct

import msgpack
import msgpack.fallback
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attnserve_client import wire
from attnserve_client.wire import WireError, decode_array, encode_array, packb, unpackb

FLOAT_DTYPES = st.sampled_from(["<f2", ">f2", "<f4", ">f4", "<f8", ">f8"])
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
FINITE = st.floats(allow_nan=False, allow_infinity=False, width=16)


def float_arrays():
    return FLOAT_DTYPES.flatmap(lambda dt: hnp.arrays(dt, SHAPES, elements=FINITE))


def wire_trip(a: np.ndarray, name: str = "x") -> np.ndarray:
    return decode_array(unpackb(packb(encode_array(a)), max_bytes=1 << 24), name=name)


# -- round trips ---------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(float_arrays(), st.booleans())
def test_msgpack_round_trip_keeps_a_wire_dtype_and_gives_float32_of_others(a, transpose):
    if transpose:
        a = a.T  # non-contiguous when ndim >= 2
    out = wire_trip(a)
    kept = a.dtype == np.dtype("<f2")  # little-endian float16 travels as it is; float64, big-endian: float32
    assert out.dtype == np.dtype("<f2" if kept else "<f4") and out.shape == a.shape and out.flags.c_contiguous
    np.testing.assert_array_equal(out, a if kept else a.astype(np.float32))


@settings(max_examples=100, deadline=None)
@given(
    FLOAT_DTYPES.flatmap(
        lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5), elements=FINITE)
    )
)
def test_json_nested_lists_round_trip(a):
    as_json = json.loads(json.dumps(a.astype(np.float32).tolist()))
    out = decode_array(as_json, name="x")
    if 0 in a.shape[:-1]:
        # Nested lists cannot show dimensions below an empty one.
        assert out.size == 0
        return
    assert out.shape == a.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out, a.astype(np.float32))


def test_encode_is_zero_copy_when_already_float32_c_order():
    a = np.arange(24, dtype="<f4").reshape(2, 3, 4)
    enc = encode_array(a)
    assert enc["dtype"] == "<f4" and enc["shape"] == [2, 3, 4]
    assert enc["data"] == a.tobytes() and len(enc["data"]) == 96
    a[0, 0, 0] = 42.0  # a view: the encoded bytes follow the array
    assert struct.unpack_from("<f", enc["data"])[0] == 42.0


def test_encode_converts_other_layouts_once():
    a = np.arange(24, dtype=">f8").reshape(4, 6)[:, ::2]
    enc = encode_array(a)
    assert enc["shape"] == [4, 3]
    assert enc["data"] == np.ascontiguousarray(a, dtype="<f4").tobytes()


def test_encode_empty_and_scalar():
    assert encode_array(np.zeros((0, 2, 3), np.float32)) == {"dtype": "<f4", "shape": [0, 2, 3], "data": b""}
    assert encode_array(np.float32(1.5))["data"] == struct.pack("<f", 1.5)


def test_decode_map_is_zero_copy_and_read_only():
    data = bytearray(np.arange(6, dtype="<f4").tobytes())
    out = decode_array({"dtype": "<f4", "shape": [2, 3], "data": data}, name="x")
    data[0:4] = struct.pack("<f", 7.0)
    assert out[0, 0] == 7.0  # shares the buffer
    frozen = decode_array({"dtype": "<f4", "shape": [6], "data": bytes(data)}, name="x")
    assert not frozen.flags.writeable


@pytest.mark.parametrize(
    "bad",
    [np.arange(3), np.array([True]), np.array([1 + 2j]), np.array(["a"]), np.array([None]), [[1.0], [2.0, 3.0]], "1.0"],
)
def test_encode_refuses_non_float(bad):
    with pytest.raises(WireError, match=r"^k: expected a float array"):
        encode_array(bad, name="k")


def test_as_float32_overflow_becomes_inf_and_check_finite_names_the_index():
    a = wire.as_float32(np.array([[1.0, 1e300]]), name="q")
    assert np.isinf(a[0, 1])
    with pytest.raises(WireError, match=r"q: expected finite values, got .*inf.* at index \(0, 1\)"):
        wire.check_finite(a, name="q")


# -- half precision ------------------------------------------------------------------------


def bfloat16_by_value(x: np.ndarray) -> np.ndarray:
    """The oracle: each float32 (not NaN) rounded to bfloat16 by its value, in float64.
    Of the two bfloat16 values around it (its upper half, and the next one away from
    zero, 2**128 standing for infinity), the nearer; on a tie the one whose bits are
    even. The bits (upper halves) as ``<u2``."""
    out = []
    for u in x.astype("<f4").reshape(-1).view("<u4").tolist():
        lo, hi = u >> 16, (u >> 16) + 1
        if u & 0xFFFF == 0:  # exact: zeros, infinities, every bfloat16 value
            out.append(lo)
            continue

        def value(h: int) -> float:
            if h & 0x7FFF == 0x7F80:
                return math.copysign(2.0**128, -1.0 if h & 0x8000 else 1.0)
            return float(np.array([h << 16], "<u4").view("<f4")[0])

        x64 = float(np.array([u], "<u4").view("<f4")[0])
        below, above = abs(x64 - value(lo)), abs(value(hi) - x64)
        out.append(lo if below < above or (below == above and lo % 2 == 0) else hi)
    return np.array(out, "<u2").reshape(x.shape)


def f32(*bits: int) -> np.ndarray:
    return np.array(bits, "<u4").view("<f4")


SPECIAL_F32 = f32(
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # ties to even (down, up), just past, just short
    0xBF808000, 0xBF818000,  # the same below zero
    0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,  # the largest: below the midpoint, at it, past (infinite)
    0x00000001, 0x00008000, 0x00018000, 0x00008001, 0x007FFFFF, 0x80000001,  # subnormals, their ties, the top one
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x3F800000,  # exact: zeros, infinities, one
)  # fmt: skip


def test_to_bfloat16_rounds_to_nearest_even_as_the_value_oracle():
    got = wire.to_bfloat16(SPECIAL_F32)
    assert got.dtype == wire.BFLOAT16 and got.shape == SPECIAL_F32.shape and got.flags.c_contiguous
    want = bfloat16_by_value(SPECIAL_F32)
    np.testing.assert_array_equal(got.view("<u2"), want)
    assert want[:4].tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F80]  # the oracle's own ties
    assert want[6:10].tolist() == [0x7F7F, 0x7F80, 0x7F80, 0xFF80]  # overflow: infinite from the midpoint on
    assert want[10:16].tolist() == [0x0000, 0x0000, 0x0002, 0x0001, 0x0080, 0x8000]  # subnormals
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2**32, size=20_000, dtype=np.uint64).astype("<u4")
    finite = bits.view("<f4")[~np.isnan(bits.view("<f4"))]
    np.testing.assert_array_equal(wire.to_bfloat16(finite).view("<u2"), bfloat16_by_value(finite))


def test_to_bfloat16_keeps_nan_and_takes_any_float_array():
    nans = f32(0x7FC00000, 0x7F800001, 0xFF800001, 0xFFFFFFFF, 0x7FFFFFFF)  # quiet, signalling, signs, all ones
    got = wire.to_bfloat16(nans).view("<u2")
    assert np.isnan(wire.to_float32(got.view(wire.BFLOAT16))).all()
    assert (got >> 15).tolist() == [0, 0, 1, 1, 0]  # signs kept
    assert wire.to_bfloat16(np.float32(1.5)).shape == () and wire.to_bfloat16(np.zeros((0, 3))).shape == (0, 3)
    wide = np.random.default_rng(6).standard_normal((3, 4))
    assert wire.to_bfloat16(wide).tobytes() == wire.to_bfloat16(wide.astype(np.float32)).tobytes()  # via float32
    strided = wide.astype(">f4").T
    assert wire.to_bfloat16(strided).tobytes() == wire.to_bfloat16(np.ascontiguousarray(strided, "<f4")).tobytes()
    with pytest.raises(WireError, match=r"^k: expected a float array, got dtype int64$"):
        wire.to_bfloat16(np.arange(3), name="k")


@pytest.mark.parametrize("dtype", sorted(wire.DTYPES))
def test_every_wire_dtype_round_trips_bit_for_bit(dtype):
    values = np.random.default_rng(7).standard_normal((3, 2, 5)).astype(np.float32)
    a = wire.to_bfloat16(values) if dtype == "bfloat16" else values.astype(wire.DTYPES[dtype])
    enc = encode_array(a)
    assert enc["dtype"] == dtype and enc["data"] == a.tobytes()  # as it is: no copy, no conversion
    out = wire_trip(a)
    assert out.dtype == a.dtype and out.shape == a.shape and out.tobytes() == a.tobytes()
    assert np.shares_memory(wire.as_wire_array(a), a)
    # JSON carries numbers: float32 holding the half's values exactly, rounded back to the same bits
    numbers = decode_array(json.loads(json.dumps(wire.to_float32(a).tolist())), name="x")
    back = wire.to_bfloat16(numbers) if dtype == "bfloat16" else numbers.astype(wire.DTYPES[dtype])
    assert back.tobytes() == a.tobytes()


# -- strict validation -------------------------------------------------------------------


def arr_map(shape=(2, 3), data=None, dtype="<f4", **extra):
    n = int(np.prod(shape)) if isinstance(shape, (list, tuple)) else 0
    obj = {
        "dtype": dtype,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "data": bytes(4 * n) if data is None else data,
    }
    obj.update(extra)
    return obj


@pytest.mark.parametrize(
    "obj, message",
    [
        (
            {"dtype": "<f4", "shape": [1]},
            r"expected exactly the keys \['data', 'dtype', 'shape'\], got \['dtype', 'shape'\]",
        ),
        (arr_map(extra=1), r"expected exactly the keys .* got \['data', 'dtype', 'extra', 'shape'\]"),
        (arr_map(dtype="<f8"), r"expected dtype one of \['<f2', '<f4', 'bfloat16'\], got '<f8'"),
        (arr_map(dtype=">f4"), r"expected dtype one of \['<f2', '<f4', 'bfloat16'\], got '>f4'"),
        (arr_map(dtype=b"<f4"), r"expected dtype one of \['<f2', '<f4', 'bfloat16'\], got b'<f4'"),
        (arr_map(shape=(2, -1), data=b""), r"expected shape as a list of at most 8 ints >= 0, got \[2, -1\]"),
        (arr_map(shape=[2, True], data=b"\0" * 8), r"expected shape as a list .* got \[2, True\]"),
        (arr_map(shape=[2.0], data=b"\0" * 8), r"expected shape as a list .* got \[2.0\]"),
        (arr_map(shape="23", data=b""), r"expected shape as a list .* got 'str'"),
        (arr_map(shape=[1] * 9, data=b"\0" * 4), r"expected shape as a list of at most 8 ints >= 0, got 'list'"),
        (arr_map(data=b"\0" * 23), r"expected 24 data bytes for shape \(2, 3\) of <f4, got 23"),
        (arr_map(data=b"\0" * 25), r"expected 24 data bytes for shape \(2, 3\) of <f4, got 25"),
        (arr_map(data="x" * 24), r"expected data as bytes, got str"),
        (arr_map(shape=[2**40, 2**40, 0], data=b""), r"expected at most \d+ elements"),
        (arr_map(shape=[0, 2**62], data=b""), r"expected at most \d+ elements"),
        (arr_map(shape=[2**31] * 8, data=b""), r"expected at most \d+ elements"),
        (3.5, r"expected an array \(a map with dtype, shape and data, or nested lists\), got float"),
        (None, r"expected an array .* got NoneType"),
        ([[1.0, 2.0], [3.0]], r"expected rectangular nested lists of shape \(2, 2\), got a list of 1 at depth 1"),
        ([[1.0, 2.0], 3.0], r"expected rectangular nested lists of shape \(2, 2\), got float at depth 1"),
        ([1.0, True], r"expected numbers, got bool"),
        ([1.0, "2"], r"expected numbers, got str"),
        ([1.0, None], r"expected numbers, got NoneType"),
        ([[[[[[[[[1.0]]]]]]]]], r"expected at most 8 dimensions, got more"),
    ],
)
def test_decode_refuses_invalid(obj, message):
    with pytest.raises(WireError, match=r"^k: " + message):
        decode_array(obj, name="k")


def test_decode_checks_ndim_and_element_cap():
    with pytest.raises(WireError, match=r"q: expected 3 dimensions, got shape \(2, 3\)"):
        decode_array(arr_map(), name="q", ndim=3)
    with pytest.raises(WireError, match=r"q: expected 3 dimensions, got shape \(2,\)"):
        decode_array([1.0, 2.0], name="q", ndim=3)
    with pytest.raises(WireError, match=r"expected at most 5 elements"):
        decode_array(arr_map(), name="q", max_elements=5)
    with pytest.raises(WireError, match=r"expected at most 5 elements"):
        decode_array([[0.0] * 3] * 2, name="q", max_elements=5)
    assert decode_array(arr_map(), name="q", ndim=2, max_elements=6).shape == (2, 3)


def test_decode_refuses_non_finite_unless_told_not_to():
    nan = arr_map(shape=(2,), data=struct.pack("<2f", 1.0, float("nan")))
    with pytest.raises(WireError, match=r"^v: expected finite values, got .*nan at index \(1,\)"):
        decode_array(nan, name="v")
    assert np.isnan(decode_array(nan, name="v", finite=False)[1])
    with pytest.raises(WireError, match=r"^v: expected finite values"):
        decode_array([[1.0, float("inf")]], name="v")
    with pytest.raises(WireError, match=r"^v: expected finite values"):
        decode_array([1.0, 10**400], name="v")  # a JSON integer past float64
    with pytest.raises(WireError, match=r"^v: expected finite values"):
        decode_array([1e39], name="v")  # past float32
    assert np.isinf(decode_array([-(10**400)], name="v", finite=False)[0])


def test_decode_accepts_empty_and_integral_json():
    assert decode_array([], name="x").shape == (0,)
    assert decode_array([[], []], name="x").shape == (2, 0)
    out = decode_array([[1, 2], [3, 4.5]], name="x")
    assert out.dtype == np.float32 and out.tolist() == [[1.0, 2.0], [3.0, 4.5]]
    assert decode_array(arr_map(shape=(0, 5), data=b""), name="x").shape == (0, 5)


# -- MessagePack limits ------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never used
        b"\x92\x01",  # truncated array
        b"\x01\x02",  # trailing data
        b"",
        b"\xc6\xff\xff\xff\xff",  # bin of 4 GiB announced
        b"\xdb\x7f\xff\xff\xff",  # str of 2 GiB announced
        b"\xdd\xff\xff\xff\xff",  # array of 4 G elements announced
        b"\xdf\xff\xff\xff\xff",  # map of 4 G pairs announced
        b"\x81\x01\x02",  # int map key
        b"\xd6\xff\x00\x00\x00\x01",  # ext (timestamp)
        b"\xc7\x01\x05\x00",  # ext type 5
        b"\xa2\xff\xfe",  # invalid UTF-8 in str
    ],
)
def test_unpackb_refuses_malformed_and_bombs(data):
    with pytest.raises(WireError, match=r"^body: expected valid MessagePack"):
        unpackb(data, max_bytes=1 << 20)


def test_unpackb_limits_body_size():
    with pytest.raises(WireError, match=r"body: expected at most 10 bytes of MessagePack, got 11"):
        unpackb(packb(b"x" * 9), max_bytes=10)
    assert unpackb(packb(b"x" * 8), max_bytes=10) == b"x" * 8


@pytest.mark.parametrize("parser", ["c", "fallback"])
def test_unpackb_refuses_deep_nesting(parser, monkeypatch):
    if parser == "fallback":
        monkeypatch.setattr(wire, "_unpackb", msgpack.fallback.unpackb)
    for deep in (b"\x91" * 100_000 + b"\xc0", b"\x81\xa1a" * 50_000 + b"\xc0"):
        with pytest.raises(WireError, match=r"^body: expected"):
            unpackb(deep, max_bytes=1 << 20)


def test_packb_uses_bin_for_bytes_and_str_for_text():
    assert packb({"a": b"\x00"}) == b"\x81\xa1a\xc4\x01\x00"
    assert unpackb(packb({"a": "é", "b": [1, 2.5, None, True]}), max_bytes=100) == {"a": "é", "b": [1, 2.5, None, True]}
    assert msgpack.unpackb(packb(encode_array(np.ones(2, np.float32))))["data"] == np.ones(2, "<f4").tobytes()


def test_media_types():
    assert wire.MSGPACK == "application/vnd.msgpack"
    assert wire.MSGPACK_TYPES == ("application/vnd.msgpack", "application/x-msgpack", "application/msgpack")
    assert wire.JSON == "application/json" and wire.PROBLEM_JSON == "application/problem+json"
    for ok in ("application/vnd.msgpack", "Application/X-MsgPack; charset=binary", " application/msgpack"):
        assert wire.is_msgpack(ok)
    for no in (None, "", "application/json", "application/vnd.msgpack+json"):
        assert not wire.is_msgpack(no)


def test_wire_imports_only_numpy_and_msgpack():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(wire))
    roots = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert roots <= {"__future__", "collections", "json", "math", "typing", "msgpack", "numpy"}


def _containers_by_parsing(doc) -> int:
    if isinstance(doc, dict):
        return 1 + sum(_containers_by_parsing(v) for v in doc.values())
    if isinstance(doc, list):
        return 1 + sum(_containers_by_parsing(v) for v in doc)
    return 0


_TRICKY_TEXT = st.text(alphabet='[]{}"\\:,a0', max_size=8)
_JSON_DOCS = st.recursive(
    st.none() | st.integers() | _TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY_TEXT, inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(doc=_JSON_DOCS, chunk=st.sampled_from([1, 2, 3, 7, 1 << 20]))
def test_json_containers_are_counted_outside_strings_across_chunks(doc, chunk):
    # brackets, quotes and runs of backslashes inside strings, cut at every chunk size
    import attnserve_client.wire as w

    old = w._SCAN_CHUNK
    w._SCAN_CHUNK = chunk
    try:
        data = json.dumps(doc).encode()
        assert wire.count_json_containers(data) == _containers_by_parsing(doc), data
    finally:
        w._SCAN_CHUNK = old


def test_loads_json_refuses_container_bombs_before_building_them(monkeypatch):
    n = 200_000
    bomb = b'{"k": [' + b"[]," * (n - 1) + b"[]]}"
    assert wire.max_containers(len(bomb), "json") < n
    built = []
    monkeypatch.setattr(json, "loads", lambda *a, **k: built.append(1))
    with pytest.raises(WireError, match="arrays and objects"):
        wire.loads_json(bomb, max_bytes=len(bomb))
    assert not built  # refused before the parser ran
    monkeypatch.undo()
    # as many brackets inside a string are text, not containers
    text = json.dumps({"s": "[]," * n, "k": [[1.5, 2.5], [3.5, 4.5]]}).encode()
    assert wire.loads_json(text, max_bytes=len(text))["k"] == [[1.5, 2.5], [3.5, 4.5]]
    # float32 rows as JSON writes them pass, even at one head of head_dim 1 (two lists a row)
    k = np.random.default_rng(0).standard_normal((n, 1, 1)).astype(np.float32)
    rows = json.dumps({"k": k.tolist()}, separators=(",", ":")).encode()
    assert np.array_equal(np.array(wire.loads_json(rows, max_bytes=len(rows))["k"], dtype=np.float32), k)
    with pytest.raises(WireError, match="at most 10 bytes"):
        wire.loads_json(b"[1, 2, 3, 4, 5]", max_bytes=10)
    with pytest.raises(WireError, match="valid JSON"):
        wire.loads_json(b"[1, 2", max_bytes=10)


# -- members: wide flat documents ------------------------------------------------


def test_loads_json_refuses_wide_objects_and_arrays_before_building_them(monkeypatch):
    keys = b"{" + b",".join(b'"k%d":0' % i for i in range(wire.MAX_MEMBERS // 2 + 1)) + b"}"
    numbers = b'{"q": [' + b",".join([b"0"] * (wire.MAX_MEMBERS + 1)) + b"]}"
    built = []
    monkeypatch.setattr(json, "loads", lambda *a, **k: built.append(1))
    for bomb in (keys, numbers):
        with pytest.raises(WireError, match="members"):
            wire.loads_json(bomb, max_bytes=len(bomb))
    assert not built  # refused before the parser ran


def test_json_members_are_counted_exactly_outside_strings():
    doc = {"a": [1, 2, 3], "b": {"c": [], "d": "x,y:z[{"}, "e": [[1, 2], [3, 4]]}
    data = json.dumps(doc).encode()
    # a container counts one and its n elements (n entries: 2n) n - 1 more (the commas, and the colons):
    # top 1 + 5, a 1 + 2, b 1 + 3, c 1 (empty), e 1 + 1 and its two rows 2 + 2
    assert wire.json_structure(data) == (7, 6 + 3 + 4 + 1 + 2 + 4)
    # the document exactly at the cap is parsed, one member past it is not
    at_cap = json.dumps({"q": [0] * 8}).encode()  # one entry (2) and 8 elements
    assert wire.json_structure(at_cap)[1] == 10
    assert wire.loads_json(at_cap, max_bytes=1 << 20, max_members=10) == {"q": [0] * 8}
    with pytest.raises(WireError, match="members"):
        wire.loads_json(at_cap, max_bytes=1 << 20, max_members=9)
    # commas inside strings do not count, whatever the raw bytes say
    texty = json.dumps({"s": "," * 100}).encode()
    assert wire.loads_json(texty, max_bytes=1 << 20, max_members=3) == {"s": "," * 100}


def test_unpackb_refuses_wide_maps_from_their_header():
    wide = msgpack.packb({f"k{i}": 0 for i in range(wire.MAX_MAP_ENTRIES + 1)})
    with pytest.raises(WireError, match=f"maps of at most {wire.MAX_MAP_ENTRIES} entries"):
        unpackb(wide, max_bytes=len(wide))
    ok = msgpack.packb({f"k{i}": 0 for i in range(wire.MAX_MAP_ENTRIES)})
    assert len(unpackb(ok, max_bytes=len(ok))) == wire.MAX_MAP_ENTRIES


@pytest.mark.parametrize("parser", ["c", "fallback"])
def test_unpackb_counts_members_across_containers(parser, monkeypatch):
    if parser == "fallback":
        monkeypatch.setattr(wire, "_unpackb", msgpack.fallback.unpackb)
    maps = msgpack.packb([{f"k{j}": 0 for j in range(16)} for _ in range(64)])  # 64 + 64 * 16 * 2 = 2112
    assert len(unpackb(maps, max_bytes=len(maps), max_members=2112)) == 64
    with pytest.raises(WireError, match="members"):
        unpackb(maps, max_bytes=len(maps), max_members=2111)
    numbers = msgpack.packb([0] * 5000)
    with pytest.raises(WireError, match="members"):  # from the array's header
        unpackb(numbers, max_bytes=len(numbers), max_members=4999)
    assert len(unpackb(numbers, max_bytes=len(numbers), max_members=5000)) == 5000


@pytest.mark.parametrize("dtype", ["<f4", "<f2", "bfloat16"])
@pytest.mark.parametrize("size", [1, 7, 1 << 18, (1 << 18) + 1, 2 * (1 << 18) + 3])
def test_all_finite_is_what_nonfinite_says_in_blocks(dtype, size):
    # all_finite checks in blocks of wire._FINITE_BLOCK elements: a bad value at
    # either end of any block, of every kind, is found; a finite array passes
    assert wire._FINITE_BLOCK == 1 << 18
    rng = np.random.default_rng(size)
    x = rng.standard_normal(size).astype(np.float32)
    x[::97] = np.float32(3.0e38) if dtype != "<f2" else np.float32(6.0e4)  # large but finite in the dtype

    def wire_array(values: np.ndarray) -> np.ndarray:
        return wire.to_bfloat16(values) if dtype == "bfloat16" else values.astype(dtype)

    a = wire_array(x)
    assert wire.all_finite(a) and not wire.nonfinite(a).any()
    assert wire.check_finite(a) is a
    edges = {0, size - 1} | {e for b in range(0, size, 1 << 18) for e in (b, b - 1) if 0 <= e < size}
    for where in sorted(edges):
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[where] = bad
            b = wire_array(y)
            assert not wire.all_finite(b), (where, bad)
            assert wire.nonfinite(b).any()
            with pytest.raises(WireError, match=rf"at index \({where},\)"):
                wire.check_finite(b)
    # any shape and layout: a transposed (non-contiguous) view too
    if size >= 14:
        y = x[: size - size % 7].copy()
        y[-1] = np.nan
        grid = wire_array(y).reshape(7, -1).T
        assert not grid.flags.c_contiguous and not wire.all_finite(grid)
        assert wire.all_finite(wire_array(x[: size - size % 7]).reshape(7, -1).T)


def test_all_finite_of_an_empty_array():
    for dtype in ("<f4", "<f2"):
        assert wire.all_finite(np.zeros((0, 3), dtype))
    assert wire.all_finite(np.zeros(0, wire.BFLOAT16))
