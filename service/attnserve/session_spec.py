"""What a session is made of, as a client asks for it: the checked fields of a
create request (also a snapshot's configuration), and their limits."""

from __future__ import annotations

from dataclasses import dataclass

from .codec import Fields
from .errors import InvalidRequest
from .kvcache import KV_FORMATS, check_head_dim

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
    kv_format: str
    max_tokens: int | None
    seed: int | None


def parse_create(doc: object) -> CreateRequest:
    f = Fields(doc, CREATE_FIELDS, "session")
    kv_format = f.str("kv_format", "f32", choices=KV_FORMATS)
    num_layers = f.int("num_layers", 1, lo=1, hi=MAX_LAYERS)
    num_qo_heads = f.int("num_qo_heads", lo=1, hi=MAX_QO_HEADS)
    num_kv_heads = f.int("num_kv_heads", lo=1, hi=MAX_QO_HEADS)
    if num_qo_heads % num_kv_heads:
        raise InvalidRequest(
            f"num_kv_heads: expected a divisor of num_qo_heads {num_qo_heads} (GQA), got {num_kv_heads}"
        )
    head_dim = f.int("head_dim")
    try:
        check_head_dim(kv_format, head_dim)
    except ValueError as e:
        raise InvalidRequest(f"head_dim: {e}") from None
    max_tokens = f.int("max_tokens", None, lo=1)
    seed = f.int("seed", None, lo=0, hi=MAX_SEED)
    return CreateRequest(num_layers, num_qo_heads, num_kv_heads, head_dim, kv_format, max_tokens, seed)
