"""The kv formats: their names, the head dims they take and the words a timestep
takes in each (the one owner of these facts; ``pool.PageLayout`` lays the words
out, the kernels read them).

* ``f32``: plain float32 rows ``[Hkv * d]``.
* ``f16``: plain IEEE half rows ``[Hkv * d]`` (two to a 32-bit word, element 2j in
  the low half): half the bytes of f32, the rounding of float16 on every value.
* ``bf16``: plain bfloat16 rows ``[Hkv * d]``, laid out as ``f16``'s (numpy's
  little-endian bfloat16, ``wire.BFLOAT16``): the dtype engines run in, so a
  bfloat16 row is kept bit for bit (a float32 one rounded to nearest even, as
  ``wire.to_bfloat16``, torch and the GPU's ``convert.wgsl`` round); half the bytes
  of f32, float32's range.
* ``turboquant``: per head, 2-bit PolarQuant codes + 1-bit QJL signs + two
  float16 norms for a key, 2-bit codes + a float16 norm for a value
  (``docs/turboquant.md``, ``shaders/tqx.wgsl``): ``TqSpec(2, True, 2)``, served by
  the same kernels as the variants.
* the TurboQuant variants (``TQ_VARIANTS``: ``tq4``, ``tq3``, ``tq4v2``, ``tq4v3``,
  ``tq3q``, ``tq4q``, and those with outlier channels below): per head, b-bit
  Lloyd-Max codes of the rotated key (with or without a 1-bit QJL residual sign per
  coordinate) and of the rotated value, b in {2, 3, 4}, each with a float16 norm word (``docs/turboquant.md``,
  ``shaders/tqx.wgsl``). A name says the key's bits per coordinate (QJL bit
  included, ``q`` when one of them is QJL) and, where they differ, the value's.
  ``tq4o`` (4.25 bits per element) keeps each vector's largest channels as float16
  (8 of a key, 2 of a value) and codes the rest (keys 2 bits, values 4); ``tq3o``
  (3.5 bits) keeps a key's 8 and codes values with 3 bits; ``tq2o`` (2.5 bits)
  keeps a key's 3 and codes keys and values with 2 bits.

What to choose is said here once too: :data:`DEFAULT_KV_FORMAT` (``f32``, exact), what
a session gets when it names no format, and :data:`RECOMMENDED`, the recommended
compressed setting (``tq4v3`` with 4 exact sinks and a window of 128). The docs name
them (``tests/test_docs_recommendation.py`` checks that they agree) and the kernel
warm-up compiles both by default (``config.Settings.warmup``, ``warmup.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "KV_FORMATS",
    "DEFAULT_KV_FORMAT",
    "CompressedSetting",
    "RECOMMENDED",
    "TqSpec",
    "TQ_SPECS",
    "TQ_VARIANTS",
    "is_tq_variant",
    "PLAIN_DTYPES",
    "PLAIN_ELEMENT_BYTES",
    "HALF_FORMATS",
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
    "catalog",
]


@dataclass(frozen=True)
class TqSpec:
    """The bit budget of a TurboQuant format, per rotated coordinate."""

    key_bits: int  # Lloyd-Max bits of a key coordinate (2, 3 or 4)
    qjl: bool  # plus one QJL sign bit of the key's residual
    value_bits: int  # Lloyd-Max bits of a value coordinate (2, 3 or 4)
    # per-vector outlier channels (no QJL): a vector's n largest-|x| channels kept as
    # float16 with their index, the rest of it coded (docs/turboquant.md)
    key_outliers: int = 0
    value_outliers: int = 0


def outlier_region(n: int) -> tuple[int, int]:
    """(words of halves, words of channels) of a slot's outlier region of ``n`` outliers:
    the float16 halves of outliers 1 .. n-1, two to a word, the lower first (outlier 0
    shares the norm word), then the 8-bit channel indices, four to a word."""
    return (-(-(n - 1) // 2), -(-n // 4)) if n else (0, 0)


def outlier_words(n: int) -> int:
    """Words of a slot's outlier region (:func:`outlier_region`)."""
    return sum(outlier_region(n))


