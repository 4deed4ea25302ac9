"""Snapshots across replicas: a session snapshotted on one server process and
restored under the same id on ANOTHER process attends bit-identically, in both kv
formats and every layer; refused blobs (truncated, corrupted, wrong version,
oversized, ...) create nothing there, not even a held id or reserved bytes."""

from __future__ import annotations

import copy
import struct
import threading

import numpy as np
import pytest

from attnserve.snapshot_format import FORMAT, VERSION, digest
from attnserve_client import wire
from hard_helpers import OracleSession, metric_sum
from svc_helpers import Api, rows

pytestmark = pytest.mark.gpu

CONFIGS = {
    # 4 layers: 70 rows (capacity 128), 5 (64), empty, 129 (192)
    "f32": dict(h=8, hkv=2, d=32, layers=4, fill=(70, 5, 0, 129)),
    "turboquant": dict(h=8, hkv=4, d=64, layers=4, fill=(70, 5, 0, 129)),
}
SMALL_BODY = 64 * 1024


@pytest.fixture(scope="module")
def replicas(spawn):
    a = spawn("replica-a")
    b = spawn("replica-b")
    c = spawn("replica-c", ATTNSERVE_MAX_BODY_BYTES=SMALL_BODY)
    apis = [Api(s.url) for s in (a, b, c)]
    yield (a, b, c), apis
    for api in apis:
        api.close()
    for s in (a, b, c):
        assert s.server_errors() == [], s.server_errors()


def snapshot(api: Api, sid: str) -> bytes:
    r = api.client.get(f"/v1/sessions/{sid}/snapshot")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == wire.MSGPACK
    return r.content


def restore(api: Api, sid: str, blob: bytes):
    return api.call("PUT", f"/v1/sessions/{sid}/snapshot", content=blob, headers={"Content-Type": wire.MSGPACK})


def state(srv, api: Api) -> tuple:
    """What a refused restore must leave exactly as it was on a replica."""
    m = srv.metrics()
    sessions = sorted(
        (s["session_id"], tuple(s["lengths"]), s["bytes"]) for s in api.call("GET", "/v1/sessions").body["sessions"]
    )
    return (
        sessions,
        metric_sum(m, "attnserve_sessions"),
        metric_sum(m, "attnserve_kv_bytes"),
        m["attnserve_memory_used_bytes"],
        api.call("GET", "/v1/info").body["limits"]["memory_used_bytes"],
    )


def same_attends(a: Api, b: Api, sid_a: str, sid_b: str, sess: OracleSession, rng, fused: bool = False) -> None:
    """Every layer: the two sessions answer byte for byte the same (and the oracle, for f32)."""
    for layer, n in enumerate(sess.model.lengths):
        variants = [dict()] if fused else [dict(), dict(causal=False), dict(start_pos=0), dict(scale=0.3)]
        for kw in variants:
            if fused:
                q, k, v = rows(rng, 1, sess.h, sess.d), rows(rng, 1, sess.hkv, sess.d), rows(rng, 1, sess.hkv, sess.d)
                kw = dict(k=k, v=v, offset=n)
            else:
                if not n:
                    continue
                q = rows(rng, min(3, n), sess.h, sess.d)
            ra, rb = a.attend(sid_a, layer, q, **kw), b.attend(sid_b, layer, q, **kw)
            assert ra.status == rb.status == 200, (ra.body, rb.body)
            assert ra.body["length"] == rb.body["length"]
            assert ra.body["out"].tobytes() == rb.body["out"].tobytes(), (layer, kw.keys())
            if fused:
                sess.model.add(layer, kw["k"], kw["v"])
                n += 1
            elif sess.kv_format == "f32":
                oracle_kw = {x: kw[x] for x in ("causal", "start_pos", "scale") if x in kw}
                want = sess.model.attention(layer, q, **oracle_kw)
                assert np.abs(rb.body["out"] - want).max() <= 1e-5 * max(np.abs(want).max(), 1e-30)


