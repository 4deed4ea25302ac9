"""Snapshots: GET a session as one MessagePack blob, PUT it back under another id, and
attends on the restored session are bit-identical; invalid blobs create nothing."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.snapshot_format import FORMAT, VERSION, digest
from attnserve_client import wire
from svc_helpers import rows

FORMATS = [
    ("f32", 8, 2, 32),
    ("bf16", 6, 3, 40),
    ("turboquant", 8, 2, 64),
    ("tq4", 8, 2, 64),
    ("tq3q", 4, 1, 32),
    ("tq4o", 4, 2, 128),
    ("tq2o", 4, 2, 64),
]


def _session(api, rng, fmt, h, hkv, d, layers=3):
    sid = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, kv_format=fmt, num_layers=layers, max_tokens=300)[
        "session_id"
    ]
    for layer, n in enumerate((70, 5, 0)[:layers]):
        if n:
            assert api.append(sid, layer, rows(rng, n, hkv, d), rows(rng, n, hkv, d)).status == 200
    return sid


def _snapshot(api, sid) -> bytes:
    r = api.client.get(f"/v1/sessions/{sid}/snapshot", headers={"Accept": wire.JSON})
    assert r.status_code == 200 and r.headers["content-type"] == wire.MSGPACK
    return r.content


def _restore(api, sid, blob: bytes, ctype: str = wire.MSGPACK):
    return api.call("PUT", f"/v1/sessions/{sid}/snapshot", content=blob, headers={"Content-Type": ctype})


@pytest.mark.parametrize("fmt, h, hkv, d", FORMATS)
def test_snapshot_round_trip_is_bit_identical(api, rng, fmt, h, hkv, d):
    sid = _session(api, rng, fmt, h, hkv, d)
    blob = _snapshot(api, sid)
    doc = wire.unpackb(blob, max_bytes=1 << 30)
    assert doc["format"] == FORMAT and doc["version"] == VERSION and doc["checksum"].startswith("sha256:")
    info = api.info(sid)
    assert doc["config"] == {
        k: info[k]
        for k in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "kv_format", "max_tokens", "seed")
    }
    assert [layer["length"] for layer in doc["layers"]] == info["lengths"] == [70, 5, 0]
    copy = f"restored-{fmt}-{rng.integers(1 << 30)}"
    r = _restore(api, copy, blob)
    assert r.status == 201, r.body
    assert r.content_type == wire.MSGPACK  # the request's type (no Accept)
    assert r.body == {**info, "session_id": copy}
    assert api.info(copy) == {**info, "session_id": copy}
    # attends, and further fused steps, agree bit for bit
    for layer in range(3):
        for _ in range(3):
            q, k, v = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
            a = api.attend(sid, layer, q, k=k, v=v)
            b = api.attend(copy, layer, q, k=k, v=v)
            assert a.status == b.status == 200 and a.body["length"] == b.body["length"]
            assert a.body["out"].tobytes() == b.body["out"].tobytes()
    assert api.info(copy)["bytes"] == api.info(sid)["bytes"]
    assert _restore(api, copy, blob).status == 409  # the id is taken now
    api.delete(sid)
    api.delete(copy)


def _mutate(doc: dict, path: tuple, value) -> dict:
    import copy

    doc = copy.deepcopy(doc)
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


def _reseal(doc: dict) -> bytes:
    doc = dict(doc)
    doc["checksum"] = digest(doc["format"], doc["version"], doc["config"], doc["layers"])
    return wire.packb(doc)


def test_invalid_snapshots_create_nothing(api, server, rng):
    sid = _session(api, rng, "f32", 4, 2, 16)
    before = api.info(sid)
    blob = _snapshot(api, sid)
    doc = wire.unpackb(blob, max_bytes=1 << 30)
    limit = server.runtime.engine.max_tokens_limit("f32", 2, 16)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x40
    nan_k = bytearray(doc["layers"][0]["k"])
    nan_k[0:4] = np.float32(np.nan).tobytes()
    cases = {
        "truncated": blob[:-10],
        "truncated-half": blob[: len(blob) // 2],
        "corrupted": bytes(flipped),
        "empty-map": b"\x80",
        "not-msgpack": b"\xc1",
        "empty": b"",
        "wrong-version": _reseal(_mutate(doc, ("version",), 2)),
        "wrong-format": _reseal(_mutate(doc, ("format",), "something-else")),
        "missing-checksum": wire.packb({k: v for k, v in doc.items() if k != "checksum"}),
        "bad-checksum": wire.packb({**doc, "checksum": "sha256:" + "0" * 64}),
        "too-few-layers": _reseal(_mutate(doc, ("layers",), doc["layers"][:2])),
        "bad-head-dim": _reseal(_mutate(doc, ("config", "head_dim"), 129)),
        "oversized-max-tokens": _reseal(_mutate(doc, ("config", "max_tokens"), limit + 1)),
        "capacity-past-max-tokens": _reseal(_mutate(doc, ("layers", 0, "capacity"), 301)),
        "length-past-capacity": _reseal(_mutate(doc, ("layers", 1, "length"), 10**6)),
        "short-k": _reseal(_mutate(doc, ("layers", 0, "k"), doc["layers"][0]["k"][:-4])),
        "nan-in-cache": _reseal(_mutate(doc, ("layers", 0, "k"), bytes(nan_k))),
        "extra-key": _reseal({**doc, "extra": 1}),
    }
    for name, bad in cases.items():
        r = _restore(api, "never-created", bad)
        assert r.status == 422 and r.body["type"] == "/problems/invalid-snapshot", (name, r.status, r.body)
        assert r.content_type == wire.PROBLEM_JSON
        assert api.call("GET", "/v1/sessions/never-created").status == 404, name
    r = _restore(api, "never-created", blob, ctype=wire.JSON)
    assert r.status == 415
    r = _restore(api, "bad.id", blob)
    assert r.status == 422 and r.body["type"] == "/problems/invalid-request"
    r = _restore(api, sid, blob)
    assert r.status == 409 and r.body["type"] == "/problems/session-exists"
    # budget and session limit: 507, nothing created
    store = server.runtime.store
    old_budget, old_max = store.memory_budget_bytes, store.max_sessions
    try:
        store.memory_budget_bytes = store.used_bytes + 100
        r = _restore(api, "never-created", blob)
        assert r.status == 507 and r.body["type"] == "/problems/out-of-memory"
        store.memory_budget_bytes = old_budget
        store.max_sessions = len(store)
        r = _restore(api, "never-created", blob)
        assert r.status == 507
    finally:
        store.memory_budget_bytes, store.max_sessions = old_budget, old_max
    assert api.call("GET", "/v1/sessions/never-created").status == 404
    assert api.info(sid) == before
    assert _snapshot(api, sid) == blob
    api.delete(sid)


@pytest.mark.parametrize("fmt, h, hkv, d", [("tq2o", 4, 2, 64), ("tq4o", 4, 2, 128)])
def test_corrupt_outlier_regions_create_nothing(api, rng, fmt, h, hkv, d):
    """Formats with outlier channels: a snapshot whose used slot names an outlier channel
    past head_dim, or holds a non-finite outlier half, is a 422 invalid-snapshot that
    names the layer and part, and creates nothing; the blob itself restores."""
    from attnserve.formats import TQ_SPECS, key_words, outlier_region, value_words

    spec = TQ_SPECS[fmt]
    sid = _session(api, rng, fmt, h, hkv, d)
    blob = _snapshot(api, sid)
    doc = wire.unpackb(blob, max_bytes=1 << 30)
    cap = doc["layers"][1]["capacity"]
    vecs = hkv * cap

    def corrupt(part: str, word: int, byte: int, value: bytes) -> bytes:
        """Layer 1 (5 timesteps), head 1, timestep 4: ``value`` at ``byte`` of outlier word ``word``."""
        regions = key_words(fmt, hkv, d) if part == "k" else value_words(fmt, hkv, d)
        at = 4 * (vecs * sum(regions[:-1]) + (1 * cap + 4) * regions[-1] + word) + byte
        buf = bytearray(doc["layers"][1][part])
        buf[at : at + len(value)] = value
        return _reseal(_mutate(doc, ("layers", 1, part), bytes(buf)))

    nan = np.array([np.nan], np.float16).tobytes()
    cases = {}
    for part, n in (("k", spec.key_outliers), ("v", spec.value_outliers)):
        if n:
            hw, _ = outlier_region(n)
            cases[f"{part}: channel {d}"] = (
                corrupt(part, hw, 1, bytes([d])),
                f"layers[1].{part}: outlier 1 of head 1 at timestep 4 names channel {d}, past head_dim {d}",
            )
            cases[f"{part}: channel 255"] = (corrupt(part, hw, n - 1 if n < 4 else 3, bytes([255])), "channel 255")
            cases[f"{part}: nan"] = (corrupt(part, 0, 0, nan), f"layers[1].{part}: non-finite outlier values")
            cases[f"{part}: inf"] = (
                corrupt(part, 0, 2 if n > 2 else 0, np.array([-np.inf], np.float16).tobytes()),
                "non-finite outlier",
            )
    assert len(cases) == (8 if spec.value_outliers else 4)
    for name, (bad, detail) in cases.items():
        r = _restore(api, "never-created", bad)
        assert r.status == 422 and r.body["type"] == "/problems/invalid-snapshot", (name, r.status, r.body)
        assert detail in r.body["detail"], (name, r.body["detail"])
        assert api.call("GET", "/v1/sessions/never-created").status == 404, name
    r = _restore(api, "never-created", blob)
    assert r.status == 201, r.body
    api.delete("never-created")
    api.delete(sid)


def test_a_bf16_snapshot_with_a_non_finite_value_creates_nothing(api, rng):
    """A bf16 layer's used rows must be finite bfloat16 (an append never stores
    others): a NaN or an infinity there is a 422; past the length, the words are not
    read."""
    sid = _session(api, rng, "bf16", 4, 2, 40)
    doc = wire.unpackb(_snapshot(api, sid), max_bytes=1 << 30)
    layer = doc["layers"][0]
    used = layer["length"] * 2 * 40
    for name, at, bits in (("k", 3, 0x7FC0), ("v", used - 1, 0xFF80)):  # a NaN; -inf, the last used element
        bad = bytearray(layer[name])
        bad[2 * at : 2 * at + 2] = int(bits).to_bytes(2, "little")
        r = _restore(api, "never-created", _reseal(_mutate(doc, ("layers", 0, name), bytes(bad))))
        assert r.status == 422 and f"layers[0].{name}: non-finite values" in r.body["detail"], r.body
        assert api.call("GET", "/v1/sessions/never-created").status == 404
    if layer["capacity"] > layer["length"]:  # a NaN in the capacity past the length is not read
        bad = bytearray(layer["k"])
        bad[2 * used : 2 * used + 2] = (0x7FC0).to_bytes(2, "little")
        r = _restore(api, "past-the-length", _reseal(_mutate(doc, ("layers", 0, "k"), bytes(bad))))
        assert r.status == 201, r.body
        api.delete("past-the-length")
    api.delete(sid)


def test_snapshot_of_unknown_session_is_404(api):
    r = api.call("GET", "/v1/sessions/nope/snapshot")
    assert r.status == 404 and r.body["type"] == "/problems/session-not-found"