#: The TurboQuant variants (kernels ``shaders/tqx.wgsl`` and ``flash_attention_tqx*.wgsl``,
#: as for ``turboquant``).
TQ_VARIANTS: dict[str, TqSpec] = {
    "tq4": TqSpec(4, False, 4),  # 4.25 bits per element at d = 128
    "tq3": TqSpec(3, False, 3),  # 3.25
    "tq4v2": TqSpec(4, False, 2),  # 3.25 (keys 4 bits, values 2: vLLM-like)
    "tq4v3": TqSpec(4, False, 3),  # 3.75
    "tq3q": TqSpec(2, True, 3),  # 3.25 (keys 2 bits + QJL)
    "tq4q": TqSpec(3, True, 4),  # 4.25 (keys 3 bits + QJL)
    "tq4o": TqSpec(2, False, 4, 8, 2),  # 4.25 (keys 2 bits + 8 outliers, values 4 bits + 2)
    "tq3o": TqSpec(2, False, 3, 8, 0),  # 3.5 (keys 2 bits + 8 outliers, values 3 bits)
    "tq2o": TqSpec(2, False, 2, 3, 0),  # 2.5 (keys 2 bits + 3 outliers, values 2 bits)
}
#: Every compressed format's bit budget (one tqx kernel family each): ``turboquant``
#: is (2, QJL, 2), its layout the variants' at b = 2.
TQ_SPECS: dict[str, TqSpec] = {"turboquant": TqSpec(2, True, 2), **TQ_VARIANTS}

KV_FORMATS = ("f32", "f16", "bf16", "turboquant", *TQ_VARIANTS)
#: The kv format of a session that names none: exact.
DEFAULT_KV_FORMAT = "f32"


@dataclass(frozen=True)
class CompressedSetting:
    """A compressed kv format with exact rows beside its codes: a session's
    ``kv_format``, ``sinks`` and ``window`` (docs/api.md, "Exact sinks and a recent
    window")."""

    kv_format: str
    sinks: int
    window: int

    def fields(self) -> dict[str, Any]:
        """The create request's fields (and ``Client.create_session``'s keywords)."""
        return {"kv_format": self.kv_format, "sinks": self.sinks, "window": self.window}

    def bits_per_element(self, head_dim: int, timesteps: int) -> float:
        """Average cache bits per K or V element at ``timesteps``: the format's, plus
        the exact rows' (float32)."""
        return bits_per_element(self.kv_format, head_dim) + 32 * (self.sinks + self.window) / timesteps

    def __str__(self) -> str:
        return f"{self.kv_format} with sinks {self.sinks} and window {self.window}"


#: The recommended compressed setting (docs/fidelity.md, "Current figures", its
#: headline row: 3.88 bits per element at 32k timesteps and head_dim 128, top-1
#: 0.9771, KL 0.0019 nats, perplexity +0.037 on SmolLM2-135M through transformers;
#: bench/results/h200-generate-fidelity-69f159b.json; ``tq4`` with the same sinks and
#: window is a little closer at half a bit more). ``tq4`` alone is the closest
#: compressed format without exact rows; there is no default compressed format.
RECOMMENDED = CompressedSetting("tq4v3", sinks=4, window=128)
#: The element type of each plain (uncompressed) format, as numpy names it
#: (little-endian; bfloat16 is ``wire.BFLOAT16``, two bytes numpy has no arithmetic
#: for): the rows are stored as numpy rounds them to it (bfloat16: as
#: ``wire.to_bfloat16`` rounds).
PLAIN_DTYPES = {"f32": "<f4", "f16": "<f2", "bf16": "|V2"}
#: Bytes of one element of each plain format.
PLAIN_ELEMENT_BYTES = {fmt: int(dtype[2:]) for fmt, dtype in PLAIN_DTYPES.items()}
#: The plain formats of two bytes an element (two to a 32-bit word: an even head_dim).
HALF_FORMATS = tuple(fmt for fmt, size in PLAIN_ELEMENT_BYTES.items() if size == 2)
TQ_HEAD_DIMS = (32, 64, 128)
F16_MAX = 65504.0  # the largest finite float16
#: The smallest magnitude a float32 value rounds to infinity from in bfloat16 (to
#: nearest even): 2^128 - 2^119, the midpoint past the largest bfloat16 (2^128 - 2^120),
#: a tie that rounds up to the even infinity. Finite float32 values from here on are refused.
BF16_INF_FROM = float(2.0**128 - 2.0**119)


