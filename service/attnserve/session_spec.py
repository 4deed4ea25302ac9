"""What a session is made of, as a client asks for it: the checked fields of a
create request (also a snapshot's configuration), and their limits."""

from __future__ import annotations

from dataclasses import dataclass

from .codec import Fields
from .errors import InvalidRequest
from .formats import KV_FORMATS, check_head_dim
from .kvcache import layer_formats

__all__ = ["MAX_LAYERS", "MAX_QO_HEADS", "MAX_SEED", "CREATE_FIELDS", "CreateRequest", "parse_create"]

MAX_LAYERS = 256
MAX_QO_HEADS = 256
MAX_SEED = (1 << 64) - 1
CREATE_FIELDS = ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "kv_format", "max_tokens", "seed")


@dataclass(frozen=True)
class CreateRequest:
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    kv_format: str | tuple[str, ...]  # one for every layer, or one per layer
    max_tokens: int | None
    seed: int | None

    @property
    def layer_formats(self) -> tuple[str, ...]:
        return layer_formats(self.kv_format, self.num_layers)


def _kv_format(f: Fields, num_layers: int) -> str | tuple[str, ...]:
    """``kv_format``: one format for every layer, or an array of one per layer."""
    value = f.doc.get("kv_format")
    if not isinstance(value, list):
        return f.str("kv_format", "f32", choices=KV_FORMATS)
    if len(value) != num_layers:
        raise InvalidRequest(
            f"kv_format: expected one format for every layer or an array of {num_layers} (one per layer), "
            f"got an array of {len(value)}"
        )
    for i, fmt in enumerate(value):
        if fmt not in KV_FORMATS:
            raise InvalidRequest(f"kv_format[{i}]: expected one of {', '.join(map(repr, KV_FORMATS))}, got {fmt!r:.40}")
    return tuple(value)


def parse_create(doc: object) -> CreateRequest:
    f = Fields(doc, CREATE_FIELDS, "session")
    num_layers = f.int("num_layers", 1, lo=1, hi=MAX_LAYERS)
    kv_format = _kv_format(f, num_layers)
    num_qo_heads = f.int("num_qo_heads", lo=1, hi=MAX_QO_HEADS)
    num_kv_heads = f.int("num_kv_heads", lo=1, hi=MAX_QO_HEADS)
    if num_qo_heads % num_kv_heads:
        raise InvalidRequest(
            f"num_kv_heads: expected a divisor of num_qo_heads {num_qo_heads} (GQA), got {num_kv_heads}"
        )
    head_dim = f.int("head_dim")
    for fmt in dict.fromkeys(layer_formats(kv_format, num_layers)):
        try:
            check_head_dim(fmt, head_dim)
        except ValueError as e:
            raise InvalidRequest(f"head_dim: {e}") from None
    max_tokens = f.int("max_tokens", None, lo=1)
    seed = f.int("seed", None, lo=0, hi=MAX_SEED)
    return CreateRequest(num_layers, num_qo_heads, num_kv_heads, head_dim, kv_format, max_tokens, seed)
