"""The batched step, POST /v1/batch/attend: bit-identical to the same attends sent
one by one, against the float64 oracle, one GPU submission, per-item problems
that change nothing, and whole-body refusals."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.config import Settings
from attnserve.metrics import counted as count
from svc_helpers import F32_TOL, Api, LiveServer, Model, from_wire, rel_err, rows, to_wire

BATCH = "/v1/batch/attend"


def _batch(api: Api, items: list[dict], enc: str = "msgpack", **kw):
    r = api.call("POST", BATCH, {"items": items}, enc=enc, **kw)
    if r.status == 200:
        r.body = from_wire(r.body)
        for res in r.body["results"]:
            if "out" in res:
                res["out"] = np.asarray(res["out"], dtype=np.float32)
    return r


# (num_qo_heads, num_kv_heads, head_dim, kv_format): awkward shapes, both formats
SHAPES = [(8, 2, 32, "f32"), (3, 1, 17, "f32"), (4, 4, 64, "turboquant"), (6, 2, 32, "turboquant"), (1, 1, 5, "f32")]


def _twins(api: Api, rng, layers: int = 2):
    """Each shape twice (same seed): one driven by batches, one by single calls."""
    pairs = []
    for i, (h, hkv, d, fmt) in enumerate(SHAPES):
        seed = int(rng.integers(1 << 30))
        spec = dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, kv_format=fmt, num_layers=layers, seed=seed)
        a = api.create(**spec)["session_id"]
        b = api.create(**spec)["session_id"]
        pairs.append((a, b, (h, hkv, d, fmt)))
    return pairs


def test_batch_is_bit_identical_to_single_calls(api, rng, enc):
    pairs = _twins(api, rng)
    models = {a: Model(h, hkv, d, layers=2) for a, _, (h, hkv, d, _) in pairs}
    # a prefill chunk (awkward lengths), then fused decode steps; the last step puts
    # two items of one session and layer into one batch (they apply in item order)
    plans = [(0, [13, 1, 7, 31, 2]), (1, [5, 9, 1, 1, 3])] + [(layer, [1] * len(pairs)) for layer in (0, 1, 0)]
    for layer, ns in plans:
        items, singles = [], []
        for (a, b, (h, hkv, d, fmt)), n in zip(pairs, ns):
            q, k, v = rows(rng, n, h, d), rows(rng, n, hkv, d), rows(rng, n, hkv, d)
            items.append({"session_id": a, "layer": layer, "q": q, "k": k, "v": v, "offset": models[a].lengths[layer]})
            singles.append((b, q, k, v))
            models[a].add(layer, k, v)
        if layer == 0 and ns[0] == 1:  # a second item for the first session, same layer
            (a, b, (h, hkv, d, _)) = pairs[0]
            q2, k2, v2 = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
            items.append({"session_id": a, "layer": 0, "q": q2, "k": k2, "v": v2})
            singles.append((b, q2, k2, v2))
            models[a].add(0, k2, v2)
        r = _batch(api, items, enc)
        assert r.status == 200, r.body
        assert len(r.body["results"]) == len(items)
        for item, res, (b, q, k, v) in zip(items, r.body["results"], singles):
            single = api.attend(b, layer, q, k=k, v=v, enc=enc)
            assert single.status == 200, single.body
            assert res["length"] == single.body["length"]
            assert res["out"].dtype == np.float32 and res["out"].shape == q.shape
            # bit for bit: the same kernels on the same bytes
            assert res["out"].tobytes() == single.body["out"].tobytes()
    for a, b, (h, hkv, d, fmt) in pairs:
        ia, ib = api.info(a), api.info(b)
        assert ia["lengths"] == ib["lengths"] == models[a].lengths
        assert ia["bytes"] == ib["bytes"]
        if fmt == "f32":  # and right: the last layer-0 step against the float64 oracle
            q = rows(rng, 3, h, d)
            got = api.attend(a, 0, q, enc=enc).body["out"]
            assert rel_err(got, models[a].attention(0, q)) <= F32_TOL
        api.delete(a)
        api.delete(b)


def test_batch_is_one_gpu_submission(api, server, rng):
    worker = server.runtime.engine.worker
    sids = [api.create(num_qo_heads=4, num_kv_heads=2, head_dim=16)["session_id"] for _ in range(6)]
    items = [
        {"session_id": s, "layer": 0, "q": rows(rng, 1, 4, 16), "k": rows(rng, 9, 2, 16), "v": rows(rng, 9, 2, 16)}
        for s in sids
    ]
    before = worker.batches
    r = _batch(api, items)
    assert r.status == 200 and all("out" in res for res in r.body["results"])
    assert worker.batches - before == 1
    for s in sids:
        api.delete(s)


def test_failed_items_get_their_problem_and_change_nothing(api, rng, enc):
    h, hkv, d = 4, 2, 16
    good = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2)["session_id"]
    other = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)["session_id"]
    m = Model(h, hkv, d, layers=2)
    k0, v0 = rows(rng, 4, hkv, d), rows(rng, 4, hkv, d)
    api.append(other, 0, k0, v0)
    before = api.info(other)

    def item(sid, layer=0, n=1, **kw):
        it = {
            "session_id": sid,
            "layer": layer,
            "q": rows(rng, n, h, d),
            "k": rows(rng, n, hkv, d),
            "v": rows(rng, n, hkv, d),
        }
        it.update(kw)
        return it

    items = [
        item(good),  # ok
        item("no-such-session"),  # 404 session-not-found
        item(other, offset=99),  # 409 offset-mismatch
        item(other, layer=5),  # 404 layer-not-found
        item(other, k=rows(rng, 1, hkv + 1, d)),  # 422 bad shape
        {"session_id": other, "layer": 0, "q": rows(rng, 1, h, d), "bogus": 1},  # 422 unknown field
        {"layer": 0, "q": rows(rng, 1, h, d)},  # 422 session_id required
        item(other, n=1, start_pos=50, k=None, v=None),  # 422 start_pos past the length
        item(good, layer=1),  # ok
    ]
    for it in items[:1] + items[8:]:
        m.add(it["layer"], it["k"], it["v"])
    r = _batch(api, items, enc)
    assert r.status == 200, r.body
    res = r.body["results"]
    want = [
        None,
        "session-not-found",
        "offset-mismatch",
        "layer-not-found",
        "invalid-request",
        "invalid-request",
        "invalid-request",
        "invalid-request",
        None,
    ]
    for i, (got, slug) in enumerate(zip(res, want)):
        if slug is None:
            assert "out" in got, got
        else:
            assert set(got) == {"error"}, got
            err = got["error"]
            assert err["type"] == f"/problems/{slug}" and err["item"] == i and err["detail"], err
    assert res[2]["error"]["length"] == 4 and res[2]["error"]["status"] == 409
    assert api.info(other)["lengths"] == before["lengths"] and api.info(other)["bytes"] == before["bytes"]
    assert api.info(good)["lengths"] == m.lengths == [1, 1]
    q = rows(rng, 1, h, d)
    assert rel_err(api.attend(good, 1, q).body["out"], m.attention(1, q)) <= F32_TOL
    api.delete(good)
    api.delete(other)


@pytest.mark.parametrize(
    "body, status, slug",
    [
        ({"items": []}, 422, "invalid-request"),
        ({"items": "x"}, 422, "invalid-request"),
        ({}, 422, "invalid-request"),
        ({"items": [], "extra": 1}, 422, "invalid-request"),
        ([1, 2], 422, "invalid-request"),
    ],
)
def test_malformed_body_is_one_problem(api, enc, body, status, slug):
    r = api.call("POST", BATCH, body, enc=enc)
    assert r.status == status and r.problem_type == f"/problems/{slug}", r.body


def test_undecodable_body_is_400(api):
    r = api.call("POST", BATCH, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status == 400 and r.problem_type == "/problems/malformed-body"


def test_item_limit_in_info_and_enforced(engine, rng):
    srv = LiveServer(Settings(max_batch_items=3), engine=engine).start()
    try:
        api = Api(srv.url)
        assert api.call("GET", "/v1/info").body["limits"]["max_batch_items"] == 3
        sid = api.create(num_qo_heads=2, num_kv_heads=1, head_dim=8)["session_id"]
        items = [
            {"session_id": sid, "layer": 0, "q": rows(rng, 1, 2, 8), "k": rows(rng, 1, 1, 8), "v": rows(rng, 1, 1, 8)}
            for _ in range(4)
        ]
        r = _batch(api, items)
        assert r.status == 422 and r.body["max_batch_items"] == 3
        assert api.info(sid)["lengths"] == [0]
        assert _batch(api, items[:3]).status == 200
        assert api.info(sid)["lengths"] == [3]
        api.close()
    finally:
        srv.stop()


def test_tenants_see_only_their_sessions_per_item(engine, rng):
    srv = LiveServer(Settings(api_keys="key-a,key-b"), engine=engine).start()
    try:
        api = Api(srv.url)
        auth_a = {"Authorization": "Bearer key-a"}
        auth_b = {"Authorization": "Bearer key-b"}
        spec = {"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 8}
        sa = api.call("POST", "/v1/sessions", spec, headers=auth_a).body["session_id"]
        sb = api.call("POST", "/v1/sessions", spec, headers=auth_b).body["session_id"]
        items = [
            {"session_id": s, "layer": 0, "q": rows(rng, 1, 2, 8), "k": rows(rng, 1, 1, 8), "v": rows(rng, 1, 1, 8)}
            for s in (sa, sb)
        ]
        r = _batch(api, items, headers=auth_a)
        assert r.status == 200
        assert "out" in r.body["results"][0]
        assert r.body["results"][1]["error"]["type"] == "/problems/session-not-found"
        assert api.call("GET", f"/v1/sessions/{sb}", headers=auth_b).body["lengths"] == [0]
        assert _batch(api, items).status == 401  # no key at all
        api.close()
    finally:
        srv.stop()


def test_queue_full_fails_every_item_and_changes_nothing(api, engine, rng):
    """A group is queued whole or not at all: past max_queue every item is 503
    overloaded and no reservation stays behind."""
    sid = api.create(num_qo_heads=2, num_kv_heads=1, head_dim=8)["session_id"]
    items = [
        {"session_id": sid, "layer": 0, "q": rows(rng, 1, 2, 8), "k": rows(rng, 1, 1, 8), "v": rows(rng, 1, 1, 8)}
        for _ in range(3)
    ]
    saved = engine.worker.max_queue
    engine.worker.max_queue = 2
    try:
        r = _batch(api, items)
    finally:
        engine.worker.max_queue = saved
    assert r.status == 200
    assert [res["error"]["type"] for res in r.body["results"]] == ["/problems/overloaded"] * 3
    assert "this batch has 3" in r.body["results"][0]["error"]["detail"]
    assert api.info(sid)["lengths"] == [0] and api.info(sid)["bytes"] == 0
    assert _batch(api, items).status == 200
    assert api.info(sid)["lengths"] == [3]
    api.delete(sid)


def test_items_of_one_layer_and_shape_run_as_one_stacked_job(api, server, rng):
    """Items alike (one layer, shapes, causal, scale) are one step and one GPU job, as
    the stacked form is; items that differ, or name a session again, are steps of
    their own in one submission; both answer per item, in the items form, and a
    refused item keeps its problem."""
    from attnserve.step.parse import parse_batch_document

    ids = [api.create(num_qo_heads=4, num_kv_heads=2, head_dim=16, num_layers=2)["session_id"] for _ in range(3)]

    def item(sid, layer=0, **kw):
        return {"session_id": sid, "layer": layer, "q": rows(rng, 1, 4, 16), "k": rows(rng, 1, 2, 16),
                "v": rows(rng, 1, 2, 16), **kw}  # fmt: skip

    alike = [item(s) for s in ids] + [item("no-such-session")]
    mixed_layers = [item(ids[0]), item(ids[1], layer=1)]
    mixed_causal = [item(ids[0]), item(ids[1], causal=False)]
    max_bytes = server.runtime.settings.max_body_bytes
    repeated = [item(ids[0]), item(ids[1]), item(ids[0])]

    def steps(items):
        return [
            s.items
            for s in parse_batch_document(to_wire({"items": items}, "msgpack"), (), "batch", max_bytes, 64).steps
        ]

    assert steps(alike) == [[0, 1, 2, 3]]
    assert steps(mixed_layers) == steps(mixed_causal) == [[0], [1]]
    assert steps(repeated) == [[0, 1], [2]]
    jobs = server.runtime.metrics.gpu_jobs
    for items, want_jobs in ((alike, 1), (mixed_layers, 2)):
        before = count(jobs)
        r = _batch(api, items)
        assert r.status == 200
        assert count(jobs) - before == want_jobs
    assert r.body["results"][1]["length"] == 1  # ids[1]'s layer 1
    r = _batch(api, alike)
    assert [res.get("length") for res in r.body["results"][:3]] == [3, 2, 2]
    assert r.body["results"][3]["error"]["type"] == "/problems/session-not-found"
    for s in ids:
        api.delete(s)


def test_items_whose_v_differs_from_k_are_refused_alone(api, rng):
    """Items alike but for ``v``'s shape are not one step: the one whose ``v`` is not
    ``k``'s shape gets its own 422, the others are answered (the tree before the
    step path answered the whole batch 500: it stacked such items by ``k``'s shape)."""
    sid = api.create(num_qo_heads=4, num_kv_heads=2, head_dim=16)["session_id"]
    other = api.create(num_qo_heads=4, num_kv_heads=2, head_dim=16)["session_id"]
    good = {"session_id": sid, "layer": 0, "q": rows(rng, 1, 4, 16), "k": rows(rng, 1, 2, 16), "v": rows(rng, 1, 2, 16)}
    bad = {**good, "session_id": other, "v": rows(rng, 1, 3, 16)}
    r = _batch(api, [good, bad])
    assert r.status == 200, r.body
    first, second = r.body["results"]
    assert first["length"] == 1
    assert second["error"]["status"] == 422 and second["error"]["item"] == 1
    assert second["error"]["detail"] == "v: expected the shape of k [1, 2, 16], got [1, 3, 16]"
    assert api.info(other)["lengths"] == [0]
    for s in (sid, other):
        api.delete(s)


