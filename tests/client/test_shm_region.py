"""The shared-memory transport's region, without a server: the allocator's ranges,
the bytes a reply needs, arrays placed into a region and resolved out of it, and
the region itself (a sealed memfd)."""

from __future__ import annotations

import fcntl
import os
import sys

import numpy as np
import pytest

from attnserve_client import wire
from attnserve_client.framing import resolve_arrays
from attnserve_client.shm import ALIGN, Ranges, aligned, create_region, place_arrays, reply_bytes, request_bytes

linux = pytest.mark.skipif(sys.platform != "linux", reason="memfd is Linux's")


def _arr(shape, dtype="<f4"):
    a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return wire.encode_array(a if dtype == "<f4" else wire.to_bfloat16(a) if dtype == "bfloat16" else a.astype(dtype))


def test_ranges_take_give_and_coalesce():
    r = Ranges(1000)  # 960 usable: whole multiples of ALIGN
    assert r.size == 960
    a, b, c = r.take(1), r.take(64), r.take(65)
    assert (a, b, c) == (0, 64, 128) and r.taken_bytes == 256
    assert r.take(705) is None and r.take(704) == 256
    assert r.take(1) is None
    r.give(64)
    assert r.owner(100) is None and r.owner(130) == 128
    assert r.take(64) == 64  # the hole is reused
    for start in (0, 64, 128, 256):
        r.give(start)
    assert r.taken_bytes == 0 and r.take(960) == 0  # one free range again
    with pytest.raises(KeyError):
        r.give(64)


def test_ranges_survive_random_use(rng):
    r, held = Ranges(64 * 200), {}
    for _ in range(2000):
        if held and rng.random() < 0.5:
            start = list(held)[rng.integers(len(held))]
            del held[start]
            r.give(start)
        else:
            n = int(rng.integers(1, 64 * 20))
            start = r.take(n)
            if start is not None:
                end = start + aligned(n)
                assert start % ALIGN == 0 and end <= r.size
                assert all(end <= s or e <= start for s, e in held.items())  # disjoint
                held[start] = end
    for start in list(held):
        r.give(start)
    assert r.take(r.size) == 0


def test_reply_bytes():
    q = _arr((3, 4, 24))  # 288 floats: out 1152 bytes
    assert reply_bytes({"op": "attend", "q": q}) == aligned(1152)
    assert reply_bytes({"op": "attend", "q": q, "return_lse": True}) == aligned(1152) + aligned(3 * 4 * 4)
    assert reply_bytes({"op": "attend", "q": q, "out_dtype": "bfloat16"}) == aligned(576)
    assert reply_bytes({"op": "attend", "q": _arr((3, 4, 24), "<f2")}) == aligned(576)  # q's dtype
    stacked = {"op": "attend_batch", "session_ids": ["a", "b"], "q": _arr((2, 1, 4, 8)), "return_lse": True}
    assert reply_bytes(stacked) == aligned(2 * 32 * 4) + aligned(2 * 4 * 4)
    items = {"op": "attend_batch", "items": [{"q": q}, {"q": q, "return_lse": True}, {"nothing": 1}, 7]}
    assert reply_bytes(items) == 2 * aligned(1152) + aligned(48)
    assert reply_bytes({"op": "attend", "q": [[[1.0, 2.0]]]}) == aligned(8)  # nested lists: float32
    for doc in ({"op": "append", "k": q, "v": q}, {"op": "ping"}, {"op": "session"}, None, []):
        assert reply_bytes(doc) == 0
    # what the operation's own checks refuse adds nothing
    for bad in ({**q, "dtype": "<f8"}, {**q, "shape": [-1]}, {**q, "shape": "x"}, {**q, "data": b"x"}, "q"):
        assert reply_bytes({"op": "attend", "q": bad}) == 0


def test_place_and_resolve_round_trip():
    region = memoryview(bytearray(4096))
    q, k = _arr((2, 3, 5)), _arr((1, 3, 5), "bfloat16")
    doc = {"op": "attend", "q": q, "k": k, "items": [{"q": q}], "session_ids": ["a"]}
    placed, end = place_arrays(doc, region, 128, 1024)
    assert placed["q"] == {"dtype": "<f4", "shape": [2, 3, 5], "shm": [128, 120]}
    assert placed["k"]["shm"] == [256, 30]  # the next multiple of 64
    assert placed["items"][0]["q"]["shm"] == [320, 120] and end == 440
    assert "data" in doc["q"]  # the document given is not changed
    assert request_bytes(doc) == aligned(120) * 2 + aligned(30)
    resolve_arrays(placed, memoryview(b""), region=region)
    for got, want in ((placed["q"], q), (placed["k"], k), (placed["items"][0]["q"], q)):
        assert bytes(got["data"]) == bytes(want["data"]) and got["dtype"] == want["dtype"]
    with pytest.raises(wire.WireError, match="need more than the 100 bytes"):
        place_arrays(doc, region, 0, 100)


def test_arrays_already_in_the_region_are_referred_to_where_they_are():
    region = memoryview(bytearray(4096))
    mine = np.frombuffer(region[512:632], np.float32).reshape(2, 3, 5)
    doc = {"q": wire.encode_array(mine), "k": _arr((1, 3, 5))}

    def in_place(data: memoryview) -> int | None:
        return 512 if np.shares_memory(np.frombuffer(data, np.uint8), mine) else None

    assert request_bytes(doc, in_place) == aligned(60)
    placed, end = place_arrays(doc, region, 0, 64, in_place)
    assert placed["q"]["shm"] == [512, 120] and placed["k"]["shm"] == [0, 60] and end == 60


def test_region_references_are_checked():
    region = memoryview(bytearray(256))
    ok = {"dtype": "<f4", "shape": [4], "shm": [64, 16]}
    for ref, said in [
        ({**ok, "shm": [250, 16]}, "a range of the region's 256 bytes"),
        ({**ok, "shm": [2, 16]}, "multiple of 4"),
        ({**ok, "shm": [64]}, "[offset, nbytes]"),
        ({**ok, "shm": [True, 16]}, "[offset, nbytes]"),
        ({**ok, "at": [0, 16]}, "exactly the keys ['dtype', 'shape', 'shm']"),
    ]:
        with pytest.raises(wire.WireError, match=said.replace("[", r"\[").replace("]", r"\]")):
            resolve_arrays({"q": ref}, memoryview(b""), region=region)
    with pytest.raises(wire.WireError, match="only a connection of the shared-memory transport"):
        resolve_arrays({"q": ok}, memoryview(b""))
    doc = {"q": dict(ok)}
    resolve_arrays(doc, memoryview(b""), region=region)
    assert wire.decode_array(doc["q"], name="q").shape == (4,)


@linux
def test_a_region_is_a_sealed_memfd():
    fd, region = create_region(8192, "attnserve-test-unit")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        assert os.fstat(fd).st_size == 8192 == len(region)
        with pytest.raises(OSError):
            os.ftruncate(fd, 4096)  # a region cannot shrink under the server's mapping
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:attnserve-test-unit")
        region[:4] = b"abcd"
        assert os.pread(fd, 4, 0) == b"abcd"  # shared, not private
    finally:
        os.close(fd)
        region.close()
