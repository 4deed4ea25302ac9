"""Per-layer kv formats: a session whose ``kv_format`` is one format per layer. Each
layer answers bit for bit as the same layer of a session of its format alone (same
seed: the same TurboQuant rotations), the f32, f16 and bf16 layers against the
float64 oracle (f16: over the rows rounded to float16, bf16: to bfloat16);
bytes, metrics, snapshots, forks and the client follow the layer formats; bad
format lists are refused and create nothing."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.formats import bytes_per_token
from attnserve_client import Client
from attnserve_client import wire
from _core import bf16_nearest
from svc_helpers import F32_TOL, PAGE, Model, Scrape, rel_err, rows

H, HKV, D = 4, 2, 32
FORMATS = ["f16", "turboquant", "f32", "bf16"]


def _bytes_per_page(fmt: str) -> int:
    return bytes_per_token(fmt, HKV, D) * PAGE


def _create(api, formats, seed: int, **kw) -> str:
    spec = dict(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=len(FORMATS), kv_format=formats, seed=seed)
    return api.create(**spec, **kw)["session_id"]


def test_each_layer_answers_as_a_session_of_its_format(api, rng, enc):
    seed = int(rng.integers(1 << 30))
    mixed = _create(api, FORMATS, seed)
    alone = {fmt: _create(api, fmt, seed) for fmt in set(FORMATS)}
    info = api.info(mixed)
    assert info["kv_format"] == FORMATS and info["layer_formats"] == FORMATS
    assert api.info(alone["f16"])["layer_formats"] == ["f16"] * 4
    model = Model(H, HKV, D, layers=len(FORMATS))
    for n in (PAGE + 3, 1, 1, 2):  # a prefill chunk past a page, then fused steps
        for layer, fmt in enumerate(FORMATS):
            q, k, v = rows(rng, n, H, D), rows(rng, n, HKV, D), rows(rng, n, HKV, D)
            got = api.attend(mixed, layer, q, k=k, v=v, enc=enc)
            want = api.attend(alone[fmt], layer, q, k=k, v=v, enc=enc)
            assert got.status == want.status == 200, (got.body, want.body)
            assert got.body["out"].tobytes() == want.body["out"].tobytes()
            if fmt == "f16":
                k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
            if fmt == "bf16":
                k, v = wire.to_float32(bf16_nearest(k)), wire.to_float32(bf16_nearest(v))
            model.add(layer, k, v)
            if fmt != "turboquant":
                assert rel_err(got.body["out"], model.attention(layer, q)) <= F32_TOL
    length = PAGE + 7
    pages = -(-length // PAGE)
    assert api.info(mixed)["lengths"] == [length] * 4
    assert api.info(mixed)["bytes"] == sum(pages * _bytes_per_page(f) for f in FORMATS)
    for fmt, sid in alone.items():
        assert api.info(sid)["bytes"] == FORMATS.count(fmt) * pages * _bytes_per_page(fmt)  # its layers of fmt
    m = Scrape(api.client.get("/metrics").text)
    for fmt in set(FORMATS):
        # the mixed session counts under each of its formats, its bytes by layer
        mixed_bytes = FORMATS.count(fmt) * pages * _bytes_per_page(fmt)
        assert m("attnserve_kv_bytes", kv_format=fmt) >= api.info(alone[fmt])["bytes"] + mixed_bytes
        assert m("attnserve_sessions", kv_format=fmt) >= 2
    for sid in (mixed, *alone.values()):
        api.delete(sid)


def test_snapshot_and_fork_keep_the_layer_formats(api, rng):
    seed = int(rng.integers(1 << 30))
    sid = _create(api, FORMATS, seed)
    for layer in range(len(FORMATS)):
        api.append(sid, layer, rows(rng, 2 * PAGE + 1, HKV, D), rows(rng, 2 * PAGE + 1, HKV, D))
    r = api.client.get(f"/v1/sessions/{sid}/snapshot")
    assert r.status_code == 200
    assert wire.unpackb(r.content, max_bytes=1 << 30)["config"]["kv_format"] == FORMATS
    copy = f"copy-{rng.integers(1 << 30)}"
    put = api.call("PUT", f"/v1/sessions/{copy}/snapshot", content=r.content, headers={"Content-Type": wire.MSGPACK})
    assert put.status == 201, put.body
    fork = api.call("POST", f"/v1/sessions/{sid}/fork", {}).body["session_id"]
    info = api.info(sid)
    assert {**api.info(copy), "session_id": sid} == info
    # a fork shares the full pages (charged once, to the source): the rest is the same
    assert {**api.info(fork), "session_id": sid, "bytes": info["bytes"]} == info
    for layer in range(len(FORMATS)):
        q, k, v = rows(rng, 1, H, D), rows(rng, 1, HKV, D), rows(rng, 1, HKV, D)
        outs = [api.attend(s, layer, q, k=k, v=v).body["out"].tobytes() for s in (sid, copy, fork)]
        assert outs[0] == outs[1] == outs[2]
    for s in (sid, copy, fork):
        api.delete(s)


@pytest.mark.parametrize(
    "kv_format, head_dim, needle",
    [
        (["f32", "turboquant"], 32, "an array of 4 (one per layer), got an array of 2"),
        (["f32", "f16x", "f32", "f32"], 32, "kv_format[1]: expected one of"),
        (["f32", "turboquant", "f32", "f32"], 17, "head_dim: turboquant supports head_dim 32, 64 or 128"),
        ([], 32, "got an array of 0"),
        ({"f32": 1}, 32, "kv_format: expected a string"),
        (["f32", "f16", "f32", "f32"], 7, "head_dim: f16 supports an even head_dim 2..128, got 7"),
    ],
)
def test_bad_format_lists_are_refused(api, enc, kv_format, head_dim, needle):
    before = len(api.call("GET", "/v1/sessions").body["sessions"])
    spec = dict(num_qo_heads=H, num_kv_heads=HKV, head_dim=head_dim, num_layers=4, kv_format=kv_format)
    r = api.call("POST", "/v1/sessions", spec, enc=enc)
    assert r.status == 422 and r.body["type"] == "/problems/invalid-request", r.body
    assert needle in r.body["detail"], r.body["detail"]
    assert len(api.call("GET", "/v1/sessions").body["sessions"]) == before


def test_client_creates_and_reads_layer_formats(server, rng):
    with Client(server.url) as client:
        s = client.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=4, kv_format=FORMATS)
        info = s.info()
        assert info.kv_format == tuple(FORMATS) and info.layer_formats == tuple(FORMATS)
        uniform = client.create_session(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=2)
        assert uniform.info().kv_format == "f32" and uniform.info().layer_formats == ("f32", "f32")
        k = rows(rng, 3, HKV, D)
        assert s.append(1, k, k) == 3 and s.info().lengths == (0, 3, 0, 0)
        s.delete()
        uniform.delete()


def test_exact_layers_are_the_per_layer_formats_they_stand_for(api, rng, enc):
    """``exact_layers`` (negative from the end) in ``exact_format`` is the per-layer
    array it stands for: the same info, and every layer answers bit for bit as the
    session created with that array."""
    seed = int(rng.integers(1 << 30))
    short = api.create(
        enc, num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=4,
        kv_format="turboquant", exact_layers=[0, -1, 3], seed=seed,
    )  # fmt: skip
    want = ["f16", "turboquant", "turboquant", "f16"]
    assert short["kv_format"] == short["layer_formats"] == want
    spelled = _create(api, want, seed)
    f32 = api.create(enc, num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=4,
                     kv_format=["tq4", "f16", "tq4", "tq4"], exact_layers=[-3], exact_format="f32")  # fmt: skip
    assert f32["layer_formats"] == ["tq4", "f32", "tq4", "tq4"]
    bf16 = api.create(enc, num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=4, kv_format="tq4",
                      exact_layers=[0, -1], exact_format="bf16")  # fmt: skip
    assert bf16["layer_formats"] == ["bf16", "tq4", "tq4", "bf16"]
    for layer in range(4):
        q, k, v = rows(rng, PAGE + 1, H, D), rows(rng, PAGE + 1, HKV, D), rows(rng, PAGE + 1, HKV, D)
        a = api.attend(short["session_id"], layer, q, k=k, v=v, enc=enc)
        b = api.attend(spelled, layer, q, k=k, v=v, enc=enc)
        assert a.status == b.status == 200 and a.body["out"].tobytes() == b.body["out"].tobytes()
    for sid in (short["session_id"], spelled, f32["session_id"], bf16["session_id"]):
        api.delete(sid)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"exact_layers": [4]}, "exact_layers[0]: expected a layer index in -4..3"),
        ({"exact_layers": [0, -5]}, "exact_layers[1]: expected a layer index in -4..3"),
        ({"exact_layers": ["0"]}, "exact_layers[0]: expected a layer index"),
        ({"exact_layers": 0}, "exact_layers: expected an array"),
        ({"exact_layers": [0], "exact_format": "tq4"}, "exact_format: expected one of 'f16', 'bf16', 'f32'"),
        ({"exact_format": "f32"}, "exact_format: applies to exact_layers"),
    ],
)
def test_bad_exact_layers_are_refused(api, enc, fields, needle):
    before = len(api.call("GET", "/v1/sessions").body["sessions"])
    spec = dict(num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=4, kv_format="turboquant", **fields)
    r = api.call("POST", "/v1/sessions", spec, enc=enc)
    assert r.status == 422 and r.body["type"] == "/problems/invalid-request", r.body
    assert needle in r.body["detail"], r.body["detail"]
    assert len(api.call("GET", "/v1/sessions").body["sessions"]) == before


def test_client_sends_exact_layers(server):
    with Client(server.url) as client:
        s = client.create_session(
            num_qo_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=3, kv_format="tq4", exact_layers=(0, -1)
        )
        assert s.info().layer_formats == ("f16", "tq4", "f16")
        s.delete()
