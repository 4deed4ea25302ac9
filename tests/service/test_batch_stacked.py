"""The stacked form of the batched step (POST /v1/batch/attend with ``session_ids``
and stacked arrays; a stream's ``attend_batch`` frame; the client's
``attend_stacked``): bit-identical to the same attends sent one by one, right
against the float64 oracle, one GPU submission, per-item problems that change
nothing (zeros and a null length in the failed item's slot), whole-body refusals."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from attnserve_client import AsyncClient, BatchError, Client, OffsetMismatch, SessionNotFound
from svc_helpers import F32_TOL, Api, Model, Scrape, from_wire, rel_err, rows

BATCH = "/v1/batch/attend"

# (num_qo_heads, num_kv_heads, head_dim, kv_format): awkward shapes, both formats
SHAPES = [(3, 1, 17, "f32"), (6, 2, 32, "turboquant"), (8, 2, 32, "f32")]


def _stack(rng, b: int, n: int, heads: int, d: int) -> np.ndarray:
    return np.stack([rows(rng, n, heads, d) for _ in range(b)])


def _stacked(api: Api, body: dict, enc: str = "msgpack"):
    r = api.call("POST", BATCH, body, enc=enc)
    if r.status == 200:
        r.body = from_wire(r.body)
        r.body["out"] = np.asarray(r.body["out"], dtype=np.float32)
    return r


def _twins(api: Api, rng, shape, b: int):
    h, hkv, d, fmt = shape
    pairs = []
    for _ in range(b):
        spec = dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, kv_format=fmt, num_layers=2)
        spec["seed"] = int(rng.integers(1 << 30))
        pairs.append((api.create(**spec)["session_id"], api.create(**spec)["session_id"]))
    return pairs


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_stacked_is_bit_identical_to_single_calls(api, rng, enc, shape):
    h, hkv, d, fmt = shape
    pairs = _twins(api, rng, shape, 5)
    ids = [a for a, _ in pairs]
    # the first session twice: its two items apply in item order
    ids.append(ids[0])
    twins = [b for _, b in pairs] + [pairs[0][1]]
    models = {a: Model(h, hkv, d, layers=2) for a, _ in pairs}
    # a prefill chunk (awkward rows, with offsets), decode steps on both layers, and a
    # read-only attend (no k, v) with explicit start_pos and no causal mask
    for layer, n, m in [(0, 7, 7), (1, 3, 5), (0, 1, 1), (1, 1, 1), (0, 1, 1)]:
        q, k, v = _stack(rng, len(ids), n, h, d), _stack(rng, len(ids), m, hkv, d), _stack(rng, len(ids), m, hkv, d)
        offsets = []
        for i, sid in enumerate(ids):
            offsets.append(models[sid].lengths[layer])
            models[sid].add(layer, k[i], v[i])
        body = {"session_ids": ids, "layer": layer, "q": q, "k": k, "v": v}
        if n > 1:
            body["offsets"] = offsets[:-1] + [None]  # the repeated session's second item: no check
        r = _stacked(api, body, enc)
        assert r.status == 200, r.body
        assert r.body["errors"] == [] and r.body["out"].shape == q.shape
        for i, b in enumerate(twins):
            single = api.attend(b, layer, q[i], k=k[i], v=v[i], enc=enc)
            assert single.status == 200, single.body
            assert r.body["lengths"][i] == single.body["length"]
            assert r.body["out"][i].tobytes() == single.body["out"].tobytes()
    q = _stack(rng, len(pairs), 2, h, d)
    body = {"session_ids": ids[:-1], "layer": 1, "q": q, "start_pos": [0, 1, 2, 3, None], "causal": False}
    r = _stacked(api, body, enc)
    assert r.status == 200, r.body
    for i, (a, b) in enumerate(pairs):
        kw = {"causal": False} | ({"start_pos": i} if i < 4 else {})
        single = api.attend(b, 1, q[i], enc=enc, **kw)
        assert r.body["out"][i].tobytes() == single.body["out"].tobytes()
        assert api.info(a)["lengths"] == api.info(b)["lengths"] == models[a].lengths
        if fmt == "f32":
            got = api.attend(a, 0, q[i], enc=enc).body["out"]
            assert rel_err(got, models[a].attention(0, q[i])) <= F32_TOL
        api.delete(a)
        api.delete(b)


def test_stacked_mixes_formats_and_lengths_across_pages(api, rng):
    """One stacked step over sessions of several kv formats (a per-layer mix too)
    at lengths on both sides of page boundaries (16 timesteps a page), layer after
    layer with fused appends that open new pages, and a session twice in a step:
    bit-identical to the same attends sent one by one to twin sessions, step after
    step."""
    h, hkv, d = 4, 2, 32
    formats = ["f32", "f16", "turboquant", "tq4", "tq2o", ["f32", "tq4o"], "tq3q", "bf16"]
    lengths = [15, 16, 17, 1, 31, 33, 0, 18]  # prefilled rows of each: around page edges
    pairs = []
    for fmt, length in zip(formats, lengths):
        spec = dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, kv_format=fmt, num_layers=2)
        spec["seed"] = int(rng.integers(1 << 30))
        a, b = api.create(**spec)["session_id"], api.create(**spec)["session_id"]
        for layer in (0, 1):
            if length:
                k, v = rows(rng, length, hkv, d), rows(rng, length, hkv, d)
                for sid in (a, b):
                    assert api.append(sid, layer, k, v).status == 200
        pairs.append((a, b))
    ids = [a for a, _ in pairs] + [pairs[2][0]]  # turboquant twice: its items in order
    twins = [b for _, b in pairs] + [pairs[2][1]]
    for step in range(3):
        for layer in (0, 1):
            m = 2 if step == 0 else 1  # a first step of two rows, then decode
            q = _stack(rng, len(ids), m, h, d)
            k, v = _stack(rng, len(ids), m, hkv, d), _stack(rng, len(ids), m, hkv, d)
            r = _stacked(api, {"session_ids": ids, "layer": layer, "q": q, "k": k, "v": v})
            assert r.status == 200 and r.body["errors"] == [], r.body
            for i, b in enumerate(twins):
                single = api.attend(b, layer, q[i], k=k[i], v=v[i])
                assert single.status == 200, single.body
                assert r.body["lengths"][i] == single.body["length"]
                assert r.body["out"][i].tobytes() == single.body["out"].tobytes(), (formats[i % len(formats)], i)
    for a, b in pairs:
        assert api.info(a)["lengths"] == api.info(b)["lengths"]
        api.delete(a)
        api.delete(b)


def test_stacked_value_refusals_match_single_calls(api, rng):
    """k, v values a format cannot store (a TurboQuant norm past float16, an f16
    value past its range, a tq2o outlier past float16) are checked for the whole
    stacked step at once; the refused items get the very problem the single
    attend gets (naming the row), the others go through, nothing else changes."""
    h, hkv, d = 4, 2, 32
    formats = ["turboquant", "f16", "tq2o", "f32", "turboquant"]
    ids = [api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, kv_format=f)["session_id"] for f in formats]
    q, k, v = _stack(rng, 5, 2, h, d), _stack(rng, 5, 2, hkv, d), _stack(rng, 5, 2, hkv, d)
    k[0, 1, 1] *= 1e5  # a norm past 65504
    v[1, 0, 0, 3] = 7e4  # past f16's range
    k[2, 1, 0, 5], k[2, 1, 0, 8:28] = 5e4, 3e3  # norm 51,769: an outlier tq2o would store past float16
    v[4, 1, 1] *= 1e5  # a value row's norm
    r = _stacked(api, {"session_ids": ids, "layer": 0, "q": q, "k": k, "v": v})
    assert r.status == 200, r.body
    got = {e["item"]: e["detail"] for e in r.body["errors"]}
    assert sorted(got) == [0, 1, 2, 4], r.body["errors"]
    for i, sid in enumerate(ids):
        single = api.attend(sid, 0, q[i], k=k[i], v=v[i])
        if i in got:
            assert single.status == 422 and single.body["detail"] == got[i]
            assert api.info(sid)["lengths"][0] == 0
        else:
            assert r.body["lengths"][i] == 2 and single.status == 200
    for sid in ids:
        api.delete(sid)


def test_stacked_is_one_gpu_submission(api, server, rng):
    worker = server.runtime.engine.worker
    ids = [api.create(num_qo_heads=4, num_kv_heads=2, head_dim=16)["session_id"] for _ in range(6)]
    before = worker.batches
    body = {"session_ids": ids, "layer": 0, "q": _stack(rng, 6, 1, 4, 16)}
    body["k"] = body["v"] = _stack(rng, 6, 9, 2, 16)
    r = _stacked(api, body)
    assert r.status == 200 and r.body["errors"] == [] and r.body["lengths"] == [9] * 6
    assert worker.batches - before == 1
    for s in ids:
        api.delete(s)


def test_failed_items_get_their_problem_zeros_and_change_nothing(api, rng):
    h, hkv, d = 4, 2, 16
    good = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)["session_id"]
    other = api.create(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)["session_id"]
    wide = api.create(num_qo_heads=h, num_kv_heads=hkv + 2, head_dim=d)["session_id"]
    api.append(other, 0, rows(rng, 4, hkv, d), rows(rng, 4, hkv, d))
    before = {s: api.info(s) for s in (other, wide)}
    ids = [good, "no-such-session", other, wide, other, 7, other, good]
    b = len(ids)
    q, k, v = _stack(rng, b, 1, h, d), _stack(rng, b, 1, hkv, d), _stack(rng, b, 1, hkv, d)
    q[4, 0, 1, 2] = np.nan  # item 4: a NaN in its query
    body = {"session_ids": ids, "layer": 0, "q": q, "k": k, "v": v, "offsets": [0, None, 99, None, None, None, 4, 1]}
    body["start_pos"] = [None] * 6 + [9, None]  # item 6: start_pos past the length
    m = Model(h, hkv, d)
    m.add(0, k[0], v[0])
    m.add(0, k[7], v[7])
    r = _stacked(api, body)
    assert r.status == 200, r.body
    want = {
        1: "session-not-found",
        2: "offset-mismatch",
        3: "invalid-request",
        4: "invalid-request",
        5: "invalid-request",
        6: "invalid-request",
    }
    got = {e["item"]: e["type"].rsplit("/", 1)[-1] for e in r.body["errors"]}
    assert got == want, r.body["errors"]
    assert all(e["detail"] for e in r.body["errors"])
    details = {e["item"]: e["detail"] for e in r.body["errors"]}
    assert "q: expected finite values" in details[4] and "session_ids[5]" in details[5]
    out = r.body["out"]
    for i in want:
        assert r.body["lengths"][i] is None and not out[i].any()
    assert r.body["lengths"][0] == 1 and r.body["lengths"][7] == 2
    assert rel_err(out[7], m.attention(0, q[7])) <= F32_TOL
    for s, info in before.items():
        assert api.info(s)["lengths"] == info["lengths"] and api.info(s)["bytes"] == info["bytes"]
    for s in (good, other, wide):
        api.delete(s)


def test_the_sessions_a_step_names_follow_deletes_and_new_sessions(api, rng):
    """A step's sessions are resolved once and kept for the steps after it (every
    layer, step after step): deleting one, or creating another under its id, is seen
    by the very next step, with the problem a single attend gets or the new session."""
    h, hkv, d = 4, 2, 16
    spec = dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=2)
    a, b = (api.create(**spec)["session_id"] for _ in range(2))
    models = {a: Model(h, hkv, d, layers=2), b: Model(h, hkv, d, layers=2)}

    def step(layer, ids, expect_ok):
        q, k, v = _stack(rng, len(ids), 1, h, d), _stack(rng, len(ids), 1, hkv, d), _stack(rng, len(ids), 1, hkv, d)
        r = _stacked(api, {"session_ids": ids, "layer": layer, "q": q, "k": k, "v": v})
        assert r.status == 200, r.body
        for i, sid in enumerate(ids):
            if sid not in expect_ok:
                assert r.body["lengths"][i] is None
                continue
            models[sid].add(layer, k[i], v[i])
            assert r.body["lengths"][i] == models[sid].lengths[layer]
            assert rel_err(r.body["out"][i], models[sid].attention(layer, q[i])) <= F32_TOL
        return r

    for layer in (0, 1, 0, 1):  # two steps of two layers over the same sessions
        step(layer, [a, b], {a, b})
    api.delete(b)
    r = step(0, [a, b], {a})
    assert [e["item"] for e in r.body["errors"]] == [1] and r.body["errors"][0]["type"].endswith("session-not-found")
    api.create(session_id=b, **spec)  # a new session under the deleted one's id: length 0
    models[b] = Model(h, hkv, d, layers=2)
    step(1, [a, b], {a, b})
    assert api.info(b)["lengths"] == [0, 1] and api.info(a)["lengths"] == [3, 3]
    for sid in (a, b):
        api.delete(sid)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"session_ids": []}, "session_ids: expected a non-empty array"),
        ({"session_ids": "x"}, "session_ids: expected an array"),
        ({"q": "stacked"}, "q: expected an array"),
        ({"q": "3d"}, "q: expected 4 dimensions"),
        ({"q": "short"}, "q: expected 2 stacked items"),
        ({"v": None}, "k, v: a fused append needs both"),
        ({"offsets": [1]}, "offsets: expected 2 values"),
        ({"layer": -1}, "layer: expected an integer"),
        ({"items": []}, "unknown field"),
        ({"scale": 1e39}, "scale: expected a finite float32"),
    ],
)
def test_malformed_stacked_body_is_one_problem_and_changes_nothing(api, rng, enc, change, needle):
    ids = [api.create(num_qo_heads=2, num_kv_heads=1, head_dim=8)["session_id"] for _ in range(2)]
    body = {"session_ids": ids, "layer": 0, "q": _stack(rng, 2, 1, 2, 8)}
    body["k"], body["v"] = _stack(rng, 2, 1, 1, 8), _stack(rng, 2, 1, 1, 8)
    for key, value in change.items():
        if value is None:
            del body[key]
        elif value == "3d":
            body[key] = rows(rng, 2, 2, 8)
        elif value == "short":
            body[key] = _stack(rng, 1, 1, 2, 8)
        elif value == "stacked":
            body[key] = 3
        else:
            body[key] = value
    r = api.call("POST", BATCH, body, enc=enc)
    assert r.status == 422 and r.problem_type == "/problems/invalid-request", r.body
    assert needle in r.body["detail"], r.body["detail"]
    for s in ids:
        assert api.info(s)["lengths"] == [0]
        api.delete(s)


def test_item_limit_counts_stacked_items(api, rng, server):
    limit = server.runtime.settings.max_batch_items
    sid = api.create(num_qo_heads=2, num_kv_heads=1, head_dim=8)["session_id"]
    body = {"session_ids": [sid] * (limit + 1), "layer": 0, "q": _stack(rng, limit + 1, 1, 2, 8)}
    r = api.call("POST", BATCH, body, enc="msgpack")
    assert r.status == 422 and r.body["max_batch_items"] == limit
    api.delete(sid)


def _client_twins(client, rng, b: int, fmt: str):
    spec = dict(num_qo_heads=4, num_kv_heads=2, head_dim=32, kv_format=fmt)
    out = []
    for _ in range(b):
        seed = int(rng.integers(1 << 30))
        out.append((client.create_session(seed=seed, **spec), client.create_session(seed=seed, **spec)))
    return out


@pytest.mark.parametrize("fmt", ["f32", "turboquant"])
def test_client_attend_stacked_http_and_stream(server, rng, fmt):
    with Client(server.url) as client, client.stream() as stream:
        pairs = _client_twins(client, rng, 4, fmt)
        sessions = [a for a, _ in pairs]
        for step, n in enumerate([5, 1, 1, 1]):
            q, k, v = _stack(rng, 4, n, 4, 32), _stack(rng, 4, n, 2, 32), _stack(rng, 4, n, 2, 32)
            want = np.stack([b.attend(0, q[i], k=k[i], v=v[i]) for i, (_, b) in enumerate(pairs)])
            offsets = [s.lengths[0] for s in sessions]
            if step % 2:  # the decode shorthand: [B, H, d] in, [B, H, d] out
                via = stream if step == 3 else client
                got = via.attend_stacked(sessions, 0, q[:, 0], k[:, 0], v[:, 0], offsets=offsets)
                assert got.shape == (4, 4, 32) and got.tobytes() == want[:, 0].tobytes()
            else:
                via = stream if step == 2 else client
                got = via.attend_stacked([s.session_id for s in sessions], 0, q, k, v)
                assert got.shape == q.shape and got.tobytes() == want.tobytes()
                for s, (_, b) in zip(sessions, pairs):  # ids: the session objects did not see it
                    s._lengths[0] = b.lengths[0]
        for s, (_, b) in zip(sessions, pairs):
            assert s.lengths == b.lengths == s.info().lengths
        # a failed item: BatchError with the others' outputs; the session objects track
        q, k = _stack(rng, 2, 1, 4, 32), _stack(rng, 2, 1, 2, 32)
        with pytest.raises(BatchError) as e:
            client.attend_stacked([sessions[0], "nope"], 0, q, k, k, offsets=[sessions[0].lengths[0], 0])
        assert isinstance(e.value.errors[1], SessionNotFound) and e.value.results[0].shape == (1, 4, 32)
        assert sessions[0].lengths == sessions[0].info().lengths
        with pytest.raises(BatchError) as e:
            stream.attend_stacked(sessions[:2], 0, q, k, k, offsets=[0, 0])
        assert all(isinstance(err, OffsetMismatch) for err in e.value.errors.values())
        for a, b in pairs:
            a.delete()
            b.delete()


def test_async_client_attend_stacked(server, rng):
    async def go():
        async with AsyncClient(server.url) as client:
            spec = dict(num_qo_heads=2, num_kv_heads=1, head_dim=8)
            a = [await client.create_session(seed=i, **spec) for i in range(3)]
            b = [await client.create_session(seed=i, **spec) for i in range(3)]
            q, k = _stack(rng, 3, 1, 2, 8), _stack(rng, 3, 2, 1, 8)
            want = np.stack([await s.attend(0, q[i], k=k[i], v=k[i]) for i, s in enumerate(b)])
            got = await client.attend_stacked(a, 0, q, k, k)
            assert got.tobytes() == want.tobytes()
            async with await client.stream() as stream:
                q = _stack(rng, 3, 1, 2, 8)
                want = np.stack([await s.attend(0, q[i]) for i, s in enumerate(b)])
                got = await stream.attend_stacked(a, 0, q)
                assert got.tobytes() == want.tobytes()
            for s in a + b:
                await s.delete()

    asyncio.run(go())


def _plan_events(api: Api) -> dict[str, float]:
    m = Scrape(api.client.get("/metrics").text)
    reasons = {dict(k).get("reason") for k in m.samples.get("attnserve_step_plans_total", {})}
    missed = {r: m.get("attnserve_step_plans_total", event="missed", reason=r) for r in reasons if r}
    return {e: m.get("attnserve_step_plans_total", event=e, reason="") for e in ("made", "run")} | missed


def test_a_steps_plan_is_made_on_its_first_layer_and_run_on_the_others(api, rng):
    """Plan once per step, run per layer, through the routes: an engine's token steps
    layer 0..3 of the same sessions at the same lengths, stacked and as single
    attends; the step's plan is made on layer 0 and run on layers 1..3 (counted in
    attnserve_step_plans_total), bit for bit what twin sessions answer item by
    item. A step that changes what the plan is made from (another row count) is
    a visible miss, by reason."""
    h, hkv, d, layers = 4, 2, 16, 4
    spec = dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, kv_format="f32", num_layers=layers)
    pairs = [(api.create(**spec)["session_id"], api.create(**spec)["session_id"]) for _ in range(5)]
    ids, twins = [a for a, _ in pairs], [b for _, b in pairs]
    for layer in range(layers):  # every layer's first page taken first: no slab grows between layers below
        k = rows(rng, 1, hkv, d)
        for sid in ids + twins:
            assert api.append(sid, layer, k, k).status == 200
    before = _plan_events(api)
    for token in range(3):
        for layer in range(layers):
            q, k, v = _stack(rng, 5, 1, h, d), _stack(rng, 5, 1, hkv, d), _stack(rng, 5, 1, hkv, d)
            r = _stacked(api, {"session_ids": ids, "layer": layer, "q": q, "k": k, "v": v})
            assert r.status == 200 and r.body["errors"] == [], r.body
            for i, b in enumerate(twins):
                single = api.attend(b, layer, q[i], k=k[i], v=v[i])
                assert r.body["out"][i].tobytes() == single.body["out"].tobytes()
    after = _plan_events(api)
    # the stacked steps: made on layer 0, run on 1..3; the twins' single attends (each
    # a step of one session): the same, per session
    assert after["made"] - before["made"] == 3 * (1 + len(twins))
    assert after["run"] - before["run"] == 3 * (layers - 1) * (1 + len(twins))
    assert {r: n - before.get(r, 0) for r, n in after.items() if r not in ("made", "run")} == {
        r: 0 for r in after if r not in ("made", "run")
    }
    # layer 0 with one query row, layer 1 with two: the plan cannot run, and says why
    q, k = _stack(rng, 5, 1, h, d), _stack(rng, 5, 1, hkv, d)
    assert _stacked(api, {"session_ids": ids, "layer": 0, "q": q, "k": k, "v": k}).status == 200
    q2 = _stack(rng, 5, 2, h, d)
    assert _stacked(api, {"session_ids": ids, "layer": 1, "q": q2, "k": k, "v": k, "causal": False}).status == 200
    final = _plan_events(api)
    assert final.get("options", 0) - after.get("options", 0) == 1  # the query rows are the plan's options
    for a, b in pairs:
        api.delete(a)
        api.delete(b)
