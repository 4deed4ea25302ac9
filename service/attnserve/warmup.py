"""Kernel warm-up: the kernels of the chosen kv formats compiled at start.

A kernel's pipeline is compiled on its first use, and a pipeline specialized on a
shape (the GQA group and head_dim: ``gpu/kernels.py``) on the first use of that
shape; lavapipe compiles a pipeline's code at its first dispatch besides. That costs
seconds per kernel on lavapipe, which the first request of each kind would otherwise
wait out, unannounced.

:func:`warm_up` runs real work through the engine, so the kernels it compiles are by
construction those requests use: for each kv format and session shape (``warmup``,
``warmup_shapes``), a one-layer session of that shape takes a few rows, attends them
with one query row (a decode step) and with all of them (a prefill chunk) under the
engine's kernel policy, and is released. Its pages go back to the pool, whose slab
then serves the sessions of that shape. The app's lifespan runs it after the start,
with ``/readyz`` at 503 until it is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import numpy as np

from .engine import Engine
from .formats import head_dims
from .kvcache import SessionConfig

__all__ = ["warm_up", "warmup_plan"]

log = logging.getLogger("attnserve")

Shape = tuple[int, int, int]  # num_qo_heads, num_kv_heads, head_dim


def shape_text(shape: Shape) -> str:
    return "x".join(map(str, shape))


def warmup_plan(formats: Sequence[str], shapes: Sequence[Shape]) -> list[tuple[str, Shape]]:
    """Every (kv format, shape) to warm: each format at each shape whose head_dim it takes."""
    return [(fmt, shape) for fmt in formats for shape in shapes if shape[2] in head_dims(fmt)]


async def warm_up(engine: Engine, formats: Sequence[str], shapes: Sequence[Shape]) -> None:
    """Compile the kernels a session of each format and shape uses (:func:`warmup_plan`),
    logging what it compiles, a line per (format, shape) done, and the time it took."""
    plan = warmup_plan(formats, shapes)
    if not plan:
        return
    what = ", ".join(f"{fmt} at {shape_text(shape)}" for fmt, shape in plan)
    log.info(f"warming up the kernels: {what}", extra={"kernel_families": len(plan)})
    start = time.monotonic()
    for i, (fmt, shape) in enumerate(plan, 1):
        t0 = time.monotonic()
        await _run_once(engine, fmt, shape)
        seconds = round(time.monotonic() - t0, 2)
        log.info(
            f"kernels warm: {fmt} at {shape_text(shape)} in {seconds} s ({i}/{len(plan)})",
            extra={"kv_format": fmt, "shape": shape_text(shape), "seconds": seconds},
        )
    seconds = round(time.monotonic() - start, 2)
    log.info(
        f"kernel warm-up done in {seconds} s",
        extra={"seconds": seconds, "pipelines": len(engine.ctx.pipelines)},
    )


async def _run_once(engine: Engine, kv_format: str, shape: Shape) -> None:
    """A decode step and a prefill chunk of a one-layer ``kv_format`` session of ``shape``."""
    h, hkv, d = shape
    rows = engine.policy.split_max_queries + 1  # the policy's prefill kernels (by default) take more
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((rows, hkv, d), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((rows, h, d), dtype=np.float32)
    session = engine.session_kv(SessionConfig(1, h, hkv, d, kv_format, rows, seed=0))
    layer = session.layers[0]
    try:
        await asyncio.wrap_future(engine.append(layer, k, v))
        await asyncio.wrap_future(engine.attend(layer, q[-1:]))  # decode: one query row
        await asyncio.wrap_future(engine.attend(layer, q))  # prefill: every row, causal
    finally:
        await asyncio.wrap_future(engine.release(session))
