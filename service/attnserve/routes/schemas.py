"""OpenAPI 3.1 schemas of the bodies, in both encodings.

The routes read and write bodies themselves (MessagePack or JSON, see
:mod:`attnserve.codec`), so FastAPI cannot infer these: they are written here
once, added to ``components.schemas`` by ``create_app``, and referenced from
each route's ``openapi_extra`` (request bodies) and ``responses``.
"""

from __future__ import annotations

from typing import Any

from ..codec import wire
from ..formats import KV_FORMATS
from ..session_spec import MAX_SINKS, MAX_WINDOW

__all__ = ["COMPONENTS", "ref", "request_body", "ok", "problems", "PROBLEM_STATUSES"]

JSON = wire.JSON
MSGPACK = wire.MSGPACK


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


#: The arrays' ranks: an attend's rows ``[n, heads, head_dim]`` (3, the names without a
#: number), a log-sum-exp ``[n, heads]`` (2), a stacked step's ``[B, n, heads, head_dim]`` (4).
ARRAY_RANKS = {2: "[n, heads]", 3: "[rows, heads, head_dim]", 4: "[B, rows, heads, head_dim]"}


def array_schema(array: str, rank: int = 3) -> str:
    """The component name of ``array`` (``ArrayJson`` or ``ArrayMsgpack``) at ``rank``."""
    return array if rank == 3 else f"{array}{rank}"


def _array_json(rank: int) -> dict[str, Any]:
    nested: dict[str, Any] = {"type": "number"}
    for _ in range(rank):
        nested = {"type": "array", "items": nested}
    return {
        "title": f"Array (JSON, rank {rank})",
        "description": f"A float32 array as nested lists of numbers, {ARRAY_RANKS[rank]}.",
        **nested,
    }


def _array_msgpack(rank: int) -> dict[str, Any]:
    return {
        "title": f"Array (MessagePack, rank {rank})",
        "description": f"A float32 array {ARRAY_RANKS[rank]} as a MessagePack map: C order, little endian; "
        "`data` is a `bin` of exactly prod(shape) * 4 bytes.",
        "type": "object",
        "required": ["dtype", "shape", "data"],
        "additionalProperties": False,
        "properties": {
            "dtype": {"type": "string", "const": "<f4"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": rank, "maxItems": rank},
            "data": {"type": "string", "format": "binary", "contentMediaType": "application/octet-stream"},
        },
    }


def _append(array: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["k", "v"],
        "additionalProperties": False,
        "properties": {
            "k": {**ref(array), "description": "[n, num_kv_heads, head_dim], n >= 1."},
            "v": {**ref(array), "description": "Same shape as k."},
            "offset": {
                "type": ["integer", "null"],
                "minimum": 0,
                "description": "If given, must equal the layer's length before the append (else 409 "
                "offset-mismatch, and nothing changes): makes a retried append safe.",
            },
        },
    }


def _attend(array: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["q"],
        "additionalProperties": False,
        "properties": {
            "q": {**ref(array), "description": "[n, num_qo_heads, head_dim], n >= 1 query rows."},
            "k": {**ref(array), "description": "[m, num_kv_heads, head_dim]: appended first (fused step)."},
            "v": {**ref(array_schema(array, 4)), "description": "Same shape as k; k and v go together."},
            "offset": {
                "type": ["integer", "null"],
                "minimum": 0,
                "description": "As for append, checked before the fused append (also without one).",
            },
            "start_pos": {
                "type": ["integer", "null"],
                "minimum": 0,
                "description": "Position of the first query row; default length - n (after the fused "
                "append). start_pos + n <= length.",
            },
            "causal": {
                "type": "boolean",
                "default": True,
                "description": "Row i attends to 0..start_pos+i; false: to all length timesteps.",
            },
            "scale": {
                "type": ["number", "null"],
                "description": "Softmax scale (any finite number); default 1/sqrt(head_dim).",
            },
            "return_lse": {
                "type": "boolean",
                "default": False,
                "description": "Answer lse beside out: each row's log-sum-exp of its scaled scores over the "
                "keys it attended (natural log), to merge attention over disjoint keys exactly.",
            },
        },
    }


def _attend_out(array: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["out", "length"],
        "properties": {
            "out": {**ref(array), "description": "[n, num_qo_heads, head_dim] float32."},
            "length": {"type": "integer", "description": "The layer's length after the call."},
            "lse": {
                **ref(array_schema(array, 2)),
                "description": "[n, num_qo_heads] float32, with return_lse: log(sum_t exp(scale * q.k_t)) "
                "over the timesteps t each row attended.",
            },
        },
    }


def _batch_attend(array: str) -> dict[str, Any]:
    item = _attend(array)
    item = {
        **item,
        "required": ["session_id", "layer", "q"],
        "properties": {
            "session_id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "layer": {"type": "integer", "minimum": 0},
            **item["properties"],
        },
    }
    return {
        "type": "object",
        "required": ["items"],
        "additionalProperties": False,
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "items": item,
                "description": "Attends, applied in order; at most limits.max_batch_items.",
            },
        },
    }


