"""Settings, read once from ``ATTNSERVE_*`` environment variables.

``get_settings()`` is cached; tests and embedders pass their own
:class:`Settings` to :func:`attnserve.app.create_app` instead.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Annotated, Literal

from pydantic import (
    BeforeValidator,
    ByteSize,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from .formats import DEFAULT_KV_FORMAT, KV_FORMATS, RECOMMENDED

__all__ = [
    "Settings",
    "get_settings",
    "parse_api_keys",
    "parse_size",
    "format_size",
    "env_name",
    "unknown_env",
    "ENV_PREFIX",
    "MiB",
    "GiB",
]

ENV_PREFIX = "ATTNSERVE_"
MiB = 1 << 20
GiB = 1 << 30

# A size is a whole number of bytes, or a number and a unit, which pydantic's ByteSize reads
# (IEC units: KiB, MiB, GiB, TiB are powers of 1024; kB, MB, GB, TB powers of 1000) once
# parse_size has checked the text and spelt its unit as ByteSize does. Three rules are ours:
# - k, m, g, t alone (and ki, mi, ...) are powers of 1024, as attnserve has always read
#   them (ByteSize reads k, m, g as powers of 1000): spelt KiB, MiB, ... for it;
# - the whole text is the size: ByteSize reads a number at the start and drops the rest
#   ("1,5g" is 1 byte to it, "8GiB of it" 8GiB), and counts bits ("8bit"), which no setting does;
# - a size is a whole number of bytes: ByteSize drops a fraction ("0.5b" is 0: no budget).
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([kmgt])(i?)(b?)|b)?\s*", re.IGNORECASE)
_BYTE_SIZE = TypeAdapter(ByteSize)
_NOT_A_SIZE = "not a size: an integer, or a number with a unit such as 64k, 512MiB, 8GiB, 10MB"


def parse_size(value: object) -> object:
    """A byte count from ``8GiB``, ``512MiB``, ``64k`` (= 64KiB), ``1.5g``, ``10MB`` (decimal)
    or a plain integer; anything else is handed on to pydantic as it is."""
    if not isinstance(value, str):
        return value
    m = _SIZE.fullmatch(value)
    if m is None:
        raise ValueError(_NOT_A_SIZE)
    number, prefix, binary, decimal = m.groups()
    unit = f"{prefix.upper()}{'B' if decimal and not binary else 'iB'}" if prefix else ""
    try:
        size = int(_BYTE_SIZE.validate_python(number + unit))
    except ValidationError:  # a number too large for a float
        raise ValueError(_NOT_A_SIZE) from None
    if "." in number and size != float(number) * ByteSize.byte_sizes.get(unit.lower(), 1):
        raise ValueError(f"not a whole number of bytes: {value.strip()}")
    return size


def format_size(n: int) -> str:
    """``8589934592`` -> ``8GiB`` (the largest binary unit that divides it), else the integer."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


Size = Annotated[int, BeforeValidator(parse_size)]
#: Most bytes of a Unix socket's path (sun_path holds 108 with the NUL on Linux).
_MAX_SOCKET_PATH = 107


