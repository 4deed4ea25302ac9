#!/usr/bin/env python3
"""A small transformer-style decode loop whose every attention runs on attnserve.

The model (random weights, no training) keeps its KV cache on the server: each
layer's prompt chunk is one fused call (append the chunk's K/V and attend its
queries), and each decoded token is one fused call per layer. Every attention
output is checked against a float64 numpy reference computed from the very
same q, k and v.

    python examples/decode_loop.py --url http://127.0.0.1:8421
    python examples/decode_loop.py --kv-format turboquant   # prints the error only

``--kv-format`` takes any format the server lists in ``GET /v1/info`` ``kv_formats``.
A server with API keys takes the key from ``$ATTNSERVE_API_KEY``, as the client
reads it; there is no option for it: a command line is visible to every user of
the machine (``ps``).

Exit status: 0 on success; 1 when an f32 output is off by more than 1e-4
(max |out - ref| / max |ref| per call); 2 when the server cannot be used (or does
not offer the format).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from attnserve_client import AttnServeError, Client

F32_TOLERANCE = 1e-4


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start_pos: int) -> np.ndarray:
    """Causal GQA attention in float64.

    q: [n, H, D]; k, v: [L, KV, D] (the whole cache); row i sits at start_pos + i.
    Returns [n, H, D] float64.
    """
    group = q.shape[1] // k.shape[1]
    kk = np.repeat(k.astype(np.float64), group, axis=1)  # [L, H, D]
    vv = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("nhd,lhd->nhl", q.astype(np.float64), kk) / math.sqrt(q.shape[2])
    visible = np.arange(k.shape[0])[None, None, :] <= start_pos + np.arange(q.shape[0])[:, None, None]
    scores = np.where(visible, scores, -np.inf)
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("nhl,lhd->nhd", w / w.sum(axis=-1, keepdims=True), vv)


class TinyModel:
    """Random pre-norm transformer: token embedding, per layer attention + MLP, output head."""

    def __init__(self, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        d = heads * head_dim  # model width
        self.embed = rng.standard_normal((vocab, d)).astype(np.float32)

        def w(rows: int, cols: int) -> np.ndarray:
            return (rng.standard_normal((rows, cols)) / math.sqrt(rows)).astype(np.float32)

        self.layers = [
            {
                "wq": w(d, heads * head_dim),
                "wk": w(d, kv_heads * head_dim),
                "wv": w(d, kv_heads * head_dim),
                "wo": w(heads * head_dim, d),
                "w1": w(d, 2 * d),
                "w2": w(2 * d, d),
            }
            for _ in range(layers)
        ]
        self.unembed = w(d, vocab)

    def next_token(self, x: np.ndarray) -> int:
        """Greedy choice from the last row of x [n, d]."""
        return int(np.argmax(self.norm(x[-1]) @ self.unembed))

    @staticmethod
    def norm(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def qkv(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x: [n, d] -> q [n, H, D], k [n, KV, D], v [n, KV, D] (float32)."""
        p, h = self.layers[layer], self.norm(x)
        n = x.shape[0]
        return (
            (h @ p["wq"]).reshape(n, self.heads, self.head_dim),
            (h @ p["wk"]).reshape(n, self.kv_heads, self.head_dim),
            (h @ p["wv"]).reshape(n, self.kv_heads, self.head_dim),
        )

    def finish(self, layer: int, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """Residual attention output and MLP: x [n, d], attn [n, H, D] -> [n, d]."""
        p = self.layers[layer]
        x = x + attn.reshape(x.shape[0], -1) @ p["wo"]
        return x + np.maximum(self.norm(x) @ p["w1"], 0.0) @ p["w2"]


#: --help's last words: where the key comes from.
KEY_EPILOG = "A server with API keys: set ATTNSERVE_API_KEY (no option takes a key: a command line shows in ps)."

#: --kv-format's help: the server owns the list of formats.
KV_FORMAT_HELP = "a kv format the server offers (GET /v1/info kv_formats: f32, f16, bf16, turboquant, tq4, ...)"


def unoffered_kv_format(client, kv_format: str) -> str | None:
    """Why ``kv_format`` cannot be used (the server does not list it in
    ``GET /v1/info`` ``kv_formats``), or None."""
    offered = client.info()["kv_formats"]
    if kv_format in offered:
        return None
    return f"--kv-format {kv_format!r}: the server offers {', '.join(offered)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=KEY_EPILOG)
    ap.add_argument("--url", default=None, help="the server (default: $ATTNSERVE_BASE_URL, else http://127.0.0.1:8421)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=37, help="prompt length in tokens")
    ap.add_argument("--chunk", type=int, default=16, help="prefill chunk length")
    ap.add_argument("--steps", type=int, default=16, help="tokens to decode")
    ap.add_argument("--kv-format", default="f32", help=KV_FORMAT_HELP)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model = TinyModel(args.layers, args.heads, args.kv_heads, args.head_dim, args.vocab, args.seed)
    prompt = np.random.default_rng(args.seed + 1).integers(0, args.vocab, args.prompt)
    # The reference's own copy of each layer's cache: exactly the k, v sent.
    cache_k = [np.zeros((0, args.kv_heads, args.head_dim), np.float32) for _ in range(args.layers)]
    cache_v = [np.zeros((0, args.kv_heads, args.head_dim), np.float32) for _ in range(args.layers)]
    errors: list[float] = []

    def attend(session, layer: int, x: np.ndarray) -> np.ndarray:
        """Attention of layer for the rows x [n, d] that follow the cache; checked."""
        q, k, v = model.qkv(layer, x)
        start = cache_k[layer].shape[0]
        out = session.attend(layer, q, k=k, v=v)  # fused: append k, v, then attend
        cache_k[layer] = np.concatenate([cache_k[layer], k])
        cache_v[layer] = np.concatenate([cache_v[layer], v])
        ref = reference_attention(q, cache_k[layer], cache_v[layer], start)
        errors.append(float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30)))
        return out

    started = time.perf_counter()
    try:
        with Client(args.url) as client:  # the key from $ATTNSERVE_API_KEY (module docstring)
            if why := unoffered_kv_format(client, args.kv_format):
                print(f"error: {why}", file=sys.stderr)
                return 2
            session = client.create_session(
                num_qo_heads=args.heads,
                num_kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                num_layers=args.layers,
                kv_format=args.kv_format,
            )
            try:
                # Prefill, chunk by chunk, each chunk through every layer.
                for begin in range(0, args.prompt, args.chunk):
                    x = model.embed[prompt[begin : begin + args.chunk]]
                    for layer in range(args.layers):
                        x = model.finish(layer, x, attend(session, layer, x))
                prefill_calls = len(errors)
                # Decode greedily, one token at a time.
                tokens = []
                token = model.next_token(x)
                for _ in range(args.steps):
                    tokens.append(token)
                    x = model.embed[[token]]
                    for layer in range(args.layers):
                        x = model.finish(layer, x, attend(session, layer, x))
                    token = model.next_token(x)
                lengths = session.info().lengths
            finally:
                session.delete()
    except AttnServeError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - started

    expected = args.prompt + args.steps
    worst = max(errors, default=0.0)
    print(
        f"{args.kv_format}: {args.layers} layers, {args.heads} q heads / {args.kv_heads} kv heads,"
        f" head_dim {args.head_dim}"
    )
    print(
        f"prefill {args.prompt} tokens in {prefill_calls} calls, decoded {args.steps} tokens in"
        f" {len(errors) - prefill_calls} calls, {elapsed:.2f} s in all"
    )
    print(f"tokens: {tokens}")
    print(f"cache lengths {list(lengths)} (expected {expected} each)")
    print(f"max relative error vs float64 reference: {worst:.3g}")
    if any(n != expected for n in lengths):
        print("FAIL: a layer's cache length is wrong", file=sys.stderr)
        return 1
    if args.kv_format == "f32" and worst > F32_TOLERANCE:
        print(f"FAIL: error above {F32_TOLERANCE:g}", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
