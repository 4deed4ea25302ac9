"""Writes the seed corpus of the call frame's fuzz target (tools/fuzz/callframe_fuzz.c)
into a folder: valid layer-call frames of every dtype, with and without k and v
(rows 0 and > 0), with finite values and with a NaN or an infinity planted, and
mutated ones (truncated, a bad magic, a huge body_len, a layer not in the step,
another step, another tenant), each wrapped in the target's input format.

    python tools/fuzz/seed_corpus.py DIR

The input format (callframe_fuzz.c reads it): a config prefix, then operations.
  config  u8 cfg (dtype cfg % 3, check_finite bit 2, layers 1 + (cfg >> 3) % 6,
          capacity 2 + bit 6), u32 step id, u8 q (1 + q % 24 elements),
          u8 kv (kv % 9 elements each of k and v), u16 base, u16 stride (the
          layers: (base + i * (1 + stride % 700)) % 4096)
  op      u8 op (op % 8: 0 a raw frame, u16 length then its bytes; 1 a frame made
          for the step; 2 the same, then claimed and settled; 3 claim; 4 settle;
          5 close; 6 open; 7 a whole token; bit 7: the other tenant), u8 slot
Stdlib only: it runs before anything else is installed."""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from pathlib import Path

MAX_LAYERS = 4096
DTYPES = ("f32", "f16", "bf16")
SIZE = {"f32": 4, "f16": 2, "bf16": 2}


def encode(values: list[float], dtype: str) -> bytes:
    if dtype == "f32":
        return struct.pack(f"<{len(values)}f", *values)
    if dtype == "f16":
        return struct.pack(f"<{len(values)}e", *values)
    # bfloat16: the top half of the float32 (truncated: these values are exact)
    return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0])[2:] for x in values)


def head(step: int, layer: int, seq: int, body_len: int) -> bytes:
    return b"ATC1" + struct.pack("<IIII", step, layer, seq, body_len)


def config(dtype: str, step: int, q: int, kv: int, n_layers: int, base: int, stride: int, checked: bool) -> bytes:
    cfg = DTYPES.index(dtype) | (checked << 2) | ((n_layers - 1) << 3)
    return struct.pack("<BIBBHH", cfg, step, q - 1, kv, base, stride - 1)


def layers_of(n_layers: int, base: int, stride: int) -> list[int]:
    return [(base + i * stride) % MAX_LAYERS for i in range(n_layers)]


def raw(frame: bytes, tenant: int = 0) -> bytes:
    """op 0 on slot 0: a raw frame"""
    return struct.pack("<BBH", 0 | (tenant << 7), 0, len(frame)) + frame


def seeds() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    step, base, stride, n_layers = 0x11, 4093, 5, 3  # layers 4093, 2, 7: wrapping past the limit
    layers = layers_of(n_layers, base, stride)
    for dtype in DTYPES:
        for kv in (0, 3):
            for checked in (True, False):
                q = 5
                values = [0.5 * i - 1.0 for i in range(q + 2 * kv)]
                prefix = config(dtype, step, q, kv, n_layers, base, stride, checked)
                body = encode(values, dtype)
                good = head(step, layers[0], 1, len(body)) + body
                name = f"{dtype}-rows{kv}-{'checked' if checked else 'unchecked'}"
                # valid: every layer of a token, the second token's first layer
                frames = b"".join(raw(head(step, layer, i, len(body)) + body) for i, layer in enumerate(layers))
                out[f"{name}-valid"] = prefix + frames + struct.pack("<BB", 7, 0) + raw(good)
                # the same layer twice (claimed by op 2, then called again)
                out[f"{name}-twice"] = (
                    prefix + struct.pack("<BBB", 2, 0, 0) + bytes(4) + b"\x04" + body + b"\x00\x01\x00" + raw(good)
                )
                for bad in (math.nan, math.inf, -math.inf):
                    for where in (0, q, len(values) - 1):
                        if where >= len(values):
                            continue
                        planted = list(values)
                        planted[where] = bad
                        body_bad = encode(planted, dtype)
                        frame = head(step, layers[1], 2, len(body_bad)) + body_bad
                        out[f"{name}-{bad}-at{where}"] = prefix + raw(frame)
                # mutated
                out[f"{name}-truncated"] = prefix + raw(good[:-1]) + raw(good[:10])
                out[f"{name}-bad-magic"] = prefix + raw(b"ATF1" + good[4:]) + raw(b"AT")
                out[f"{name}-huge-body-len"] = prefix + raw(head(step, layers[0], 3, 0xFFFFFFFF) + body)
                out[f"{name}-wrong-layer"] = prefix + raw(head(step, 1, 4, len(body)) + body)
                out[f"{name}-layer-4096"] = prefix + raw(head(step, MAX_LAYERS, 4, len(body)) + body)
                out[f"{name}-other-step"] = prefix + raw(head(step + 1, layers[0], 5, len(body)) + body)
                out[f"{name}-other-tenant"] = prefix + raw(good, tenant=1)
                out[f"{name}-short-body-len"] = prefix + raw(head(step, layers[0], 6, len(body) - 1) + body)
    # the fixed steps (ids 2 and 2**32 - 1, layers 0-2 and 4095), broken steps, churn
    prefix = config("f32", 1, 1, 0, 1, 0, 1, True)
    out["fixed-steps"] = prefix + raw(head(2, 1, 0, 32) + encode([1.0] * 16, "f16"))
    out["fixed-steps"] += struct.pack("<BB", 0x80, 0) + struct.pack("<H", 26) + head(0xFFFFFFFF, 4095, 0, 6)
    out["fixed-steps"] += encode([1.0, 2.0, 3.0], "bf16")
    # claim layer 0 of step 2, settle it partly applied: broken; then a call of it
    out["broken"] = (
        prefix + bytes([3, 1, 0, 4, 1, 0, 0b111]) + struct.pack("<I", 5) + raw(head(2, 1, 0, 32) + bytes(32))
    )
    out["close-reopen"] = prefix + bytes([5, 1, 6, 1, 5, 0, 6, 0, 6, 2, 7, 1, 7, 2])
    out["same-id"] = config("f16", 2, 8, 4, 3, 0, 1, True) + bytes([5, 1, 6, 0, 7, 0])
    return out


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.splitlines()[4].strip(), file=sys.stderr)
        return 2
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    corpus = seeds()
    for data in corpus.values():
        # libFuzzer's own naming: the content's SHA-1
        (folder / hashlib.sha1(data).hexdigest()).write_bytes(data)
    print(f"seed_corpus: {len(corpus)} inputs in {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
