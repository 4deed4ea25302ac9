"""Session-level TurboQuant state: rotation signs, the Lloyd-Max codebook, constants.

Everything here is host-side and deterministic across machines:

* ``layer_signs(seed, layer, d)`` draws the two +-1 vectors (polar, JL) of one
  layer from splitmix64, a fixed integer recurrence (no numpy Generator, whose
  streams may change between numpy releases), so a seed gives the same signs on
  every host and snapshots stay loadable anywhere.
* ``CODEBOOK[d]`` is the 4-level Lloyd-Max quantizer for one coordinate of a
  randomly rotated unit vector in dimension d (density proportional to
  ``(1 - x^2)^((d-3)/2)`` on [-1, 1]), stored as float32 values that the kernels
  and the float64 oracle share bit for bit. ``lloyd_max_codebook(d)`` recomputes
  it in float64 (a test checks the table against it).
* ``codebook(d, bits)`` is the ``2**bits``-level quantizer (bits 2, 3, 4) of the
  same coordinate, for the TurboQuant variants (``formats.TQ_VARIANTS``); the
  2-bit one is ``CODEBOOK[d]``. ``lloyd_max_codebook(d, levels=...)`` recomputes any.
* ``qjl_scale(d)`` is the QJL constant for the ORTHONORMAL rotation
  ``rht(x, s) = H (s * x) / sqrt(d)``: sqrt(pi/2) / sqrt(d) (docs/turboquant.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .formats import TQ_HEAD_DIMS

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "CODEBOOK",
    "Codebook",
    "codebook",
    "lloyd_max_codebook",
    "layer_signs",
    "layer_signs_bytes",
    "session_signs",
    "qjl_scale",
    "splitmix64",
]

SUPPORTED_HEAD_DIMS = TQ_HEAD_DIMS

# float32 centroids c0 < c1 < c2 < c3 (exact float32 values, written as hex).
_CODEBOOK_HEX = {
    32: ("-0x1.0da39ap-2", "-0x1.46de64p-4", "0x1.46de64p-4", "0x1.0da39ap-2"),
    64: ("-0x1.7ffe5ap-3", "-0x1.cef846p-5", "0x1.cef846p-5", "0x1.7ffe5ap-3"),
    128: ("-0x1.107812p-3", "-0x1.479c74p-5", "0x1.479c74p-5", "0x1.107812p-3"),
}


# The positive halves (c_{L/2} < ... < c_{L-1}) of the 3- and 4-bit quantizers,
# exact float32 values as hex; the negative half mirrors them.
_CODEBOOK_POS_HEX = {
    (3, 32): ("0x1.5f0a24p-5", "0x1.0dd624p-3", "0x1.dc144ap-3", "0x1.770f06p-2"),
    (3, 64): ("0x1.f335p-6", "0x1.805642p-4", "0x1.544fd0p-3", "0x1.0e3f74p-2"),
    (3, 128): ("0x1.61f70cp-6", "0x1.10bc12p-4", "0x1.e3e686p-4", "0x1.81d662p-3"),
    (4, 32): ("0x1.6dd7d8p-6", "0x1.142b66p-4", "0x1.d284a2p-4", "0x1.4da8bap-3",
              "0x1.bac1d4p-3", "0x1.1b33b0p-2", "0x1.66529ep-2", "0x1.d04f7cp-2"),
    (4, 64): ("0x1.04d138p-6", "0x1.89f396p-5", "0x1.4d0d92p-4", "0x1.dd2136p-4",
              "0x1.3d4998p-3", "0x1.9741e4p-3", "0x1.02fbd0p-2", "0x1.52bc44p-2"),
    (4, 128): ("0x1.725c36p-7", "0x1.17c508p-5", "0x1.d9454ap-5", "0x1.5343eep-4",
               "0x1.c3bdbcp-4", "0x1.226ac4p-3", "0x1.725a20p-3", "0x1.e6bc4ap-3"),
}  # fmt: skip


@dataclass(frozen=True)
class Codebook:
    """The quantizer of one head_dim (4 levels, or ``2**bits``), as float32 values (held as float64)."""

    head_dim: int
    centroids: tuple[float, ...]
    boundaries: tuple[float, ...]

    @property
    def bits(self) -> int:
        return len(self.centroids).bit_length() - 1

    def centroids_f32(self) -> np.ndarray:
        return np.asarray(self.centroids, dtype=np.float32)

    def boundaries_f32(self) -> np.ndarray:
        return np.asarray(self.boundaries, dtype=np.float32)


def _make_codebook(d: int, bits: int = 2) -> Codebook:
    hexes: tuple[str, ...]
    if bits == 2:
        hexes = _CODEBOOK_HEX[d]
    else:
        pos = _CODEBOOK_POS_HEX[(bits, d)]
        hexes = tuple("-" + h for h in reversed(pos)) + pos
    c = tuple(float(np.float32(float.fromhex(h))) for h in hexes)
    # b_i = (c_i + c_{i+1}) / 2, rounded once to float32: the GPU and the oracle
    # compare against exactly these thresholds.
    b = tuple(float(np.float32((c[i] + c[i + 1]) / 2.0)) for i in range(len(c) - 1))
    return Codebook(d, c, b)


CODEBOOK: dict[int, Codebook] = {d: _make_codebook(d) for d in SUPPORTED_HEAD_DIMS}


_CODEBOOKS: dict[tuple[int, int], Codebook] = {
    (bits, d): _make_codebook(d, bits) for bits in (3, 4) for d in SUPPORTED_HEAD_DIMS
}


def codebook(head_dim: int, bits: int = 2) -> Codebook:
    """The ``2**bits``-level quantizer of ``head_dim`` (bits 2, 3 or 4)."""
    try:
        return CODEBOOK[head_dim] if bits == 2 else _CODEBOOKS[(bits, head_dim)]
    except KeyError:
        raise ValueError(
            f"turboquant supports head_dim in {SUPPORTED_HEAD_DIMS} and 2, 3 or 4 bits, got {head_dim}, {bits}"
        ) from None


def lloyd_max_codebook(d: int, iters: int = 200, levels: int = 4) -> np.ndarray:
    """Recompute the ``levels``-level Lloyd-Max centroids in float64 on the exact
    density (more levels converge more slowly: give them a few thousand iterations)."""
    gx, gw = np.polynomial.legendre.leggauss(200)

    def integ(f: Callable[[np.ndarray], np.ndarray], a: float, b: float) -> float:
        x = (b - a) / 2 * gx + (a + b) / 2
        return float((b - a) / 2 * np.sum(gw * f(x)))

    def dens(x: np.ndarray) -> np.ndarray:
        density: np.ndarray = (1.0 - x * x) ** ((d - 3) / 2)
        return density

    if levels == 4:
        c = np.array([-1.5104, -0.4528, 0.4528, 1.5104]) / math.sqrt(d)  # Gaussian start
    else:  # the Gaussian's quantiles
        from statistics import NormalDist

        c = np.array([NormalDist().inv_cdf((i + 0.5) / levels) for i in range(levels)]) / math.sqrt(d)
    for _ in range(iters):
        b = np.concatenate([[-1.0], (c[:-1] + c[1:]) / 2, [1.0]])
        c = np.array(
            [integ(lambda x: x * dens(x), b[i], b[i + 1]) / integ(dens, b[i], b[i + 1]) for i in range(levels)]
        )
    return (c - c[::-1]) / 2  # exactly symmetric


_MASK64 = (1 << 64) - 1


def splitmix64(state: int, n: int) -> list[int]:
    """n outputs of splitmix64 started from ``state`` (a fixed, portable recurrence)."""
    out = []
    s = state & _MASK64
    for _ in range(n):
        s = (s + 0x9E3779B97F4A7C15) & _MASK64
        z = s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


@lru_cache(maxsize=4096)
def _layer_signs_cached(seed: int, layer: int, d: int) -> bytes:
    # One stream per (seed, layer): mix the layer into the start state so that
    # neighbouring layers do not share a shifted stream.
    start = splitmix64((seed & _MASK64) ^ ((layer + 1) * 0xD1B54A32D192ED03 & _MASK64), 1)[0]
    words = splitmix64(start, (2 * d + 63) // 64)
    bits = [(words[j // 64] >> (j % 64)) & 1 for j in range(2 * d)]
    return np.where(np.array(bits, dtype=np.uint8) == 1, 1.0, -1.0).astype(np.float32).tobytes()


def layer_signs(seed: int, layer: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(polar_signs, jl_signs) of one layer: float32 arrays of +-1.0, length d each."""
    s = np.frombuffer(_layer_signs_cached(int(seed), int(layer), int(d)), dtype=np.float32)
    return s[:d].copy(), s[d:].copy()