@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_restore_on_another_replica_is_bit_identical(replicas, rng, fmt):
    (a, b, _), (api_a, api_b, _) = replicas
    sid = f"snap-{fmt}-{rng.integers(1 << 40)}"
    sess = OracleSession(api_a, rng, kv_format=fmt, session_id=sid, **CONFIGS[fmt])
    info = api_a.info(sid)
    blob = snapshot(api_a, sid)
    doc = wire.unpackb(blob, max_bytes=1 << 30)
    assert (doc["format"], doc["version"]) == (FORMAT, VERSION)
    assert doc["config"]["seed"] == info["seed"] and doc["config"]["kv_format"] == fmt
    assert [layer["length"] for layer in doc["layers"]] == list(CONFIGS[fmt]["fill"])
    assert [layer["capacity"] for layer in doc["layers"]] == [128, 64, 0, 192]

    before_b = metric_sum(b.metrics(), "attnserve_kv_bytes")
    r = restore(api_b, sid, blob)  # the same id, on another process
    assert r.status == 201, r.body
    assert r.body == info and api_b.info(sid) == info
    assert metric_sum(b.metrics(), "attnserve_kv_bytes") - before_b == info["bytes"]
    assert snapshot(api_b, sid) == blob

    same_attends(api_a, api_b, sid, sid, sess, rng)
    for _ in range(3):  # decode steps on both replicas, every layer (the empty one too)
        same_attends(api_a, api_b, sid, sid, sess, rng, fused=True)
    assert api_b.info(sid) == api_a.info(sid)
    assert snapshot(api_b, sid) == snapshot(api_a, sid)

    # The seed travels with the snapshot: replaying the same rows into a new session
    # with that seed on replica b gives the restored session's bytes and answers.
    replay = f"replay-{sid}"
    api_b.create(
        "msgpack",
        replay,
        num_qo_heads=sess.h,
        num_kv_heads=sess.hkv,
        head_dim=sess.d,
        num_layers=sess.layers,
        kv_format=fmt,
        max_tokens=info["max_tokens"],
        seed=info["seed"],
    )
    for layer, fill in enumerate(CONFIGS[fmt]["fill"]):
        chunks = ([fill] if fill else []) + [1, 1, 1]
        t = 0
        for n in chunks:
            k, v = sess.model.k[layer][t : t + n], sess.model.v[layer][t : t + n]
            assert api_b.append(replay, layer, k, v, offset=t).status == 200
            t += n
    doc_restored = wire.unpackb(snapshot(api_b, sid), max_bytes=1 << 30)
    doc_replay = wire.unpackb(snapshot(api_b, replay), max_bytes=1 << 30)
    assert doc_replay["layers"] == doc_restored["layers"]
    for layer, n in enumerate(sess.model.lengths):
        q = rows(rng, 2, sess.h, sess.d)
        x, y = api_b.attend(sid, layer, q), api_b.attend(replay, layer, q)
        assert x.body["out"].tobytes() == y.body["out"].tobytes()

    for api, s in ((api_a, sid), (api_b, sid), (api_b, replay)):
        assert api.delete(s).status == 204
    assert metric_sum(b.metrics(), "attnserve_kv_bytes") == before_b


def test_empty_session_restores_elsewhere(replicas, rng):
    (_, _, _), (api_a, api_b, _) = replicas
    sid = f"empty-{rng.integers(1 << 40)}"
    info = api_a.create("json", sid, num_qo_heads=4, num_kv_heads=4, head_dim=32, num_layers=2, kv_format="turboquant")
    r = restore(api_b, sid, snapshot(api_a, sid))
    assert r.status == 201 and r.body == info and info["bytes"] == 0
    k, v, q = rows(rng, 3, 4, 32), rows(rng, 3, 4, 32), rows(rng, 3, 4, 32)
    x = api_a.attend(sid, 1, q, k=k, v=v)
    y = api_b.attend(sid, 1, q, k=k, v=v)
    assert x.status == y.status == 200 and x.body["out"].tobytes() == y.body["out"].tobytes()
    assert api_a.info(sid) == api_b.info(sid)
    api_a.delete(sid)
    api_b.delete(sid)


def _mutate(doc: dict, path: tuple, value) -> dict:
    doc = copy.deepcopy(doc)
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


_DELETE = object()


def _reseal(doc: dict) -> bytes:
    """Re-sign a mutated document, so only the mutation can be what is refused."""
    doc = dict(doc)
    try:
        doc["checksum"] = digest(doc["format"], doc["version"], doc["config"], doc["layers"])
    except (TypeError, ValueError, KeyError, struct.error):
        pass  # a mutation the digest cannot even cover: keep the old checksum
    return wire.packb(doc)