class Settings(BaseSettings):
    """Every knob of the server. Environment: ``ATTNSERVE_<NAME>`` (case-insensitive)."""

    model_config = SettingsConfigDict(
        env_prefix="ATTNSERVE_",
        extra="ignore",
        frozen=True,
        hide_input_in_errors=True,  # keys never printed
    )

    host: str = Field(default="127.0.0.1", description="Address `attnserve serve` binds.")
    port: int = Field(default=8421, ge=0, le=65535, description="Port `attnserve serve` binds.")
    frames_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Port of the frame transport (the stream's operations over plain TCP, arrays as raw "
        "bytes: the fastest data plane; docs/api.md, Frame transport) on the same host; unset: off; "
        "0: a free port (GET /v1/info names it).",
    )
    frames_max_connections: int = Field(
        default=1024, ge=1, description="Most frame-transport connections at once (past it a new one is refused)."
    )
    shm_socket: str | None = Field(
        default=None,
        description="Path of the shared-memory transport's Unix socket (the frame transport's operations, "
        "arrays in a memory region the client shares: for a client on this host; docs/api.md, "
        "Shared-memory transport); unset: off. Made with mode 0600 and removed at shutdown; a stale socket "
        "there is replaced, anything else stops the start.",
    )
    shm_max_region_bytes: Size = Field(
        default=256 * MiB,
        ge=4096,
        description="Largest memory region one shared-memory connection may share (its hello is refused "
        "with 413 past it).",
    )
    adapter: str | None = Field(
        default=None,
        description="Which wgpu adapter: an index, a backend (vulkan, metal, dx12), an adapter "
        "type (cpu, discrete-gpu), or part of its name. Empty: the first one.",
    )
    cuda_context: str = Field(
        default="auto",
        description="On an NVIDIA adapter, hold a CUDA context so the driver runs the GPU at full clocks "
        "(without one it may keep them idle under Vulkan: 4x slower decode measured on the H200): auto "
        "(the only CUDA device visible; none, with a warning, where there are several), off, or the "
        "adapter's CUDA device ordinal.",
    )
    max_body_bytes: Size = Field(default=64 * MiB, ge=1024, description="Largest request body (413 past it).")
    memory_budget_bytes: Size = Field(
        default=8 * GiB, ge=0, description="GPU bytes all sessions may hold together (507 past it); 0: no budget."
    )
    max_sessions: int = Field(default=1024, ge=1, description="Most sessions at once (507 past it).")
    default_max_tokens: int = Field(
        default=32768, ge=1, description="max_tokens of a session that gives none (capped by the adapter)."
    )
    kernels: Literal["auto", "split", "tiled", "single"] = Field(
        default="auto",
        description="Attention kernel family: auto (split-KV for up to 16 query rows, the query-block "
        "tiled kernels for more), or always split, tiled or single (the single-pass kernels).",
    )
    split_target_workgroups: int = Field(
        default=128,
        ge=1,
        description="Split-KV sizing: about this many workgroups per decode attend (the H200 optimum).",
    )
    warmup: str = Field(
        # the default kv format and the recommended compressed one (formats.py)
        default=",".join(dict.fromkeys((DEFAULT_KV_FORMAT, RECOMMENDED.kv_format))),
        description="The kv formats whose kernels are compiled at start, before /readyz reports ready (else "
        "the first request of each compiles them: seconds each on lavapipe): none, all, or kv formats "
        "separated by commas (by default the default format and the recommended compressed one). Each is "
        "warmed at every warmup_shapes shape it takes, for decode (one query row) and prefill (many rows) "
        "with the kernels the kernels setting picks; a compressed format also with exact sinks and a window "
        f"(the recommended {RECOMMENDED.sinks} and {RECOMMENDED.window}), whose attends take other kernels.",
    )
    warmup_shapes: str = Field(
        default="32x8x128",
        description="The session shapes the warmup compiles kernels for, separated by commas, each "
        "num_qo_heads x num_kv_heads x head_dim as your model's (some kernels are specialized on the "
        "GQA group and head_dim; another shape compiles its own on first use).",
    )
    page_tokens: int = Field(
        default=64,
        ge=16,
        le=1024,
        description="Timesteps per page of the paged KV pool (a power of two, 16..1024): a layer holds "
        "whole pages, so at most one partly filled page per (session, layer).",
    )
    pool_slab_bytes: Size = Field(
        default=0,
        ge=0,
        description="Largest K (or V) buffer of one slab of the KV pool; 0: the adapter's binding limit. "
        "A layer's pages live in one slab, so this also caps a layer's tokens.",
    )
    max_batch_jobs: int = Field(default=256, ge=1, description="Most jobs coalesced into one GPU submission.")
    batch_arena_bytes: Size = Field(
        default=256 * MiB,
        ge=64 * 1024,
        description="The size the GPU worker keeps each of its six batch arenas at (a submission's inputs, "
        "outputs and scratch; its two readback buffers at twice it): jobs are coalesced into one submission "
        "only while every arena stays within it, and one larger request runs alone in arenas made for it and "
        "let go after. So the device memory for work in flight stays within 10x this (GET /v1/info: arenas), "
        "however many requests are queued (capped by the adapter's binding limit).",
    )
    max_queue: int = Field(default=4096, ge=1, description="Most jobs waiting for the GPU (503 overloaded past it).")
    stream_max_in_flight: int = Field(
        default=256,
        ge=1,
        description="Most operations one connection of /v1/stream, the frame transport or shared memory may have in "
        "flight, an operation counting until its reply is flushed (stream_max_unsent_bytes); past it the server "
        "reads no further frame of that connection until one is answered (backpressure).",
    )
    stream_max_in_flight_bytes: Size = Field(
        default=8 * MiB,
        ge=64 * 1024,
        description="Most bytes of request frames one connection of /v1/stream, the frame transport or shared "
        "memory may have in flight (arrays in a shared memory region not counted): past it the server reads no "
        "further frame of that connection until an operation is answered (a larger frame is read alone).",
    )
    stream_max_unsent_bytes: Size = Field(
        default=1 * MiB,
        ge=64 * 1024,
        description="Most reply bytes one connection of /v1/stream, the frame transport or shared memory may leave "
        "unsent in its socket's buffer (its peer not reading): past it the server reads no further frame of "
        "that connection, and each in-flight operation keeps its slot until the buffer is flushed below a "
        "quarter of this. With stream_max_in_flight_bytes, this bounds the memory a connection holds.",
    )
    stream_ping_interval_s: float = Field(
        default=20.0,
        ge=0,
        description="How often the server pings a /v1/stream peer (WebSocket keepalive); 0: never.",
    )
    stream_ping_timeout_s: float = Field(
        default=20.0,
        gt=0,
        description="How long a /v1/stream peer has to answer a ping, counted only while the server reads "
        "its frames (a peer held back by its operations in flight is never dropped for a late pong).",
    )
    stream_send_timeout_s: float = Field(
        default=60.0,
        ge=0,
        description="A /v1/stream peer that reads none of its replies for this long is disconnected (its "
        "operations complete; their replies are lost); 0: never.",
    )
    max_batch_items: int = Field(
        default=1024,
        ge=1,
        description="Most items in one batched step (POST /v1/batch/attend, and a stream's attend_batch).",
    )
    offload_bytes: Size = Field(
        default=256 * 1024,
        ge=0,
        description="Bodies (and answers) larger than this are decoded (encoded) on a worker "
        "thread, so the event loop never stalls on a large body.",
    )
    gc_threshold: int = Field(
        default=50_000,
        ge=0,
        description="Once started, freeze the objects alive (gc.freeze) and collect the youngest "
        "generation every this many allocations (Python's default: 700 on 3.12), so a batched "
        "step's short-lived objects do not set off collections that walk the server's state; "
        "0 leaves the collector as Python sets it.",
    )
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="On shutdown, how long to wait for requests in flight."
    )
    drain_delay_s: float = Field(
        default=0.0,
        ge=0,
        description="On SIGTERM, how long to keep serving with /readyz at 503 before shutting "
        "down (so a load balancer can take the replica out first).",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="Log level."
    )
    log_format: Literal["auto", "json", "text"] = Field(
        default="auto",
        description="Log lines as JSON (one object per line, what a log collector reads) or as text; auto: "
        "text when stderr is a terminal, else JSON.",
    )
    instance_name: str | None = Field(
        default=None,
        description="This replica's name, sent on every response as X-Attnserve-Instance (default: the host name).",
    )
    # ── tenants, quotas, overload, persistence ───────────────────────────────
    api_keys: SecretStr | None = Field(
        default=None,
        description="API keys, comma-separated. When any key is configured (here or in "
        "api_keys_file), every /v1 request needs `Authorization: Bearer <key>`, and each key "
        "is a tenant that sees only its own sessions.",
    )
    api_keys_file: str | None = Field(
        default=None,
        description="A file of API keys: one per line (or comma-separated); blank lines and "
        "lines starting with # are ignored. Read once at start.",
    )
    metrics_auth: bool = Field(default=False, description="With API keys configured, /metrics needs a valid key too.")
    quota_sessions_per_key: int = Field(
        default=0, ge=0, description="Most sessions one tenant may hold at once (507 past it); 0: no quota."
    )
    quota_bytes_per_key: Size = Field(
        default=0, ge=0, description="GPU bytes one tenant's sessions may hold (507 past it); 0: no quota."
    )
    request_timeout_s: float = Field(
        default=60.0,
        ge=0,
        description="Longest an append or attend may wait in the GPU queue before it is "
        "dropped, unapplied, with 503 timeout; 0: no timeout.",
    )
    session_ttl_seconds: float = Field(
        default=0.0,
        ge=0,
        description="A session not used for this long is deleted (its GPU memory freed); 0: sessions never expire.",
    )
    step_idle_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="A step opened over HTTP that no layer call has used for this long is closed (its sessions "
        "freed); a step opened on a stream, frames or shared-memory connection closes with its connection.",
    )
    snapshot_dir: str | None = Field(
        default=None,
        description="A local directory: on shutdown every session is written there as a "
        "snapshot, and the next start restores them before it reports ready.",
    )
    sync_interval_s: float = Field(
        default=1.0,
        ge=0,
        description="With snapshot_dir: every this many seconds, the pages that filled since the last sync "
        "are appended to each session's journal and fsynced, so a hard kill loses at most this interval "
        "and each layer's partly filled page; 0: snapshots at shutdown only.",
    )

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("adapter", "api_keys_file", "snapshot_dir", "frames_port", "shm_socket", mode="before")
    @classmethod
    def _empty_is_none(cls, v: object) -> object:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("shm_socket")
    @classmethod
    def _socket_path(cls, v: str | None) -> str | None:
        if v is not None and (len(os.fsencode(v)) > _MAX_SOCKET_PATH or "\0" in v):
            raise ValueError(
                f"a Unix socket's path is at most {_MAX_SOCKET_PATH} bytes without NUL, got {len(os.fsencode(v))}"
            )
        return v

    @field_validator("cuda_context")
    @classmethod
    def _cuda_context(cls, v: str) -> str:
        v = v.strip().lower()
        if v not in ("auto", "off") and not v.isdigit():
            raise ValueError(f"must be auto, off or a CUDA device ordinal (0, 1, ...), got {v!r}")
        return v

    @field_validator("warmup")
    @classmethod
    def _warmup(cls, v: str) -> str:
        names = [n.strip().lower() for n in v.split(",") if n.strip()]
        if names in (["none"], ["all"]) or not names:
            return names[0] if names else "none"
        for name in names:
            if name not in KV_FORMATS:
                close = difflib.get_close_matches(name, KV_FORMATS, n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                raise ValueError(
                    f"{name!r} is no kv format; {hint}expected none, all or some of {', '.join(KV_FORMATS)}"
                )
        return ",".join(dict.fromkeys(names))

    @field_validator("warmup_shapes")
    @classmethod
    def _warmup_shapes(cls, v: str) -> str:
        shapes = []
        for text in (s.strip().lower() for s in v.split(",") if s.strip()):
            m = re.fullmatch(r"(\d+)\s*x\s*(\d+)\s*x\s*(\d+)", text)
            if m is None:
                raise ValueError(f"{text!r} is not num_qo_heads x num_kv_heads x head_dim, such as 32x8x128")
            h, hkv, d = map(int, m.groups())
            if not (1 <= hkv <= h and h % hkv == 0 and 1 <= d <= 128):
                raise ValueError(
                    f"{text!r}: num_kv_heads must divide num_qo_heads, and head_dim be 1 to 128 (as a session's)"
                )
            shapes.append(f"{h}x{hkv}x{d}")
        if not shapes:
            raise ValueError("give at least one shape, such as 32x8x128 (warmup=none warms nothing)")
        return ",".join(dict.fromkeys(shapes))

    @field_validator("page_tokens")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two (16, 32, 64, ... 1024), got {v}")
        return v

    @model_validator(mode="after")
    def _keys_readable(self) -> "Settings":
        if self.frames_port and self.frames_port == self.port:
            raise ValueError(f"frames_port: must differ from port ({self.port}): the frame transport has its own")
        self.api_key_list()  # a missing file or a malformed key stops the start, with the reason
        return self

    def api_key_list(self) -> list[str]:
        """Every configured API key (from api_keys and api_keys_file), in order, without
        duplicates. Raises ValueError (naming a key by its position only, never its text)."""
        keys: list[str] = []
        if self.api_keys is not None:
            keys += parse_api_keys(self.api_keys.get_secret_value(), "api_keys")
        if self.api_keys_file:
            try:
                with open(self.api_keys_file, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"api_keys_file: cannot read {self.api_keys_file!r}: {type(e).__name__}") from None
            lines = [ln for ln in text.splitlines() if not ln.strip().startswith("#")]
            keys += parse_api_keys(",".join(lines), "api_keys_file")
        return list(dict.fromkeys(keys))

    def warmup_formats(self) -> tuple[str, ...]:
        """The kv formats whose kernels the start warms (``warmup``), in order."""
        if self.warmup == "none":
            return ()
        return KV_FORMATS if self.warmup == "all" else tuple(self.warmup.split(","))

    def warmup_shape_list(self) -> list[tuple[int, int, int]]:
        """``warmup_shapes`` as (num_qo_heads, num_kv_heads, head_dim) triples."""
        return [(h, hkv, d) for h, hkv, d in (map(int, s.split("x")) for s in self.warmup_shapes.split(","))]


_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {","}


def parse_api_keys(text: str, where: str) -> list[str]:
    """Keys from comma- or newline-separated ``text`` (blank entries skipped). A key is
    1 to 4096 visible ASCII characters, no commas or spaces (it travels in a header)."""
    keys = []
    for i, raw in enumerate(text.replace("\n", ",").split(",")):
        key = raw.strip()
        if not key:
            continue
        if len(key) > 4096 or not set(key) <= _KEY_CHARS:
            raise ValueError(f"{where}: key #{i + 1} is not 1 to 4096 visible ASCII characters without spaces")
        keys.append(key)
    return keys


def env_name(field: str) -> str:
    """The environment variable of a setting: ``port`` -> ``ATTNSERVE_PORT``."""
    return ENV_PREFIX + field.upper()


# ATTNSERVE_* variables that are not settings but that the project's own tools read
# where a server may run (the image's health check, the client tools, the tests).
OTHER_VARIABLES = frozenset({"ATTNSERVE_HEALTHCHECK_TIMEOUT_S"})
OTHER_PREFIXES = ("ATTNSERVE_TEST_",)


def unknown_env(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """Each ``ATTNSERVE_*`` variable of ``environ`` that is no setting, with the closest
    setting's variable (or None), sorted by name. Values are never looked at."""
    known = {env_name(f) for f in Settings.model_fields}
    found: list[tuple[str, str | None]] = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known or upper in OTHER_VARIABLES:
            continue
        if upper.startswith(OTHER_PREFIXES):
            continue
        close = difflib.get_close_matches(upper[len(ENV_PREFIX) :].lower(), list(Settings.model_fields), n=1)
        found.append((name, env_name(close[0]) if close else None))
    return found


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
