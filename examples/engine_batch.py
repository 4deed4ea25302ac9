#!/usr/bin/env python3
"""An engine-shaped loop: a batch of sequences run through a model layer by layer,
every layer's attention for all sequences in ONE batched step on attnserve.

Each sequence has a session; prompts of different lengths are prefilled with one
batched step per layer (one item per sequence, its whole prompt), then every
decoded token is one batched step per layer with the arrays stacked
(``attend_stacked``: q ``[B, H, d]``) over the streaming connection
(``client.stream()``), exactly as an inference engine would call it. The model is a
tiny random transformer (no training): layer l's queries, keys and values come
from the output of layer l-1, so the layers must run in order. Every attention
output is checked against a float64 numpy reference of the same q, k and v.

    python examples/engine_batch.py --url http://127.0.0.1:8421 --sequences 8 --layers 4
    python examples/engine_batch.py --transport http        # batched steps over plain HTTP
    python examples/engine_batch.py --open-step             # decode through an open step

``--open-step`` decodes through a step opened over the batch (``open_step``,
``docs/client.md`` "Steps"): each layer call carries only q, k, v, and the server
keeps the append positions (no offsets), with the same answers.

``--kv-format`` takes any format the server lists in ``GET /v1/info`` ``kv_formats``.
A server with API keys takes the key from ``$ATTNSERVE_API_KEY``, as the client
reads it; there is no option for it: a command line is visible to every user of
the machine (``ps``).

Exit status: 0 on success; 1 when an f32 output is off by more than 1e-4
(max |out - ref| / max |ref| per item); 2 when the server cannot be used (or does
not offer the format).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from pathlib import Path

import numpy as np

from attnserve_client import AttendItem, AttnServeError, Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import KEY_EPILOG, KV_FORMAT_HELP, reference_attention, unoffered_kv_format  # noqa: E402  (one copy each)

F32_TOLERANCE = 1e-4


class TinyModel:
    """Per layer: q, k, v projections of the hidden state, attention, an output
    projection added back (pre-norm, no MLP: attention is what is served)."""

    def __init__(self, layers: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.width = d = heads * head_dim

        def w(rows: int, cols: int) -> np.ndarray:
            return (rng.standard_normal((rows, cols)) / math.sqrt(rows)).astype(np.float32)

        self.layers = [(w(d, d), w(d, kv_heads * head_dim), w(d, kv_heads * head_dim), w(d, d)) for _ in range(layers)]

    def qkv(self, layer: int, x: np.ndarray):
        wq, wk, wv, _ = self.layers[layer]
        h = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6)
        n = x.shape[0]
        return (
            (h @ wq).reshape(n, self.heads, self.head_dim),
            (h @ wk).reshape(n, self.kv_heads, self.head_dim),
            (h @ wv).reshape(n, self.kv_heads, self.head_dim),
        )

    def residual(self, layer: int, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        return (x + attn.reshape(x.shape[0], -1) @ self.layers[layer][3]).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=KEY_EPILOG)
    ap.add_argument("--url", default=None, help="the server (default: $ATTNSERVE_BASE_URL, else http://127.0.0.1:8421)")
    ap.add_argument("--sequences", type=int, default=8, help="sequences in the batch")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=24, help="longest prompt; sequence i has prompt - 3 * i rows (>= 1)")
    ap.add_argument("--steps", type=int, default=8, help="tokens to decode")
    ap.add_argument("--kv-format", default="f32", help=KV_FORMAT_HELP)
    ap.add_argument("--transport", choices=["stream", "http"], default="stream")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--open-step", action="store_true", help="decode through a step open over the batch")
    args = ap.parse_args(argv)
    model = TinyModel(args.layers, args.heads, args.kv_heads, args.head_dim, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompts = [max(1, args.prompt - 3 * i) for i in range(args.sequences)]
    # the reference's copy of every cache: [sequence][layer] -> (k, v)
    ref_k = [[np.zeros((0, args.kv_heads, args.head_dim), np.float32)] * args.layers for _ in prompts]
    ref_v = [[np.zeros((0, args.kv_heads, args.head_dim), np.float32)] * args.layers for _ in prompts]
    errors: list[float] = []

    def run_layer(via, layer: int, xs: list[np.ndarray], positions: list[int], open_step=None) -> list[np.ndarray]:
        """One batched step: layer ``layer`` of every sequence; returns the new hidden
        states. Prompts of different lengths go as items; decode rows (one per
        sequence, the same shapes) as stacked arrays, as an engine holds them: a
        layer call of ``open_step`` when there is one."""
        qs, ks, vs = [], [], []
        for i, x in enumerate(xs):
            q, k, v = model.qkv(layer, x)
            ref_k[i][layer] = np.concatenate([ref_k[i][layer], k])
            ref_v[i][layer] = np.concatenate([ref_v[i][layer], v])
            qs.append(q)
            ks.append(k)
            vs.append(v)
        if open_step is not None:
            outs = open_step.call(layer, np.stack(qs), np.stack(ks), np.stack(vs))
        elif len({q.shape for q in qs}) == 1:
            outs = via.attend_stacked(sessions, layer, np.stack(qs), np.stack(ks), np.stack(vs), offsets=positions)
        else:
            outs = via.attend_batch(
                [AttendItem(s, layer, q, k, v, offset=p) for s, q, k, v, p in zip(sessions, qs, ks, vs, positions)]
            )
        new = []
        for i, (x, q, out) in enumerate(zip(xs, qs, outs)):
            ref = reference_attention(q, ref_k[i][layer], ref_v[i][layer], positions[i])
            errors.append(float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30)))
            new.append(model.residual(layer, x, out))
        return new

    started = time.perf_counter()
    try:
        with Client(args.url) as client:  # the key from $ATTNSERVE_API_KEY (module docstring)
            if why := unoffered_kv_format(client, args.kv_format):
                print(f"error: {why}", file=sys.stderr)
                return 2
            sessions = [
                client.create_session(
                    num_qo_heads=args.heads,
                    num_kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    num_layers=args.layers,
                    kv_format=args.kv_format,
                )
                for _ in prompts
            ]
            stream = client.stream() if args.transport == "stream" else None
            step = stream or client  # attend_batch and attend_stacked, over the stream or HTTP
            try:
                # prefill: every prompt through every layer, one batched step per layer
                xs = [rng.standard_normal((n, model.width)).astype(np.float32) for n in prompts]
                positions = [0] * len(prompts)
                for layer in range(args.layers):
                    xs = run_layer(step, layer, xs, positions)
                positions = list(prompts)
                # decode: one token per sequence per step, one batched step per layer
                decoding = step.open_step(sessions) if args.open_step else None  # a row a sequence a call
                try:
                    for _ in range(args.steps):
                        xs = [x[-1:] + rng.standard_normal((1, model.width)).astype(np.float32) for x in xs]
                        for layer in range(args.layers):
                            xs = run_layer(step, layer, xs, positions, decoding)
                        positions = [p + 1 for p in positions]
                finally:
                    if decoding is not None:
                        decoding.close()
                lengths = [list(s.lengths) for s in sessions]
            finally:
                if stream is not None:
                    stream.close()
                for s in sessions:
                    s.delete()
    except AttnServeError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    took = time.perf_counter() - started
    calls = args.layers * (1 + args.steps)
    want = [[n + args.steps] * args.layers for n in prompts]
    print(
        f"{len(prompts)} sequences x {args.layers} layers, {args.kv_format} over {args.transport}"
        f"{' (decoding through an open step)' if args.open_step else ''}: "
        f"{calls} batched steps, {calls * len(prompts)} attends in {took:.2f} s"
    )
    print(f"cache lengths {[ln[0] for ln in lengths]} (expected {[w[0] for w in want]})")
    print(f"max relative error against float64: {max(errors):.2e}")
    if lengths != want:
        print("FAIL: cache lengths differ from the tokens sent", file=sys.stderr)
        return 1
    if args.kv_format == "f32" and max(errors) > F32_TOLERANCE:
        print(f"FAIL: error above {F32_TOLERANCE}", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
