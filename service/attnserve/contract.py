"""The contract: every request and answer body, declared once as a typed model.

The models say each member's name, type, default, bounds, choices and meaning.
From them follow:

* the checks of a request document (:class:`Fields` reads a
  model's members: unknown names are refused with a "did you mean" hint, and each
  member is checked against its type, bounds and choices, naming it in the
  problem);
* the OpenAPI document's component schemas (:func:`components`), each body in
  both encodings (the arrays as nested JSON lists, or as MessagePack maps of raw
  bytes), with the request examples that ``/docs`` "Try it out" sends.

The service reads bodies itself (MessagePack or JSON, arrays wrapped without a
copy and checked as columns), so the models are not instantiated on the hot path:
pydantic's own validation would not check the arrays (wrapped, not parsed), words
its problems otherwise than the API's documented ones, and costs about what the
checks here cost for an attend's other members (4-5 us either way, measured).
"""

from __future__ import annotations

import builtins
import difflib
import functools
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union, cast, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler, JsonValue
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from .codec import wire
from .errors import InvalidRequest
from .formats import DEFAULT_KV_FORMAT, KV_FORMATS

__all__ = [
    "MAX_LAYERS", "MAX_QO_HEADS", "MAX_SEED", "MAX_SINKS", "MAX_WINDOW", "EXACT_FORMATS", "SESSION_ID_PATTERN",
    "Member", "members", "CreateSession", "ForkSession", "Append", "Attend", "BatchItem", "BatchItems",
    "StackedBatch", "AppendItem", "StepOpen", "StepCallArrays", "StepCall",
    "StreamHello", "ShmHello", "components", "ref", "array_schema", "request_body",
    "ok", "problems", "PROBLEM_STATUSES", "Fields",
]  # fmt: skip

MAX_LAYERS = 256
MAX_QO_HEADS = 256
MAX_SEED = (1 << 64) - 1
MAX_SINKS = 4096  # exact first timesteps of a compressed layer
MAX_WINDOW = 1 << 20  # exact recent timesteps of a compressed layer
#: The formats a layer kept exact by ``exact_layers`` may take.
EXACT_FORMATS = ("f16", "bf16", "f32")
SESSION_ID_PATTERN = "^[A-Za-z0-9_-]{1,64}$"


# ── arrays ──────────────────────────────────────────────────────────────────

#: The arrays' ranks: an attend's rows ``[n, heads, head_dim]`` (3, the names without a
#: number), a log-sum-exp ``[n, heads]`` (2), a stacked step's ``[B, n, heads, head_dim]`` (4).
ARRAY_RANKS = {2: "[n, heads]", 3: "[rows, heads, head_dim]", 4: "[B, rows, heads, head_dim]"}
# where a model's schema names an array (of this rank), before an encoding is chosen
_ARRAY = "x-array-rank"


def array_schema(array: str, rank: int = 3) -> str:
    """The component name of ``array`` (``ArrayJson`` or ``ArrayMsgpack``) at ``rank``."""
    return array if rank == 3 else f"{array}{rank}"


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


@dataclass(frozen=True)
class ArrayOf:
    """A float32 array member of rank ``rank``: as nested lists in JSON, a map of raw
    bytes in MessagePack (``wire.decode_array`` reads either)."""

    rank: int

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.any_schema()

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {_ARRAY: self.rank}  # the encoding's array schema, put in by components()


#: An array's dtype by its wire name (``wire.DTYPES``).
WireDtype = Literal["<f4", "<f2", "bfloat16"]
assert set(WireDtype.__args__) == set(wire.DTYPES), "the contract names every wire dtype"  # type: ignore[attr-defined]
Array2 = Annotated[Any, ArrayOf(2)]
Array3 = Annotated[Any, ArrayOf(3)]
Array4 = Annotated[Any, ArrayOf(4)]
SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN)]
_NonNegative = Annotated[int, Field(ge=0)]


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
        "description": f"An array {ARRAY_RANKS[rank]} as a MessagePack map: C order, little endian, of dtype "
        "`<f4` (float32), `<f2` (IEEE float16) or `bfloat16` (a float32's upper 16 bits); `data` is a `bin` "
        "of exactly prod(shape) * itemsize bytes (4, 2, 2).",
        "type": "object",
        "required": ["dtype", "shape", "data"],
        "additionalProperties": False,
        "properties": {
            "dtype": {"type": "string", "enum": list(wire.DTYPES)},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": rank, "maxItems": rank},
            "data": {"type": "string", "format": "binary", "contentMediaType": "application/octet-stream"},
        },
    }