def _stacked_attend(array: str) -> dict[str, Any]:
    ints = {"type": "array", "items": {"type": ["integer", "null"], "minimum": 0}}
    props = _attend(array)["properties"]
    return {
        "type": "object",
        "required": ["session_ids", "layer", "q"],
        "additionalProperties": False,
        "properties": {
            "session_ids": {
                "type": "array",
                "minItems": 1,
                "items": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": "B sessions (one may repeat: its items apply in order); at most limits.max_batch_items.",
            },
            "layer": {"type": "integer", "minimum": 0, "description": "The layer of every item."},
            "q": {**ref(array_schema(array, 4)), "description": "[B, n, num_qo_heads, head_dim]: item i attends q[i]."},
            "k": {**ref(array_schema(array, 4)), "description": "[B, m, num_kv_heads, head_dim]: k[i] appended first."},
            "v": {**ref(array_schema(array, 4)), "description": "Same shape as k; k and v go together."},
            "offsets": {**ints, "description": "B offsets (null: unchecked), as an attend's offset."},
            "start_pos": {**ints, "description": "B start positions (null: the default)."},
            "causal": props["causal"],
            "scale": props["scale"],
            "return_lse": props["return_lse"],
        },
    }


def _stacked_out(array: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["out", "lengths", "errors"],
        "properties": {
            "out": {
                **ref(array_schema(array, 4)),
                "description": "[B, n, num_qo_heads, head_dim] float32; zeros for a failed item.",
            },
            "lse": {
                **ref(array),
                "description": "[B, n, num_qo_heads] float32, with return_lse: each row's log-sum-exp of its "
                "scaled scores; zeros for a failed item.",
            },
            "lengths": {
                "type": "array",
                "items": {"type": ["integer", "null"]},
                "description": "Each item's layer length after it; null for a failed item.",
            },
            "errors": {
                "type": "array",
                "items": ref("Problem"),
                "description": "The failed items' problems (with `item`, the index); each changed nothing.",
            },
        },
    }


def _batch_out(array: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["results"],
        "properties": {
            "results": {
                "type": "array",
                "description": "One per item, in item order.",
                "items": {
                    "oneOf": [
                        _attend_out(array),
                        {
                            "type": "object",
                            "required": ["error"],
                            "properties": {
                                "error": {
                                    **ref("Problem"),
                                    "description": "The item's problem (with `item`, its index); "
                                    "the item changed nothing.",
                                }
                            },
                        },
                    ]
                },
            },
        },
    }


