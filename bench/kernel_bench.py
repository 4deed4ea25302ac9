#!/usr/bin/env python3
"""Kernel benchmark: decode and prefill, f32, f16 and TurboQuant (``--formats``: any
of formats.KV_FORMATS, e.g. the variants tq4, tq3; ``tq4/s4w128``: tq4 with 4 exact
sinks and an exact window of 128, the session's ``sinks`` and ``window``), against torch SDPA.

    python bench/kernel_bench.py [--json-out bench/results/h200-latest.json] [--quick]

Shapes: 32 query heads, 8 KV heads, head_dim 128. Decode (one query row) at
contexts 4096, 32768, 131072; prefill 2048 causal queries over 2048 keys, and
512 queries at the end of 8192 keys (bottom-right-aligned causal mask).

wgpu time: the kernels of one attend (TurboQuant: tq_rotate_q + the attention
kernels) recorded ``iters`` times into one submission, timed from submit to
completion and divided by ``iters``: the CPU's command recording is excluded and
the ~0.2-0.3 ms submit/readback round trip is paid once, so it is amortized away. torch time: CUDA events around
``scaled_dot_product_attention`` (f32 and bf16), median of repeats, at its best:
both GQA forms are timed (``enable_gqa=True``, and the K/V heads repeated with
``repeat_interleave``), the faster is the peer, and both are recorded. ``bytes_read`` is what the kernel must read at least: the
K/V cache up to the context (in its format) plus the queries; ``gbps`` is that
over the wgpu time, and ``bandwidth_fraction`` its ratio to the device-to-device
copy bandwidth measured in the same run (bytes read + written per second).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service"), str(ROOT)]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from attnserve.engine import Engine  # noqa: E402
from attnserve.gpu.batch import Batch  # noqa: E402
from attnserve.gpu import kernels as K  # noqa: E402
from attnserve.kv.config import SessionConfig  # noqa: E402
from attnserve.formats import bytes_per_token, is_plain  # noqa: E402

from tools.common import window_setting, write_result  # noqa: E402

H, HKV, D = 32, 8, 128
DECODE_CONTEXTS = (4096, 32768, 131072)
PREFILL_SHAPES = ((2048, 2048), (512, 8192))  # (queries, keys)


def git_commit() -> str:
    env = os.environ.get("ATTNSERVE_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return "unknown"


def submit(batch: Batch, encoded) -> memoryview | None:
    """Submit what ``batch.encode()`` made and wait for the readback, if any (the
    worker does the two apart: ``queue_submit``, then ``read_back``)."""
    batch.queue_submit(encoded)
    return batch.read_back(encoded)


def choose_split(
    kv_format: str,
    max_seq: int,
    n_kv_heads: int,
    n_queries: int,
    group: int,
    target_workgroups: int = K.KernelPolicy.target_workgroups,
) -> tuple[int, int]:
    """(split_len, n_splits) of one attend over ``max_seq`` timesteps (``kernels.split_sizes``,
    looked up when called: what a probe's patch of it returns)."""
    split_len, n_splits = K.split_sizes(
        kv_format, np.asarray([max_seq]), n_kv_heads, n_queries, group, target_workgroups
    )
    return int(split_len[0]), int(n_splits[0])


def fill_layer(engine: Engine, layer, length: int, rng) -> None:
    """Append ``length`` random rows in chunks (bounded host memory)."""
    chunk = 16384
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        k = rng.standard_normal((n, HKV, D), dtype=np.float32)
        v = rng.standard_normal((n, HKV, D), dtype=np.float32)
        engine.append(layer, k, v).result()


def time_wgpu(engine: Engine, layer, n: int, length: int, rng, budget_s: float) -> float:
    """Milliseconds per attend, from one submission of ``iters`` attends."""
    q = rng.standard_normal((n, H, D), dtype=np.float32)

    def run(iters: int) -> float:
        done = [0]

        def job(ctx):
            import wgpu

            batch = Batch(ctx.device, ctx.pipelines, engine.worker.arenas, ctx.offset_align, engine.policy)
            q_seg = batch.upload(q)
            # a buffer of its own: no readback of the whole output per timing
            out = ctx.device.create_buffer(size=q.nbytes, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
            room = 0.8 * ctx.max_binding  # arenas are bound whole: stay within one binding
            for _ in range(iters):
                if batch.largest_arena > room:
                    break
                done[0] += 1
                layer.plan_attend_rows(
                    batch,
                    q_seg,
                    q.shape,
                    out=out,
                    length=length,
                    start_pos=length - n,
                    causal=True,
                    scale=1 / math.sqrt(D),
                )
                batch.flush()  # its own dispatches: one attend's time, not a batched one's
            sync = batch.output(4)
            batch.copy(out, 0, sync, 0, 4)
            encoded = batch.encode()  # CPU work: bind groups, command recording
            t0 = time.perf_counter()
            submit(batch, encoded)  # GPU work + one 4-byte readback
            return time.perf_counter() - t0

        return engine.worker.run(job) / done[0]

    run(1)  # warm-up (pipelines, arenas)
    once = run(1)
    iters = int(min(500, max(3, budget_s / max(once, 1e-5))))
    times = [run(iters) for _ in range(3)]
    return 1e3 * min(times)


def plan_batched_steps(batch: Batch, layers: list, q: np.ndarray, steps: int = 1, room: float | None = None) -> int:
    """``steps`` batched decode steps into ``batch``: the query row ``q`` uploaded once,
    for each of ``layers`` over its whole length, each step flushed (every item's split
    in one dispatch, merges in one), the outputs left on the GPU (scratch) and 4 bytes
    of the first read back to wait on; stops before the arenas pass ``room`` bytes
    (they are bound whole). Returns the steps planned."""
    q_seg = batch.upload(q)
    outs = [batch.scratch(q.nbytes) for _ in layers]
    planned = 0
    for _ in range(steps):
        if room is not None and batch.largest_arena > room:
            break
        planned += 1
        for layer, out in zip(layers, outs):
            layer.plan_attend_rows(
                batch, q_seg, q.shape, out=out, length=layer.length, start_pos=layer.length - q.shape[0],
                causal=True, scale=1 / math.sqrt(q.shape[-1]),
            )  # fmt: skip
        batch.flush()
    sync = batch.output(4)
    batch.copy(outs[0], 0, sync, 0, 4)
    return planned


def time_batched(engine: Engine, layers: list, rng, budget_s: float, iters: int | None = None) -> float:
    """Milliseconds per batched decode step: one query row for each of ``layers``
    (over its whole length) planned together, so the batch records one dispatch per
    phase for all of them (the engine's batched step); ``iters`` steps per submission
    (default: as many as ``budget_s`` allows, at most 200)."""
    q = rng.standard_normal((1, H, D), dtype=np.float32)

    def run(iters: int) -> float:
        steps = [0]

        def job(ctx):
            batch = Batch(ctx.device, ctx.pipelines, engine.worker.arenas, ctx.offset_align, engine.policy)
            steps[0] = plan_batched_steps(batch, layers, q, iters, room=0.8 * ctx.max_binding)
            encoded = batch.encode()
            t0 = time.perf_counter()
            submit(batch, encoded)
            return time.perf_counter() - t0

        return engine.worker.run(job) / steps[0]

    run(1)
    if iters is None:
        once = run(1)
        iters = int(min(200, max(3, budget_s / max(once, 1e-5))))
    return 1e3 * min(run(iters) for _ in range(3))


def batched_rows(engine: Engine, fmt: str, n_sessions: int, length: int, rng, budget_s: float) -> list[dict]:
    """The batched decode of ``n_sessions`` sessions at ``length`` each against one
    session at ``n_sessions * length`` (the same bytes read): issue 13's goal."""
    big_len = n_sessions * length
    big = engine.session_kv(SessionConfig(1, H, HKV, D, fmt, big_len, 1))
    fill_layer(engine, big.layers[0], big_len, rng)
    one_ms = time_wgpu(engine, big.layers[0], 1, big_len, rng, budget_s)
    engine.release(big).result()
    sessions = [engine.session_kv(SessionConfig(1, H, HKV, D, fmt, length, 2 + i)) for i in range(n_sessions)]
    for s in sessions:
        fill_layer(engine, s.layers[0], length, rng)
    layers = [s.layers[0] for s in sessions]
    slabs = {id(layer.slab) for layer in layers}
    batch_ms = time_batched(engine, layers, rng, budget_s)
    for s in sessions:
        engine.release(s).result()
    nbytes = big_len * bytes_per_token(fmt, HKV, D) + n_sessions * H * D * 4
    print(
        f"batched  {fmt:10} {n_sessions} x {length}: {batch_ms:.3f} ms per step ({len(slabs)} slab); "
        f"one session at {big_len}: {one_ms:.3f} ms; ratio {batch_ms / one_ms:.2f}",
        flush=True,
    )
    return [
        {
            "kernel": "batched-decode",
            "kv_format": fmt,
            "sessions": n_sessions,
            "context": length,
            "queries": 1,
            "slabs": len(slabs),
            "wgpu_ms": round(batch_ms, 4),
            "one_session_context": big_len,
            "one_session_ms": round(one_ms, 4),
            "ratio_to_one_session": round(batch_ms / one_ms, 3),
            "bytes_read": nbytes,
            "gbps": round(nbytes / (batch_ms / 1e3) / 1e9, 1),
        }
    ]


def torch_sdpa_ms(n: int, length: int, dtype_name: str, gqa: str = "repeat"):
    """torch SDPA in milliseconds (median of 7 x 20 calls, CUDA events), or None
    without a CUDA torch. ``gqa``: "repeat" repeats the K/V heads to the query heads
    (``repeat_interleave``: reads G x the K/V bytes at decode), "native" passes
    ``enable_gqa=True`` (torch's own GQA path)."""
    try:
        import torch
        import torch.nn.functional as F
    except Exception:
        return None
    if not torch.cuda.is_available():
        return None
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, H, n, D, device=dev, dtype=dt, generator=g)
    k = torch.randn(1, HKV, length, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, HKV, length, D, device=dev, dtype=dt, generator=g)
    kwargs: dict = {}
    if gqa == "repeat":
        k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
    else:
        kwargs["enable_gqa"] = True
    if n == 1:
        pass  # one query at the end attends to everything
    elif n == length:
        kwargs["is_causal"] = True
    else:
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(n, length)

    def fn():
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    except (RuntimeError, TypeError, NotImplementedError):  # a form this torch cannot run for the shape
        return None
    times = []
    for _ in range(7):
        reps = 20
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)  # q, k, v go with the frame