# ── the members of a model, as the checks read them ────────────────────────


@dataclass(frozen=True)
class Member:
    """One member of a request body: its default (``required`` when it has none),
    integer bounds, string choices, and an array's rank."""

    name: str
    required: bool
    default: Any
    lo: int | None
    hi: int | None
    choices: tuple[str, ...] | None
    rank: int | None


@functools.cache
def members(model: type[BaseModel]) -> dict[str, Member]:
    """``model``'s members by name, in declaration order (what :class:`Fields` checks)."""
    out: dict[str, Member] = {}
    for name, info in model.model_fields.items():
        lo = hi = rank = None
        for m in (*info.metadata, *_metadata(info.annotation)):
            if isinstance(m, annotated_types.Ge):
                lo = int(m.ge)  # type: ignore[call-overload]
            elif isinstance(m, annotated_types.Le):
                hi = int(m.le)  # type: ignore[call-overload]
            elif isinstance(m, ArrayOf):
                rank = m.rank
        out[name] = Member(name, info.is_required(), info.default, lo, hi, _choices(info.annotation), rank)
    return out


def _metadata(annotation: Any) -> list[Any]:
    """The ``Annotated`` metadata of an annotation (or of its optional form's)."""
    if get_origin(annotation) is Union:
        return [m for a in get_args(annotation) for m in _metadata(a)]
    return list(getattr(annotation, "__metadata__", ()))


def _choices(annotation: Any) -> tuple[str, ...] | None:
    """The strings a ``Literal`` member (or one of its union's forms) may take."""
    if get_origin(annotation) is Literal:
        return tuple(get_args(annotation))
    if get_origin(annotation) is Union:
        for a in get_args(annotation):
            if get_origin(a) is Literal:
                return tuple(get_args(a))
    return None


# ── request bodies ──────────────────────────────────────────────────────────

_STRICT = ConfigDict(extra="forbid")
_Format = Literal[KV_FORMATS]  # type: ignore[valid-type]


class CreateSession(BaseModel):
    """The session to create: its shape, kv format(s) and limits."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"num_layers": 2, "num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 4, "kv_format": "f32"},
                {"num_layers": 30, "num_qo_heads": 9, "num_kv_heads": 3, "head_dim": 64, "kv_format": "tq4",
                 "exact_layers": [0, -1], "sinks": 4, "window": 128},
            ]
        },
    )  # fmt: skip

    num_layers: int = Field(1, ge=1, le=MAX_LAYERS)
    num_qo_heads: int = Field(ge=1, le=MAX_QO_HEADS)
    num_kv_heads: int = Field(ge=1, le=MAX_QO_HEADS, description="Divides num_qo_heads (GQA).")
    head_dim: int = Field(
        description="f32: 1..128; f16, bf16: even, 2..128; turboquant and its variants (tq4, tq3, ...): 32, 64 or 128."
    )
    kv_format: Union[_Format, list[_Format]] = Field(
        DEFAULT_KV_FORMAT,
        description="One format for every layer, or an array of num_layers formats, one per layer "
        "(e.g. the first and last two layers f16, the rest turboquant).",
    )
    exact_layers: Optional[list[int]] = Field(
        None,
        description="Layers kept exact, in exact_format, whatever kv_format says: layer indexes, "
        "negative ones counted from the last layer (e.g. [0, -1]: the first and the last). "
        "Shorthand for a per-layer kv_format array, which the session's info then shows.",
    )
    exact_format: Optional[Literal["f16", "bf16", "f32"]] = Field("f16", description="The format of the exact_layers.")
    sinks: int = Field(
        0,
        ge=0,
        le=MAX_SINKS,
        description="Every compressed layer keeps its first `sinks` timesteps exact (float32, as sent) "
        "beside its codes, and every attend reads them from there (docs/api.md, exact sinks and window).",
    )
    window: int = Field(
        0,
        ge=0,
        le=MAX_WINDOW,
        description="Every compressed layer keeps a recent window exact: an attend whose first query "
        "row sits at p reads timesteps from p + 1 - window on (and every row appended in its own call) "
        "exactly; older ones from the codes. Between calls a layer holds its last `window` rows.",
    )
    max_tokens: Optional[int] = Field(
        None,
        ge=1,
        description="Cap on each layer's length. Default: the server's default_max_tokens, "
        "capped by what the adapter can bind for this shape (more is a 422 that says the limit).",
    )
    seed: Optional[int] = Field(
        None,
        ge=0,
        le=MAX_SEED,
        description="Decides the TurboQuant rotations; random in [0, 2^53) if absent; echoed back.",
    )


class ForkSession(BaseModel):
    """A new session sharing the source's timesteps (copy on write)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"session_id": "my-fork", "length": 1}]})

    session_id: Optional[SessionId] = Field(None, description="The new session's id; a random one if absent.")
    length: Optional[int] = Field(
        None,
        ge=0,
        description="Fork every layer at this length (at most each layer's length); "
        "default: each layer's current length.",
    )


