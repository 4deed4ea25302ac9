"""Typed views of the contract's JSON objects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import InvalidResponse

__all__ = ["SessionInfo"]


@dataclass(frozen=True)
class SessionInfo:
    """A session's info, as ``GET /v1/sessions/{id}`` answers it.

    Attributes:
        session_id: the session's id.
        num_layers: number of layers, each with its own KV cache.
        num_qo_heads: query/output heads; ``q`` and the attend output are
            ``[n, num_qo_heads, head_dim]``.
        num_kv_heads: key/value heads; ``k`` and ``v`` are ``[m, num_kv_heads, head_dim]``.
        head_dim: size of one head.
        kv_format: how the cache is stored (``"f32"``, ``"f16"``, ``"bf16"``, ``"turboquant"`` or a
            TurboQuant variant: ``"tq4"``, ``"tq3"``, ``"tq4v2"``, ``"tq4v3"``, ``"tq3q"``, ``"tq4q"``,
            ``"tq4o"``, ``"tq3o"``, ``"tq2o"``), as
            created: one format for every layer, or a tuple of one per layer.
        layer_formats: each layer's format.
        max_tokens: cap on each layer's length, or ``None`` if the server gave none.
        seed: the seed of the TurboQuant rotations, or ``None``.
        lengths: each layer's length (timesteps held), one int per layer.
        bytes: GPU memory the session holds now.
        sinks: the compressed layers' first timesteps kept exact (0: none).
        window: the compressed layers' recent timesteps kept exact (0: none).
        extra: any members the server sent that this version does not know.
    """

    session_id: str
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    kv_format: str | tuple[str, ...]
    max_tokens: int | None
    seed: int | None
    lengths: tuple[int, ...]
    bytes: int
    layer_formats: tuple[str, ...] = ()  # derived from kv_format when not given
    sinks: int = 0  # 0 from a server that does not send it
    window: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.layer_formats:
            fmt = self.kv_format
            object.__setattr__(self, "layer_formats", (fmt,) * self.num_layers if isinstance(fmt, str) else tuple(fmt))

    @classmethod
    def from_dict(cls, obj: Any) -> SessionInfo:
        """Build from a decoded info object; extra members are kept in ``extra``.

        Raises:
            InvalidResponse: a member is missing or has the wrong type.
        """
        if not isinstance(obj, Mapping):
            raise InvalidResponse(f"session info: expected an object, got {type(obj).__name__}")

        def get(key: str, kind: type, optional: bool = False) -> Any:
            value = obj.get(key)
            if value is None and optional:
                return None
            if not isinstance(value, kind) or isinstance(value, bool):
                raise InvalidResponse(f"session info: expected {key!r} as {kind.__name__}, got {value!r}")
            return value

        def get_list(key: str, kind: type) -> tuple[Any, ...]:
            value = obj.get(key)
            if not isinstance(value, (list, tuple)) or not all(type(n) is kind for n in value):
                raise InvalidResponse(f"session info: expected {key!r} as a list of {kind.__name__}, got {value!r}")
            return tuple(value)

        session_id, num_layers = get("session_id", str), get("num_layers", int)
        kv_format = get_list("kv_format", str) if isinstance(obj.get("kv_format"), list) else get("kv_format", str)
        formats = get_list("layer_formats", str) if "layer_formats" in obj else ()  # () before per-layer formats

        known = {f.name for f in fields(cls)}
        info = cls(
            session_id=session_id,
            num_layers=num_layers,
            num_qo_heads=get("num_qo_heads", int),
            num_kv_heads=get("num_kv_heads", int),
            head_dim=get("head_dim", int),
            kv_format=kv_format,
            layer_formats=formats,
            max_tokens=get("max_tokens", int, optional=True),
            seed=get("seed", int, optional=True),
            lengths=get_list("lengths", int),
            bytes=get("bytes", int),
            sinks=get("sinks", int, optional=True) or 0,
            window=get("window", int, optional=True) or 0,
            extra={k: v for k, v in obj.items() if k not in known},
        )
        for name in ("lengths", "layer_formats"):
            if len(getattr(info, name)) != info.num_layers:
                raise InvalidResponse(
                    f"session info: expected {info.num_layers} {name} (one per layer), got {len(getattr(info, name))}"
                )
        return info