def torch_peer_ms(n: int, length: int, dtype_name: str) -> dict:
    """The peer at its best: both GQA forms timed, the faster is the peer."""
    forms = {form: torch_sdpa_ms(n, length, dtype_name, form) for form in ("native", "repeat")}
    timed = {f: t for f, t in forms.items() if t is not None}
    best = min(timed, key=timed.__getitem__) if timed else None
    return {"ms": timed[best] if best else None, "form": best, **{f"{f}_ms": t for f, t in forms.items()}}


def copy_gbps(engine: Engine) -> tuple[float, str]:
    """Device-to-device copy bandwidth (read + write bytes per second)."""
    try:
        import torch

        if torch.cuda.is_available():
            n = 2 << 30
            a = torch.empty(n, dtype=torch.uint8, device="cuda")
            b = torch.empty_like(a)
            for _ in range(3):
                b.copy_(a)
            torch.cuda.synchronize()
            t = []
            for _ in range(10):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                b.copy_(a)
                e1.record()
                torch.cuda.synchronize()
                t.append(e0.elapsed_time(e1) / 1e3)
            del a, b
            torch.cuda.empty_cache()
            return 2 * n / min(t) / 1e9, "torch device copy"
    except Exception:
        pass
    import wgpu

    def job(ctx):
        n = min(1 << 28, ctx.max_binding)
        usage = wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        a = ctx.device.create_buffer(size=n, usage=usage)
        b = ctx.device.create_buffer(size=n, usage=usage)
        best = 1e9
        for _ in range(5):
            enc = ctx.device.create_command_encoder()
            for _ in range(4):
                enc.copy_buffer_to_buffer(a, 0, b, 0, n)
            t0 = time.perf_counter()
            ctx.device.queue.submit([enc.finish()])
            ctx.device.queue.read_buffer(b, 0, 4)
            best = min(best, (time.perf_counter() - t0) / 4)
        return 2 * n / best / 1e9

    return engine.worker.run(job), "wgpu copy_buffer_to_buffer"