# [1, 1, 4]: one row of the example session's one KV head; [1, 2, 4]: its two query heads
_EXAMPLE_ROWS: JsonValue = [[[0.5, -0.25, 1.0, 0.0]]]
_EXAMPLE_QUERY: JsonValue = [[[0.1, 0.2, 0.3, 0.4], [-0.4, 0.3, -0.2, 0.1]]]


class Append(BaseModel):
    """K/V rows appended to a layer."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"k": _EXAMPLE_ROWS, "v": _EXAMPLE_ROWS, "offset": 0}]}
    )

    k: Array3 = Field(description="[n, num_kv_heads, head_dim], n >= 1.")
    v: Array3 = Field(description="Same shape as k.")
    offset: Optional[int] = Field(
        None,
        ge=0,
        description="If given, must equal the layer's length before the append (else 409 "
        "offset-mismatch, and nothing changes): makes a retried append safe.",
    )


class Attend(BaseModel):
    """Query rows attended over a layer, after the fused append of k, v if given."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"q": _EXAMPLE_QUERY, "k": _EXAMPLE_ROWS, "v": _EXAMPLE_ROWS}, {"q": _EXAMPLE_QUERY}]
        },
    )

    q: Array3 = Field(description="[n, num_qo_heads, head_dim], n >= 1 query rows.")
    k: Optional[Array3] = Field(None, description="[m, num_kv_heads, head_dim]: appended first (fused step).")
    v: Optional[Array3] = Field(None, description="Same shape as k; k and v go together.")
    offset: Optional[int] = Field(
        None, ge=0, description="As for append, checked before the fused append (also without one)."
    )
    start_pos: Optional[int] = Field(
        None,
        ge=0,
        description="Position of the first query row; default length - n (after the fused append). "
        "start_pos + n <= length.",
    )
    causal: bool = Field(True, description="Row i attends to 0..start_pos+i; false: to all length timesteps.")
    scale: Optional[float] = Field(None, description="Softmax scale (any finite number); default 1/sqrt(head_dim).")
    return_lse: bool = Field(
        False,
        description="Answer lse beside out: each row's log-sum-exp of its scaled scores over the "
        "keys it attended (natural log), to merge attention over disjoint keys exactly.",
    )
    out_dtype: Optional[WireDtype] = Field(
        None,
        description="The dtype of out: `<f4`, `<f2` or `bfloat16` (rounded to nearest even on the GPU); "
        "default q's. JSON answers give its values as numbers. lse stays float32.",
    )


class _ItemHead(BaseModel):
    session_id: SessionId
    layer: int = Field(ge=0)


class BatchItem(Attend, _ItemHead):
    """One attend of a batch: its session and layer (first), then an attend's members."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=None)


class AppendItem(Append, _ItemHead):
    """One append of a stream frame: its session and layer (first), then an append's members."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=None)