COMPONENTS: dict[str, Any] = {
    **{
        array_schema(a, rank): make(rank)
        for a, make in (("ArrayJson", _array_json), ("ArrayMsgpack", _array_msgpack))
        for rank in ARRAY_RANKS
    },
    "CreateSession": {
        "type": "object",
        "required": ["num_qo_heads", "num_kv_heads", "head_dim"],
        "additionalProperties": False,
        "properties": {
            "num_layers": {"type": "integer", "minimum": 1, "maximum": 256, "default": 1},
            "num_qo_heads": {"type": "integer", "minimum": 1, "maximum": 256},
            "num_kv_heads": {"type": "integer", "minimum": 1, "description": "Divides num_qo_heads (GQA)."},
            "head_dim": {
                "type": "integer",
                "description": "f32: 1..128; f16: even, 2..128; "
                "turboquant and its variants (tq4, tq3, ...): 32, 64 or 128.",
            },
            "kv_format": {
                "anyOf": [
                    {"type": "string", "enum": list(KV_FORMATS)},
                    {"type": "array", "items": {"type": "string", "enum": list(KV_FORMATS)}, "minItems": 1},
                ],
                "default": "f32",
                "description": "One format for every layer, or an array of num_layers formats, one per layer "
                "(e.g. the first and last two layers f16, the rest turboquant).",
            },
            "exact_layers": {
                "type": ["array", "null"],
                "items": {"type": "integer"},
                "description": "Layers kept exact, in exact_format, whatever kv_format says: layer indexes, "
                "negative ones counted from the last layer (e.g. [0, -1]: the first and the last). "
                "Shorthand for a per-layer kv_format array, which the session's info then shows.",
            },
            "exact_format": {
                "type": ["string", "null"],
                "enum": ["f16", "f32", None],
                "default": "f16",
                "description": "The format of the exact_layers.",
            },
            "sinks": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_SINKS,
                "default": 0,
                "description": "Every compressed layer keeps its first `sinks` timesteps exact (float32, as sent) "
                "beside its codes, and every attend reads them from there (docs/api.md, exact sinks and window).",
            },
            "window": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_WINDOW,
                "default": 0,
                "description": "Every compressed layer keeps a recent window exact: an attend whose first query "
                "row sits at p reads timesteps from p + 1 - window on (and every row appended in its own call) "
                "exactly; older ones from the codes. Between calls a layer holds its last `window` rows.",
            },
            "max_tokens": {
                "type": ["integer", "null"],
                "minimum": 1,
                "description": "Cap on each layer's length. Default: the server's default_max_tokens, "
                "capped by what the adapter can bind for this shape (more is a 422 that says the limit).",
            },
            "seed": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": 18446744073709551615,
                "description": "Decides the TurboQuant rotations; random in [0, 2^53) if absent; echoed back.",
            },
        },
    },
    "ForkSession": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "session_id": {
                "type": ["string", "null"],
                "pattern": "^[A-Za-z0-9_-]{1,64}$",
                "description": "The new session's id; a random one if absent.",
            },
            "length": {
                "type": ["integer", "null"],
                "minimum": 0,
                "description": "Fork every layer at this length (at most each layer's length); "
                "default: each layer's current length.",
            },
        },
    },
    "SessionInfo": {
        "type": "object",
        "required": [
            "session_id",
            "num_layers",
            "num_qo_heads",
            "num_kv_heads",
            "head_dim",
            "kv_format",
            "layer_formats",
            "max_tokens",
            "seed",
            "sinks",
            "window",
            "lengths",
            "bytes",
        ],
        "properties": {
            "session_id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "num_layers": {"type": "integer"},
            "num_qo_heads": {"type": "integer"},
            "num_kv_heads": {"type": "integer"},
            "head_dim": {"type": "integer"},
            "kv_format": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
                "description": "As created: one format, or one per layer.",
            },
            "layer_formats": {"type": "array", "items": {"type": "string"}, "description": "Each layer's format."},
            "max_tokens": {"type": "integer"},
            "seed": {"type": "integer"},
            "sinks": {"type": "integer", "description": "The compressed layers' exact first timesteps (0: none)."},
            "window": {"type": "integer", "description": "The compressed layers' exact recent window (0: none)."},
            "lengths": {"type": "array", "items": {"type": "integer"}, "description": "Each layer's length."},
            "bytes": {
                "type": "integer",
                "description": "GPU memory the session holds now (with a window: its layers' exact rows "
                "counted at the most they hold between calls).",
            },
        },
    },
    "SessionList": {
        "type": "object",
        "required": ["sessions"],
        "properties": {"sessions": {"type": "array", "items": ref("SessionInfo")}},
    },
    "AppendJson": _append("ArrayJson"),
    "AppendMsgpack": _append("ArrayMsgpack"),
    "AppendResult": {
        "type": "object",
        "required": ["length"],
        "properties": {"length": {"type": "integer", "description": "The layer's new length."}},
    },
    "AttendJson": _attend("ArrayJson"),
    "AttendMsgpack": _attend("ArrayMsgpack"),
    "AttendResultJson": _attend_out("ArrayJson"),
    "AttendResultMsgpack": _attend_out("ArrayMsgpack"),
    "BatchAttendJson": {"anyOf": [_batch_attend("ArrayJson"), _stacked_attend("ArrayJson")]},
    "BatchAttendMsgpack": {"anyOf": [_batch_attend("ArrayMsgpack"), _stacked_attend("ArrayMsgpack")]},
    "BatchAttendResultJson": {"oneOf": [_batch_out("ArrayJson"), _stacked_out("ArrayJson")]},
    "BatchAttendResultMsgpack": {"oneOf": [_batch_out("ArrayMsgpack"), _stacked_out("ArrayMsgpack")]},
    "Status": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}},
    "ServerInfo": {
        "type": "object",
        "required": ["version", "adapter", "backend", "kv_formats", "limits", "auth"],
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "api_version": {"type": "integer"},
            "adapter": {
                "type": "object",
                "description": "The wgpu adapter: name, backend, adapter_type, vendor, description, and "
                "its max_storage_buffer_binding_size and max_buffer_size; cuda_context: the CUDA "
                "context held for full clocks on NVIDIA ({cuda_device, name}), or null.",
                "properties": {"name": {"type": "string"}, "backend": {"type": "string"}},
                "additionalProperties": True,
            },
            "backend": {"type": "string", "description": "The adapter's backend (Vulkan, Metal, D3D12...)."},
            "kv_formats": {"type": "array", "items": {"type": "string"}},
            "head_dims": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "integer"}}},
            "kv_format_sizes": {
                "type": "object",
                "description": "Per kv format, at head_dim 32, 64 and 128 (those it takes): cache bits per "
                "element and bytes per token, KV head and layer (keys and values).",
                "additionalProperties": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["head_dim", "bits_per_element", "bytes_per_token_per_kv_head"],
                        "properties": {
                            "head_dim": {"type": "integer"},
                            "bits_per_element": {"type": "number"},
                            "bytes_per_token_per_kv_head": {"type": "integer"},
                        },
                    },
                },
            },
            "limits": {
                "type": "object",
                "properties": {
                    "max_body_bytes": {"type": "integer"},
                    "memory_budget_bytes": {"type": "integer", "description": "0: no budget."},
                    "memory_used_bytes": {"type": "integer"},
                    "max_sessions": {"type": "integer"},
                    "default_max_tokens": {"type": "integer"},
                    "max_layers": {"type": "integer"},
                    "max_qo_heads": {"type": "integer"},
                    "max_binding_bytes": {"type": "integer"},
                    "max_queue": {"type": "integer"},
                    "max_batch_jobs": {"type": "integer"},
                    "max_batch_items": {"type": "integer", "description": "Most items in one batched step."},
                },
                "additionalProperties": True,
            },
            "sessions": {"type": "integer"},
            "auth": {
                "type": "boolean",
                "description": "Whether API keys are configured: true, every /v1 request needs "
                "`Authorization: Bearer <key>`; false, the server serves anyone who reaches it.",
            },
            "persistence": {"type": "boolean", "description": "Whether sessions are snapshotted at shutdown."},
            "pool": {
                "type": ["object", "null"],
                "description": "The paged KV pool, server-wide: page_tokens, page_table_bytes (GPU bytes of "
                "the buffer that holds every layer's page table), and per layout (kv_format, "
                "num_kv_heads, head_dim) its slabs, pages, used_pages (pages shared by forks count once) "
                "and bytes (GPU bytes of its slabs).",
                "additionalProperties": True,
            },
            "arenas": {
                "type": ["object", "null"],
                "description": "bytes: GPU bytes of the GPU worker's batch arenas and readback buffers "
                "(they grow to the largest batch and are kept).",
                "additionalProperties": True,
            },
            "pipelines": {
                "type": ["object", "null"],
                "description": "compiled: how many compute pipelines the device holds (a kernel and its "
                "constants each; compiled at start or on first use, and kept).",
                "additionalProperties": True,
            },
            "journal": {
                "type": ["object", "null"],
                "description": "With a snapshot directory: sync_interval_s, and the last journal sync's "
                "start and finish (Unix seconds) and pages written.",
                "additionalProperties": True,
            },
            "ready": {"type": "boolean"},
            "frames": {
                "type": ["object", "null"],
                "description": "The frame transport "
                "(docs/api.md#frame-transport-plain-tcp-arrays-as-raw-bytes): {port} on this server's "
                "host, or null when it is off.",
                "properties": {"port": {"type": "integer"}},
            },
        },
    },
    "Problem": {
        "type": "object",
        "description": "RFC 9457 problem details; extra members depend on the type (offset-mismatch and "
        "capacity-exceeded carry `length`, capacity-exceeded also `max_tokens`).",
        "required": ["type", "title", "status", "detail"],
        "properties": {
            "type": {"type": "string", "examples": ["/problems/offset-mismatch"]},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "instance": {"type": "string"},
            "length": {"type": "integer"},
            "max_tokens": {"type": "integer"},
        },
        "additionalProperties": True,
    },
}