def gpu_description(engine: Engine) -> tuple[str, str]:
    gpu, driver = engine.ctx.name, str(engine.ctx.info.get("description", ""))
    try:
        out = (
            subprocess.check_output(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], text=True
            )
            .strip()
            .splitlines()[0]
        )
        gpu, driver = [s.strip() for s in out.split(",")]
    except Exception:
        pass
    return gpu, driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--quick", action="store_true", help="small shapes (CI smoke / lavapipe)")
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER"))
    ap.add_argument(
        "--formats", default="f32,f16,turboquant", help="kv formats; NAME/sSwR: with exact sinks and window"
    )
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of GPU work per timing")
    ap.add_argument("--only", choices=["decode", "prefill", "batched"], help="time only one kernel kind")
    ap.add_argument(
        "--batched",
        default="64x4096",
        help="the batched decode: SESSIONSxCONTEXT, against one session of SESSIONS*CONTEXT ('' to skip)",
    )
    ap.add_argument("--page-tokens", type=int, default=64, help="timesteps per page of the KV pool")
    ap.add_argument(
        "--path",
        choices=["auto", "split", "tiled", "single"],
        default="auto",
        help="attention kernel family (auto: split-KV for decode, query-block tiled for prefill)",
    )
    ap.add_argument("--target-workgroups", type=int, help="split sizing (default: the policy's)")
    ap.add_argument(
        "--prefill-f32",
        choices=["tiled", "rb"],
        default=K.KernelPolicy.prefill_f32,
        help="f32 query-block prefill kernel: attention_prefill_tiled or attention_prefill_rb",
    )
    ap.add_argument(
        "--prefill-f16",
        choices=["tiled", "rb"],
        default=K.KernelPolicy.prefill_f16,
        help="the same for the half formats (f16, bf16)",
    )
    args = ap.parse_args(argv)

    decode_ctx = (512, 2048) if args.quick else DECODE_CONTEXTS
    prefill = ((64, 64), (16, 256)) if args.quick else PREFILL_SHAPES
    default = K.KernelPolicy()
    policy = K.KernelPolicy(
        force=None if args.path == "auto" else args.path,
        target_workgroups=args.target_workgroups or default.target_workgroups,
        prefill_f32=args.prefill_f32,
        prefill_f16=args.prefill_f16,
    )
    engine = Engine.open(args.adapter, policy=policy, page_tokens=args.page_tokens)
    rng = np.random.default_rng(0)
    gpu, driver = gpu_description(engine)
    cgbps, cmethod = copy_gbps(engine)
    print(f"# {gpu} (driver {driver}) via {engine.ctx.backend}; copy bandwidth {cgbps:.0f} GB/s ({cmethod})")
    rows = []
    hdr = f"{'kernel':8} {'format':10} {'ctx':>7} {'q':>5} {'wgpu ms':>9} {'torch f32':>9} {'torch bf16':>10} {'MB read':>8} {'GB/s':>7} {'bw%':>5} {'x f32':>6} {'x bf16':>6}"
    print(hdr)
    max_ctx = max(list(decode_ctx) + [k for _, k in prefill])
    torch_cache: dict = {}
    for setting in args.formats.split(","):
        fmt, sinks, window = window_setting(setting)  # tq4/s4w128: exact sinks and window beside the codes
        s = engine.session_kv(SessionConfig(1, H, HKV, D, fmt, max_ctx, 1, sinks=sinks, window=window))
        layer = s.layers[0]
        filled = 0
        shapes = [("decode", 1, c) for c in decode_ctx] + [("prefill", n, k) for n, k in prefill]
        shapes = [x for x in shapes if args.only in (None, x[0])]
        if args.batched and args.only in (None, "batched"):
            n_sessions, length = (int(x) for x in (args.batched if not args.quick else "8x256").split("x"))
            rows += batched_rows(engine, fmt, n_sessions, length, rng, args.budget)
        for kernel, n, ctx_len in sorted(shapes, key=lambda x: x[2]):
            if ctx_len > filled:
                fill_layer(engine, layer, ctx_len - filled, rng)
                filled = ctx_len
            ms = time_wgpu(engine, layer, n, ctx_len, rng, args.budget)
            key = (n, ctx_len)
            if key not in torch_cache:
                torch_cache[key] = (torch_peer_ms(n, ctx_len, "f32"), torch_peer_ms(n, ctx_len, "bf16"))
            pf32, pbf16 = torch_cache[key]
            tf32, tbf16 = pf32["ms"], pbf16["ms"]
            nbytes = ctx_len * bytes_per_token(fmt, HKV, D) + n * H * D * 4
            nbytes += min(sinks + window, ctx_len) * bytes_per_token("f32", HKV, D)
            gbps = nbytes / (ms / 1e3) / 1e9
            path = policy.path(fmt, n, H, HKV, D) if not (sinks or window) else "split-windowed"
            if path == "tiled" and is_plain(fmt) and policy.plain_prefill(fmt) == "rb":
                path = "tiled-rb"
            row = {
                "kernel": kernel,
                "kv_format": setting,
                "context": ctx_len,
                "queries": n,
                "path": path,
                "wgpu_ms": round(ms, 4),
                "torch_f32_ms": None if tf32 is None else round(tf32, 4),
                "torch_bf16_ms": None if tbf16 is None else round(tbf16, 4),
                # the peer is the faster of torch's two GQA forms, both recorded
                "torch_peer": {
                    dtype: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in peer.items()}
                    for dtype, peer in (("f32", pf32), ("bf16", pbf16))
                },
                "bytes_read": nbytes,
                "gbps": round(gbps, 1),
                "bandwidth_fraction": round(gbps / cgbps, 4),
                "speedup_vs_torch_f32": None if tf32 is None else round(tf32 / ms, 3),
                "speedup_vs_torch_bf16": None if tbf16 is None else round(tbf16 / ms, 3),
            }
            rows.append(row)
            fmt_opt = lambda x, w: f"{x:{w}.3f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
            print(
                f"{kernel:8} {setting:10} {ctx_len:7d} {n:5d} {ms:9.3f} {fmt_opt(tf32, 9)} {fmt_opt(tbf16, 10)} "
                f"{nbytes / 1e6:8.1f} {gbps:7.1f} {100 * gbps / cgbps:5.1f} "
                f"{fmt_opt(row['speedup_vs_torch_f32'], 6)} {fmt_opt(row['speedup_vs_torch_bf16'], 6)}",
                flush=True,
            )
        engine.release(s).result()
    result = {
        "gpu": gpu,
        "driver": driver,
        "backend": engine.ctx.backend,
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "copy_gbps": round(cgbps, 1),
        "copy_method": cmethod,
        "shape": {"num_qo_heads": H, "num_kv_heads": HKV, "head_dim": D},
        "page_tokens": args.page_tokens,
        "bytes_per_token_per_layer": {  # of the codes (a window's exact rows besides: float32)
            f: bytes_per_token(window_setting(f)[0], HKV, D) for f in args.formats.split(",")
        },
        "rows": rows,
    }
    write_result(args.json_out, result)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