class BatchItems(BaseModel):
    """The items form of a batched step: attends of any sessions and layers."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"items": [{"session_id": "my-session-1", "layer": 0, "q": _EXAMPLE_QUERY, "k": _EXAMPLE_ROWS,
                            "v": _EXAMPLE_ROWS}]}
            ]
        },
    )  # fmt: skip

    items: list[BatchItem] = Field(
        min_length=1, description="Attends, applied in order; at most limits.max_batch_items."
    )


class StackedBatch(BaseModel):
    """The stacked form of a batched step: one layer of B sessions, arrays stacked."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"session_ids": ["my-session-1"], "layer": 0, "q": [_EXAMPLE_QUERY], "k": [_EXAMPLE_ROWS],
                 "v": [_EXAMPLE_ROWS]}
            ]
        },
    )  # fmt: skip

    session_ids: list[SessionId] = Field(
        min_length=1,
        description="B sessions (one may repeat: its items apply in order); at most limits.max_batch_items.",
    )
    layer: int = Field(ge=0, description="The layer of every item.")
    q: Array4 = Field(description="[B, n, num_qo_heads, head_dim]: item i attends q[i].")
    k: Optional[Array4] = Field(None, description="[B, m, num_kv_heads, head_dim]: k[i] appended first.")
    v: Optional[Array4] = Field(None, description="Same shape as k; k and v go together.")
    offsets: Optional[list[Optional[_NonNegative]]] = Field(
        None, description="B offsets (null: unchecked), as an attend's offset."
    )
    start_pos: Optional[list[Optional[_NonNegative]]] = Field(
        None, description="B start positions (null: the default)."
    )
    causal: bool = Attend.model_fields["causal"]  # type: ignore[assignment]  # (the attend's member, as it is)
    scale: Optional[float] = Attend.model_fields["scale"]  # type: ignore[assignment]
    return_lse: bool = Attend.model_fields["return_lse"]  # type: ignore[assignment]
    out_dtype: Optional[WireDtype] = Attend.model_fields["out_dtype"]  # type: ignore[assignment]


class StepOpen(BaseModel):
    """A step: a fixed batch of sessions held open across layers, called once per
    layer per token (docs/api.md, "Steps: a batch held open across layers")."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"session_ids": ["my-session-1"], "rows": 1}]}
    )

    session_ids: list[SessionId] = Field(
        min_length=1,
        description="B distinct sessions of one shape (num_qo_heads, num_kv_heads, head_dim), in the order of the "
        "calls' arrays; at most limits.max_batch_items. Each may be in one open step at a time.",
    )
    rows: int = Field(1, ge=0, description="K/V rows each session appends per layer call (0: none; 1 at decode).")
    queries: Optional[int] = Field(
        None, ge=1, description="Query rows per session per call; default rows, or 1 when rows is 0."
    )
    layers: Optional[list[_NonNegative]] = Field(
        None,
        description="The distinct layers the step calls, each once per token; default every layer of the "
        "sessions (which then must have one num_layers).",
    )
    dtype: WireDtype = Field("<f4", description="The dtype of every call's q, k and v.")
    causal: bool = Attend.model_fields["causal"]  # type: ignore[assignment]
    scale: Optional[float] = Attend.model_fields["scale"]  # type: ignore[assignment]
    return_lse: bool = Attend.model_fields["return_lse"]  # type: ignore[assignment]
    out_dtype: Optional[WireDtype] = Field(None, description="The dtype of out; default the step's dtype.")


class StepCallArrays(BaseModel):
    """A layer call of a step: only its arrays (the step fixed everything else)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"q": [_EXAMPLE_QUERY], "k": [_EXAMPLE_ROWS], "v": [_EXAMPLE_ROWS]}]},
    )

    q: Array4 = Field(
        description="[B, queries, num_qo_heads, head_dim] in the step's dtype; [B, num_qo_heads, head_dim] "
        "when queries is 1 (the answer then has no rows axis either)."
    )
    k: Optional[Array4] = Field(
        None,
        description="[B, rows, num_kv_heads, head_dim] in the step's dtype ([B, num_kv_heads, head_dim] when rows "
        "is 1); required when the step's rows > 0, absent when 0.",
    )
    v: Optional[Array4] = Field(None, description="Same shape as k.")


