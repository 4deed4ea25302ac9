#!/usr/bin/env python3
"""TurboQuant decode kernel variants against the shipped split kernel (issue 14).

    python bench/probes/tq_decode_variants.py [--adapter nvidia] [--contexts 4096,32768,131072]
        [--variants base,v3-vpf0,...] [--targets 128,...] [--quick] [--json-out FILE]

The decode step (one query row; 32 query heads, 8 KV heads, d = 128 unless
--quick) over a TurboQuant cache written by the service itself (Engine, pool,
its encode kernels), planned by the service's own code (kv.kinds -> kernels.py:
tq_rotate_q, the split kernel with the params blocks _plan_split packs,
attention_merge). A variant replaces only the split kernel's dispatches: the
same bindings, params (TqSplitParams) and partials, so the shipped merge finishes
it; the variants are compiled with the shipped kernel's defines (turboquant's
TQX_CONSTS: they read its 2-bit codebook from there).
The variants (``VARIANTS``) are pipelines of ``bench/probes/shaders/
flash_attention_tq_split_{v2,v3}.wgsl`` (research kernels: not shipped; they include
from ``bench/probes/shaders/include`` and the shipped ``shaders/include``) with
override switches; ``base`` is the
shipped split kernel of ``turboquant``, its tqx instance
(``attention_split_tqx.turboquant``; the turboquant-only ``attention_split_tq``
the variants were first measured against is retired). Splits are the policy's (kernels.split_sizes), capped
at what the variant's pipeline takes on the device (``Variant.split_cap``).
Names with ``@`` are phase cuts (the split kernel returns after its scores /
weights / values: timing only, garbage output); ``-padN`` add N KiB of unused
workgroup memory (occupancy test).

Per context it checks every variant's output against the shipped kernel's
(max abs difference over the output's max abs, <= 1e-4) and against a float64
numpy oracle of the decoded cache (``tools.reference.tqx_attention``,
one KV head at a time), then times each: the whole step (rotation + split +
merge) and the split kernel alone (the rotation and merge dispatches dropped),
many steps recorded into one submission: GPU time from timestamps written
before and after it when the device has ``timestamp-query`` (asked for here),
and the wall time from submit to completion (amortized over the steps, as
bench/kernel_bench.py). For reference: the step with only its rotation and merge
(the split kernel dropped: what they cost), the f32 split step, torch bf16 SDPA
(when a CUDA torch is there) and the copy bandwidth (bench/kernel_bench.py's
helpers). Prints a table and the best variant per context; writes it all as JSON
to bench/results/tq-decode-variants-<adapter>.json (tools.common.write_result).
Exit status 1 when an output check failed or a variant could not run.

Everything that swaps kernels is monkeypatching inside this process
(Batch.dispatch, kernels.split_sizes and entries of shaders.KERNELS, restored on
exit; device.OPTIONAL_FEATURES gains timestamp-query): no service file is changed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "service"), str(ROOT / "client"), str(ROOT)]
import kernel_bench as B  # noqa: E402  (bench/kernel_bench.py: Engine, fill_layer, copy_gbps, torch peers)
from gpu_timing import GpuTimer, request_timestamps  # noqa: E402

from attnserve.gpu import kernels as K  # noqa: E402
from attnserve.gpu import shaders as S  # noqa: E402
from attnserve.gpu.batch import Batch  # noqa: E402
from tools import reference as ref  # noqa: E402
from attnserve.formats import TQ_SPECS  # noqa: E402
from attnserve.turboquant import layer_signs  # noqa: E402
from tools.common import rel_err, write_result  # noqa: E402

BASE_KERNEL = S.tqx_kernel("attention_split_tqx", "turboquant")  # the shipped split kernel of turboquant
DESIGNS = ("v2", "v3")  # SHADERS / flash_attention_tq_split_{design}.wgsl
SHADERS = Path(__file__).resolve().parent / "shaders"  # the research kernels (KernelSpec.folder)
TOL = 1e-4  # variant vs shipped kernel, and vs the float64 oracle (max abs error / max abs)


@dataclass(frozen=True)
class Variant:
    """A pipeline of flash_attention_tq_split_v2.wgsl: its override switches."""

    name: str
    doc: str
    switches: tuple[tuple[str, int], ...] = ()
    max_split: int = 512  # SPLIT at most this (256: one key per thread)
    design: str = "v2"  # SHADERS / flash_attention_tq_split_{design}.wgsl

    @property
    def kernel(self) -> str:
        return f"attention_split_tq_{self.design}"

    @property
    def timing_only(self) -> bool:
        """A cut kernel (CUT): garbage partials, timed as a split kernel only."""
        sw = dict(self.switches)
        return bool(sw.get("CUT", 0) or sw.get("SKIP", 0))

    @property
    def measurement(self) -> bool:
        """Made to measure something (cut, skipped work, padding): not a candidate."""
        return self.timing_only or bool(dict(self.switches).get("PAD", 0))

    def smem_bytes(self, group: int, head_dim: int, split: int) -> int:
        """Workgroup memory of the pipeline (the WGSL's override-sized arrays,
        include/split_tq_v2_decls.wgsl)."""
        sw = {"JL_LUT": 1, "CODE_LUT": 1, "STAGE_V": 1, "PAD": 0, **dict(self.switches)}
        d4, nq, pairs = head_dim // 4, -(-group // 4), -(-group // 2)
        if self.design == "v3":  # one shared array (jlut) for the tables, reductions, weights, sums
            shared = max(sw["JL_LUT"] * pairs * head_dim * 4, 4 * 256 * nq, 2 * split * nq)
            return (
                group * d4 * 16  # qv
                + ((1 - sw["JL_LUT"]) * group * d4 + 1) * 16  # qjv
                + shared * 8  # jlut
                + 4
                + 64 * 16
                + 16 * 8
                + 8 * 4  # vstage, red4, cdec, qsum_sh
                + (split // 16 + 1) * 4  # pg_sh
                + (sw["PAD"] + 1) * 4  # padbuf
            )
        return (
            group * d4 * 16  # qv
            + ((1 - sw["JL_LUT"]) * group * d4 + 1) * 16  # qjv
            + (sw["JL_LUT"] * pairs * head_dim * 4 + 1) * 8  # jlut
            + (sw["STAGE_V"] * split * head_dim // 16 + 1) * 4  # vstage
            + split * nq * 16  # wts
            + 32 * 16  # red4
            + 16 * 8  # cdec
            + 8 * 4  # qsum_sh
            + (split // 16 + 1) * 4  # pg_sh
            + (sw.get("PAD", 0) + 1) * 4  # padbuf
        )

    def split_cap(self, group: int, head_dim: int, limit: int) -> int:
        """The longest split the pipeline takes on a device with ``limit`` bytes of
        workgroup memory (SPLIT: 512 or 256, at most the shipped cap)."""
        ship = min(K.TQ_MAX_SPLIT, K.TQ_MAX_SCORES // group)
        for s in (512, 256):
            if s <= min(ship, self.max_split) and self.smem_bytes(group, head_dim, s) <= limit:
                return s
        raise ValueError(f"{self.name}: G={group} d={head_dim} does not fit {limit} bytes of workgroup memory")

    def constants(self, shipped: dict[str, int], limit: int) -> dict[str, int]:
        g, d = int(shipped["GROUP"]), int(shipped["HEAD_DIM"])
        return {"GROUP": g, "HEAD_DIM": d, "SPLIT": self.split_cap(g, d, limit), **dict(self.switches)}


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("v2", "JL by nibble tables, codes by a 16-entry table, values staged in workgroup memory"),
        Variant("v2-alucodes", "v2 with codes decoded by compare/select", (("CODE_LUT", 0),)),
        Variant("v2-alujl", "v2 with the JL term as one FMA per bit and head", (("JL_LUT", 0),)),
        Variant("v2-nostage", "v2 with value words read from global memory in the value phase", (("STAGE_V", 0),)),
        Variant(
            "v2-alu", "v2's structure with no tables and no staging", (("JL_LUT", 0), ("CODE_LUT", 0), ("STAGE_V", 0))
        ),
        Variant("v2-k1", "v2 with one key per thread (splits of at most 256)", (), 256),
        Variant("v2-nostage-k1", "v2-nostage with one key per thread", (("STAGE_V", 0),), 256),
        Variant(
            "v3",
            "v2's scoring, 11 KiB of workgroup memory (one shared array), value rows prefetched in "
            "registers eight at a time, one (max, sum) reduction",
            design="v3",
        ),
        Variant("v3-vpf2", "v3 with value rows prefetched two steps (16 rows) ahead", (("VPF", 2),), design="v3"),
        Variant(
            "v3-vpf0",
            "v3 with its first value rows loaded after the scores (fewer registers)",
            (("VPF", 0),),
            design="v3",
        ),  # fmt: skip
        Variant(
            "v3-vpf2-valu", "v3-vpf2 with value codes by compare/select", (("VPF", 2), ("VCODE_LUT", 0)), design="v3"
        ),
        Variant("v3-alucodes", "v3 with codes decoded by compare/select", (("CODE_LUT", 0),), design="v3"),
        Variant("v3-k1", "v3 with one key per thread (splits of at most 256)", (), 256, design="v3"),
        Variant(
            "v2-nostage-pad",
            "v2-nostage with 16 KiB of unused workgroup memory (occupancy test)",
            (("STAGE_V", 0), ("PAD", 4096)),
        ),  # fmt: skip
    )
}
# phase cuts (timing only): the split kernel stopped after its scores, weights, values
for _base in ("v2", "v2-nostage", "v3", "v3-vpf0", "v3-vpf2"):
    for _cut, _what in ((1, "scores"), (2, "weights"), (3, "values")):
        _v = VARIANTS[_base]
        VARIANTS[f"{_base}@{_what}"] = dataclasses.replace(
            _v, name=f"{_base}@{_what}", doc=f"{_base} cut after its {_what} (timing only)",
            switches=(*_v.switches, ("CUT", _cut)),
        )  # fmt: skip
# measurement only: the scores without their polar / JL part; v3 with padding
for _skip, _what in ((1, "nopolar"), (2, "nojl")):
    VARIANTS[f"v3@scores-{_what}"] = dataclasses.replace(
        VARIANTS["v3"], name=f"v3@scores-{_what}", doc=f"v3 cut after its scores, {_what} (timing only)",
        switches=(("CUT", 1), ("SKIP", _skip)),
    )  # fmt: skip
for _kib in (8, 16, 24, 32):
    VARIANTS[f"v3-pad{_kib}"] = dataclasses.replace(
        VARIANTS["v3"], name=f"v3-pad{_kib}", doc=f"v3 with {_kib} KiB of unused workgroup memory (occupancy test)",
        switches=(("PAD", _kib * 256),),
    )  # fmt: skip
CUTS = tuple(n for n, v in VARIANTS.items() if v.timing_only)
ALL = ("base", *(n for n, v in VARIANTS.items() if not v.measurement))
DEFAULT = (*ALL, "v3-vpf0@scores", "v3-vpf0@weights", "v3-vpf0@values")
TARGETS_US = {32768: 21.0, 131072: 68.0}  # issue 14: 2x faster than torch bf16 SDPA


def register() -> list[str]:
    """Add the variants' kernels to the pipeline registry of this process (the same
    bindings as the shipped split kernel); returns the names it added (``routed``
    takes them out again: the service's own list of kernels stays as shipped)."""
    added = []
    for design in DESIGNS:
        name = f"attention_split_tq_{design}"
        if name not in S.KERNELS:
            base = S.KERNELS[BASE_KERNEL]  # its bindings, and turboquant's constants (the codebook)
            S.KERNELS[name] = S.KernelSpec(
                f"flash_attention_tq_split_{design}.wgsl", name, base.bindings, defines=base.defines, folder=SHADERS
            )
            added.append(name)
    return added


def workgroup_limit(engine) -> int:
    return int(engine.ctx.limits["max-compute-workgroup-storage-size"])


@contextlib.contextmanager
def routed(engine, variant: str | None, head_dim: int, drop: tuple[str, ...] = ()):
    """While inside, the batches of this process send the shipped TurboQuant split
    kernel's dispatches to ``variant`` (None or "base": unchanged), with splits no
    longer than the variant's pipeline takes, and skip the dispatches of the
    kernels in ``drop``."""
    added = register()
    v = VARIANTS.get(variant) if variant else None
    limit = workgroup_limit(engine)
    orig_dispatch, orig_sizes = Batch.dispatch, K.split_sizes

    def dispatch(self, kernel, bindings, grid, constants=None):
        if kernel in drop:
            return None
        if kernel == BASE_KERNEL and v is not None:
            kernel, constants = v.kernel, v.constants(constants, limit)
        return orig_dispatch(self, kernel, bindings, grid, constants)

    def sizes(kv_format, max_seq, n_kv_heads, n_queries, group, *args, **kw):
        s, n = orig_sizes(kv_format, max_seq, n_kv_heads, n_queries, group, *args, **kw)
        if v is not None and kv_format == "turboquant":
            cap = v.split_cap(group, head_dim, limit)
            over = s > cap
            s, n = np.where(over, cap, s), np.where(over, -(-np.asarray(max_seq) // cap), n)
        return s, n

    Batch.dispatch, K.split_sizes = dispatch, sizes
    try:
        yield
    finally:
        Batch.dispatch, K.split_sizes = orig_dispatch, orig_sizes
        for name in added:
            S.KERNELS.pop(name, None)


def split_of(engine, variant: str | None, fmt: str, length: int, n_kv: int, group: int, head_dim: int):
    """(split_len, n_splits) the step of ``variant`` runs with (the policy's split, capped)."""
    s, n = B.choose_split(fmt, length, n_kv, 1, group, engine.policy.target_workgroups)
    v = VARIANTS.get(variant) if variant else None
    if v is not None and fmt == "turboquant":
        cap = v.split_cap(group, head_dim, workgroup_limit(engine))
        if s > cap:
            s, n = cap, -(-length // cap)
    return s, n


def attend(engine, layer, q, *, variant=None, start_pos=None, causal=True, scale=None) -> np.ndarray:
    """One attend of ``q [n, H, d]`` over the whole layer, the split kernel routed to ``variant``."""
    with routed(engine, variant, layer.head_dim):
        out, _ = engine.attend(layer, q, start_pos=start_pos, causal=causal, scale=scale).result()
    return np.array(out)


def oracle(engine, session, layer, q, *, start_pos=None, causal=True, scale=None) -> np.ndarray:
    """The float64 attention of ``q`` over the layer's TurboQuant words as they are on
    the GPU (reference.tqx_attention, one KV head at a time: bounded host memory)."""
    kb, vb = engine.call(lambda ctx: layer.read_words(ctx.device)).result()
    kw, vw = np.frombuffer(kb, np.uint32), np.frombuffer(vb, np.uint32)
    cap, hkv, d = layer.capacity, layer.n_kv_heads, layer.head_dim
    pw, jw, vecs = d // 16, d // 32, hkv * cap
    ps, js = layer_signs(session.config.seed, layer.layer, d)
    g = q.shape[1] // hkv
    out = np.empty(q.shape, np.float64)
    for h in range(hkv):
        kh = np.concatenate(
            [
                kw[h * cap * pw : (h + 1) * cap * pw],
                kw[vecs * pw + h * cap * jw : vecs * pw + (h + 1) * cap * jw],
                kw[vecs * (pw + jw) + h * cap : vecs * (pw + jw) + (h + 1) * cap],
            ]
        )
        vh = np.concatenate(
            [vw[h * cap * pw : (h + 1) * cap * pw], vw[vecs * pw + h * cap : vecs * pw + (h + 1) * cap]]
        )
        out[:, h * g : (h + 1) * g] = ref.tqx_attention(
            q[:, h * g : (h + 1) * g], kh, vh, TQ_SPECS["turboquant"], n_kv_heads=1, cap=cap, length=layer.length,
            polar_signs=ps, jl_signs=js, start_pos=start_pos, causal=causal, scale=scale,
        )  # fmt: skip
    return out


# ── timing ───────────────────────────────────────────────────────────────────


def time_step(engine, layer, q, budget_s: float, timer_box: list) -> tuple[float, float | None]:
    """(wall ms, GPU ms or None) per decode step: ``iters`` steps of ``q`` over the
    whole layer recorded into one submission (each its own dispatches), as many as
    ``budget_s`` of GPU work allows (at most 400); the best of three."""
    length = layer.length

    def run(iters: int):
        done = [0]

        def job(ctx):
            batch = Batch(ctx.device, ctx.pipelines, engine.worker.arenas, ctx.offset_align, engine.policy)
            q_seg = batch.upload(q)
            out = batch.scratch(q.nbytes)
            room = 0.8 * ctx.max_binding  # arenas are bound whole
            for _ in range(iters):
                if batch.largest_arena > room:
                    break
                done[0] += 1
                layer.plan_attend_rows(
                    batch, q_seg, q.shape, out=out, length=length, start_pos=length - q.shape[0], causal=True,
                    scale=1 / math.sqrt(q.shape[-1]),
                )  # fmt: skip
                batch.flush()
            sync = batch.output(4)
            batch.copy(out, 0, sync, 0, 4)
            encoded = batch.encode()
            timer = timer_box[0]
            if timer is None and "timestamp-query" in ctx.features:
                timer = timer_box[0] = GpuTimer(ctx.device)
            t0 = time.perf_counter()
            if timer is not None:
                gpu = timer.run(encoded[0])
                batch.read_back(encoded)
            else:
                gpu = None
                B.submit(batch, encoded)
            return time.perf_counter() - t0, gpu

        wall, gpu = engine.worker.run(job)
        return 1e3 * wall / done[0], (None if gpu is None else gpu / done[0])

    run(1)  # pipelines, arenas
    once = run(1)[0] / 1e3
    iters = int(min(400, max(3, budget_s / max(once, 1e-5))))
    runs = [run(iters) for _ in range(3)]
    wall = min(r[0] for r in runs)
    gpus = [r[1] for r in runs if r[1] is not None]
    return wall, (min(gpus) if gpus else None)


# ── the run ──────────────────────────────────────────────────────────────────


def _slug(name: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    for key in ("h200", "h100", "llvmpipe", "lavapipe"):
        if key in s:
            return ("nvidia-" + key) if key.startswith("h") else key
    return s[:40] or "unknown"


def _fmt(x, w=8, p=4):
    return f"{x:{w}.{p}f}" if isinstance(x, float) else f"{'-':>{w}}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER"))
    ap.add_argument("--contexts", help="comma-separated (default 4096,32768,131072; --quick: 1000,3001)")
    ap.add_argument(
        "--variants",
        default=",".join(DEFAULT),
        help=f"comma-separated, of {', '.join(ALL)}; measurement: {', '.join(n for n in VARIANTS if n not in ALL)} "
        "(default: every candidate and the phase cuts of v3-vpf0)",
    )
    ap.add_argument("--targets", default="", help="KernelPolicy.target_workgroups values (default: the policy's)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (lavapipe): 8 heads, 2 KV heads, d 64")
    ap.add_argument("--budget", type=float, default=0.15, help="seconds of GPU work per timing")
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--no-f32", action="store_true", help="skip the f32 split step (reference)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch bf16 SDPA (reference)")
    ap.add_argument("--json-out", type=Path, help="default bench/results/tq-decode-variants-<adapter>.json")
    args = ap.parse_args(argv)

    h, hkv, d = (8, 2, 64) if args.quick else (B.H, B.HKV, B.D)
    contexts = [int(x) for x in (args.contexts or ("1000,3001" if args.quick else "4096,32768,131072")).split(",")]
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v != "base" and v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; known: {', '.join(ALL)} and the phase cuts {', '.join(CUTS)}")
    if "base" not in variants:
        variants.insert(0, "base")  # the reference every output is checked against

    request_timestamps()  # asked for when the adapter has it
    eng = B.Engine.open(args.adapter, page_tokens=args.page_tokens)
    policy0 = dataclasses.replace(eng.policy, force="split")
    targets = [int(x) for x in args.targets.split(",") if x] or [policy0.target_workgroups]
    eng.policy = policy0
    gpu_name, driver = B.gpu_description(eng)
    limit = workgroup_limit(eng)
    timer_box: list = [None]
    ts = "timestamp-query" in eng.ctx.features
    cgbps, cmethod = B.copy_gbps(eng)
    print(
        f"# {gpu_name} (driver {driver}) via {eng.ctx.backend}; copy {cgbps:.0f} GB/s ({cmethod}); "
        f"workgroup memory {limit} B; timing: {'GPU timestamps + wall' if ts else 'wall only'}",
        flush=True,
    )
    print(f"# shape: {h} q heads, {hkv} KV heads, d {d}, one query row; variants: {', '.join(variants)}", flush=True)
    for name in variants:
        if name in VARIANTS:
            v = VARIANTS[name]
            print(f"#   {name}: {v.doc}; SPLIT {v.split_cap(h // hkv, d, limit)}, "
                  f"{v.smem_bytes(h // hkv, d, v.split_cap(h // hkv, d, limit))} B")  # fmt: skip

    rng = np.random.default_rng(0)
    sessions = {}
    for fmt in ("turboquant",) + (() if args.no_f32 else ("f32",)):
        sessions[fmt] = eng.session_kv(B.SessionConfig(1, h, hkv, d, fmt, max(contexts), 1))
    filled = {fmt: 0 for fmt in sessions}
    rows, failures = [], []

    def fill(fmt, n):
        layer = sessions[fmt].layers[0]
        chunk = 16384
        for start in range(filled[fmt], n, chunk):
            m = min(chunk, n - start)
            k = rng.standard_normal((m, hkv, d), dtype=np.float32)
            v = rng.standard_normal((m, hkv, d), dtype=np.float32)
            eng.append(layer, k, v).result()
        filled[fmt] = n
        return layer

    hdr = (
        f"{'ctx':>7} {'variant':12} {'target':>6} {'split':>5} {'wgs':>5} {'step gpu':>8} {'step wall':>9} "
        f"{'split gpu':>9} {'split wall':>10} {'x base':>6} {'GB/s':>7} {'err base':>8} {'err f64':>8}"
    )
    print(hdr)
    for ctx_len in sorted(contexts):
        layer = fill("turboquant", ctx_len)
        nbytes = ctx_len * B.bytes_per_token("turboquant", hkv, d) + h * d * 4
        q = rng.standard_normal((1, h, d), dtype=np.float32)
        want = oracle(eng, sessions["turboquant"], layer, q)
        peer = None
        if not args.no_torch and not args.quick:
            peer = B.torch_peer_ms(1, ctx_len, "bf16")["ms"]
        ref_rows = {}
        if not args.no_f32:
            f32_layer = fill("f32", ctx_len)
            wall, gms = time_step(eng, f32_layer, q, args.budget, timer_box)
            ref_rows["f32 split step"] = (gms, wall)
        with routed(eng, None, d, drop=(BASE_KERNEL,)):
            wall, gms = time_step(eng, layer, q, args.budget, timer_box)
        ref_rows["rotate+merge only"] = (gms, wall)
        for tw in targets:
            eng.policy = dataclasses.replace(policy0, target_workgroups=tw)
            base_out, base_step = None, None
            for name in variants:
                var = None if name == "base" else name
                split_len, n_splits = split_of(eng, var, "turboquant", ctx_len, hkv, h // hkv, d)
                if var is not None and VARIANTS[var].timing_only:
                    with routed(eng, var, d, drop=("tq_rotate_q", "attention_merge")):
                        split_wall, split_gpu = time_step(eng, layer, q, args.budget, timer_box)
                    rows.append({"context": ctx_len, "variant": name, "switches": dict(VARIANTS[name].switches),
                                 "target_workgroups": tw, "split_len": split_len, "workgroups": n_splits * hkv,
                                 "split_gpu_ms": split_gpu, "split_wall_ms": round(split_wall, 5)})  # fmt: skip
                    print(f"{ctx_len:7d} {name:20} {tw:6d} {split_len:5d} {n_splits * hkv:5d} {'':18} "
                          f"{_fmt(split_gpu, 9)} {_fmt(split_wall, 10)}  (cut: timing only)", flush=True)  # fmt: skip
                    continue
                try:
                    out = attend(eng, layer, q, variant=var)
                except Exception as e:  # a pipeline the device refuses: say so, time the rest
                    failures.append(f"{name} ctx {ctx_len} target {tw}: {type(e).__name__}: {e}")
                    print(f"{ctx_len:7d} {name:12} FAILED: {e}", flush=True)
                    continue
                if base_out is None:
                    base_out = out
                e_base, e_f64 = rel_err(out, base_out), rel_err(out, want)
                ok = e_base <= TOL and e_f64 <= TOL and np.isfinite(out).all()
                if not ok:
                    failures.append(f"{name} ctx {ctx_len} target {tw}: err vs base {e_base:.2e}, vs f64 {e_f64:.2e}")
                with routed(eng, var, d):
                    step_wall, step_gpu = time_step(eng, layer, q, args.budget, timer_box)
                with routed(eng, var, d, drop=("tq_rotate_q", "attention_merge")):
                    split_wall, split_gpu = time_step(eng, layer, q, args.budget, timer_box)
                step = step_gpu if step_gpu is not None else step_wall
                if base_step is None:
                    base_step = step
                row = {
                    "context": ctx_len,
                    "variant": name,
                    "switches": dict(VARIANTS[name].switches) if name in VARIANTS else {},
                    "target_workgroups": tw,
                    "split_len": split_len,
                    "n_splits": n_splits,
                    "workgroups": n_splits * hkv,
                    "step_gpu_ms": None if step_gpu is None else round(step_gpu, 5),
                    "step_wall_ms": round(step_wall, 5),
                    "split_gpu_ms": None if split_gpu is None else round(split_gpu, 5),
                    "split_wall_ms": round(split_wall, 5),
                    "speedup_vs_base": round(base_step / step, 3),
                    "gbps": round(nbytes / step / 1e6, 1),
                    "torch_bf16_ms": None if peer is None else round(peer, 5),
                    "err_vs_base": float(f"{e_base:.3g}"),
                    "err_vs_oracle": float(f"{e_f64:.3g}"),
                    "ok": bool(ok),
                }
                rows.append(row)
                print(
                    f"{ctx_len:7d} {name:12} {tw:6d} {split_len:5d} {n_splits * hkv:5d} {_fmt(step_gpu)} "
                    f"{_fmt(step_wall, 9)} {_fmt(split_gpu, 9)} {_fmt(split_wall, 10)} {base_step / step:6.2f} "
                    f"{nbytes / step / 1e6:7.1f} {e_base:8.1e} {e_f64:8.1e}{'' if ok else '  FAIL'}",
                    flush=True,
                )
        ctx_rows = [r for r in rows if r["context"] == ctx_len and r.get("ok")]
        if ctx_rows:
            best = min(ctx_rows, key=lambda r: r["step_gpu_ms"] or r["step_wall_ms"])
            bms = best["step_gpu_ms"] or best["step_wall_ms"]
            goal = TARGETS_US.get(ctx_len)
            print(
                f"{ctx_len:7d} best: {best['variant']} (target {best['target_workgroups']}) {1e3 * bms:.1f} us a step, "
                f"{best['speedup_vs_base']:.2f}x the shipped kernel"
                + (f", {peer / bms:.2f}x torch bf16" if peer else "")
                + (f"; issue 14 asks <= {goal:.0f} us" if goal else ""),
                flush=True,
            )
        for what, (gms, wall) in ref_rows.items():
            rows.append({"context": ctx_len, "variant": what, "step_gpu_ms": gms, "step_wall_ms": round(wall, 5)})
            print(f"{ctx_len:7d} {what:22} {'':19}{_fmt(gms)} {_fmt(wall, 9)}", flush=True)
        if peer is not None:
            print(f"{ctx_len:7d} {'torch bf16 SDPA':22} {'':19}{_fmt(peer)}", flush=True)
        eng.policy = policy0
    doc = {
        "gpu": gpu_name,
        "driver": driver,
        "backend": eng.ctx.backend,
        "commit": B.git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "copy_gbps": round(cgbps, 1),
        "copy_method": cmethod,
        "timing": "gpu timestamps and wall" if ts else "wall",
        "workgroup_storage_limit": limit,
        "shape": {"num_qo_heads": h, "num_kv_heads": hkv, "head_dim": d, "queries": 1},
        "page_tokens": args.page_tokens,
        "variants": {n: {"doc": v.doc, "switches": dict(v.switches)} for n, v in VARIANTS.items()},
        "rows": rows,
        "failures": failures,
    }
    path = args.json_out or ROOT / "bench" / "results" / f"tq-decode-variants-{_slug(gpu_name)}.json"
    write_result(path, doc)
    print(f"# wrote {path}")
    for s in sessions.values():
        eng.release(s).result()
    eng.close()
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