def test_integers_past_int64_are_refused_as_any_other_wrong_value(api, rng):
    """An offset or start_pos past int64 (the fuzzer's 1913730379018524164096) is an
    offset that is not the length (409) or a start_pos past it (422), in every form;
    the rules compare them as Python ints, never through an int64 array."""
    huge = 1913730379018524164096
    sid = api.create(num_qo_heads=4, num_kv_heads=2, head_dim=16)["session_id"]
    k = rows(rng, 1, 2, 16)
    r = api.call("POST", f"/v1/sessions/{sid}/layers/0/kv", {"k": k, "v": k, "offset": huge})
    assert r.status == 409 and r.body["detail"] == f"offset {huge} is not the layer's length 0; nothing was appended"
    q = rows(rng, 1, 4, 16)
    r = api.call("POST", f"/v1/sessions/{sid}/layers/0/attend", {"q": q, "k": k, "v": k, "start_pos": huge})
    assert r.status == 422 and r.body["detail"].startswith(f"start_pos: 1 query rows from start_pos {huge} pass")
    stacked = {"session_ids": [sid, sid], "layer": 0, "q": np.stack([q, q]), "k": np.stack([k, k]),
               "v": np.stack([k, k]), "offsets": [huge, None], "start_pos": [None, huge]}  # fmt: skip
    r = api.call("POST", "/v1/batch/attend", stacked)
    assert r.status == 200, r.body
    assert [e["status"] for e in r.body["errors"]] == [409, 422]
    assert api.info(sid)["lengths"] == [0]
    api.delete(sid)
