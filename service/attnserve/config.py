"""Settings, read once from ``ATTNSERVE_*`` environment variables.

``get_settings()`` is cached; tests and embedders pass their own
:class:`Settings` to :func:`attnserve.app.create_app` instead.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "get_settings", "MiB", "GiB"]

MiB = 1 << 20
GiB = 1 << 30


class Settings(BaseSettings):
    """Every knob of the server. Environment: ``ATTNSERVE_<NAME>`` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="ATTNSERVE_", extra="ignore", frozen=True)

    host: str = Field("127.0.0.1", description="Address `attnserve serve` binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port `attnserve serve` binds.")
    adapter: str | None = Field(
        None,
        description="Which wgpu adapter: an index, a backend (vulkan, metal, dx12), an adapter "
        "type (cpu, discrete-gpu), or part of its name. Empty: the first one.",
    )
    max_body_bytes: int = Field(64 * MiB, ge=1024, description="Largest request body (413 past it).")
    memory_budget_bytes: int = Field(
        8 * GiB, ge=0, description="GPU bytes all sessions may hold together (507 past it); 0: no budget."
    )
    max_sessions: int = Field(1024, ge=1, description="Most sessions at once (507 past it).")
    default_max_tokens: int = Field(
        32768, ge=1, description="max_tokens of a session that gives none (capped by the adapter)."
    )
    max_batch_jobs: int = Field(256, ge=1, description="Most jobs coalesced into one GPU submission.")
    max_queue: int = Field(4096, ge=1, description="Most jobs waiting for the GPU (503 overloaded past it).")
    offload_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="Bodies (and answers) larger than this are decoded (encoded) on a worker "
        "thread, so the event loop never stalls on a large body.",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On shutdown, how long to wait for requests in flight."
    )
    drain_delay_s: float = Field(
        0.0,
        ge=0,
        description="On SIGTERM, how long to keep serving with /readyz at 503 before shutting "
        "down (so a load balancer can take the replica out first).",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level."
    )
    log_format: Literal["json", "text"] = Field("json", description="Log lines as JSON or as text.")
    instance_name: str | None = Field(
        None,
        description="This replica's name, sent on every response as X-Attnserve-Instance "
        "(default: the host name).",
    )

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("adapter", mode="before")
    @classmethod
    def _empty_is_none(cls, v: object) -> object:
        return None if isinstance(v, str) and not v.strip() else v


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