class StepCall(StepCallArrays):
    """A stream frame's layer call: the step's handle and the layer, then the arrays."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=None)

    step: int = Field(ge=1, description="The step's handle.")
    layer: int = Field(ge=0, description="One of the step's layers, not yet called this token.")


class StreamHello(BaseModel):
    """The first frame of a frames connection (docs/api.md, frame transport)."""

    model_config = _STRICT

    id: Any = None
    op: Literal["hello"]
    version: int
    key: Optional[str] = None


class ShmHello(StreamHello):
    """The first frame of a shared-memory connection (docs/api.md, shared-memory
    transport): a frames hello, and the bytes of the region whose memfd it passes."""

    region: int = Field(ge=1)


# ── answers ─────────────────────────────────────────────────────────────────


class SessionInfo(BaseModel):
    session_id: SessionId
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    kv_format: Union[str, list[str]] = Field(description="As created: one format, or one per layer.")
    layer_formats: list[str] = Field(description="Each layer's format.")
    max_tokens: int
    seed: int
    sinks: int = Field(description="The compressed layers' exact first timesteps (0: none).")
    window: int = Field(description="The compressed layers' exact recent window (0: none).")
    lengths: list[int] = Field(description="Each layer's length.")
    bytes: int = Field(
        description="GPU memory the session holds now (with a window: its layers' exact rows "
        "counted at the most they hold between calls)."
    )


class SessionList(BaseModel):
    sessions: list[SessionInfo]


class AppendResult(BaseModel):
    length: int = Field(description="The layer's new length.")


class Problem(BaseModel):
    """RFC 9457 problem details; extra members depend on the type (offset-mismatch and
    capacity-exceeded carry `length`, capacity-exceeded also `max_tokens`)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(examples=["/problems/offset-mismatch"])
    title: str
    status: int
    detail: str
    instance: Optional[str] = None
    length: Optional[int] = None
    max_tokens: Optional[int] = None


class AttendResult(BaseModel):
    out: Array3 = Field(description="[n, num_qo_heads, head_dim] in out_dtype (default q's dtype).")
    length: int = Field(description="The layer's length after the call.")
    lse: Optional[Array2] = Field(
        None,
        description="[n, num_qo_heads] float32, with return_lse: log(sum_t exp(scale * q.k_t)) "
        "over the timesteps t each row attended.",
    )


class ItemProblem(BaseModel):
    error: Problem = Field(description="The item's problem (with `item`, its index); the item changed nothing.")


class BatchResults(BaseModel):
    results: list[Union[AttendResult, ItemProblem]] = Field(description="One per item, in item order.")


class StackedResult(BaseModel):
    out: Array4 = Field(
        description="[B, n, num_qo_heads, head_dim] in out_dtype (default q's dtype); zeros for a failed item."
    )
    lse: Optional[Array3] = Field(
        None,
        description="[B, n, num_qo_heads] float32, with return_lse: each row's log-sum-exp of its "
        "scaled scores; zeros for a failed item.",
    )
    lengths: list[Optional[int]] = Field(description="Each item's layer length after it; null for a failed item.")
    errors: list[Problem] = Field(
        description="The failed items' problems (with `item`, the index); each changed nothing."
    )


class StepFailure(BaseModel):
    layer: int
    token: int
    item: int = Field(description="The failed item's index (its session's position in session_ids).")
    type: str = Field(description="The item's problem type.")
    detail: str


class StepInfo(BaseModel):
    """An open step."""

    step: int = Field(description="The step's handle (scoped to the caller's API key).")
    session_ids: list[SessionId]
    layers: list[int]
    rows: int
    queries: int
    dtype: str
    causal: bool
    scale: Optional[float]
    return_lse: bool
    out_dtype: Optional[str]
    token: int = Field(description="The current token: how many times every layer of the step has been called.")
    broken: Optional[StepFailure] = Field(
        description="The first call that applied to some sessions and failed for others (null: none); a broken "
        "step refuses its calls (409 step-broken)."
    )
    lengths: list[list[int]] = Field(description="Per session, the length of each of the step's layers.")


class StepCallResult(StackedResult):
    token: int = Field(description="The token this call belonged to.")


class Status(BaseModel):
    status: str