def layer_signs_bytes(seed: int, layer: int, d: int) -> bytes:
    """One layer's signs as the kernels read them (uploaded with each batch): ``2 * d``
    float32 values, polar then JL."""
    return _layer_signs_cached(int(seed), int(layer), int(d))


def session_signs(seed: int, num_layers: int, d: int) -> np.ndarray:
    """All layers' signs in the kernels' layout: layer l at ``l * 2 * d``, polar then JL."""
    return np.concatenate([np.concatenate(layer_signs(seed, l, d)) for l in range(num_layers)])


def qjl_scale(d: int) -> float:
    """Unbiased QJL constant for the orthonormal ``q_jl = rht(q_rot, jl_signs)``."""
    return math.sqrt(math.pi / 2.0) / math.sqrt(d)


#: The largest row norm turboquant stores: norms are kept as float16.
MAX_NORM = 65504.0


def largest_norm(rows: np.ndarray) -> tuple[float, tuple[int, int]]:
    """The largest L2 norm of ``rows [n, heads, d]`` (float32 arithmetic: rows under
    :data:`MAX_NORM` cannot overflow it, and an overflow is inf, which is refused too)
    and its ``(row, head)``."""
    norms = np.sqrt(np.einsum("nhd,nhd->nh", rows, rows))
    i, h = np.unravel_index(int(norms.argmax()), norms.shape)
    return float(norms[i, h]), (int(i), int(h))