def refusal_cases(blob: bytes, doc: dict, limit: int) -> dict[str, bytes]:
    cases: dict[str, bytes] = {}
    n = len(blob)
    for cut in sorted({1, 2, 10, 40, 100, n // 4, n // 2, n - 100, n - 72, n - 71, n - 1}):
        cases[f"truncated-{cut}"] = blob[:cut]
    for pos in sorted({0, 5, 30, 60, n // 3, n // 2, n - 80, n - 40, n - 2}):
        for bit in (0x01, 0x80):
            flipped = bytearray(blob)
            flipped[pos] ^= bit
            cases[f"corrupted-{pos}-{bit:#x}"] = bytes(flipped)
    cases["appended-byte"] = blob + b"\x00"
    cases["twice"] = blob + blob
    cases["empty"] = b""
    for v in (0, 2, 10**6, "1", 1.0, True, None):
        cases[f"version-{v!r}"] = _reseal(_mutate(doc, ("version",), v))
    cases["format-other"] = _reseal(_mutate(doc, ("format",), "attnserve-snapshot-v2"))
    cases["format-bytes"] = wire.packb({**doc, "format": FORMAT.encode()})  # bin, not str
    cases["checksum-zero"] = wire.packb({**doc, "checksum": "sha256:" + "0" * 64})
    cases["checksum-missing"] = wire.packb({k: v for k, v in doc.items() if k != "checksum"})
    cases["checksum-md5"] = wire.packb({**doc, "checksum": "md5:0"})
    # oversized: more than the adapter can bind, capacities past max_tokens, more bytes than declared
    cases["max-tokens-past-adapter"] = _reseal(_mutate(doc, ("config", "max_tokens"), limit + 1))
    cases["max-tokens-2**64"] = _reseal(_mutate(doc, ("config", "max_tokens"), 2**64 - 1))
    cases["capacity-past-max-tokens"] = _reseal(
        _mutate(doc, ("layers", 0, "capacity"), doc["config"]["max_tokens"] + 1)
    )
    cases["length-past-capacity"] = _reseal(_mutate(doc, ("layers", 1, "length"), doc["layers"][1]["capacity"] + 1))
    cases["length-2**63"] = _reseal(_mutate(doc, ("layers", 1, "length"), 2**63))
    cases["k-longer"] = _reseal(_mutate(doc, ("layers", 0, "k"), doc["layers"][0]["k"] + b"\0" * 4))
    cases["v-shorter"] = _reseal(_mutate(doc, ("layers", 0, "v"), doc["layers"][0]["v"][:-4]))
    cases["capacity-without-bytes"] = _reseal(_mutate(doc, ("layers", 2, "capacity"), 64))
    cases["k-as-list"] = _reseal(_mutate(doc, ("layers", 0, "k"), [1, 2]))
    cases["layers-missing-one"] = _reseal(_mutate(doc, ("layers",), doc["layers"][:-1]))
    cases["layers-one-more"] = _reseal(_mutate(doc, ("layers",), doc["layers"] + doc["layers"][:1]))
    cases["layers-not-a-list"] = _reseal(_mutate(doc, ("layers",), {"0": doc["layers"][0]}))
    cases["layer-extra-key"] = _reseal(_mutate(doc, ("layers", 0, "extra"), 1))
    cases["layer-length-missing"] = _reseal(_mutate(doc, ("layers", 0, "length"), _DELETE))
    cases["layer-length-negative"] = _reseal(_mutate(doc, ("layers", 1, "length"), -1))
    cases["layer-length-float"] = _reseal(_mutate(doc, ("layers", 1, "length"), 5.0))
    cases["num-layers-0"] = _reseal(_mutate(doc, ("config", "num_layers"), 0))
    cases["num-layers-257"] = _reseal(_mutate(doc, ("config", "num_layers"), 257))
    cases["heads-not-dividing"] = _reseal(_mutate(doc, ("config", "num_kv_heads"), 3))
    cases["head-dim-129"] = _reseal(_mutate(doc, ("config", "head_dim"), 129))
    cases["kv-format-unknown"] = _reseal(_mutate(doc, ("config", "kv_format"), "int8"))
    cases["kv-format-swapped"] = _reseal(_mutate(doc, ("config", "kv_format"), "turboquant"))
    cases["seed-missing"] = _reseal(_mutate(doc, ("config", "seed"), _DELETE))
    cases["seed-null"] = _reseal(_mutate(doc, ("config", "seed"), None))
    cases["seed-negative"] = _reseal(_mutate(doc, ("config", "seed"), -1))
    cases["config-extra-key"] = _reseal(_mutate(doc, ("config", "owner"), "x"))
    cases["top-extra-key"] = _reseal({**doc, "extra": 1})
    cases["not-a-map"] = wire.packb([doc["format"], doc["version"]])
    cases["json-text"] = b'{"format": "attnserve-snapshot", "version": 1}'
    nan_k = bytearray(doc["layers"][0]["k"])
    nan_k[4:8] = np.float32(np.inf).tobytes()
    cases["inf-in-f32-cache"] = _reseal(_mutate(doc, ("layers", 0, "k"), bytes(nan_k)))
    cases["deep-nesting"] = b"\x81\xa6layers" + b"\x91" * 5000 + b"\xc0"
    cases["huge-declared-bin"] = b"\x85\xa6format" + wire.packb(FORMAT) + b"\xa1k\xc6\x7f\xff\xff\xff"
    return cases


def test_refused_blobs_create_nothing_on_another_replica(replicas, rng):
    (a, b, _), (api_a, api_b, _) = replicas
    sid = f"victim-{rng.integers(1 << 40)}"
    OracleSession(api_a, rng, session_id=sid, h=4, hkv=2, d=16, layers=3, fill=(70, 5, 0))
    blob = snapshot(api_a, sid)
    doc = wire.unpackb(blob, max_bytes=1 << 30)
    limit = int(api_b.call("GET", "/v1/info").body["limits"]["max_binding_bytes"]) // (2 * 16 * 4)
    other = OracleSession(api_b, rng, h=2, hkv=1, d=8, layers=1, fill=(9,))  # b is not empty
    before = state(b, api_b)
    cases = refusal_cases(blob, doc, limit)
    assert len(cases) > 60
    for name, bad in cases.items():
        ctype = wire.JSON if name == "json-text" else wire.MSGPACK
        r = api_b.call("PUT", f"/v1/sessions/{sid}/snapshot", content=bad, headers={"Content-Type": ctype})
        if name == "json-text":
            assert r.status == 415, (name, r.body)
            continue
        assert r.status == 422, (name, r.status, r.body)
        assert r.content_type == wire.PROBLEM_JSON and r.body["type"] == "/problems/invalid-snapshot", name
        assert api_b.call("GET", f"/v1/sessions/{sid}").status == 404, name
        assert state(b, api_b) == before, name
    other.check()
    # nothing held: the id and the bytes are free, and the good blob restores
    r = restore(api_b, sid, blob)
    assert r.status == 201, r.body
    assert snapshot(api_b, sid) == blob
    api_a.delete(sid)
    api_b.delete(sid)
    api_b.delete(other.sid)


def test_blob_over_the_body_limit_is_413_and_creates_nothing(replicas, rng):
    (a, _, c), (api_a, _, api_c) = replicas
    sid = f"big-{rng.integers(1 << 40)}"
    OracleSession(api_a, rng, session_id=sid, h=4, hkv=4, d=32, layers=2, fill=(100, 0))
    blob = snapshot(api_a, sid)
    assert len(blob) > SMALL_BODY
    before = state(c, api_c)
    r = restore(api_c, sid, blob)
    assert r.status == 413 and r.body["type"] == "/problems/payload-too-large"
    # streamed without Content-Length: refused as soon as the bytes pass the limit
    chunks = iter([blob[i : i + 8192] for i in range(0, len(blob), 8192)])
    r = api_c.client.put(f"/v1/sessions/{sid}/snapshot", content=chunks, headers={"Content-Type": wire.MSGPACK})
    assert r.status_code == 413
    assert api_c.call("GET", f"/v1/sessions/{sid}").status == 404
    assert state(c, api_c) == before
    api_a.delete(sid)


def test_concurrent_restores_of_one_id_make_one_session(replicas, rng):
    (a, b, _), (api_a, api_b, _) = replicas
    sid = f"race-{rng.integers(1 << 40)}"
    OracleSession(api_a, rng, session_id=sid, h=4, hkv=2, d=16, layers=2, fill=(40, 3))
    blob = snapshot(api_a, sid)
    results: list[int] = []
    lock = threading.Lock()

    def put() -> None:
        with _ctx(b.url) as api:
            r = restore(api, sid, blob)
            with lock:
                results.append(r.status)

    threads = [threading.Thread(target=put) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [201] + [409] * 5, results
    assert snapshot(api_b, sid) == blob
    api_a.delete(sid)
    api_b.delete(sid)


class _ctx:
    def __init__(self, url: str):
        self.api = Api(url)

    def __enter__(self) -> Api:
        return self.api

    def __exit__(self, *exc) -> None:
        self.api.close()