class ServerInfo(BaseModel):
    name: Optional[str] = None
    version: str
    api_version: Optional[int] = None
    adapter: dict[str, Any] = Field(
        description="The wgpu adapter: name, backend, adapter_type, vendor, description, and "
        "its max_storage_buffer_binding_size and max_buffer_size; cuda_context: the CUDA "
        "context held for full clocks on NVIDIA ({cuda_device, name}), or null."
    )
    backend: str = Field(description="The adapter's backend (Vulkan, Metal, D3D12...).")
    kv_formats: list[str]
    head_dims: Optional[dict[str, list[int]]] = None
    kv_format_sizes: Optional[dict[str, list[dict[str, Any]]]] = Field(
        None,
        description="Per kv format, at head_dim 32, 64 and 128 (those it takes): cache bits per "
        "element and bytes per token, KV head and layer (keys and values): head_dim, bits_per_element, "
        "bytes_per_token_per_kv_head.",
    )
    limits: dict[str, Any] = Field(
        description="max_body_bytes, memory_budget_bytes (0: no budget), memory_used_bytes, max_sessions, "
        "default_max_tokens, max_layers, max_qo_heads, max_binding_bytes, max_queue, max_batch_jobs, "
        "max_batch_items (most items in one batched step)."
    )
    sessions: Optional[int] = None
    auth: bool = Field(
        description="Whether API keys are configured: true, every /v1 request needs "
        "`Authorization: Bearer <key>`; false, the server serves anyone who reaches it."
    )
    persistence: Optional[bool] = Field(None, description="Whether sessions are snapshotted at shutdown.")
    pool: Optional[dict[str, Any]] = Field(
        None,
        description="The paged KV pool, server-wide: page_tokens, page_table_bytes (GPU bytes of "
        "the buffer that holds every layer's page table), and per layout (kv_format, "
        "num_kv_heads, head_dim) its slabs, pages, used_pages (pages shared by forks count once) "
        "and bytes (GPU bytes of its slabs).",
    )
    arenas: Optional[dict[str, Any]] = Field(
        None,
        description="bytes: GPU bytes of the GPU worker's batch arenas and readback buffers "
        "(they grow to the largest batch and are kept).",
    )
    pipelines: Optional[dict[str, Any]] = Field(
        None,
        description="compiled: how many compute pipelines the device holds (a kernel and its "
        "constants each; compiled at start or on first use, and kept).",
    )
    journal: Optional[dict[str, Any]] = Field(
        None,
        description="With a snapshot directory: sync_interval_s, and the last journal sync's "
        "start and finish (Unix seconds) and pages written.",
    )
    ready: Optional[bool] = None
    frames: Optional[dict[str, Any]] = Field(
        None,
        description="The frame transport (docs/api.md#frame-transport-plain-tcp-arrays-as-raw-bytes): "
        "{port} on this server's host, or null when it is off.",
    )
    shm: Optional[dict[str, Any]] = Field(
        None,
        description="The shared-memory transport (docs/api.md#shared-memory-transport-same-host): "
        "{socket, max_region_bytes, uid}: the path of its Unix socket on this server's host, the largest "
        "region a connection may share, and the user the server runs as (a client shares its region and key "
        "only with a server of its own user, root, or this uid), or null when it is off.",
    )


# ── the OpenAPI components ──────────────────────────────────────────────────

#: Bodies with arrays: one component per encoding (``<Name>Json``, ``<Name>Msgpack``).
_WITH_ARRAYS: dict[str, type[BaseModel]] = {
    "Append": Append,
    "Attend": Attend,
    "AttendResult": AttendResult,
    "StepCallArrays": StepCallArrays,
    "StepCallResult": StepCallResult,
}
_PLAIN: dict[str, type[BaseModel]] = {
    "CreateSession": CreateSession,
    "ForkSession": ForkSession,
    "SessionInfo": SessionInfo,
    "SessionList": SessionList,
    "AppendResult": AppendResult,
    "Status": Status,
    "ServerInfo": ServerInfo,
    "Problem": Problem,
    "StepOpen": StepOpen,
    "StepInfo": StepInfo,
}


