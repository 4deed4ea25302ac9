"""Helpers for the compute-core tests (no pytest fixtures here)."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from attnserve.kv.config import SessionConfig
from attnserve.kv.session import SessionKV
from tools.common import rel_err  # noqa: F401  (the tests import it from here)

# Relative error of a result against its float64 oracle: max abs error over the
# oracle's max abs value (a norm-wise bound; per-element relative error is
# meaningless for outputs near zero).


# Timesteps per page of the core tests' engine (conftest.engine): the smallest the
# pool takes, so that every length the kernel tests use spans page boundaries.
CORE_PAGE_TOKENS = 16


def lse_err(got: np.ndarray, want: np.ndarray) -> float:
    """An attend's log-sum-exp against its oracle's: max abs error over max(1,
    |lse|) per value (a log: its absolute error is what a merge's weights feel,
    relative where the value is large)."""
    want = np.asarray(want, np.float64)
    assert np.shape(got) == want.shape, (np.shape(got), want.shape)
    return float((np.abs(np.asarray(got, np.float64) - want) / np.maximum(np.abs(want), 1.0)).max())


def session(engine, fmt, h, hkv, d, *, layers=1, max_tokens=4096, seed=1234) -> SessionKV:
    return engine.session_kv(SessionConfig(layers, h, hkv, d, fmt, max_tokens, seed))


def filled(engine, rng, fmt, h, hkv, d, n):
    """A one-layer session of ``fmt`` holding ``n`` random timesteps: the session,
    its layer, and the rows appended (k, v)."""
    kv = session(engine, fmt, h, hkv, d)
    k, v = rows(rng, n, hkv, d), rows(rng, n, hkv, d)
    engine.append(kv.layers[0], k, v).result()
    return kv, kv.layers[0], k, v


def core_engine(**options):
    """An engine on the tests' adapter (``ATTNSERVE_ADAPTER``, else the first) with the
    smallest page, so the kernels' tests cross page boundaries at every length (the
    caller closes it)."""
    from attnserve.engine import Engine

    adapter = os.environ.get("ATTNSERVE_ADAPTER") or None
    return Engine.open(adapter, page_tokens=CORE_PAGE_TOKENS, **options)


def small_slab_engine():
    """An engine whose slabs hold 8 pages of a [P, 1, 8] f32 layout: layers fill them
    fast and move (the caller closes it)."""
    return core_engine(pool_slab_bytes=8 * CORE_PAGE_TOKENS * 8 * 4)


def rows(rng, n, heads, d, scale=1.0) -> np.ndarray:
    return (rng.standard_normal((n, heads, d)) * scale).astype(np.float32)


def stored(fmt: str, x: np.ndarray) -> np.ndarray:
    """Rows as a plain format stores them (f16: rounded to float16 as numpy rounds;
    bf16: to bfloat16 to nearest even, :func:`bf16_nearest`), for the float64 oracle."""
    from attnserve.formats import PLAIN_DTYPES
    from attnserve_client import wire

    if fmt == "bf16":
        return wire.to_float32(bf16_nearest(x))
    return x.astype(PLAIN_DTYPES[fmt]).astype(np.float32)


def run_plan(engine, plan, timeout: float | None = None):
    """Queue ``plan`` (a ``Batch -> finish`` function) on the engine's GPU worker and
    wait: what its finish returns from the batch's output bytes."""
    return engine.worker.submit_plan(plan).result(timeout)


def reserve(engine, layer, capacity):
    """Take the pages of ``capacity`` timesteps of ``layer`` now (capped at its
    max_tokens; never gives any back)."""

    def plan(batch):
        layer._ensure_pages(batch, min(capacity, layer.max_tokens))
        return lambda out: None

    run_plan(engine, plan)


def read_words(engine, layer):
    kb, vb = engine.call(lambda ctx: layer.read_words(ctx.device)).result()
    return np.frombuffer(kb, np.uint32), np.frombuffer(vb, np.uint32)


def no_adapter(reason: str):
    """Skip a GPU test on a developer machine without what it needs; under CI (the
    CI variable set) fail instead, so CI can never pass by skipping them."""
    if os.environ.get("CI"):
        pytest.fail(f"CI needs a wgpu adapter (lavapipe): {reason}", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def item_path():
    """While inside, every step is planned item by item (``Engine``'s item path, the
    one its columns fall back to): the oracle the columns are bit-identical to.
    Wait for the jobs inside (the plans run on the GPU thread)."""
    from attnserve.engine import Engine

    def every_item(batch, layers, *args, **kw):
        return [i for i, layer in enumerate(layers) if layer is not None]

    original = Engine.__dict__["_plan_columns"]  # the staticmethod itself
    Engine._plan_columns = staticmethod(every_item)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Engine._plan_columns = original  # type: ignore[method-assign]


def bf16_nearest(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (``wire.BFLOAT16`` bits), derived in float64
    from the two neighbours (the truncation and the next value up in magnitude):
    the nearer, a tie to the even one; past the largest finite bfloat16's halfway
    point, infinity; NaN stays NaN. The oracle of the GPU's narrowing, independent of
    its integer formula."""
    bits = np.ascontiguousarray(x, np.float32).view("<u4")
    low = (bits >> 16).astype(np.uint32)
    high = low + 1
    as64 = np.ascontiguousarray(x, np.float32).astype(np.float64)
    lo = (low << 16).view(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        hi = (high.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        d_lo, d_hi = np.abs(as64 - lo), np.abs(hi - as64)
        # a truncation that is the largest finite magnitude: "high" is infinity, reached
        # when x is at least halfway to 2^128 (the next power that would follow)
        top = (low & 0x7FFF) == 0x7F7F
        halfway = np.where(top, np.abs(lo) + 2.0 ** (127 - 7) / 2, np.nan)
        pick_high = np.where(top, np.abs(as64) >= halfway, (d_hi < d_lo) | ((d_hi == d_lo) & (low & 1 == 1)))
    out = np.where(pick_high, high, low)
    nan = np.isnan(as64)
    out = np.where(nan, (low | 0x40), out)
    inf = np.isinf(as64)
    out = np.where(inf, low, out)
    return out.astype("<u2").view("V2")