#: The bound :func:`outlier_bound` puts on a stored outlier may be at most this:
#: outliers are kept as float16.
MAX_OUTLIER = MAX_NORM
#: Slack on :func:`outlier_bound` for what the encoder rounds: the float16 norm of the
#: rest (relative 2^-11) and the float32 sums and butterfly (under 2^-16 at d <= 128).
OUTLIER_SLACK = 1.0 + 2.0**-10


def outlier_bound(rows: np.ndarray, n: int, bits: int) -> np.ndarray:
    """An upper bound ``[rows, heads]`` of the magnitude of every outlier a format that
    keeps ``n`` outlier channels and codes the rest with ``bits`` stores for ``rows
    [rows, heads, d]``. A stored outlier is ``(x[ch] - rest_hat[ch]) * s[ch]`` with
    ``rest_hat = rht_inv(c[idx] * f16(norm_rest))`` (docs/turboquant.md), and

        |rest_hat[ch]| = f16(norm_rest) |sum_i H[ch][i] c[idx_i]| / sqrt(d)
                       <= f16(norm_rest) * d * max|c| / sqrt(d),

    so ``|stored| <= (max|x| + sqrt(d) * max|c| * norm_rest) * OUTLIER_SLACK``, with
    ``norm_rest`` the norm of the row without its n largest-|x| channels (the same
    whichever of equal channels the encoder takes)."""
    x = np.asarray(rows, np.float64)
    d = x.shape[-1]
    sq = x * x
    rest = np.sqrt(np.partition(sq, d - n, axis=-1)[..., : d - n].sum(axis=-1))
    bound: np.ndarray = (np.abs(x).max(axis=-1) + outlier_rest_factor(d, bits) * rest) * OUTLIER_SLACK
    return bound


def outlier_rest_factor(d: int, bits: int) -> float:
    """``sqrt(d) * max|c|`` of the ``bits`` codebook: the most the codes of a rest of norm 1
    reconstruct at one channel (:func:`outlier_bound`)."""
    return math.sqrt(d) * float(np.abs(codebook(d, bits).centroids_f32()).max())


def largest_outlier_bound(rows: np.ndarray, n: int, bits: int) -> tuple[float, tuple[int, int]]:
    """The largest :func:`outlier_bound` of ``rows [n, heads, d]`` and its ``(row, head)``."""
    bound = outlier_bound(rows, n, bits)
    i, h = np.unravel_index(int(bound.argmax()), bound.shape)
    return float(bound[i, h]), (int(i), int(h))