def request_body(json_schema: str, msgpack_schema: str | None = None, *, required: bool = True) -> dict[str, Any]:
    msgpack_schema = msgpack_schema or json_schema
    return {
        "requestBody": {
            "required": required,
            "content": {
                MSGPACK: {"schema": ref(msgpack_schema)},
                JSON: {"schema": ref(json_schema)},
            },
        }
    }


def ok(status: int, description: str, json_schema: str, msgpack_schema: str | None = None) -> dict[int, Any]:
    msgpack_schema = msgpack_schema or json_schema
    return {
        status: {
            "description": description + " (MessagePack or JSON, as negotiated).",
            "content": {MSGPACK: {"schema": ref(msgpack_schema)}, JSON: {"schema": ref(json_schema)}},
        }
    }


PROBLEM_STATUSES: dict[int, str] = {
    400: "malformed-body",
    404: "session-not-found, layer-not-found",
    409: "offset-mismatch, session-exists, capacity-exceeded",
    413: "payload-too-large",
    415: "unsupported-media-type",
    422: "invalid-request",
    500: "internal-error, gpu-error",
    503: "overloaded (with Retry-After), not-ready",
    507: "out-of-memory",
}


def problems(*statuses: int, slugs: dict[int, str] | None = None) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for st in statuses:
        desc = (slugs or {}).get(st) or PROBLEM_STATUSES.get(st, "")
        out[st] = {
            "description": f"Problem: {desc}",
            "content": {wire.PROBLEM_JSON: {"schema": ref("Problem")}},
        }
    return out
