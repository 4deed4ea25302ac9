"""The kv formats: their names, the head dims they take and the words a timestep
takes in each (the one owner of these facts; ``pool.PageLayout`` lays the words
out, the kernels read them).

* ``f32``: plain float32 rows ``[Hkv * d]``.
* ``f16``: plain IEEE half rows ``[Hkv * d]`` (two to a 32-bit word, element 2j in
  the low half): half the bytes of f32, the rounding of float16 on every value.
* ``turboquant``: per head, 2-bit PolarQuant codes + 1-bit QJL signs + two
  float16 norms for a key, 2-bit codes + a float16 norm for a value
  (``docs/turboquant.md``, ``shaders/turboquant.wgsl``).
"""

from __future__ import annotations

__all__ = [
    "KV_FORMATS",
    "PLAIN_DTYPES",
    "PLAIN_ELEMENT_BYTES",
    "F16_MAX",
    "is_plain",
    "head_dims",
    "check_head_dim",
    "key_words",
    "value_words",
    "slot_heads",
    "bytes_per_token",
    "bits_per_element",
    "sizes",
]

KV_FORMATS = ("f32", "f16", "turboquant")
#: The element type of each plain (uncompressed) format, as numpy names it
#: (little-endian): the rows are stored as numpy rounds them to it.
PLAIN_DTYPES = {"f32": "<f4", "f16": "<f2"}
#: Bytes of one element of each plain format.
PLAIN_ELEMENT_BYTES = {fmt: int(dtype[2:]) for fmt, dtype in PLAIN_DTYPES.items()}
TQ_HEAD_DIMS = (32, 64, 128)
F16_MAX = 65504.0  # the largest finite float16


def is_plain(kv_format: str) -> bool:
    return kv_format in PLAIN_ELEMENT_BYTES


def head_dims(kv_format: str) -> list[int]:
    """The head dims a layer of ``kv_format`` takes."""
    if kv_format == "f32":
        return list(range(1, 129))
    if kv_format == "f16":
        return list(range(2, 129, 2))  # whole 32-bit words per row
    if kv_format == "turboquant":
        return list(TQ_HEAD_DIMS)
    raise ValueError(f"unknown kv_format {kv_format!r}; expected one of {KV_FORMATS}")


def check_head_dim(kv_format: str, head_dim: int) -> None:
    dims = head_dims(kv_format)
    if head_dim not in dims:
        if kv_format == "turboquant":
            raise ValueError(f"turboquant supports head_dim 32, 64 or 128, got {head_dim}")
        if kv_format == "f16":
            raise ValueError(f"f16 supports an even head_dim 2..128, got {head_dim}")
        raise ValueError(f"{kv_format} supports head_dim 1..128, got {head_dim}")


def slot_heads(kv_format: str, n_kv_heads: int) -> int:
    """Slots a timestep takes: one row of every head (plain) or one slot per head (TurboQuant)."""
    return 1 if is_plain(kv_format) else n_kv_heads


def key_words(kv_format: str, n_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """32-bit words of each region of a key slot: a plain row is one region of
    ``Hkv * d`` elements; a TurboQuant key is codes, signs and the norms word."""
    if is_plain(kv_format):
        return (n_kv_heads * head_dim * PLAIN_ELEMENT_BYTES[kv_format] // 4,)
    return (head_dim // 16, head_dim // 32, 1)


def value_words(kv_format: str, n_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """32-bit words of each region of a value slot (as :func:`key_words`)."""
    if is_plain(kv_format):
        return key_words(kv_format, n_kv_heads, head_dim)
    return (head_dim // 16, 1)


def bytes_per_token(kv_format: str, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one timestep of one layer occupies in the cache (keys + values)."""
    check_head_dim(kv_format, head_dim)
    words = sum(key_words(kv_format, num_kv_heads, head_dim)) + sum(value_words(kv_format, num_kv_heads, head_dim))
    return slot_heads(kv_format, num_kv_heads) * words * 4


def bits_per_element(kv_format: str, head_dim: int) -> float:
    """Cache bits per K or V element (keys and values averaged)."""
    return 8 * bytes_per_token(kv_format, 1, head_dim) / (2 * head_dim)


def sizes(kv_format: str) -> list[dict]:
    """What ``/v1/info`` says of a format's size: at head_dim 32, 64 and 128 (those
    it takes), its bits per element and bytes per token and KV head (one layer)."""
    dims = head_dims(kv_format)
    return [
        {
            "head_dim": d,
            "bits_per_element": bits_per_element(kv_format, d),
            "bytes_per_token_per_kv_head": bytes_per_token(kv_format, 1, d),
        }
        for d in TQ_HEAD_DIMS
        if d in dims
    ]
