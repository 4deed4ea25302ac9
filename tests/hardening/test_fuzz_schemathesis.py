"""Schemathesis against the live server's /openapi.json, JSON and MessagePack bodies.

A real server process on 127.0.0.1 (its own settings: 1 MiB bodies, room for
every session the fuzzer creates, so any 5xx is a bug). Before the run, a few
sessions are filled with random rows and their answers recorded; the fuzzer never
learns their ids. Schemathesis then generates valid and invalid requests for every
operation (its coverage phase, then Hypothesis), sends them, and checks each
answer: no 5xx, status codes, content types, headers and bodies as the OpenAPI
document declares (``response_schema_conformance`` for MessagePack answers too,
through the deserializer below), invalid data refused, plus two checks of ours:
every MessagePack array in an answer is a well-formed wire array, and every
problem's ``type`` belongs to its status (api.md's table).

MessagePack: the OpenAPI document declares ``application/vnd.msgpack`` request
bodies; the serializer registered here packs the generated document (binary
``data`` fields as ``bin``; a binary body, the snapshot blob, as it is), and the
deserializer unpacks answers for validation (``bin`` as a string, the type
``format: binary`` describes). A hook steers part of the cases onto a few fuzz
sessions with arrays of the right shapes (so valid appends, attends and
snapshot restores reach the GPU) and the rest stays as generated. The last test
checks that MessagePack was really exercised, that requests got through to the
GPU, and that the sessions made before the run still answer oracle-exact and
bit-identically to before.

Bounded: at most ``ATTNSERVE_FUZZ_EXAMPLES`` examples per operation and phase (default 200).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET
from schemathesis.specs.openapi import checks
from schemathesis.core.parameters import ParameterLocation
from schemathesis.transport.serialization import Binary

from attnserve_client import wire
from hard_helpers import OracleSession, ServerProcess
from svc_helpers import Api, rows

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("ATTNSERVE_FUZZ_EXAMPLES", "200"))
BODY_LIMIT = 1 << 20

# Fuzz sessions: the hook puts them in paths, with arrays of their shapes.
POOL = {
    "fz-f32": dict(num_qo_heads=2, num_kv_heads=1, head_dim=2, num_layers=2, kv_format="f32", max_tokens=4096),
    "fz-gqa": dict(num_qo_heads=4, num_kv_heads=2, head_dim=8, num_layers=1, kv_format="f32", max_tokens=4096),
    "fz-tq": dict(num_qo_heads=2, num_kv_heads=1, head_dim=32, num_layers=2, kv_format="turboquant", max_tokens=4096),
}

# api.md: which problem types each status may carry
SLUGS = {
    400: {"malformed-body"},
    404: {"session-not-found", "layer-not-found", "not-found", "step-not-found"},
    405: {"method-not-allowed"},
    408: {"body-timeout"},
    409: {
        "offset-mismatch",
        "session-exists",
        "capacity-exceeded",
        "session-in-step",
        "step-layer-called",
        "step-broken",
    },
    413: {"payload-too-large"},
    415: {"unsupported-media-type"},
    422: {"invalid-request", "invalid-snapshot"},
}


@dataclass
class Stats:
    msgpack_bodies: int = 0
    msgpack_answers: int = 0
    calls: Counter = field(default_factory=Counter)  # (operation, request type, status)
    answers: Counter = field(default_factory=Counter)  # answer content types
    steered: int = 0
    custom_checks: Counter = field(default_factory=Counter)
    ran: bool = False


STATS = Stats()
STEERED: set[int] = set()


# ── MessagePack for schemathesis ────────────────────────────────────────────


def _plain(value: Any) -> Any:
    """A generated document as msgpack can pack it: Binary -> bytes; integers
    msgpack cannot hold become floats (the server refuses either)."""
    if isinstance(value, Binary):
        return value.data
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 64):
        return float(value)
    return value


@schemathesis.serializer(wire.MSGPACK)
def _msgpack_serializer(ctx, value):
    STATS.msgpack_bodies += 1
    if isinstance(value, Binary):  # a binary body (the snapshot blob) goes as it is
        return value.data
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return msgpack.packb(_plain(value), use_bin_type=True)


def _strings(value: Any) -> Any:
    """``bin`` as a (latin-1) string: what ``type: string, format: binary`` describes."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("latin-1")
    if isinstance(value, dict):
        return {k: _strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strings(v) for v in value]
    return value


