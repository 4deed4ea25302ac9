"""Float64 numpy oracles for every numeric path the kernels take.

Shapes (row-major, like the wire format):

* queries ``q``: ``[n, num_qo_heads, head_dim]``
* keys / values ``k``, ``v``: ``[length, num_kv_heads, head_dim]``

Head ``h`` reads KV head ``h // (num_qo_heads // num_kv_heads)`` (GQA). Query row
``i`` sits at position ``start_pos + i``; causal rows attend to ``0..pos``
inclusive, non-causal rows to all ``length`` timesteps.

The TuroQuant oracles follow ``docs/turboquant.md`` step by step in float64,
using the same float32 codebook and boundaries and the same +-1 signs as the
kernels, and produce the packed cache words in the kernels' layout, so tests can
compare the GPU cache with them word by word. Intermediate values (the rotated
coordinates and the JL projections) are returned too: where the GPU's float32
arithmetic lands on the other side of a decision boundary, a test can prove the
oracle value was within rounding of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnserve.formats import TqSpec, outlier_region, outlier_words
from attnserve.turboquant import Codebook, codebook, qjl_scale

__all__ = [
    "attention",
    "hadamard",
    "rht",
    "rht_inv",
    "f16_bits",
    "f16_value",
    "EncodedKeys",
    "EncodedValues",
    "encode_keys",
    "encode_values",
    "residual_bits",
    "pack_key_cache",
    "pack_value_cache",
    "unpack_key_cache",
    "unpack_value_cache",
    "rotate_q",
    "tq_scores",
    "softmax_rows",
    "lse_rows",
    "pack_codes",
    "unpack_codes",
    "tqx_codebooks",
    "tqx_encode",
    "pack_tqx_key_cache",
    "pack_tqx_value_cache",
    "unpack_tqx_key_cache",
    "unpack_tqx_value_cache",
    "tqx_scores",
    "tqx_attention",
    "Outliers",
    "select_outliers",
    "outlier_values",
    "unpack_tqx_outliers",
    "tqx_decoded_rows",
    "exact_from",
    "windowed_attention",
]

NORM_EPS = 1e-12


# ── exact attention ─────────────────────────────────────────────────────────


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    start_pos: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
) -> Any:
    """Exact softmax attention in float64: ``[n, H, d]`` from ``k``/``v`` ``[L, Hkv, d]``;
    with ``return_lse``, ``(out, lse [n, H])`` (:func:`lse_rows`)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    n, h, d = q.shape
    length, hkv, _ = k.shape
    start_pos, scale = _defaults(n, d, length, start_pos, scale)
    group = h // hkv
    kh = np.repeat(k, group, axis=1)  # [L, H, d]
    vh = np.repeat(v, group, axis=1)
    s = np.einsum("nhd,lhd->hnl", q, kh) * scale  # [H, n, L]
    p = softmax_rows(s, start_pos, causal)
    return _answer(np.einsum("hnl,lhd->nhd", p, vh), s, start_pos, causal, return_lse)


def _defaults(n: int, d: int, length: int, start_pos: int | None, scale: float | None) -> tuple[int, float]:
    """An attend's ``start_pos`` (default: its ``n`` rows are the last of ``length``)
    and ``scale`` (default ``1 / sqrt(d)``)."""
    return (length - n if start_pos is None else start_pos), (1.0 / math.sqrt(d) if scale is None else scale)


def _masked(s: np.ndarray, start_pos: int, causal: bool) -> np.ndarray:
    """Scaled scores ``[H, n, L]`` whose query row ``i`` sits at ``start_pos + i``,
    the keys past it ``-inf`` when ``causal``."""
    if causal:
        n, length = s.shape[-2:]
        mask = np.arange(length)[None, :] > (start_pos + np.arange(n))[:, None]  # [n, L]
        s = np.where(mask[None], -np.inf, s)
    return s


def softmax_rows(s: np.ndarray, start_pos: int, causal: bool) -> np.ndarray:
    """Softmax over the last axis of scaled scores ``[H, n, L]`` whose query row ``i``
    sits at ``start_pos + i``; ``causal`` masks the keys past it."""
    s = _masked(s, start_pos, causal)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True)


