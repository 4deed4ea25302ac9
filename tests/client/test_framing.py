"""The frame transport's framing (``attnserve_client.framing``), without a server:
a document's arrays leave the head for the body and come back as views of it,
bit for bit; the caller's document is not changed; every malformed prefix or
reference is a WireError that names it."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve_client import wire
from attnserve_client.framing import MAGIC, PREFIX, frame_buffers, read_prefix, resolve_arrays


def _received(doc):
    """``doc`` framed, joined as a socket would deliver it, and read back."""
    frame = b"".join(bytes(b) for b in frame_buffers(doc, wire.packb))
    head_len, body_len = read_prefix(frame[: PREFIX.size])
    assert len(frame) == PREFIX.size + head_len + body_len
    view = memoryview(frame)[PREFIX.size :]
    got = wire.unpackb(view[:head_len], max_bytes=1 << 20)
    return got, view[head_len:], head_len


def test_arrays_travel_in_the_body_and_come_back_bit_for_bit(rng):
    q = rng.standard_normal((3, 1, 4, 17)).astype("<f4")  # awkward sizes
    k = rng.standard_normal((3, 1, 2, 17)).astype("<f4")
    item_q = rng.standard_normal((5, 4, 17)).astype("<f4")
    empty = np.zeros((0, 2, 17), "<f4")
    doc = {
        "id": 7,
        "op": "attend_batch",
        "session_ids": ["a", "b", "c"],
        "q": wire.encode_array(q),
        "k": wire.encode_array(k),
        "items": [{"session_id": "d", "layer": 0, "q": wire.encode_array(item_q), "k": wire.encode_array(empty)}],
        "offsets": [1, None, 3],
    }
    before = repr(doc)
    got, body, head_len = _received(doc)
    assert repr(doc) == before  # the caller's document is untouched
    assert head_len < 400  # the head carries references, not bytes
    assert body.nbytes == q.nbytes + k.nbytes + item_q.nbytes
    assert got["q"] == {"dtype": "<f4", "shape": [3, 1, 4, 17], "at": [0, q.nbytes]}
    resolve_arrays(got, body)
    for name, want in (("q", q), ("k", k)):
        arr = wire.decode_array(got[name], name=name, ndim=4)
        assert arr.tobytes() == want.tobytes() and arr.shape == want.shape
        assert arr.base is not None  # a view of the received bytes, not a copy
    assert wire.decode_array(got["items"][0]["q"], name="q").tobytes() == item_q.tobytes()
    assert wire.decode_array(got["items"][0]["k"], name="k").shape == (0, 2, 17)
    assert got["session_ids"] == ["a", "b", "c"] and got["offsets"] == [1, None, 3]


def test_a_reply_s_outputs_are_found_under_result(rng):
    out = rng.standard_normal((2, 3, 8)).astype("<f4")
    doc = {"id": 1, "status": 200, "result": {"results": [{"out": wire.encode_array(out), "length": 4}, {"x": 1}]}}
    got, body, _ = _received(doc)
    resolve_arrays(got, body)
    arr = wire.decode_array(got["result"]["results"][0]["out"], name="out")
    assert arr.tobytes() == out.tobytes() and got["result"]["results"][1] == {"x": 1}


def test_inline_arrays_stay_inline():
    doc = {"id": 1, "q": {"dtype": "<f4", "shape": [1], "data": [1.0]}}  # not bytes: left as it is
    got, body, _ = _received(doc)
    assert body.nbytes == 0 and got == doc


@pytest.mark.parametrize(
    "ref, said",
    [
        ({"dtype": "<f4", "shape": [2], "at": [0, 16]}, "range of the body's 8 bytes"),
        ({"dtype": "<f4", "shape": [1], "at": [2, 4]}, "multiple of 4"),
        ({"dtype": "<f4", "shape": [2], "at": [0]}, "[offset, nbytes]"),
        ({"dtype": "<f4", "shape": [2], "at": [0, -8]}, "[offset, nbytes]"),
        ({"dtype": "<f4", "shape": [2], "at": [0, 8.0]}, "[offset, nbytes]"),
        ({"dtype": "<f4", "shape": [2], "at": [0, 8], "data": b""}, "exactly the keys"),
    ],
)
def test_malformed_references_are_refused_by_name(ref, said):
    with pytest.raises(wire.WireError, match="q: ") as e:
        resolve_arrays({"q": ref}, memoryview(bytes(8)))
    assert said in str(e.value)


def test_a_prefix_without_the_magic_is_refused():
    assert read_prefix(PREFIX.pack(MAGIC, 3, 5)) == (3, 5)
    with pytest.raises(wire.WireError, match="magic"):
        read_prefix(b"GET / HTTP/1")