def _response_schema(operation, status: int, media: str) -> dict:
    responses = operation.definition.raw.get("responses", {})
    return responses.get(str(status), {}).get("content", {}).get(media, {}).get("schema", {})


@schemathesis.deserializer(wire.MSGPACK)
def _msgpack_deserializer(ctx, response):
    STATS.msgpack_answers += 1
    if _response_schema(ctx.operation, response.status_code, wire.MSGPACK).get("format") == "binary":
        return response.content.decode("latin-1")  # an opaque blob (snapshots)
    return _strings(wire.unpackb(response.content, max_bytes=1 << 30))


@schemathesis.check
def msgpack_arrays_are_wire_arrays(ctx, response, case):
    """Every array in a MessagePack answer decodes: a wire dtype (out_dtype may ask
    for <f2 or bfloat16), its shape (an attend's 3-D, a stacked answer's or a step
    call's 4-D), exactly prod(shape) * itemsize bytes."""
    STATS.custom_checks["msgpack_arrays"] += 1
    ctype = response.headers.get("content-type", [""])
    ctype = ctype[0] if isinstance(ctype, list) else ctype
    if not wire.is_msgpack(ctype) or response.status_code >= 300:
        return None
    if _response_schema(case.operation, response.status_code, wire.MSGPACK).get("format") == "binary":
        doc = wire.unpackb(response.content, max_bytes=1 << 30)  # a snapshot: still one msgpack map
        assert isinstance(doc, dict) and doc.get("format") == "attnserve-snapshot", "not a snapshot"
        return True
    doc = wire.unpackb(response.content, max_bytes=1 << 30)
    if isinstance(doc, dict) and "out" in doc:
        out = wire.decode_array(doc["out"], name="out", finite=False)
        assert out.ndim in (3, 4) and out.dtype in set(wire.DTYPES.values()), (out.shape, out.dtype)
    return True


@schemathesis.check
def problem_type_matches_status(ctx, response, case):
    STATS.custom_checks["problem_type"] += 1
    if response.status_code < 400:
        return None
    body = response.json()
    slug = body["type"].removeprefix("/problems/")
    allowed = SLUGS.get(response.status_code)
    assert allowed is None or slug in allowed, f"{response.status_code} with problem type {slug}"
    assert body["status"] == response.status_code
    return True


# ── the server, the sessions made before the run, the fuzz pool ────────────


class Pool:
    def __init__(self, api: Api):
        self.api = api
        self.blobs: dict[str, bytes] = {}
        self.ensure()

    def ensure(self) -> None:
        """(Re)create the fuzz sessions a case deleted or filled up."""
        for sid, cfg in POOL.items():
            r = self.api.call("GET", f"/v1/sessions/{sid}")
            if r.status == 200 and max(r.body["lengths"]) < cfg["max_tokens"] - 64:
                continue
            if r.status == 200:
                self.api.delete(sid)
            r = self.api.call("PUT", f"/v1/sessions/{sid}", cfg)
            assert r.status == 201, r.body
            rng = np.random.default_rng(len(sid))
            for layer in range(cfg["num_layers"]):
                k = rows(rng, 5, cfg["num_kv_heads"], cfg["head_dim"])
                assert self.api.append(sid, layer, k, k).status == 200
            if sid not in self.blobs:
                self.blobs[sid] = self.api.client.get(f"/v1/sessions/{sid}/snapshot").content


