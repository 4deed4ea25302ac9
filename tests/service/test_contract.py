"""The contract (attnserve.contract): every body declared once as a model, from
which the checks of a request (names, types, bounds, choices, a "did you mean"
hint for an unknown name) and the OpenAPI document (both encodings, with the
request examples /docs "Try it out" sends) follow."""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator

from attnserve.contract import (
    MAX_LAYERS,
    Attend,
    CreateSession,
    Fields,
    StackedBatch,
    components,
    members,
)
from attnserve.errors import InvalidRequest
from attnserve_client import wire

CREATE = "/v1/sessions"


def _example(spec: dict, path: str) -> dict:
    return spec["paths"][path]["post"]["requestBody"]["content"][wire.JSON]["example"]


def test_the_checks_read_the_model():
    m = members(CreateSession)
    assert list(m)[:4] == ["num_layers", "num_qo_heads", "num_kv_heads", "head_dim"]
    assert (m["num_layers"].default, m["num_layers"].lo, m["num_layers"].hi) == (1, 1, MAX_LAYERS)
    assert m["num_qo_heads"].required and not m["seed"].required
    assert m["exact_format"].choices == ("f16", "bf16", "f32") and "tq4" in m["kv_format"].choices
    assert members(Attend)["q"].rank == 3 and members(StackedBatch)["q"].rank == 4
    f = Fields({"num_layers": MAX_LAYERS + 1}, CreateSession, "session")
    with pytest.raises(InvalidRequest, match=rf"num_layers: expected an integer in 1..{MAX_LAYERS}, got 257"):
        f.int("num_layers")
    assert Fields({}, CreateSession, "session").int("num_layers") == 1  # the model's default


def test_an_unknown_member_names_the_one_it_may_mean(api):
    r = api.call("POST", CREATE, {"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 4, "num_layer": 2})
    assert r.status == 422
    assert r.body["detail"].startswith("session: unknown field(s) 'num_layer' (did you mean 'num_layers'?); ")
    assert r.body["fields"] == ["num_layer"]
    r = api.call("POST", CREATE, {"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 4, "zzz": 1})
    assert "'zzz'; expected some of num_layers, num_qo_heads" in r.body["detail"]  # nothing close: no hint


def test_the_documents_examples_work_as_sent(api):
    """What /docs "Try it out" sends (each request body's JSON example) is
    answered 2xx: create a session, append to it, attend, batch."""
    spec = api.client.get("/openapi.json").json()
    create = _example(spec, CREATE)
    r = api.call("POST", CREATE, create, enc="json")
    assert r.status == 201
    api.delete(r.body["session_id"])
    param = spec["paths"]["/v1/sessions/{session_id}"]["put"]["parameters"][0]
    assert param["schema"]["examples"] == ["my-session-1"]  # the path's example id, which the other examples name
    r = api.client.put("/v1/sessions/my-session-1", json=create)
    assert r.status_code == 201, r.text
    layer = "/v1/sessions/{session_id}/layers/{layer}"
    path = layer.replace("{session_id}", "my-session-1").replace("{layer}", "0")
    append = _example(spec, layer + "/kv")
    assert api.call("POST", path + "/kv", append, enc="json").status == 200
    attend = _example(spec, layer + "/attend")
    r = api.call("POST", path + "/attend", attend, enc="json")
    assert r.status == 200 and r.body["length"] == 2
    r = api.call("POST", "/v1/batch/attend", _example(spec, "/v1/batch/attend"), enc="json")
    assert r.status == 200 and "error" not in r.body["results"][0], r.body
    api.delete("my-session-1")


def test_each_body_has_a_schema_per_encoding_and_its_examples_fit():
    schemas = components()
    for name in ("Append", "Attend", "AttendResult", "BatchAttend", "BatchAttendResult"):
        assert {f"{name}Json", f"{name}Msgpack"} <= set(schemas)
    assert schemas["AttendMsgpack"]["properties"]["q"]["$ref"].endswith("/ArrayMsgpack")
    assert schemas["AttendJson"]["properties"]["q"]["$ref"].endswith("/ArrayJson")
    assert "examples" not in schemas["AttendMsgpack"]  # the examples are JSON documents
    for name in ("CreateSession", "ForkSession", "AppendJson", "AttendJson"):
        for example in schemas[name]["examples"]:
            validator = Draft202012Validator({**schemas[name], "components": {"schemas": schemas}})
            assert not list(validator.iter_errors(example)), (name, example)
    bad = {**schemas["AttendJson"]["examples"][0], "offest": 0}
    assert list(Draft202012Validator({**schemas["AttendJson"], "components": {"schemas": schemas}}).iter_errors(bad))