def is_plain(kv_format: str) -> bool:
    return kv_format in PLAIN_ELEMENT_BYTES


def is_tq_variant(kv_format: str) -> bool:
    return kv_format in TQ_VARIANTS


def head_dims(kv_format: str) -> list[int]:
    """The head dims a layer of ``kv_format`` takes."""
    if kv_format == "f32":
        return list(range(1, 129))
    if kv_format in HALF_FORMATS:
        return list(range(2, 129, 2))  # whole 32-bit words per row
    if kv_format in TQ_SPECS:
        return list(TQ_HEAD_DIMS)
    raise ValueError(f"unknown kv_format {kv_format!r}; expected one of {KV_FORMATS}")


def check_head_dim(kv_format: str, head_dim: int) -> None:
    dims = head_dims(kv_format)
    if head_dim not in dims:
        if kv_format in TQ_SPECS:
            raise ValueError(f"{kv_format} supports head_dim 32, 64 or 128, got {head_dim}")
        if kv_format in HALF_FORMATS:
            raise ValueError(f"{kv_format} supports an even head_dim 2..128, got {head_dim}")
        raise ValueError(f"{kv_format} supports head_dim 1..128, got {head_dim}")


def slot_heads(kv_format: str, n_kv_heads: int) -> int:
    """Slots a timestep takes: one row of every head (plain) or one slot per head (TurboQuant)."""
    return 1 if is_plain(kv_format) else n_kv_heads


def key_words(kv_format: str, n_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """32-bit words of each region of a key slot: a plain row is one region of
    ``Hkv * d`` elements; a TurboQuant key is codes (``b * d / 32`` words), the QJL
    signs (``d / 32``, where the format has them) and the norms word."""
    if is_plain(kv_format):
        return (n_kv_heads * head_dim * PLAIN_ELEMENT_BYTES[kv_format] // 4,)
    spec = TQ_SPECS[kv_format]
    codes = spec.key_bits * head_dim // 32
    if spec.qjl:
        return (codes, head_dim // 32, 1)
    return (codes, 1, outlier_words(spec.key_outliers)) if spec.key_outliers else (codes, 1)


def value_words(kv_format: str, n_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """32-bit words of each region of a value slot (as :func:`key_words`)."""
    if is_plain(kv_format):
        return key_words(kv_format, n_kv_heads, head_dim)
    spec = TQ_SPECS[kv_format]
    codes = spec.value_bits * head_dim // 32
    return (codes, 1, outlier_words(spec.value_outliers)) if spec.value_outliers else (codes, 1)


def norm_region(kv_format: str, keys: bool) -> int:
    """Which region of a TurboQuant key (or value) slot is its norm word."""
    regions = key_words(kv_format, 1, 32) if keys else value_words(kv_format, 1, 32)
    spec = TQ_SPECS[kv_format]
    return len(regions) - (2 if (spec.key_outliers if keys else spec.value_outliers) else 1)


def bytes_per_token(kv_format: str, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one timestep of one layer occupies in the cache (keys + values)."""
    check_head_dim(kv_format, head_dim)
    words = sum(key_words(kv_format, num_kv_heads, head_dim)) + sum(value_words(kv_format, num_kv_heads, head_dim))
    return slot_heads(kv_format, num_kv_heads) * words * 4


def bits_per_element(kv_format: str, head_dim: int) -> float:
    """Cache bits per K or V element (keys and values averaged)."""
    return 8 * bytes_per_token(kv_format, 1, head_dim) / (2 * head_dim)


def catalog() -> dict[str, Any]:
    """What ``GET /v1/info`` says of the kv formats: their names, the head dims each
    takes and their sizes (:func:`sizes`)."""
    return {
        "kv_formats": list(KV_FORMATS),
        "head_dims": {fmt: head_dims(fmt) for fmt in KV_FORMATS},
        "kv_format_sizes": {fmt: sizes(fmt) for fmt in KV_FORMATS},
    }


def sizes(kv_format: str) -> list[dict[str, int | float]]:
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