@dataclass
class FuzzEnv:
    server: ServerProcess
    api: Api
    oracles: list[OracleSession]
    recorded: list[tuple[OracleSession, int, np.ndarray, bytes]]
    pool: Pool


@pytest.fixture(scope="module")
def fuzz_env(spawn):
    srv = spawn(
        "fuzz", ATTNSERVE_MAX_BODY_BYTES=BODY_LIMIT, ATTNSERVE_MAX_SESSIONS=1_000_000, ATTNSERVE_DEFAULT_MAX_TOKENS=4096
    )
    api = Api(srv.url)
    rng = np.random.default_rng(7)
    oracles = [
        OracleSession(api, rng, h=4, hkv=2, d=16, layers=3, fill=(33, 1, 0)),
        OracleSession(api, rng, h=8, hkv=4, d=64, layers=1, fill=(130,)),
        OracleSession(api, rng, h=4, hkv=1, d=32, layers=2, fill=(20, 65), kv_format="turboquant"),
    ]
    recorded = []
    for o in oracles:
        for layer, n in enumerate(o.model.lengths):
            if n:
                q = rows(rng, min(2, n), o.h, o.d)
                r = api.attend(o.sid, layer, q)
                assert r.status == 200
                recorded.append((o, layer, q, r.body["out"].tobytes()))
    env = FuzzEnv(srv, api, oracles, recorded, Pool(api))
    yield env
    api.close()


def _array(draw, heads: int, d: int, as_map: bool, n: int):
    a = np.asarray(
        draw(st.lists(st.floats(-4, 4, width=32), min_size=n * heads * d, max_size=n * heads * d)), dtype="<f4"
    ).reshape(n, heads, d)
    return {"dtype": "<f4", "shape": [n, heads, d], "data": Binary(a.tobytes())} if as_map else a.tolist()


def _components(case) -> tuple[bool, bool, bool]:
    """(negative case, path generated valid, body generated valid)."""
    meta = case._meta
    if meta is None:
        return False, True, True

    def positive(loc: ParameterLocation) -> bool:
        info = meta.components.get(loc)
        return info is None or info.mode == GenerationMode.POSITIVE

    return (
        meta.generation.mode == GenerationMode.NEGATIVE,
        positive(ParameterLocation.PATH),
        positive(ParameterLocation.BODY),
    )


def _steer_path(case, sid: str, layer: str) -> None:
    case.path_parameters = {**case.path_parameters, "session_id": sid}
    if "{layer}" in case.operation.path:
        case.path_parameters["layer"] = layer


