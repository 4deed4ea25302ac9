#!/usr/bin/env python3
"""Half-precision decode kernel variants against the shipped split kernel (issue 54 item 1).

    python bench/probes/half_decode_variants.py --adapter nvidia --json-out bench/results/NAME.json
    python bench/probes/half_decode_variants.py --adapter nvidia --smoke      # ~30 s sanity run
        [--contexts 4096,32768,131072] [--formats f16,bf16,f32] [--variants base,wide,flash,...]
        [--budget 0.1] [--batched 64x4096 | --batched ''] [--no-torch]

Predictions (written before any measurement; H100, one query row, 32 q / 8 KV heads of
128; the shipped f16 kernel takes ~0.11 ms at 32k and ~0.42 ms at 128k there, issue 54):

- ``base`` f16 (the shipped kernel): 0.11 / 0.42 ms at 32k / 128k, as issue 54 measured.
  ``base`` bf16 (the shipped kernel over a bf16 slab, widened by a shift and a mask
  instead of unpack2x16float): the same within 5%, since the widening is not what
  bounds it.
- ``wide`` (16-byte loads in both phases): the score phase issues half the load
  instructions (16 instead of 32 a key row, each thread's warp load touching 32 rows:
  the L1 wavefronts of a score step halve) and the value phase half the loads per
  row; the FMAs and the queries' workgroup-memory reads are unchanged. If the loads
  (uncoalesced score loads above all) are what bounds it: ~1.3x, f16 0.085 / 0.32 ms;
  bf16 the same.
- ``flash`` (lane groups of 16 per key, online softmax, no scores array, TK = 4): the
  score loads become fully coalesced (a warp load covers two whole 256-byte rows: ~8x
  fewer L1 wavefronts than thread-per-key), the queries live in registers (no
  workgroup-memory reads in the loop), no barriers until the end; it pays 4 x G x TK
  = 64 shuffles per lane per tile and softmax work repeated in the 16 lanes of a group
  (~30% more instructions than shipped per key). A lane-group design was measured
  1.5-1.7x slower once (the retired attention_split_lanes, which kept the scores array
  and the thread-per-column value phase); this one keeps every byte in registers
  between its load and its use. Prediction: 0.065 / 0.23 ms (f16 and bf16: ~2.1 /
  2.3 TB/s, ~65-70% of the H100's copy bandwidth), i.e. 1.7-1.8x the shipped kernel,
  still ~1.2x torch bf16 (~0.055 / 0.19 ms). ``flash-t2`` slower (more rescales per
  key, fewer loads in flight); ``flash-long`` (splits twice as long) within 5% at 128k, slower at 32k (128
  workgroups on 132 SMs).
- ``flash`` over f32 (variant (d)): f32 is already near its bytes (0.41 ms at 128k, 87%
  of bandwidth on the H100); flash reads the same bytes with two 16-byte loads per
  piece: no gain, 0.40-0.45 ms at 128k.
- batched 64 x 4k: each session is 4 splits of 1024 keys; the variants' gains carry
  over as at 4k-32k (wide ~1.2x, flash ~1.5x the shipped f16 step).

Seen since (a --smoke sanity run on an H200, not the H100; 4k and 32k, budget 0.02 s;
not the measurement): ``wide`` 1.15x / 1.28x the shipped f16 kernel at 4k / 32k (0.090
against 0.115 ms at 32k), bf16 alike; the first ``flash`` (its per-lane values in
function-scope arrays, with a ``flash-t8`` of tiles of 8) ran 4.2x slower than shipped
(0.476 ms at 32k): naga clamps such arrays' indices and the driver kept them in local
memory. The kernel was rewritten with named registers and vec4-per-four-heads softmax
(tiles of 2 or 4 keys; ``flash-t8`` dropped); the predictions above stand for it.

What it does: a decode attend (one query row) over a plain cache written by the
service (Engine, pool, appends: f16 rows rounded on the host as numpy rounds), planned
by the service's own code (kv.kinds -> kernels.plan_split: the split kernel with the
params blocks it packs, then attention_merge). A variant replaces only the split
kernel's dispatches: the same bindings, params (SplitParams) and partials, so the
shipped merge finishes it. Formats: ``f16`` (the service's), ``bf16`` (an f16 session's
slab holding bfloat16 bits, loaded through LayerCache.load_words: the same layout,
rounded to nearest even on the host), ``f32``. Variants (``VARIANTS``):

- ``base``: the shipped split kernel (``attention_split.f16`` / ``.f32``; for bf16 the
  shipped file compiled with the shipped bf16 slab include, shaders/include/kv_vec4_bf16.wgsl);
- ``wide``: (b) of the issue's brief, shipped since as the half formats' split kernel
  (shaders/attention_split_wide.wgsl, include/kv_wide_{f16,bf16}.wgsl; halves only):
  ``base`` is then the vec4 kernel it replaced for head_dim % 8 == 0;
- ``flash``, ``flash-t2``, ``flash-long``: half_split_flash.wgsl, (c)
  (and over f32, (d)); needs the adapter's ``subgroup`` feature (asked for here) and
  queries the subgroup size (a one-line kernel) to size its lane groups.

Per format and context every variant's output is checked against the shipped
kernel's and against a float64 numpy oracle of the cache as stored (one KV head at a
time), <= 1e-4 of the output's max abs value (``TOL``; observed spread printed), before
it is timed: the whole step (split + merge) and the split kernel alone (merge dropped),
many steps recorded into one submission, GPU timestamps (tq_decode_variants.time_step,
imported). Bandwidth: bytes of K+V read over the step's time, and its share of the
copy bandwidth measured in the same run (kernel_bench.copy_gbps). Peers in the same run,
timed by kernel_bench.torch_peer_ms (both GQA forms, the faster counts): torch SDPA
bf16, and f16 (the same function with torch.bfloat16 standing for torch.float16 while
it runs: kernel_bench knows only f32 and bf16). The batched step (``--batched``,
default 64x4096; kernel_bench.time_batched, wall time) runs every variant over 64
sessions of one slab per format. Writes JSON (``--json-out``; default
bench/results/half-decode-variants-<adapter>.json); exit status 1 when a check
failed or a variant could not run.

Everything that swaps kernels is monkeypatching inside this process (Batch.dispatch,
kernels.PLAIN_MAX_SCORES for the long splits, entries of shaders.KERNELS; restored on
exit; device.OPTIONAL_FEATURES gains timestamp-query and subgroup): no service file
is changed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / p) for p in ("bench/probes", "bench", "service", "client")] + [str(ROOT)]
import kernel_bench as B  # noqa: E402  (Engine, copy_gbps, torch peers, time_batched)
import tq_decode_variants as TV  # noqa: E402  (time_step: GPU-timestamped decode steps)
from gpu_timing import request_timestamps  # noqa: E402

from attnserve.gpu import device as DEV  # noqa: E402
from attnserve.gpu import kernels as K  # noqa: E402
from attnserve.gpu import shaders as S  # noqa: E402
from attnserve.gpu.batch import Batch  # noqa: E402
from attnserve.kv.config import SessionConfig  # noqa: E402
from tools import reference as ref  # noqa: E402
from tools.common import rel_err, write_result  # noqa: E402

SHADERS = Path(__file__).resolve().parent / "shaders"  # the probe's kernels (KernelSpec.folder)
TOL = 1e-4  # max abs error / max abs of the reference: against the shipped kernel and the float64 oracle
FORMATS = ("f16", "bf16", "f32")
HALF = ("f16", "bf16")
SLAB = {"f16": "f16", "bf16": "f16", "f32": "f32"}  # the service format whose slab holds each
ELEMENT_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
MAX_PPL = 2  # half_split_flash.wgsl: pieces per lane at most (its TK: 2 or 4)


@dataclass(frozen=True)
class Variant:
    """A decode split kernel: ``file``/``entry`` of SHADERS (None: the shipped one)."""

    name: str
    doc: str
    file: str | None = None
    entry: str | None = None
    tk: int = 0  # flash: keys per lane group and tile
    split_mult: int = 1  # splits up to this many times the shipped cap (PLAIN_MAX_SCORES / G)
    formats: tuple[str, ...] = FORMATS

    @property
    def subgroups(self) -> bool:
        return self.entry == "half_split_flash"

    def kernel(self, fmt: str) -> str:
        """The KERNELS name this variant runs for ``fmt``."""
        if self.file is None:
            return S.plain_kernel("attention_split", fmt) if fmt != "bf16" else "attention_split.bf16-probe"
        return f"{self.entry}.{fmt}"


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("base", "the vec4 split kernel (attention_split.wgsl; bf16: the shipped file over kv_vec4_bf16.wgsl)"),
        Variant(
            "wide",
            "attention_split's structure, 16-byte loads (8 halves) in the score and the value phase: the shipped "
            "kernel of the half formats since issue 54 (attention_split_wide.wgsl)",
            "attention_split_wide.wgsl",
            "attention_split_wide",
            formats=HALF,
        ),
        Variant(
            "flash",
            "lane group per key (d/8 lanes, 16-byte pieces), shuffle-xor dots, online softmax over tiles of 4 keys, "
            "V in the same lanes, lane groups combined at the end",
            "half_split_flash.wgsl",
            "half_split_flash",
            tk=4,
        ),
        Variant("flash-t2", "flash with tiles of 2 keys", "half_split_flash.wgsl", "half_split_flash", tk=2),
        Variant(
            "flash-long",
            "flash with splits up to twice the shipped cap",
            "half_split_flash.wgsl",
            "half_split_flash",
            tk=4,
            split_mult=2,
        ),
    )
}
DEFAULT = ("base", "wide", "flash", "flash-t2", "flash-long")
SMOKE = ("base", "wide", "flash")


# ── kernels: registration, subgroup size, routing ───────────────────────────


def register() -> list[str]:
    """Add the probe's kernels to this process's registry (the shipped split kernel's
    bindings); returns the names added (:func:`unregister` takes them out again)."""
    bindings = S.KERNELS[S.plain_kernel("attention_split", "f32")].bindings
    added = []
    specs = {"attention_split.bf16-probe": S.KernelSpec(
        str(S.shader_dir() / "attention_split.wgsl"), "attention_split", bindings, (), (("KV", "bf16"),),
        warm=False, folder=SHADERS,
    )}  # fmt: skip
    for v in VARIANTS.values():
        if v.file is not None:
            for fmt in v.formats:
                features = ("subgroup",) if v.subgroups else ()
                specs[v.kernel(fmt)] = S.KernelSpec(
                    v.file, v.entry, bindings, features, (("KV", fmt),), warm=False, folder=SHADERS
                )
    for name, spec in specs.items():
        if name not in S.KERNELS:
            S.KERNELS[name] = spec
            added.append(name)
    return added


def unregister(added: list[str]) -> None:
    for name in added:
        S.KERNELS.pop(name, None)


def request_subgroups() -> None:
    """Have ``open_device`` ask for the ``subgroup`` feature where the adapter has it."""
    if "subgroup" not in DEV.OPTIONAL_FEATURES:
        DEV.OPTIONAL_FEATURES = (*DEV.OPTIONAL_FEATURES, "subgroup")


_SG_WGSL = """
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(256, 1, 1)
fn main(@builtin(local_invocation_index) i: u32, @builtin(subgroup_size) s: u32) {
    out[i] = s;
}
"""


def subgroup_size(engine) -> int | None:
    """The subgroup size a 256-invocation compute workgroup runs with on this device
    (the least its invocations report), or None without the ``subgroup`` feature."""
    if "subgroup" not in engine.ctx.features:
        return None

    def job(ctx):
        import wgpu

        dev = ctx.device
        buf = dev.create_buffer(size=1024, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
        module = dev.create_shader_module(code=_SG_WGSL)
        pipe = dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[{"binding": 0, "resource": {
            "buffer": buf, "offset": 0, "size": 1024}}])  # fmt: skip
        enc = dev.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(1, 1, 1)
        cp.end()
        dev.queue.submit([enc.finish()])
        sizes = np.frombuffer(dev.queue.read_buffer(buf), np.uint32)
        buf.destroy()
        return int(sizes.min())

    return int(engine.call(job).result())


def flash_shape(head_dim: int, sg: int | None) -> tuple[int, int, int]:
    """(NP, LG, PPL) of the flash kernel at ``head_dim`` on a subgroup of ``sg``
    lanes: pieces a row, lanes a key (the least power of two holding the pieces, at
    most the subgroup), pieces a lane. Raises where it cannot run."""
    if head_dim % 8 or head_dim > 128:
        raise ValueError(f"flash needs head_dim % 8 == 0 and <= 128, not {head_dim}")
    if not sg:
        raise ValueError("flash needs the adapter's subgroup feature")
    n_pieces = head_dim // 8
    lanes = min(1 << (n_pieces - 1).bit_length(), sg)
    ppl = -(-n_pieces // lanes)
    if ppl > MAX_PPL:
        raise ValueError(f"flash: {n_pieces} pieces on a subgroup of {sg} need {ppl} pieces a lane (> {MAX_PPL})")
    return n_pieces, lanes, ppl


def supports(variant: str, fmt: str, head_dim: int, sg: int | None) -> str | None:
    """Why ``variant`` cannot run ``fmt`` at ``head_dim`` here (None: it can)."""
    v = VARIANTS[variant]
    if fmt not in v.formats:
        return f"{variant} does not read {fmt}"
    if v.file is not None and head_dim % 8:
        return f"{variant} reads 16-byte pieces: head_dim % 8 != 0"
    if v.subgroups:
        try:
            flash_shape(head_dim, sg)
        except ValueError as e:
            return str(e)
    return None


@contextlib.contextmanager
def routed(engine, variant: str, fmt: str, group: int, head_dim: int, sg: int | None, drop: tuple[str, ...] = ()):
    """While inside, the batches of this process send the plain split kernel's
    dispatches of ``fmt``'s slab to ``variant`` (with its constants), give the
    plain kernels longer splits where it asks, and skip the dispatches of the
    kernels in ``drop``."""
    v = VARIANTS[variant]
    target = v.kernel(fmt)
    # what the service dispatches for this slab: the wide kernel for halves with head_dim % 8 == 0
    shipped = S.plain_kernel(
        "attention_split_wide" if K.wide_split(SLAB[fmt], head_dim) else "attention_split", SLAB[fmt]
    )
    consts: dict[str, int] | None = None
    cap = K.PLAIN_MAX_SCORES * v.split_mult
    if v.subgroups:
        n_pieces, lanes, ppl = flash_shape(head_dim, sg)
        pg_max = max(256, cap // max(group, 1) // engine.pools.page_tokens + 2)
        consts = {"GROUP": group, "NP": n_pieces, "LG": lanes, "PPL": ppl, "TK": v.tk, "PG_MAX": pg_max}
    orig_dispatch, orig_cap = Batch.dispatch, K.PLAIN_MAX_SCORES

    def dispatch(self, kernel, bindings, grid, constants=None):
        if kernel in drop:
            return None
        if kernel == shipped and target != shipped:
            kernel, constants = target, consts
        return orig_dispatch(self, kernel, bindings, grid, constants)

    Batch.dispatch, K.PLAIN_MAX_SCORES = dispatch, cap
    try:
        yield
    finally:
        Batch.dispatch, K.PLAIN_MAX_SCORES = orig_dispatch, orig_cap


def split_of(engine, variant: str, length: int, n_kv: int, group: int) -> tuple[int, int]:
    """(split_len, n_splits) of one attend of ``variant`` (the policy's, capped)."""
    saved = K.PLAIN_MAX_SCORES
    K.PLAIN_MAX_SCORES = saved * VARIANTS[variant].split_mult
    try:
        return B.choose_split("f32", length, n_kv, 1, group, engine.policy.target_workgroups)
    finally:
        K.PLAIN_MAX_SCORES = saved


# ── caches and the oracle ────────────────────────────────────────────────────


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (finite inputs)."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((b + (((b >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def stored(fmt: str, x: np.ndarray) -> np.ndarray:
    """The values a ``fmt`` cache holds for float32 rows ``x`` (as float32)."""
    if fmt == "f16":
        return x.astype(np.float16).astype(np.float32)
    if fmt == "bf16":
        return bf16_value(bf16_bits(x))
    return np.asarray(x, np.float32)


def make_session(engine, fmt: str, h: int, hkv: int, d: int, max_tokens: int, seed: int = 1):
    """A one-layer session whose slab holds ``fmt`` (bf16: an f16 session's)."""
    return engine.session_kv(SessionConfig(1, h, hkv, d, SLAB[fmt], max_tokens, seed))


def fill(engine, layer, fmt: str, k: np.ndarray, v: np.ndarray) -> None:
    """Make ``layer`` hold the rows ``k, v [L, Hkv, d]`` (float32) as ``fmt``: appended
    through the service (f16, f32; the rows past its length appended), or, for bf16,
    the bfloat16 bits of every row loaded in the f16 slab's layout (load_words)."""
    if fmt != "bf16":
        chunk = 16384
        for start in range(layer.length, k.shape[0], chunk):
            end = min(start + chunk, k.shape[0])
            engine.append(layer, np.ascontiguousarray(k[start:end]), np.ascontiguousarray(v[start:end])).result()
        return
    n = k.shape[0]
    kb, vb = bf16_bits(k.reshape(n, -1)).tobytes(), bf16_bits(v.reshape(n, -1)).tobytes()
    engine.call(lambda ctx: layer.load_words(ctx.device, n, n, kb, vb)).result()


def oracle(fmt: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, **kw) -> np.ndarray:
    """float64 attention of ``q [n, H, d]`` over the cache as ``fmt`` stores ``k, v``
    (one KV head at a time: bounded host memory)."""
    hkv = k.shape[1]
    g = q.shape[1] // hkv
    out = np.empty(q.shape, np.float64)
    for h in range(hkv):
        out[:, h * g : (h + 1) * g] = ref.attention(
            q[:, h * g : (h + 1) * g], stored(fmt, k[:, h : h + 1]), stored(fmt, v[:, h : h + 1]), **kw
        )
    return out


def attend(engine, layer, q, fmt: str, variant: str, sg: int | None, **kw) -> np.ndarray:
    """One attend of ``q [n, H, d]`` over the whole layer, its split kernel ``variant``."""
    g = q.shape[1] // layer.n_kv_heads
    with routed(engine, variant, fmt, g, layer.head_dim, sg):
        out, _ = engine.attend(layer, q, **kw).result()
    return np.array(out)


# ── the run ──────────────────────────────────────────────────────────────────


def _f(x, w=8, p=4):
    return f"{x:{w}.{p}f}" if isinstance(x, float) else f"{'-':>{w}}"


def torch_peers(length: int) -> dict:
    """torch SDPA at one decode (kernel_bench's shapes): bf16 and f16, both GQA forms."""
    out = {"bf16": B.torch_peer_ms(1, length, "bf16")}
    try:
        import torch
    except Exception:
        return out
    saved = torch.bfloat16
    torch.bfloat16 = torch.float16  # kernel_bench.torch_sdpa_ms's dtype table knows f32 and bf16 only
    try:
        out["f16"] = B.torch_peer_ms(1, length, "bf16")
    finally:
        torch.bfloat16 = saved
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER"))
    ap.add_argument("--contexts", help="comma-separated (default 4096,32768,131072; --smoke 4096,32768)")
    ap.add_argument("--formats", default="f16,bf16,f32", help="of f16, bf16, f32")
    ap.add_argument("--variants", help=f"comma-separated, of {', '.join(VARIANTS)} (default: all; --smoke: "
                    f"{','.join(SMOKE)}); f32 runs base and the flash ones")  # fmt: skip
    ap.add_argument("--budget", type=float, default=0.1, help="seconds of GPU work per timing (--smoke 0.02)")
    ap.add_argument("--batched", default="64x4096", help="SESSIONSxCONTEXT batched step ('' to skip; --smoke skips)")
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-split-only", action="store_true", help="skip timing the split kernel alone")
    ap.add_argument("--smoke", action="store_true", help="a ~30 s sanity run: 4k and 32k, base/wide/flash")
    ap.add_argument("--json-out", type=Path, help="default bench/results/half-decode-variants-<adapter>.json")
    args = ap.parse_args(argv)

    h, hkv, d = B.H, B.HKV, B.D
    g = h // hkv
    contexts = sorted(
        int(x) for x in (args.contexts or ("4096,32768" if args.smoke else "4096,32768,131072")).split(",")
    )
    formats = [f for f in args.formats.split(",") if f]
    variants = [v for v in (args.variants.split(",") if args.variants else (SMOKE if args.smoke else DEFAULT)) if v]
    budget = 0.02 if args.smoke and args.budget == 0.1 else args.budget
    batched = "" if args.smoke else args.batched
    bad = [v for v in variants if v not in VARIANTS] + [f for f in formats if f not in FORMATS]
    if bad:
        ap.error(f"unknown {bad}; variants: {', '.join(VARIANTS)}; formats: {', '.join(FORMATS)}")
    if "base" not in variants:
        variants.insert(0, "base")  # the reference every output is checked against

    features = DEV.OPTIONAL_FEATURES
    request_timestamps()
    request_subgroups()
    try:
        eng = B.Engine.open(args.adapter, page_tokens=args.page_tokens)
    finally:
        DEV.OPTIONAL_FEATURES = features  # as it was, for what this process opens next
    added = register()
    eng.policy = dataclasses.replace(eng.policy, force="split")
    try:
        return _run(eng, args, h, hkv, d, g, contexts, formats, variants, budget, batched)
    finally:
        eng.close()
        unregister(added)


def _run(eng, args, h, hkv, d, g, contexts, formats, variants, budget, batched) -> int:
    gpu_name, driver = B.gpu_description(eng)
    sg = subgroup_size(eng)
    ts = "timestamp-query" in eng.ctx.features
    cgbps, cmethod = B.copy_gbps(eng)
    print(f"# {gpu_name} (driver {driver}) via {eng.ctx.backend}; copy {cgbps:.0f} GB/s ({cmethod}); subgroup size "
          f"{sg}; timing: {'GPU timestamps + wall' if ts else 'wall only'}", flush=True)  # fmt: skip
    print(f"# shape: {h} q heads, {hkv} KV heads, d {d}, one query row; budget {budget} s a timing", flush=True)
    for name in variants:
        v = VARIANTS[name]
        extra = ""
        if v.subgroups and sg:
            n_pieces, lanes, ppl = flash_shape(d, sg)
            extra = f" [LG {lanes}, pieces/lane {ppl}, TK {v.tk}]"
        print(f"#   {name}: {v.doc}{extra}", flush=True)

    rng = np.random.default_rng(0)
    cap = max(contexts)
    k_all = np.empty((cap, hkv, d), np.float32)
    v_all = np.empty((cap, hkv, d), np.float32)
    made = 0
    sessions = {fmt: make_session(eng, fmt, h, hkv, d, cap) for fmt in formats}
    rows, failures, peers = [], [], {}
    timer_box: list = [None]
    hdr = (f"{'fmt':5} {'ctx':>7} {'variant':11} {'split':>5} {'wgs':>5} {'step gpu':>8} {'step wall':>9} "
           f"{'split gpu':>9} {'x base':>6} {'GB/s':>7} {'%copy':>5} {'err base':>8} {'err f64':>8}")  # fmt: skip
    print(hdr, flush=True)
    for ctx_len in contexts:
        if ctx_len > made:
            k_all[made:ctx_len] = rng.standard_normal((ctx_len - made, hkv, d), dtype=np.float32)
            v_all[made:ctx_len] = rng.standard_normal((ctx_len - made, hkv, d), dtype=np.float32)
            made = ctx_len
        q = rng.standard_normal((1, h, d), dtype=np.float32)
        if not args.no_torch:
            peers[ctx_len] = torch_peers(ctx_len)
        for fmt in formats:
            layer = sessions[fmt].layers[0]
            fill(eng, layer, fmt, k_all[:ctx_len], v_all[:ctx_len])
            want = oracle(fmt, q, k_all[:ctx_len], v_all[:ctx_len])
            kv_bytes = 2 * ctx_len * hkv * d * ELEMENT_BYTES[fmt]
            base_out, base_step = None, None
            for name in variants:
                why = supports(name, fmt, d, sg)
                if why:
                    if name == "base" or VARIANTS[name].subgroups and fmt != "f32":
                        failures.append(f"{fmt} {name}: {why}")
                    continue
                split_len, n_splits = split_of(eng, name, ctx_len, hkv, g)
                try:
                    out = attend(eng, layer, q, fmt, name, sg)
                except Exception as e:  # a pipeline the device refuses: say so, time the rest
                    failures.append(f"{fmt} {name} ctx {ctx_len}: {type(e).__name__}: {e}")
                    print(f"{fmt:5} {ctx_len:7d} {name:11} FAILED: {e}", flush=True)
                    continue
                if base_out is None:
                    base_out = out
                e_base, e_f64 = rel_err(out, base_out), rel_err(out, want)
                ok = bool(np.isfinite(out).all() and e_base <= TOL and e_f64 <= TOL)
                if not ok:
                    failures.append(f"{fmt} {name} ctx {ctx_len}: err vs base {e_base:.2e}, vs f64 {e_f64:.2e}")
                    print(f"{fmt:5} {ctx_len:7d} {name:11} WRONG: err vs base {e_base:.2e}, vs f64 {e_f64:.2e}")
                    continue  # never time a wrong kernel
                with routed(eng, name, fmt, g, d, sg):
                    step_wall, step_gpu = TV.time_step(eng, layer, q, budget, timer_box)
                split_gpu = split_wall = None
                if not args.no_split_only:
                    with routed(eng, name, fmt, g, d, sg, drop=("attention_merge",)):
                        split_wall, split_gpu = TV.time_step(eng, layer, q, budget, timer_box)
                step = step_gpu if step_gpu is not None else step_wall
                base_step = base_step or step
                gbps = kv_bytes / step / 1e6
                row = {
                    "kv_format": fmt, "context": ctx_len, "variant": name, "split_len": split_len,
                    "n_splits": n_splits, "workgroups": n_splits * hkv,
                    "step_gpu_ms": None if step_gpu is None else round(step_gpu, 5),
                    "step_wall_ms": round(step_wall, 5),
                    "split_gpu_ms": None if split_gpu is None else round(split_gpu, 5),
                    "split_wall_ms": None if split_wall is None else round(split_wall, 5),
                    "speedup_vs_base": round(base_step / step, 3), "kv_bytes": kv_bytes,
                    "kv_gbps": round(gbps, 1), "copy_fraction": round(gbps / cgbps, 4),
                    "err_vs_base": float(f"{e_base:.3g}"), "err_vs_oracle": float(f"{e_f64:.3g}"), "ok": ok,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{fmt:5} {ctx_len:7d} {name:11} {split_len:5d} {n_splits * hkv:5d} {_f(step_gpu)} "
                    f"{_f(step_wall, 9)} {_f(split_gpu, 9)} {base_step / step:6.2f} {gbps:7.1f} "
                    f"{100 * gbps / cgbps:5.1f} {e_base:8.1e} {e_f64:8.1e}",
                    flush=True,
                )
        for dt, peer in peers.get(ctx_len, {}).items():
            if peer.get("ms"):
                nb = 2 * ctx_len * hkv * d * 2
                print(f"{'torch':5} {ctx_len:7d} {dt + ' SDPA':11} {'':11} {_f(peer['ms'])} {'':30}"
                      f"{nb / peer['ms'] / 1e6:7.1f} {100 * nb / peer['ms'] / 1e6 / cgbps:5.1f}  ({peer['form']}; "
                      f"gqa {_f(peer.get('native_ms'), 6)}, repeat {_f(peer.get('repeat_ms'), 6)})", flush=True)  # fmt: skip
    for s in sessions.values():
        eng.release(s).result()

    batched_rows = []
    if batched:
        n_sess, length = (int(x) for x in batched.split("x"))
        for fmt in formats:
            group_s = [make_session(eng, fmt, h, hkv, d, length, 2 + i) for i in range(n_sess)]
            for s in group_s:
                fill(eng, s.layers[0], fmt, rng.standard_normal((length, hkv, d), dtype=np.float32),
                     rng.standard_normal((length, hkv, d), dtype=np.float32))  # fmt: skip
            layers = [s.layers[0] for s in group_s]
            base_ms = None
            for name in variants:
                if supports(name, fmt, d, sg):
                    continue
                try:
                    with routed(eng, name, fmt, g, d, sg):
                        ms = B.time_batched(eng, layers, rng, budget)
                except Exception as e:
                    failures.append(f"batched {fmt} {name}: {type(e).__name__}: {e}")
                    continue
                base_ms = base_ms or ms
                nb = 2 * n_sess * length * hkv * d * ELEMENT_BYTES[fmt]
                batched_rows.append({"kv_format": fmt, "variant": name, "sessions": n_sess, "context": length,
                                     "wall_ms": round(ms, 4), "speedup_vs_base": round(base_ms / ms, 3),
                                     "kv_gbps": round(nb / ms / 1e6, 1)})  # fmt: skip
                print(f"batched {fmt:5} {n_sess}x{length} {name:11} {ms:8.4f} ms (wall, per step)  "
                      f"x base {base_ms / ms:5.2f}  {nb / ms / 1e6:7.1f} GB/s", flush=True)  # fmt: skip
            for s in group_s:
                eng.release(s).result()

    worst = {}
    for r in rows:
        key = f"{r['kv_format']} {r['variant']}"
        worst[key] = max(worst.get(key, 0.0), r["err_vs_oracle"])
    print("# worst error vs the float64 oracle: " + ", ".join(f"{k} {e:.1e}" for k, e in worst.items()))
    doc = {
        "gpu": gpu_name,
        "driver": driver,
        "backend": eng.ctx.backend,
        "commit": B.git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "copy_gbps": round(cgbps, 1),
        "copy_method": cmethod,
        "subgroup_size": sg,
        "timing": "gpu timestamps and wall" if ts else "wall",
        "budget_s": budget,
        "shape": {"num_qo_heads": h, "num_kv_heads": hkv, "head_dim": d, "queries": 1},
        "page_tokens": args.page_tokens,
        "tolerance": TOL,
        "variants": {n: {"doc": v.doc, "tk": v.tk, "split_mult": v.split_mult} for n, v in VARIANTS.items()},
        "rows": rows,
        "batched": batched_rows,
        "torch": {str(c): p for c, p in peers.items()},
        "worst_err_vs_oracle": worst,
        "failures": failures,
    }
    path = args.json_out or ROOT / "bench" / "results" / f"half-decode-variants-{TV._slug(gpu_name)}.json"
    write_result(path, doc)
    print(f"# wrote {path}")
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
