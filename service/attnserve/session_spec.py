"""What a session is made of, as a client asks for it: the checked fields of a
create request (also a snapshot's configuration); their model and limits are
:class:`attnserve.contract.CreateSession`'s."""

from __future__ import annotations

from dataclasses import dataclass

from .contract import CreateSession, Fields
from .errors import InvalidRequest
from .formats import KV_FORMATS, TQ_SPECS, check_head_dim
from .kv.config import layer_formats

__all__ = ["CreateRequest", "parse_create"]


@dataclass(frozen=True)
class CreateRequest:
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    kv_format: str | tuple[str, ...]  # one for every layer, or one per layer
    max_tokens: int | None
    seed: int | None
    sinks: int = 0  # the compressed layers' exact first timesteps
    window: int = 0  # ... and exact recent ones

    @property
    def layer_formats(self) -> tuple[str, ...]:
        return layer_formats(self.kv_format, self.num_layers)


def _kv_format(f: Fields, num_layers: int) -> str | tuple[str, ...]:
    """``kv_format``: one format for every layer, or an array of one per layer."""
    value = f.doc.get("kv_format")
    if not isinstance(value, list):
        single: str = f.str("kv_format")
        return single
    if len(value) != num_layers:
        raise InvalidRequest(
            f"kv_format: expected one format for every layer or an array of {num_layers} (one per layer), "
            f"got an array of {len(value)}"
        )
    for i, fmt in enumerate(value):
        if fmt not in KV_FORMATS:
            raise InvalidRequest(f"kv_format[{i}]: expected one of {', '.join(map(repr, KV_FORMATS))}, got {fmt!r:.40}")
    return tuple(value)


def _exact_layers(f: Fields, num_layers: int, kv_format: str | tuple[str, ...]) -> str | tuple[str, ...]:
    """``exact_layers`` (layer indexes, negative ones counted from the last layer) in
    ``exact_format``: the per-layer formats they make, or ``kv_format`` unchanged."""
    exact_format = f.str("exact_format")
    given = f.list("exact_layers")
    if given is None:
        if f.doc.get("exact_format") is not None:
            raise InvalidRequest("exact_format: applies to exact_layers, which is not given")
        return kv_format
    chosen = set()
    for i, value in enumerate(given):
        if type(value) is not int or not -num_layers <= value < num_layers:
            raise InvalidRequest(
                f"exact_layers[{i}]: expected a layer index in {-num_layers}..{num_layers - 1} "
                f"(negative: from the last layer), got {value!r:.40}"
            )
        chosen.add(value % num_layers)
    formats = layer_formats(kv_format, num_layers)
    return tuple(exact_format if i in chosen else fmt for i, fmt in enumerate(formats))


def parse_create(doc: object) -> CreateRequest:
    f = Fields(doc, CreateSession, "session")
    num_layers = f.int("num_layers")
    kv_format = _exact_layers(f, num_layers, _kv_format(f, num_layers))
    num_qo_heads = f.int("num_qo_heads")
    num_kv_heads = f.int("num_kv_heads")
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
    max_tokens = f.int("max_tokens")
    seed = f.int("seed")
    sinks = f.int("sinks")
    window = f.int("window")
    if (sinks or window) and not any(fmt in TQ_SPECS for fmt in layer_formats(kv_format, num_layers)):
        raise InvalidRequest(
            "sinks, window: they keep rows exact beside a compressed layer's codes, and every layer of this "
            f"session is exact already (kv_format {kv_format if isinstance(kv_format, str) else list(kv_format)})"
        )
    return CreateRequest(
        num_layers, num_qo_heads, num_kv_heads, head_dim, kv_format, max_tokens, seed, sinks, window
    )  # fmt: skip