def _schema(model: type[BaseModel], encoding: str = "Json") -> dict[str, Any]:
    """``model``'s JSON schema, its nested models inlined, ``Problem`` referenced,
    and its arrays in ``encoding`` (``Json`` or ``Msgpack``)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = {k: v for k, v in schema.pop("$defs", {}).items() if k != "Problem"}
    if encoding != "Json":  # the examples are JSON documents (what /docs "Try it out" sends)
        schema.pop("examples", None)
    return cast("dict[str, Any]", _inline(schema, defs, encoding))


def _inline(node: Any, defs: dict[str, Any], encoding: str) -> Any:
    if isinstance(node, dict):
        rest = {k: _inline(v, defs, encoding) for k, v in node.items() if k not in ("$ref", _ARRAY)}
        if _ARRAY in node:
            return {**ref(array_schema(f"Array{encoding}", node[_ARRAY])), **rest}
        name = str(node.get("$ref", "")).rsplit("/", 1)[-1]
        if name in defs:
            return {**_inline(defs[name], defs, encoding), **rest}
        return {**({"$ref": node["$ref"]} if "$ref" in node else {}), **rest}
    if isinstance(node, list):
        return [_inline(v, defs, encoding) for v in node]
    return node


@functools.cache
def components() -> dict[str, Any]:
    """The component schemas of every body, as ``components.schemas`` holds them."""
    out: dict[str, Any] = {
        array_schema(a, rank): make(rank)
        for a, make in (("ArrayJson", _array_json), ("ArrayMsgpack", _array_msgpack))
        for rank in ARRAY_RANKS
    }
    out.update({name: _schema(model) for name, model in _PLAIN.items()})
    for enc in ("Json", "Msgpack"):
        out.update({f"{name}{enc}": _schema(model, enc) for name, model in _WITH_ARRAYS.items()})
        out[f"BatchAttend{enc}"] = {"anyOf": [_schema(BatchItems, enc), _schema(StackedBatch, enc)]}
        out[f"BatchAttendResult{enc}"] = {"oneOf": [_schema(BatchResults, enc), _schema(StackedResult, enc)]}
    return out


# ── a route's OpenAPI parts ─────────────────────────────────────────────────


def request_body(json_schema: str, msgpack_schema: str | None = None, *, required: bool = True) -> dict[str, Any]:
    """A route's ``openapi_extra``: its body in JSON (first: what /docs "Try it out"
    sends, with the schema's first example) or MessagePack."""
    schema = components()[json_schema]
    example = (schema.get("examples") or schema.get("anyOf", [{}])[0].get("examples") or [None])[0]
    content = _content(json_schema, msgpack_schema)
    if example is not None:
        content[wire.JSON]["example"] = example
    return {"requestBody": {"required": required, "content": content}}


def ok(status: int, description: str, json_schema: str, msgpack_schema: str | None = None) -> dict[int, Any]:
    return {
        status: {
            "description": description + " (MessagePack or JSON, as negotiated).",
            "content": _content(json_schema, msgpack_schema),
        }
    }


def _content(json_schema: str, msgpack_schema: str | None) -> dict[str, dict[str, Any]]:
    """A body's media types: JSON (first: what /docs shows and sends) and MessagePack
    (``msgpack_schema``, or the JSON one for a body without arrays)."""
    return {wire.JSON: {"schema": ref(json_schema)}, wire.MSGPACK: {"schema": ref(msgpack_schema or json_schema)}}


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
        out[st] = {"description": f"Problem: {desc}", "content": {wire.PROBLEM_JSON: {"schema": ref("Problem")}}}
    return out


# ── the checks of a request document, by its model ─────────────────────────

_MISSING: Any = object()  # a required member
_MODEL: Any = object()  # what the model says