def _steer(pool: Pool):
    """The ``flatmap_case`` hook (fuzzing phase): most cases on a session path go to
    one of the fuzz sessions, and a valid body gets arrays of that session's shapes
    (a restore: one of the pool's real blobs, whole, truncated or with a byte
    changed; a create: heads and head_dim the server takes). What was generated
    invalid stays as it is, and must still be refused."""

    @st.composite
    def steered(draw, case):
        op = case.operation.path
        if not draw(st.integers(0, 3)):
            return case  # a quarter as generated
        negative, path_ok, body_ok = _components(case)
        if negative and (body_ok or not path_ok):
            return case  # the invalid part may be the path: leave it whole
        sid = draw(st.sampled_from(sorted(POOL)))
        cfg = POOL[sid]
        if "{session_id}" in op and path_ok:
            layers = [str(i) for i in range(cfg["num_layers"])]
            _steer_path(case, sid, draw(st.sampled_from(layers * 4 + ["7"])))
        if case.method.upper() in ("POST", "PUT") and op in ("/v1/sessions", "/v1/sessions/{session_id}"):
            if body_ok and isinstance(case.body, dict):
                body = dict(case.body)
                fmt = body.get("kv_format", "f32")
                body["num_kv_heads"] = draw(st.sampled_from([1, 2]))
                body["num_qo_heads"] = body["num_kv_heads"] * draw(st.integers(1, 4))
                body["head_dim"] = draw(st.sampled_from([32, 64] if fmt == "turboquant" else [1, 7, 32, 128]))
                if body.get("max_tokens") is not None:
                    body["max_tokens"] = min(body["max_tokens"], 100_000)
                if "num_layers" in body:
                    body["num_layers"] = min(body["num_layers"], 8)
                case.body = body
            if "{session_id}" in op and path_ok and draw(st.integers(0, 3)):
                case.path_parameters["session_id"] = f"made-{draw(st.integers(0, 10**9))}"
        elif body_ok and (op.endswith("/kv") or op.endswith("/attend")) and isinstance(case.body, dict):
            body = dict(case.body)
            n = draw(st.integers(1, 3))
            as_map = case.media_type == wire.MSGPACK
            if ("k" in body) != ("v" in body):  # k and v go together
                body["k" if "v" in body else "v"] = _array(draw, cfg["num_kv_heads"], cfg["head_dim"], as_map, n)
            for name in ("k", "v", "q"):
                if name in body:
                    heads = cfg["num_qo_heads"] if name == "q" else cfg["num_kv_heads"]
                    body[name] = _array(draw, heads, cfg["head_dim"], as_map, n)
            for name in ("start_pos", "offset"):
                if name in body and draw(st.integers(0, 3)):
                    body.pop(name)  # mostly: a random one is mostly refused
                elif isinstance(body.get(name), float):
                    # JSON Schema counts 3.0 as an integer; the server does not (api.md)
                    body[name] = int(body[name])
            if isinstance(body.get("scale"), float) and abs(body["scale"]) > 100 and draw(st.booleans()):
                body.pop("scale")
            case.body = body
        elif body_ok and op.endswith("/snapshot") and case.method.upper() == "PUT":
            blob = pool.blobs[draw(st.sampled_from(sorted(pool.blobs)))]
            how = draw(st.sampled_from(["whole", "whole", "truncated", "flipped"]))
            if how == "truncated":
                blob = blob[: draw(st.integers(0, len(blob) - 1))]
            elif how == "flipped":
                i = draw(st.integers(0, len(blob) - 1))
                blob = blob[:i] + bytes([blob[i] ^ draw(st.integers(1, 255))]) + blob[i + 1 :]
            case.body = Binary(blob)
            if path_ok:
                case.path_parameters["session_id"] = draw(
                    st.sampled_from([sid, f"restored-{draw(st.integers(0, 10**9))}"])
                )
        STATS.steered += 1
        STEERED.add(id(case))
        return case

    def flatmap_case(ctx, case):
        return steered(case)

    return flatmap_case


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_env):
    schema = schemathesis.openapi.from_url(fuzz_env.server.url + "/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES)
    schema.hook("flatmap_case")(_steer(fuzz_env.pool))
    return schema


schema = schemathesis.pytest.from_fixture("fuzz_schema")
_COUNTER = iter(range(1 << 62))


@schema.parametrize()
def test_fuzz(case, fuzz_env):
    STATS.ran = True
    i = next(_COUNTER)
    steered = id(case) in STEERED
    STEERED.discard(id(case))
    phase = case._meta.phase.name.value if case._meta is not None else "?"
    if not steered and phase == "coverage" and "{session_id}" in case.operation.path and i % 4:
        # The coverage phase (boundary values, missing and wrong-typed members, content
        # types) is not steered by hooks: send three of four of its cases on a session
        # path to a fuzz session, so their bodies are judged by a route, not a 404.
        negative, path_ok, _ = _components(case)
        if path_ok and case.method.upper() not in ("DELETE", "PUT"):
            sid = sorted(POOL)[i % len(POOL)]
            _steer_path(case, sid, "0")
    headers = {}
    if case.method.upper() == "GET" and i % 2:
        headers["Accept"] = wire.MSGPACK  # MessagePack answers are validated as well
    if i % 100 == 0 or case.method.upper() == "DELETE":
        fuzz_env.pool.ensure()
    response = case.call(headers=headers, timeout=60)
    sent = case.media_type if case.body is not NOT_SET and case.media_type else "-"
    answer = response.headers.get("content-type", ["-"])
    answer = (answer[0] if isinstance(answer, list) else answer).split(";")[0]
    STATS.calls[(case.operation.label, sent, response.status_code)] += 1
    STATS.answers[answer] += 1
    if case.method.upper() == "DELETE" or response.status_code == 409:
        fuzz_env.pool.ensure()
    # Every check schemathesis has, but positive_data_acceptance: the schema cannot say
    # that k must have the session's shape or that num_kv_heads divides num_qo_heads, so
    # schema-valid requests are refused (422) by design. A steered case is valid by
    # construction, but schemathesis may re-classify a MessagePack body it did not
    # generate as invalid (it re-validates it against another media type's schema), so
    # for those negative_data_rejection is not asked either.
    excluded = [checks.positive_data_acceptance]
    # The batched step answers a schema-violating *item* with that item's problem
    # inside a 200 (items are independent, docs/api.md); a body malformed as a
    # whole is still a 4xx, which test_batch.py checks.
    if steered or case.operation.path == "/v1/batch/attend":
        excluded.append(checks.negative_data_rejection)
    case.validate_response(response, excluded_checks=excluded)


def test_after_the_fuzz_sessions_made_before_are_intact(fuzz_env):
    if not STATS.ran:
        if os.environ.get("CI"):
            pytest.fail("the schemathesis run did not happen")
        pytest.skip("run together with test_fuzz")
    srv, api = fuzz_env.server, fuzz_env.api
    assert srv.alive()
    assert srv.server_errors() == [], srv.server_errors()[:3]
    for o in fuzz_env.oracles:
        o.check()
    for o, layer, q, before in fuzz_env.recorded:
        r = api.attend(o.sid, layer, q)
        assert r.status == 200 and r.body["out"].tobytes() == before, (o.sid, layer)
    # MessagePack was exercised both ways, and valid requests of both encodings reached the GPU
    calls = STATS.calls
    by: Counter = Counter()
    detail: Counter = Counter()
    for (op, ctype, status), n in calls.items():
        method, path = op.split(" ", 1)
        by[(f"{method} {path.rsplit('/', 1)[-1]}", ctype, status // 100)] += n
        detail[(f"{method} {path.rsplit('/', 1)[-1]}", ctype, status)] += n
    print(
        f"\nfuzz: {sum(calls.values())} requests, {STATS.steered} steered; request bodies by type: "
        f"{dict(Counter(c for (_, c, _), n in calls.items() for _ in range(n)))}; answers by type: "
        f"{dict(STATS.answers)}; statuses: {dict(Counter(s for (_, _, s), n in calls.items() for _ in range(n)))}"
    )
    for key in sorted(detail):
        print("  ", key, detail[key])
    assert min(STATS.custom_checks.values()) > 100 and len(STATS.custom_checks) == 2, STATS.custom_checks
    sent_msgpack = sum(n for (_, c, _), n in calls.items() if c == wire.MSGPACK)
    assert sent_msgpack >= 100 and STATS.answers[wire.MSGPACK] >= 50, (sent_msgpack, STATS.answers)
    assert not any(s >= 500 for (_, _, s) in calls)
    for op in ("kv", "attend"):
        for ctype in (wire.MSGPACK, wire.JSON):
            assert by[(f"POST {op}", ctype, 2)] > 0, f"no {ctype} {op} request got through"
            assert by[(f"POST {op}", ctype, 4)] > 0, f"no {ctype} {op} request refused"
    assert by[("PUT snapshot", wire.MSGPACK, 2)] > 0 and by[("PUT snapshot", wire.MSGPACK, 4)] > 0
    assert by[("POST sessions", wire.MSGPACK, 2)] + by[("PUT {session_id}", wire.MSGPACK, 2)] > 0
