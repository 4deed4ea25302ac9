#!/usr/bin/env python3
"""Which decode-native 4-bit (or 3-bit) kv code (issue 54, item 3) keeps attention
closest to exact: TurboQuant's random rotation with uniform codes (a float16 scale and
offset per vector or per group, decoded by one multiply-add per element, no codebook,
no QJL), numpy round trips of the K and V rows measured on CPU, no GPU and no server.

    python bench/probes/kv4_fidelity.py [--candidates r4,r4g32,r4g16,r3,...] [--seeds 0,1,2]
        [--texts gettysburg,austen,melville,darwin] [--max-tokens N] [--sinks N]
        [--window N] [--chunk N] [--decode-tail N] [--contexts 1024,4096] [--queries 8]
        [--no-model] [--no-synthetic] [--quick] [--json-out FILE]

Candidates (``[rows, Hkv, d] float32 -> stored -> float32``; names ``[ru]B[gG]``):

* ``rB`` (``r4``, ``r3``): each row rotated by the project's TurboQuant rotation
  (``rht(x, s) = H (s * x) / sqrt(d)``, ``H`` the Sylvester Walsh-Hadamard matrix, ``s``
  the layer's polar signs from the session seed: ``kv8_fidelity.rotation("rht", ...)``,
  the one ``tq_rotate.wgsl`` applies to the query once per attend), then B-bit uniform
  codes per vector: ``offset`` = the row's min rounded DOWN to float16, ``scale`` =
  (max - offset) / (2^B - 1) rounded UP to float16 (so no element lies outside the
  code range and every element is within half a step of its level), codes
  ``clip(rint((x - offset) / scale), 0, 2^B - 1)``; decoded ``code * scale + offset``
  (one FMA per element, float32). The rotated query dotted with the decoded rotated
  key is the score, the decoded rotated values summed by the weights and rotated back
  once per attend give the output; measured here by un-rotating each decoded row in
  float64 (the same scores and outputs). B + 32/d bits per element.
* ``rBgG`` (``r4g32``, ``r4g16``, ``r3g32``...): the same with a scale and offset per
  group of G consecutive elements of the rotated row; B + 32 * ceil(d/G) / d bits
  (G not dividing d: the last group is shorter and has its own scale and offset).
* ``uBgG`` (``u4g32``): the same codes with NO rotation: the reference that tells what
  the rotation is worth (SmolLM2's key outlier channels set their group's step).
* ``KEYS:VALUES`` (``r4g32:r3g32``): keys in one code, values in another.
* a service format (``tq4v3``, ``tq4``, ``f16``...): the control, coded by the service's
  own float64 oracle (``e2e_model.OracleAttention``), so it runs beside the candidates
  on the same texts, tokens and exact rows.

Measures (as ``kv8_fidelity.py``, whose machinery this imports: its rotation,
``attention_rows``, the e2e path's structure): (1) output cosine on
``bench/fidelity.py``'s LLM-shaped data (8 query / 2 KV heads of 128, rotated by the
first seed's layer 0); (2) end to end through SmolLM2-135M-Instruct by
``bench/e2e_model.py``'s numpy Llama with ``OracleAttention`` (each candidate's round
trip as every layer's format; ``--sinks``/``--window`` read the first N timesteps, each
call's own rows and the ``window`` before them exactly, ``reference.windowed_attention``
as the service does; ``--chunk``/``--decode-tail`` feed the text as an engine does: with
a window, a whole-text prefill reads every row exactly, so the windowed runs prefill in
chunks of 512 and decode the last 64 tokens of each text one at a time, as
``oracle-e2e-windows-5da2b37.json`` measured ``tq4v3/s4w128``). Top-1, KL(exact ||
candidate), Δ perplexity with ``e2e_model.summarize``'s bootstrap, and the decoded
positions alone. The rotated candidates take the session seed (a rotation per layer),
so they run once per ``--seeds`` seed; the unrotated ones once.

PREDICTION (written before any run). A rotated row of d = 64 is near Gaussian with
sigma ||x|| / 8; its min..max spans about 4.8 sigma (expected range of 64 normals), so
4-bit per-vector steps are 0.32 sigma and the MSE step^2 / 12 = 0.0085 sigma^2, about
the 4-bit Lloyd-Max codebook's 0.0095: ``r4`` should match ``tq4`` (same rotation, same
per-vector side information, a uniform grid instead of a codebook): through SmolLM2 on
the long texts with 4 sinks and a window of 128 KL about 0.0016 (0.0013-0.0022), top-1
about 0.98, within the goal (KL <= 0.003, top-1 >= 0.975) at 4.5 bits (d 64; 4.25 at d
128). Groups of 32 (range about 4.1 sigma) cut the MSE to about 0.73x and groups of 16
(3.5 sigma) to about 0.55x: ``r4g32`` KL about 0.0012 (5 bits), ``r4g16`` about 0.0009 (6
bits), diminishing returns for the bits. 3-bit codes have 4.5x the MSE: ``r3`` KL about
0.007 (as ``tq3/s4w128``'s 0.0064), ``r3g32`` about 0.005, ``r3g16`` about 0.0035: no
3-bit setting within KL <= 0.003 except perhaps g16, which costs 5 bits at d 64 (more
than ``r4``). ``r4:r3g32`` (keys 4-bit, values 3-bit, as ``tq4v3``) about 0.0025, beside
``tq4v3``'s 0.0021. The unrotated ``u4g32`` 2-3x ``r4g32``'s KL (SmolLM2's key outlier
channels set their group's range; the values gain less from the rotation). Without
exact rows the formats alone: ``r4`` about ``tq4``'s 0.06 on the long texts, 0.09 on the
short; ``r3`` about 0.25. On the LLM-shaped data (4 outlier key channels) the rotation
wins by more: ``u4g32`` output cosine well below ``r4g32``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [p for p in (str(Path(__file__).resolve().parent),) if p not in sys.path]

import kv8_fidelity as kv8  # noqa: E402  (its rotation, oracles and paths; not edited here)

CANDIDATES = ("r4", "r4g32", "r4g16", "r3", "r3g32", "r3g16", "r4:r3g32", "u4g32", "tq4v3")
NAME = re.compile(r"([ru])([2-8])(?:g(\d+))?")

# -- uniform codes with a float16 scale and offset per group ------------------------------

F16 = np.float16


def f16_down(x) -> np.ndarray:
    """The largest float16 <= x (float64 in); ValueError past float16's range."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        h = x.astype(F16)
    if not np.isfinite(h).all():
        raise ValueError("a value beyond float16's range (65504): no float16 offset or scale")
    return np.where(h.astype(np.float64) > x, np.nextafter(h, F16(-np.inf)), h).astype(F16)