class Fields:
    """Typed access to the members of a request document, refusing unknown ones:
    the members of ``model`` (and the ``head`` names before them: a stream frame's
    ``id`` and ``op``), or the names ``model`` lists. A getter takes the member's
    default, bounds, choices and rank from the model unless given.

    ``None`` (JSON ``null``, MessagePack ``nil``) counts as absent for optional
    members. Every refusal is ``422 invalid-request`` naming the member; an
    unknown name's names the member it may have meant.
    """

    def __init__(self, doc: Any, model: type[BaseModel] | tuple[str, ...], what: str, *, head: tuple[str, ...] = ()):
        if not isinstance(doc, dict):
            raise InvalidRequest(f"{what}: expected an object (a map), got {_type_name(doc)}")
        if isinstance(model, type):
            self.members, allowed = members(model), _names(model, head)
        else:
            self.members, allowed = {}, (*head, *model)
        unknown = [k for k in doc if k not in allowed]
        if unknown:
            raise InvalidRequest(
                f"{what}: unknown field(s) {', '.join(_meant(u, allowed) for u in unknown)}; "
                f"expected some of {', '.join(allowed)}",
                fields=[str(u) for u in unknown],
            )
        self.doc = doc

    def _default(self, name: str, default: Any) -> Any:
        """The value of an absent (or null) member: ``default``, else the model's;
        refused when the member is required."""
        if default is _MODEL:
            m = self.members.get(name)
            default = _MISSING if m is None or m.required else m.default
        if default is _MISSING:
            raise InvalidRequest(f"{name}: required")
        return default

    def int(self, name: str, default: Any = _MODEL, *, lo: Any = _MODEL, hi: Any = _MODEL) -> Any:
        value = self.doc.get(name)
        if value is None:
            return self._default(name, default)
        if type(value) is not int:
            raise InvalidRequest(f"{name}: expected an integer, got {_type_name(value)} {_short(value)}")
        if lo is _MODEL or hi is _MODEL:
            m = self.members.get(name)
            lo = (m.lo if m else None) if lo is _MODEL else lo
            hi = (m.hi if m else None) if hi is _MODEL else hi
        if lo is not None and value < lo or hi is not None and value > hi:
            rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise InvalidRequest(f"{name}: expected an integer in {rng}, got {value}")
        return value

    def bool(self, name: str, default: Any = _MODEL) -> Any:
        value = self.doc.get(name)
        if value is None:
            value = self._default(name, default)
        if type(value) is not bool:
            raise InvalidRequest(f"{name}: expected true or false, got {_type_name(value)} {_short(value)}")
        return value

    def str(self, name: str, default: Any = _MODEL, *, choices: Any = _MODEL) -> Any:
        value = self.doc.get(name)
        if value is None:
            value = self._default(name, default)
            if value is None:  # an optional member, absent
                return None
        if not isinstance(value, str):
            raise InvalidRequest(f"{name}: expected a string, got {_type_name(value)} {_short(value)}")
        if choices is _MODEL:
            m = self.members.get(name)
            choices = m.choices if m else None
        if choices is not None and value not in choices:
            raise InvalidRequest(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
        return value

    def number(self, name: builtins.str, default: Any = _MODEL) -> Any:
        value = self.doc.get(name)
        if value is None:
            return self._default(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequest(f"{name}: expected a number, got {_type_name(value)} {_short(value)}")
        try:
            f = float(value)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise InvalidRequest(f"{name}: expected a finite number, got {value}")
        return f

    def list(self, name: builtins.str, default: Any = _MODEL) -> Any:
        value = self.doc.get(name)
        if value is None:
            return self._default(name, default)
        if not isinstance(value, list):
            raise InvalidRequest(f"{name}: expected an array, got {_type_name(value)} {_short(value)}")
        return value

    def array(
        self,
        name: builtins.str,
        default: Any = _MODEL,
        *,
        max_elements: builtins.int = wire.MAX_ELEMENTS,
        finite: builtins.bool = True,
    ) -> Any:
        value = self.doc.get(name)
        if value is None:
            return self._default(name, default)
        m = self.members.get(name)
        ndim = m.rank if m is not None and m.rank is not None else 3
        try:
            return wire.decode_array(value, name=name, ndim=ndim, finite=finite, max_elements=max_elements)
        except wire.WireError as e:
            raise InvalidRequest(str(e)) from None


@functools.cache
def _names(model: type[BaseModel], head: tuple[str, ...]) -> tuple[str, ...]:
    return (*head, *members(model))


def _meant(name: Any, allowed: tuple[builtins.str, ...]) -> builtins.str:
    """An unknown member's name, and the one it may have meant."""
    close = difflib.get_close_matches(name, allowed, 1) if isinstance(name, builtins.str) else []
    return f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (bytes, bytearray, memoryview)):
        return "binary"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _short(v: Any) -> str:
    if isinstance(v, (dict, list, bytes, bytearray, memoryview)):
        return ""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."