def lse_rows(s: np.ndarray, start_pos: int, causal: bool) -> np.ndarray:
    """The log-sum-exp (natural log) of scaled scores ``[H, n, L]`` over the keys
    :func:`softmax_rows` weighs, as ``[n, H]`` (an attend's ``lse``)."""
    s = _masked(s, start_pos, causal)
    top = s.max(axis=-1, keepdims=True)
    return (top[..., 0] + np.log(np.exp(s - top).sum(axis=-1))).T


def _answer(out: np.ndarray, s: np.ndarray, start_pos: int, causal: bool, return_lse: bool):
    """``out``, or ``(out, lse)`` with ``return_lse`` (``lse`` of the scaled scores ``s``)."""
    return (out, lse_rows(s, start_pos, causal)) if return_lse else out


# ── randomized Hadamard transform ───────────────────────────────────────────


def hadamard(d: int) -> np.ndarray:
    """Unnormalized Walsh-Hadamard matrix (Sylvester order, entries +-1)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard needs a power of two, got {d}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def rht(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``H (s * x) / sqrt(d)`` along the last axis (orthonormal)."""
    d = x.shape[-1]
    return (np.asarray(x, np.float64) * s) @ hadamard(d).T / math.sqrt(d)


def rht_inv(y: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Inverse of :func:`rht`: ``s * (H y) / sqrt(d)``."""
    d = y.shape[-1]
    return s * (np.asarray(y, np.float64) @ hadamard(d).T) / math.sqrt(d)


# ── f16 norm words (pack2x16float) ──────────────────────────────────────────


def f16_bits(x: np.ndarray) -> np.ndarray:
    """Round float64 values to IEEE half (nearest-even) and return the 16-bit patterns."""
    return np.asarray(x, np.float64).astype(np.float16).view(np.uint16).astype(np.uint32)


def f16_value(bits: np.ndarray) -> np.ndarray:
    """The float64 value of 16-bit half patterns."""
    return np.asarray(bits, np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)


# ── TurboQuant encode ───────────────────────────────────────────────────────


def _quantize(y: np.ndarray, cb: Codebook) -> np.ndarray:
    b = np.asarray(cb.boundaries, np.float64)
    return (y[..., None] >= b).sum(axis=-1).astype(np.uint32)


@dataclass
class EncodedValues:
    """Per-vector codes of ``[..., d]`` inputs (leading axes kept)."""

    norm: np.ndarray  # [...] float64
    y: np.ndarray  # [..., d] rotated unit vector (float64)
    idx: np.ndarray  # [..., d] uint32 in 0..3 (0 for zero vectors)
    live: np.ndarray  # [...] bool: norm >= 1e-12


@dataclass
class EncodedKeys(EncodedValues):
    residual_norm: np.ndarray  # [...] float64 (unit-key space)
    z: np.ndarray  # [..., d] rht(r / ||r||, jl_signs) (float64)
    bits: np.ndarray  # [..., d] uint32 JL sign bits


def encode_values(x: np.ndarray, polar_signs: np.ndarray, cb: Codebook) -> EncodedValues:
    """Steps 1-2 of the encoding: norm, rotation and 2-bit indices."""
    x = np.asarray(x, np.float64)
    norm = np.sqrt((x * x).sum(axis=-1))
    live = norm >= NORM_EPS
    safe = np.where(live, norm, 1.0)[..., None]
    y = np.where(live[..., None], rht(x / safe, polar_signs), 0.0)
    idx = np.where(live[..., None], _quantize(y, cb), 0).astype(np.uint32)
    return EncodedValues(norm=np.where(live, norm, 0.0), y=y, idx=idx, live=live)


def residual_bits(
    y: np.ndarray, idx: np.ndarray, live: np.ndarray, jl_signs: np.ndarray, cb: Codebook
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps 3-4 from given indices: (residual_norm, z, bits).

    Split out so a test can replay them with the GPU's indices where a float32
    rotation fell on the other side of a boundary.
    """
    c = np.asarray(cb.centroids, np.float64)
    r = np.where(live[..., None], y - c[idx], 0.0)
    rn = np.sqrt((r * r).sum(axis=-1))
    rlive = live & (rn >= NORM_EPS)
    safe = np.where(rlive, rn, 1.0)[..., None]
    z = np.where(rlive[..., None], rht(r / safe, jl_signs), 0.0)
    bits = (rlive[..., None] & (z >= 0.0)).astype(np.uint32)
    return np.where(live, rn, 0.0), z, bits


def encode_keys(k: np.ndarray, polar_signs: np.ndarray, jl_signs: np.ndarray, cb: Codebook) -> EncodedKeys:
    """All four steps for keys ``[..., d]``."""
    ev = encode_values(k, polar_signs, cb)
    rn, z, bits = residual_bits(ev.y, ev.idx, ev.live, jl_signs, cb)
    return EncodedKeys(norm=ev.norm, y=ev.y, idx=ev.idx, live=ev.live, residual_norm=rn, z=z, bits=bits)


def _pack_polar(idx: np.ndarray) -> np.ndarray:
    """[..., d] 2-bit indices -> [..., d/16] u32 words, element j at bits 2j..2j+1."""
    d = idx.shape[-1]
    g = idx.reshape(*idx.shape[:-1], d // 16, 16).astype(np.uint64)
    return (g << (2 * np.arange(16, dtype=np.uint64))).sum(axis=-1).astype(np.uint32)


def _pack_bits(bits: np.ndarray) -> np.ndarray:
    """[..., d] bits -> [..., d/32] u32 words, element j at bit j."""
    d = bits.shape[-1]
    g = bits.reshape(*bits.shape[:-1], d // 32, 32).astype(np.uint64)
    return (g << np.arange(32, dtype=np.uint64)).sum(axis=-1).astype(np.uint32)


def _unpack_polar(words: np.ndarray, d: int) -> np.ndarray:
    w = np.asarray(words, np.uint32)[..., None]
    return ((w >> (2 * np.arange(16, dtype=np.uint32))) & 3).reshape(*words.shape[:-1], d)


def _unpack_bits(words: np.ndarray, d: int) -> np.ndarray:
    w = np.asarray(words, np.uint32)[..., None]
    return ((w >> np.arange(32, dtype=np.uint32)) & 1).reshape(*words.shape[:-1], d)


def _to_slots(a: np.ndarray, cap: int) -> np.ndarray:
    """[L, Hkv, ...] per-timestep data -> [Hkv * cap, ...] slot order (zeros past L)."""
    length, hkv = a.shape[:2]
    out = np.zeros((hkv, cap) + a.shape[2:], a.dtype)
    out[:, :length] = np.swapaxes(a, 0, 1)
    return out.reshape((hkv * cap,) + a.shape[2:])


def pack_key_cache(enc: EncodedKeys, cap: int) -> np.ndarray:
    """Key cache words ``[polar | jl | norms]`` for keys encoded from ``[L, Hkv, d]``."""
    polar = np.where(enc.live[..., None], _pack_polar(enc.idx), 0)
    jl = _pack_bits(enc.bits)
    nw = f16_bits(enc.norm) | (f16_bits(enc.residual_norm) << 16)
    nw = np.where(enc.live, nw, 0).astype(np.uint32)
    return np.concatenate(
        [_to_slots(polar, cap).ravel(), _to_slots(jl, cap).ravel(), _to_slots(nw, cap).ravel()]
    ).astype(np.uint32)


def pack_value_cache(enc: EncodedValues, cap: int) -> np.ndarray:
    """Value cache words ``[polar | norms]`` for values encoded from ``[L, Hkv, d]``."""
    polar = np.where(enc.live[..., None], _pack_polar(enc.idx), 0)
    nw = np.where(enc.live, f16_bits(enc.norm), 0).astype(np.uint32)
    return np.concatenate([_to_slots(polar, cap).ravel(), _to_slots(nw, cap).ravel()]).astype(np.uint32)


def unpack_key_cache(words: np.ndarray, *, n_kv_heads: int, cap: int, d: int, length: int):
    """Inverse of :func:`pack_key_cache` for timesteps ``< length``.

    Returns ``(idx [L, Hkv, d], bits [L, Hkv, d], norm [L, Hkv], residual_norm [L, Hkv])``
    with the norms decoded from their f16 halves.
    """
    vecs = n_kv_heads * cap
    pw, jw = d // 16, d // 32
    w = np.asarray(words, np.uint32)
    polar = w[: vecs * pw].reshape(n_kv_heads, cap, pw)[:, :length]
    jl = w[vecs * pw : vecs * (pw + jw)].reshape(n_kv_heads, cap, jw)[:, :length]
    nw = w[vecs * (pw + jw) : vecs * (pw + jw + 1)].reshape(n_kv_heads, cap)[:, :length]
    idx = np.swapaxes(_unpack_polar(polar, d), 0, 1)
    bits = np.swapaxes(_unpack_bits(jl, d), 0, 1)
    norm = f16_value(nw & 0xFFFF).T
    rn = f16_value(nw >> 16).T
    return idx, bits, norm, rn


def unpack_value_cache(words: np.ndarray, *, n_kv_heads: int, cap: int, d: int, length: int):
    """Inverse of :func:`pack_value_cache`: ``(idx [L, Hkv, d], norm [L, Hkv])``."""
    vecs = n_kv_heads * cap
    pw = d // 16
    w = np.asarray(words, np.uint32)
    polar = w[: vecs * pw].reshape(n_kv_heads, cap, pw)[:, :length]
    nw = w[vecs * pw : vecs * (pw + 1)].reshape(n_kv_heads, cap)[:, :length]
    return np.swapaxes(_unpack_polar(polar, d), 0, 1), f16_value(nw & 0xFFFF).T


# ── TurboQuant queries, scores and attention ────────────────────────────────


def rotate_q(q: np.ndarray, polar_signs: np.ndarray, jl_signs: np.ndarray):
    """``(q_rot, q_jl, sums)`` for queries ``[..., d]`` (``tq_rotate_q``)."""
    q_rot = rht(q, polar_signs)
    q_jl = rht(q_rot, jl_signs)
    return q_rot, q_jl, q_jl.sum(axis=-1)


def tq_scores(q_rot, q_jl, idx, bits, norm, residual_norm, cb: Codebook, *, polar_only=False):
    """Estimated ``<q, k>`` for rotated queries ``[n, H, d]`` and key codes ``[L, Hkv, d]``.

    Returns ``[H, n, L]`` float64 (unscaled). ``polar_only`` drops the QJL term
    (PolarQuant alone), for comparing the two estimators.
    """
    d = q_rot.shape[-1]
    group = q_rot.shape[1] // idx.shape[1]
    c = np.asarray(cb.centroids, np.float64)
    kc = np.repeat(c[idx], group, axis=1)  # [L, H, d]
    polar = np.einsum("nhd,lhd->hnl", q_rot, kc)
    est = polar
    if not polar_only:
        sign = np.repeat(2.0 * bits.astype(np.float64) - 1.0, group, axis=1)
        signed = np.einsum("nhd,lhd->hnl", q_jl, sign)
        rn = np.repeat(residual_norm, group, axis=1).T[:, None, :]  # [H, 1, L]
        est = polar + rn * qjl_scale(d) * signed
    return est * np.repeat(norm, group, axis=1).T[:, None, :]


# ── the TurboQuant variants (formats.TQ_SPECS: b-bit codes, QJL optional) ────
#
# Codes of b bits per coordinate, per slot ``b * d / 32`` words: first the low two
# bits of every code as 2-bit fields (``d / 16`` words, element j at bits
# 2(j % 16) of word j / 16: the ``turboquant`` polar layout), then one bit plane
# per higher bit p = 2 .. b-1 (``d / 32`` words each, bit p of element j at bit
# j % 32 of word j / 32). Regions as ``turboquant``'s: keys
# ``[codes | jl (QJL only) | norms]``, values ``[codes | norms]``; a norm word is
# ``pack2x16float(norm, residual_norm)`` (keys with QJL) or ``(norm, 0)``.


def pack_codes(idx: np.ndarray, bits: int) -> np.ndarray:
    """[..., d] b-bit codes -> [..., b * d / 32] words (low 2-bit fields, then planes)."""
    idx = np.asarray(idx, np.uint32)
    parts = [_pack_polar(idx & 3)] + [_pack_bits((idx >> p) & 1) for p in range(2, bits)]
    return np.concatenate(parts, axis=-1).astype(np.uint32)


def unpack_codes(words: np.ndarray, d: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`."""
    w = np.asarray(words, np.uint32)
    lw, pw = d // 16, d // 32
    idx = _unpack_polar(w[..., :lw], d)
    for p in range(2, bits):
        o = lw + (p - 2) * pw
        idx = idx | (_unpack_bits(w[..., o : o + pw], d) << p)
    return idx


def tqx_codebooks(spec: TqSpec, d: int) -> tuple[Codebook, Codebook]:
    """(key codebook, value codebook) of a format."""
    return codebook(d, spec.key_bits), codebook(d, spec.value_bits)


@dataclass
class Outliers:
    """A vector's outlier channels (formats with ``key_outliers`` / ``value_outliers``)."""

    ch: np.ndarray  # [..., n] uint32 channels, largest |x| first (ties: the lower channel)
    half: np.ndarray  # [..., n] uint32 float16 bits of `value`
    # [..., n] float64: (x[ch] - the codes' reconstruction at ch) * polar_signs[ch]
    value: np.ndarray | None = None


def select_outliers(x: np.ndarray, n: int, polar_signs: np.ndarray) -> tuple[np.ndarray, Outliers]:
    """(the rest of ``x`` with its ``n`` largest-|x| channels zeroed, those channels,
    their values still uncorrected: :func:`correct_outliers` gives them)."""
    x = np.asarray(x, np.float64)
    ch = np.argsort(-np.abs(x), axis=-1, kind="stable")[..., :n]
    rest = x.copy()
    np.put_along_axis(rest, ch, 0.0, axis=-1)
    vals = np.take_along_axis(x, ch, axis=-1) * np.asarray(polar_signs, np.float64)[ch]
    return rest, Outliers(ch.astype(np.uint32), f16_bits(vals), vals)


def rest_signed(idx: np.ndarray, norm_bits: np.ndarray, cb: Codebook) -> np.ndarray:
    """What a vector's codes reconstruct, times the polar signs: ``H (c[idx] * norm) / sqrt(d)``
    with the stored (float16) norm, in float64."""
    d = idx.shape[-1]
    y = np.asarray(cb.centroids, np.float64)[idx] * f16_value(norm_bits)[..., None]
    return y @ hadamard(d).T / math.sqrt(d)


def correct_outliers(o: Outliers, x: np.ndarray, polar_signs, idx, norm_bits, cb: Codebook) -> Outliers:
    """The stored outlier values: ``(x[ch] - the codes' reconstruction at ch) * s[ch]``,
    so that codes plus outliers give x[ch] exactly (up to float16) at the outlier channels."""
    x = np.asarray(x, np.float64)
    s = np.asarray(polar_signs, np.float64)
    ch = o.ch.astype(np.int64)
    val = np.take_along_axis(x, ch, -1) * s[ch] - np.take_along_axis(rest_signed(idx, norm_bits, cb), ch, -1)
    return Outliers(o.ch, f16_bits(val), val)


def outlier_values(o: Outliers, polar_signs: np.ndarray, d: int) -> np.ndarray:
    """The outliers as a dense ``[..., d]`` array in the original basis (zeros elsewhere)."""
    out = np.zeros(o.ch.shape[:-1] + (d,))
    vals = f16_value(o.half) * np.asarray(polar_signs, np.float64)[o.ch]
    np.put_along_axis(out, o.ch.astype(np.int64), vals, axis=-1)
    return out


def tqx_encode(k: np.ndarray, v: np.ndarray, spec: TqSpec, polar_signs: np.ndarray, jl_signs: np.ndarray):
    """(keys, values) encoded as ``spec`` says: keys with QJL are :class:`EncodedKeys`;
    with outlier channels the codes are of the rest and ``.outliers`` holds them."""
    d = k.shape[-1]
    kcb, vcb = tqx_codebooks(spec, d)
    k0, v0 = k, v
    ko = vo = None
    if spec.key_outliers:
        k, ko = select_outliers(k, spec.key_outliers, polar_signs)
    if spec.value_outliers:
        v, vo = select_outliers(v, spec.value_outliers, polar_signs)
    ek = encode_keys(k, polar_signs, jl_signs, kcb) if spec.qjl else encode_values(k, polar_signs, kcb)
    ev = encode_values(v, polar_signs, vcb)
    if ko is not None:
        ko = correct_outliers(ko, k0, polar_signs, _live_idx(ek), _norm_bits(ek), kcb)
    if vo is not None:
        vo = correct_outliers(vo, v0, polar_signs, _live_idx(ev), _norm_bits(ev), vcb)
    ek.outliers, ev.outliers = ko, vo  # type: ignore[attr-defined]
    return ek, ev


def _live_idx(enc: EncodedValues) -> np.ndarray:
    return np.where(enc.live[..., None], enc.idx, 0).astype(np.uint32)


def _norm_bits(enc: EncodedValues) -> np.ndarray:
    return np.where(enc.live, f16_bits(enc.norm), 0).astype(np.uint32)


def _pack_outliers(enc: EncodedValues, cap: int, nw: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(norm words with outlier 0 in the upper half, [the outlier region in slot order])."""
    o = getattr(enc, "outliers", None)
    if o is None:
        return nw, []
    n = o.ch.shape[-1]
    nw = nw | (o.half[..., 0] << 16)
    hwn, cwn = outlier_region(n)
    halves = np.zeros(o.ch.shape[:-1] + (2 * hwn,), np.uint32)
    halves[..., : n - 1] = o.half[..., 1:]
    hw = halves[..., 0::2] | (halves[..., 1::2] << 16)
    chs = np.zeros(o.ch.shape[:-1] + (4 * cwn,), np.uint32)
    chs[..., :n] = o.ch
    iw = chs[..., 0::4] | (chs[..., 1::4] << 8) | (chs[..., 2::4] << 16) | (chs[..., 3::4] << 24)
    return nw.astype(np.uint32), [_to_slots(np.concatenate([hw, iw], axis=-1).astype(np.uint32), cap).ravel()]


def _unpack_outliers(region: np.ndarray, nw: np.ndarray, n: int) -> Outliers:
    """Inverse of :func:`_pack_outliers` from ``[..., words]`` and the norm words."""
    hwn, _ = outlier_region(n)
    hw, iw = region[..., :hwn], region[..., hwn:]
    halves = np.stack([hw & 0xFFFF, hw >> 16], axis=-1).reshape(*hw.shape[:-1], 2 * hwn)[..., : n - 1]
    half = np.concatenate([(nw >> 16)[..., None], halves], axis=-1)
    ch = np.stack([(iw >> (8 * b)) & 0xFF for b in range(4)], axis=-1).reshape(*iw.shape[:-1], -1)[..., :n]
    return Outliers(ch.astype(np.uint32), half.astype(np.uint32))


def pack_tqx_key_cache(enc: EncodedValues, cap: int, spec: TqSpec) -> np.ndarray:
    """Key cache words ``[codes | jl (QJL) | norms]`` of keys encoded from ``[L, Hkv, d]``."""
    codes = np.where(enc.live[..., None], pack_codes(enc.idx, spec.key_bits), 0)
    parts = [_to_slots(codes, cap).ravel()]
    nw = f16_bits(enc.norm)
    if spec.qjl:
        parts.append(_to_slots(_pack_bits(enc.bits), cap).ravel())
        nw = nw | (f16_bits(enc.residual_norm) << 16)
    nw, extra = _pack_outliers(enc, cap, np.where(enc.live, nw, 0).astype(np.uint32))
    parts.append(_to_slots(nw, cap).ravel())
    return np.concatenate(parts + extra).astype(np.uint32)


def pack_tqx_value_cache(enc: EncodedValues, cap: int, spec: TqSpec) -> np.ndarray:
    """Value cache words ``[codes | norms]``."""
    codes = np.where(enc.live[..., None], pack_codes(enc.idx, spec.value_bits), 0)
    nw, extra = _pack_outliers(enc, cap, np.where(enc.live, f16_bits(enc.norm), 0).astype(np.uint32))
    return np.concatenate([_to_slots(codes, cap).ravel(), _to_slots(nw, cap).ravel()] + extra).astype(np.uint32)


def unpack_tqx_key_cache(words: np.ndarray, spec: TqSpec, *, n_kv_heads: int, cap: int, d: int, length: int):
    """``(idx, bits, norm, residual_norm)`` of timesteps ``< length`` (bits and the
    residual norm all zero without QJL)."""
    vecs = n_kv_heads * cap
    cw, jw = spec.key_bits * d // 32, (d // 32 if spec.qjl else 0)
    w = np.asarray(words, np.uint32)
    codes = w[: vecs * cw].reshape(n_kv_heads, cap, cw)[:, :length]
    idx = np.swapaxes(unpack_codes(codes, d, spec.key_bits), 0, 1)
    if spec.qjl:
        jl = w[vecs * cw : vecs * (cw + jw)].reshape(n_kv_heads, cap, jw)[:, :length]
        bits = np.swapaxes(_unpack_bits(jl, d), 0, 1)
    else:
        bits = np.zeros_like(idx)
    nw = w[vecs * (cw + jw) : vecs * (cw + jw + 1)].reshape(n_kv_heads, cap)[:, :length]
    if spec.key_outliers:  # the upper half is outlier 0: no residual norm
        return idx, bits, f16_value(nw & 0xFFFF).T, np.zeros(nw.T.shape)
    return idx, bits, f16_value(nw & 0xFFFF).T, f16_value(nw >> 16).T


def unpack_tqx_outliers(words: np.ndarray, spec: TqSpec, keys: bool, *, n_kv_heads: int, cap: int, d: int, length: int):
    """The outliers ``[L, Hkv, n]`` of a key (or value) cache of a format that has them, else None."""
    n = spec.key_outliers if keys else spec.value_outliers
    if not n:
        return None
    vecs = n_kv_heads * cap
    cw = (spec.key_bits if keys else spec.value_bits) * d // 32
    w = np.asarray(words, np.uint32)
    nw = w[vecs * cw : vecs * (cw + 1)].reshape(n_kv_heads, cap)[:, :length]
    ow = outlier_words(n)
    region = w[vecs * (cw + 1) : vecs * (cw + 1 + ow)].reshape(n_kv_heads, cap, ow)[:, :length]
    o = _unpack_outliers(region, nw, n)
    return Outliers(np.swapaxes(o.ch, 0, 1), np.swapaxes(o.half, 0, 1))


def unpack_tqx_value_cache(words: np.ndarray, spec: TqSpec, *, n_kv_heads: int, cap: int, d: int, length: int):
    """``(idx [L, Hkv, d], norm [L, Hkv])``."""
    vecs = n_kv_heads * cap
    cw = spec.value_bits * d // 32
    w = np.asarray(words, np.uint32)
    codes = w[: vecs * cw].reshape(n_kv_heads, cap, cw)[:, :length]
    nw = w[vecs * cw : vecs * (cw + 1)].reshape(n_kv_heads, cap)[:, :length]
    return np.swapaxes(unpack_codes(codes, d, spec.value_bits), 0, 1), f16_value(nw & 0xFFFF).T


def tqx_scores(q_rot, q_jl, idx, bits, norm, residual_norm, spec: TqSpec) -> np.ndarray:
    """Estimated ``<q, k>`` ``[H, n, L]`` (unscaled): the QJL term only where ``spec`` has it."""
    kcb = codebook(q_rot.shape[-1], spec.key_bits)
    return tq_scores(q_rot, q_jl, idx, bits, norm, residual_norm, kcb, polar_only=not spec.qjl)


def tqx_attention(
    q: np.ndarray,
    key_words: np.ndarray,
    value_words: np.ndarray,
    spec: TqSpec,
    *,
    n_kv_heads: int,
    cap: int,
    length: int,
    polar_signs: np.ndarray,
    jl_signs: np.ndarray,
    start_pos: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
) -> Any:
    """Attention computed from a variant's packed words, in float64 (``flash_attention_tqx``);
    with ``return_lse``, ``(out, lse)`` of the estimated scores."""
    q = np.asarray(q, np.float64)
    n, h, d = q.shape
    start_pos, scale = _defaults(n, d, length, start_pos, scale)
    dims = dict(n_kv_heads=n_kv_heads, cap=cap, d=d, length=length)
    idx, bits, norm, rn = unpack_tqx_key_cache(key_words, spec, **dims)
    vidx, vnorm = unpack_tqx_value_cache(value_words, spec, **dims)
    q_rot, q_jl, _ = rotate_q(q, polar_signs, jl_signs)
    s = tqx_scores(q_rot, q_jl, idx, bits, norm, rn, spec)  # [H, n, L]
    group = h // n_kv_heads
    ko = unpack_tqx_outliers(key_words, spec, True, **dims)
    if ko is not None:  # the outlier channels' exact part of <q, k>
        s = s + np.einsum("nhd,lhd->hnl", q, np.repeat(outlier_values(ko, polar_signs, d), group, axis=1))
    s = s * scale
    p = softmax_rows(s, start_pos, causal)
    c = np.asarray(codebook(d, spec.value_bits).centroids, np.float64)
    vrot = np.repeat(c[vidx] * vnorm[..., None], group, axis=1)
    out = rht_inv(np.einsum("hnl,lhd->nhd", p, vrot), polar_signs)
    vo = unpack_tqx_outliers(value_words, spec, False, **dims)
    if vo is not None:
        out = out + np.einsum("hnl,lhd->nhd", p, np.repeat(outlier_values(vo, polar_signs, d), group, axis=1))
    return _answer(out, s, start_pos, causal, return_lse)


# ── exact sinks and recent window over a compressed cache (issue 27) ─────────


def tqx_decoded_rows(
    key_words: np.ndarray,
    value_words: np.ndarray,
    spec: TqSpec,
    *,
    n_kv_heads: int,
    cap: int,
    d: int,
    length: int,
    polar_signs: np.ndarray,
    jl_signs: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values ``[L, Hkv, d]`` (float64) that a variant's packed words
    stand for: ``q . k_hat`` is :func:`tqx_attention`'s score estimate of ``<q, k>``
    (codes, QJL term and outliers) and ``p @ v_hat`` its output, for every ``q`` and
    ``p``: both estimators are linear, so ``attention(q, k_hat, v_hat)`` is
    :func:`tqx_attention` up to float64 rounding (a test checks it). The rotations
    move onto the rows: ``rht(q, s) . a = q . rht_inv(a, s)``."""
    ps = np.asarray(polar_signs, np.float64)
    dims = dict(n_kv_heads=n_kv_heads, cap=cap, d=d, length=length)
    idx, bits, norm, rn = unpack_tqx_key_cache(key_words, spec, **dims)
    kc = np.asarray(codebook(d, spec.key_bits).centroids, np.float64)[idx]
    if spec.qjl:
        signed = rht_inv(2.0 * bits.astype(np.float64) - 1.0, np.asarray(jl_signs, np.float64))
        kc = kc + rn[..., None] * qjl_scale(d) * signed
    k_hat = rht_inv(kc * norm[..., None], ps)
    ko = unpack_tqx_outliers(key_words, spec, True, **dims)
    if ko is not None:
        k_hat = k_hat + outlier_values(ko, ps, d)
    vidx, vnorm = unpack_tqx_value_cache(value_words, spec, **dims)
    vc = np.asarray(codebook(d, spec.value_bits).centroids, np.float64)[vidx]
    v_hat = rht_inv(vc * vnorm[..., None], ps)
    vo = unpack_tqx_outliers(value_words, spec, False, **dims)
    if vo is not None:
        v_hat = v_hat + outlier_values(vo, ps, d)
    return k_hat, v_hat


#: :func:`exact_from` of a layer without a window: no timestep past the sinks is exact.
NO_WINDOW = 2**62


def exact_from(start_pos: int, sinks: int, window: int, held_from: int = 0) -> int:
    """The first timestep past the sinks that an attend whose first query row sits at
    ``start_pos`` reads exactly: its window reaches ``window`` rows back from that row
    (so every row of the attend's own chunk is exact too), but not before the rows the
    layer still holds exactly (``held_from``: rows older than a window are dropped as
    the session grows) nor into the sinks. Timesteps in ``[sinks, exact_from)`` are
    read from the codes. One value per attend, for all its query rows (as
    Hugging Face's quantized cache reads a prefill's own rows exactly)."""
    return max(sinks, start_pos + 1 - window, held_from) if window else NO_WINDOW


def windowed_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    k_hat: np.ndarray,
    v_hat: np.ndarray,
    *,
    sinks: int,
    exact_from: int,
    start_pos: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
) -> Any:
    """Attention in float64 that reads timesteps ``t < sinks`` and ``t >= exact_from``
    from ``k, v`` (the exact rows, as stored: float16 or float32) and the others from
    ``k_hat, v_hat`` (:func:`tqx_decoded_rows` of the compressed cache), under one
    softmax. ``[n, H, d]`` from rows ``[L, Hkv, d]``; with ``return_lse``, ``(out, lse)``."""
    q = np.asarray(q, np.float64)
    n, h, d = q.shape
    length, hkv, _ = k.shape
    start_pos, scale = _defaults(n, d, length, start_pos, scale)
    group = h // hkv

    def heads(a: np.ndarray) -> np.ndarray:  # [L, Hkv, d] -> [H, L, d]
        return np.repeat(np.asarray(a, np.float64), group, axis=1).transpose(1, 0, 2)

    # every row from the codes, then the exact rows put in (only those are computed twice)
    cols = np.r_[0 : min(sinks, length), max(exact_from, sinks) : length]
    qh = q.transpose(1, 0, 2)  # [H, n, d]
    kh, vh = heads(k_hat), heads(v_hat)
    s = qh @ kh.transpose(0, 2, 1)  # [H, n, L]
    s[:, :, cols] = qh @ heads(k[cols]).transpose(0, 2, 1)
    s = s * scale
    p = softmax_rows(s, start_pos, causal)
    out = p @ vh + p[:, :, cols] @ (heads(v[cols]) - vh[:, cols])
    return _answer(out.transpose(1, 0, 2), s, start_pos, causal, return_lse)