def f16_up(x) -> np.ndarray:
    """The smallest float16 >= x (float64 in); ValueError past float16's range."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        h = x.astype(F16)
    if not np.isfinite(h).all():
        raise ValueError("a value beyond float16's range (65504): no float16 offset or scale")
    h = np.where(h.astype(np.float64) < x, np.nextafter(h, F16(np.inf)), h).astype(F16)
    if not np.isfinite(h).all():
        raise ValueError("a scale beyond float16's range (65504)")
    return h


def n_groups(d: int, group: int) -> int:
    if group < 1 or d < 1:
        raise ValueError(f"group {group} and d {d} must be positive")
    if group > d:
        raise ValueError(f"group {group} is larger than the row (d = {d}): use the per-vector code")
    return -(-d // group)


def encode(x: np.ndarray, bits: int, group: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x [..., d]`` -> (codes uint8 ``[..., d]`` in ``[0, 2^bits - 1]``, scale and offset
    float16 ``[..., ceil(d / G)]``), G = ``group`` (0: the whole row). The last group of a
    G that does not divide d holds the remaining ``d % G`` elements."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits {bits} not in 1..8")
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    group = group or d
    ng = n_groups(d, group)
    pad = ng * group - d
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], mode="edge") if pad else x  # the edge: min/max unchanged
    xg = xp.reshape(*x.shape[:-1], ng, group)
    top = (1 << bits) - 1
    offset = f16_down(xg.min(-1))
    scale = f16_up((xg.max(-1) - offset.astype(np.float64)) / top)
    s64 = scale.astype(np.float64)[..., None]
    safe = np.where(s64 > 0, s64, 1.0)
    codes = np.clip(np.rint((xg - offset.astype(np.float64)[..., None]) / safe), 0, top).astype(np.uint8)
    return codes.reshape(*x.shape[:-1], ng * group)[..., :d], scale, offset


def decode(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray, group: int = 0) -> np.ndarray:
    """``code * scale + offset`` in float32, the group's scale and offset broadcast over its
    ``group`` elements (0: the whole row), as ``encode`` made them (what a kernel does:
    one FMA per element)."""
    codes = np.asarray(codes)
    d = codes.shape[-1]
    group = group or d
    if scale.shape[-1] != n_groups(d, group) or offset.shape != scale.shape:
        raise ValueError(f"{scale.shape[-1]} scales for d {d} in groups of {group}")
    at = np.arange(d) // group
    s, o = scale.astype(np.float32)[..., at], offset.astype(np.float32)[..., at]
    return (codes.astype(np.float32) * s + o).astype(np.float32)


def uniform(bits: int, group: int = 0):
    """The round trip ``x -> decode(encode(x))`` (float32 in and out)."""

    def fn(x: np.ndarray) -> np.ndarray:
        return decode(*encode(np.asarray(x, np.float32), bits, group), group)

    return fn


def parse(name: str) -> tuple[bool, int, int] | None:
    """``r4g32`` -> (rotated True, bits 4, group 32); ``r4`` -> group 0 (per vector); None
    for a name of another kind (a service format)."""
    m = NAME.fullmatch(name)
    return None if m is None else (m[1] == "r", int(m[2]), int(m[3] or 0))


def one(name: str, seed: int = 0, layer: int = 0):
    p = parse(name)
    if p is None:
        raise ValueError(f"not a uniform-code candidate: {name!r}")
    rot, bits, group = p
    base = uniform(bits, group)
    return kv8.rotated(base, "rht", seed, layer) if rot else base


def quantizer(name: str, seed: int = 0, layer: int = 0):
    """``(fn_k, fn_v)`` for ``NAME`` or ``KEYS:VALUES``."""
    kn, _, vn = name.partition(":")
    return one(kn, seed, layer), one(vn or kn, seed, layer)


def is_uniform(name: str) -> bool:
    return all(parse(part) is not None for part in name.split(":"))


def seeded(name: str) -> bool:
    """Whether the session seed enters (a rotation; a service format's TurboQuant signs)."""
    if not is_uniform(name):
        return name not in ("f32", "f16", "bf16")
    return any(parse(part)[0] for part in name.split(":"))


def bits_per_element(name: str, d: int) -> float:
    """Code bits plus the float16 scale and offset of each group, per element (the exact
    sink and window rows not counted)."""
    if ":" in name:
        kn, vn = name.split(":")
        return (bits_per_element(kn, d) + bits_per_element(vn, d)) / 2
    p = parse(name)
    if p is None:
        kv8._paths()
        from attnserve.formats import catalog

        for size in catalog().get("kv_format_sizes", {}).get(name, []):
            if size["head_dim"] == d:
                return float(size["bits_per_element"])
        return float("nan")
    _, bits, group = p
    return bits + 32.0 * n_groups(d, group or d) / d


# -- (1) fidelity.py's LLM-shaped data ---------------------------------------------------


def synthetic(candidates, contexts, n_q: int, seed: int, rot_seed: int = 0, log=print) -> list[dict]:
    kv8._paths()
    import fidelity

    rows = []
    for length in contexts:
        rng = np.random.default_rng([seed, length, 1])  # fidelity.measure's stream for "llm"
        q, k, v = fidelity.make_data("llm", length, n_q, rng)
        want = kv8.attention_rows(q, k, v, length - n_q)
        for name in candidates:
            if not is_uniform(name):
                continue  # service formats: their synthetic figures are bench/fidelity.py's
            fk, fv = quantizer(name, rot_seed, 0)
            kh, vh = fk(k), fv(v)
            out = kv8.attention_rows(q, kh, vh, length - n_q)
            cos = (out * want).sum(-1) / (np.linalg.norm(out, axis=-1) * np.linalg.norm(want, axis=-1))
            row = {
                "candidate": name,
                "data": "llm",
                "context": length,
                "bits_per_element_d128": bits_per_element(name, fidelity.D),
                "cos_mean": float(cos.mean()),
                "cos_min": float(cos.min()),
                "max_rel_err": float(np.abs(out - want).max() / np.abs(want).max()),
                "k_rel_rms": float(np.sqrt(((kh - k) ** 2).mean() / (k.astype(np.float64) ** 2).mean())),
                "v_rel_rms": float(np.sqrt(((vh - v) ** 2).mean() / (v.astype(np.float64) ** 2).mean())),
            }
            rows.append(row)
            log(json.dumps(row), flush=True)
    return rows


# -- (2) through SmolLM2-135M (e2e_model's oracle path) -----------------------------------


def through_model(
    candidates,
    texts: list[str],
    seeds,
    max_tokens: int,
    sinks: int = 0,
    window: int = 0,
    chunk: int = 0,
    decode_tail: int = 0,
    boot: int = 2000,
    log=print,
    progress=None,
) -> dict:
    kv8._paths()
    import e2e_model as e2e

    class KV4Attention(e2e.OracleAttention):
        """OracleAttention with every layer in a candidate's round trip (the rotation drawn
        per layer from the session seed); a service format goes the parent's way."""

        def __init__(self, cfg, name: str, seed: int) -> None:
            uni = is_uniform(name)
            super().__init__(cfg, ["f32" if uni else name] * cfg.n_layers, seed, sinks=sinks, window=window)
            self.fns = [quantizer(name, seed, layer) for layer in range(cfg.n_layers)] if uni else None

        def _coded(self, layer, k, v):
            if self.fns is None:
                return super()._coded(layer, k, v)
            fk, fv = self.fns[layer]
            return k.astype(np.float64), v.astype(np.float64), np.asarray(fk(k), np.float64), np.asarray(fv(v), np.float64)  # fmt: skip

    model, tok = e2e.Llama.from_gguf(e2e.package_gguf())
    ids = {}
    for name in texts:
        t = tok.encode(e2e.text_of(name))
        ids[name] = t[:max_tokens] if max_tokens else t
    log(f"# texts: {', '.join(f'{n} {len(t)}' for n, t in ids.items())} tokens", flush=True)
    cfg = model.cfg
    t0 = time.perf_counter()
    exact = {n: model.run(t, e2e.ExactAttention(cfg), chunk, decode_tail) for n, t in ids.items()}
    exact_nll = np.concatenate([e2e.position_stats(exact[n], exact[n], t)["nll"] for n, t in ids.items()])
    text_idx = [i for i, t in enumerate(ids.values()) for _ in range(len(t) - 1)]
    decoded = []
    for t in ids.values():
        first = 0 if chunk == 1 else max(0, len(t) - decode_tail) if decode_tail else len(t)
        decoded += [i >= first for i in range(len(t) - 1)]
    decoded_at = np.asarray(decoded, bool)
    log(f"exact: ppl {np.exp(exact_nll.mean()):.4f} over {exact_nll.size} positions ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    rows = [{"candidate": "exact", "positions": int(exact_nll.size), "ppl": float(np.exp(exact_nll.mean()))}]
    out = {
        "model": "SmolLM2-135M-Instruct Q4_1 (float64 numpy, e2e_model.Llama)",
        "texts": {n: len(t) for n, t in ids.items()},
        "sinks": sinks,
        "window": window,
        "chunk": chunk,
        "decode_tail": decode_tail,
        "rows": rows,
    }
    for name in candidates:
        t0 = time.perf_counter()
        runs = []
        for seed in seeds if seeded(name) else seeds[:1]:
            stats = [
                e2e.position_stats(exact[n], model.run(t, KV4Attention(cfg, name, int(seed)), chunk, decode_tail), t)
                for n, t in ids.items()
            ]
            runs.append({k: np.concatenate([s[k] for s in stats]) for k in stats[0]})
        summary = e2e.summarize(runs, exact_nll, text_idx, boot, 0)
        row = {
            "candidate": name,
            "bits_per_element_d64": bits_per_element(name, cfg.head_dim),
            "bits_per_element_d128": bits_per_element(name, 128),
            "seeded": seeded(name),
            "seconds": round(time.perf_counter() - t0, 1),
            **summary,
        }
        if decoded_at.any():
            row["decoded"] = {
                "positions": int(decoded_at.sum()),
                "top1": float(np.mean([r["agree"][decoded_at] for r in runs])),
                "kl": float(np.mean([r["kl"][decoded_at] for r in runs])),
            }
        rows.append(row)
        dec = f" decoded: top1 {row['decoded']['top1']:.4f} kl {row['decoded']['kl']:.3e}" if "decoded" in row else ""
        log(
            f"{name}: top1 {row['top1']:.4f} kl {row['kl']:.3e} dppl {row['dppl']:+.4g} "
            f"[{row['dppl_ci95'][0]:+.3f}, {row['dppl_ci95'][1]:+.3f}] seeds {row['seeds']}{dec} ({row['seconds']} s)",
            flush=True,
        )
        if progress is not None:
            progress(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="fidelity.py's data seed")
    ap.add_argument("--seeds", default="0,1,2", help="e2e session seeds (the rotated candidates take them)")
    ap.add_argument("--texts", default="gettysburg,austen,melville,darwin")
    ap.add_argument("--max-tokens", type=int, default=0)
    ap.add_argument("--sinks", type=int, default=0, help="SmolLM2 pass: the first N timesteps read exactly")
    ap.add_argument("--window", type=int, default=0, help="SmolLM2 pass: each call's rows and N before read exactly")
    ap.add_argument("--chunk", type=int, default=0, help="SmolLM2 pass: tokens a call (0: the whole text)")
    ap.add_argument("--decode-tail", type=int, default=0, help="SmolLM2 pass: the last N tokens one at a time")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--no-model", action="store_true", help="skip the SmolLM2 pass")
    ap.add_argument("--no-synthetic", action="store_true", help="skip fidelity.py's data")
    ap.add_argument("--quick", action="store_true", help="context 1024, 4 queries, one text of 48 tokens, seed 0")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    cands = args.candidates.split(",")
    for c in cands:
        if is_uniform(c):
            quantizer(c)  # refuse a bad name before the model loads
    contexts = [1024] if args.quick else [int(x) for x in args.contexts.split(",")]
    n_q = 4 if args.quick else args.queries
    texts = ["gettysburg"] if args.quick else args.texts.split(",")
    max_tokens = 48 if args.quick else args.max_tokens
    seeds = ["0"] if args.quick else args.seeds.split(",")
    result = {
        "probe": "bench/probes/kv4_fidelity.py",
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("ATTNSERVE_COMMIT", ""),
        "device": "CPU (numpy float64 oracle; no GPU)",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "bits_per_element": {c: {"d64": bits_per_element(c, 64), "d128": bits_per_element(c, 128)} for c in cands},
    }

    def save(_=None) -> None:
        if args.json_out:
            sys.path[:0] = [str(ROOT)]
            from tools.common import write_result

            write_result(args.json_out, result)

    if not args.no_synthetic:
        result["synthetic"] = synthetic(cands, contexts, n_q, args.seed, int(seeds[0]))
        save()
    if not args.no_model:

        def progress(model_result):
            result["model"] = model_result
            save()

        result["model"] = through_model(
            cands, texts, seeds, max_tokens, args.sinks, args.window, args.chunk, args.decode_tail,
            args.bootstrap, progress=progress,
        )  # fmt: skip
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
