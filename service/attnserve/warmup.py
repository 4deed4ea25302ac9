"""Kernel warm-up: the kernels of the chosen kv formats compiled at start.

A kernel's pipeline is compiled on its first use, and a pipeline specialized on a
shape (the GQA group and head_dim: ``gpu/kernels.py``) on the first use of that
shape; lavapipe compiles a pipeline's code at its first dispatch besides. That costs
seconds per kernel on lavapipe, which the first request of each kind would otherwise
wait out, unannounced.

:func:`warm_up` runs real work through the engine, so the kernels it compiles are by
construction those requests use: for each kv format and session shape (``warmup``,
``warmup_shapes``), a one-layer session of that shape takes a few rows, attends them
with one query row (a decode step) and with more rows than the split-KV kernels take
(a prefill chunk) under the engine's kernel policy, and is released. A compressed
format is warmed a second time with exact sinks and a window
(:data:`formats.RECOMMENDED`'s), whose attends take the split-KV kernels for every
query row and read the exact rows with the f32 ones; that session holds more rows
than the sinks and the window, so its attends read codes too.
Its pages go back to the pool, whose slab then serves the sessions of that shape. The
app's lifespan runs it after the start, with ``/readyz`` at 503 until it is done.

The log says what it compiles: the plan, each new pipeline (the pipeline cache's line,
``gpu/shaders.py``, which for a kernel compiled after the device's start says "on its
first use": while the warm-up runs it says "for the warm-up of" the format and shape
instead), a line per format and shape as each is done, and the total.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .engine import Engine
from .formats import RECOMMENDED, TQ_SPECS, head_dims
from .kv.config import SessionConfig

__all__ = ["Warm", "warm_up", "warmup_plan"]

log = logging.getLogger("attnserve")

Shape = tuple[int, int, int]  # num_qo_heads, num_kv_heads, head_dim


class Warm(NamedTuple):
    """One session the warm-up runs: a kv format at a shape, with exact sinks and a
    window or without (0 and 0)."""

    kv_format: str
    shape: Shape
    sinks: int = 0
    window: int = 0

    def __str__(self) -> str:
        exact = f" with sinks {self.sinks} and window {self.window}" if self.sinks or self.window else ""
        return f"{self.kv_format}{exact} at {shape_text(self.shape)}"


def shape_text(shape: Shape) -> str:
    return "x".join(map(str, shape))


def warmup_plan(formats: Sequence[str], shapes: Sequence[Shape]) -> list[Warm]:
    """Every session to warm: each format at each shape whose head_dim it takes, and a
    compressed one again with the recommended sinks and window."""
    plan = []
    for fmt in formats:
        for shape in shapes:
            if shape[2] in head_dims(fmt):
                plan.append(Warm(fmt, shape))
                if fmt in TQ_SPECS:
                    plan.append(Warm(fmt, shape, RECOMMENDED.sinks, RECOMMENDED.window))
    return plan


async def warm_up(engine: Engine, formats: Sequence[str], shapes: Sequence[Shape]) -> None:
    """Compile the kernels a session of each format and shape uses (:func:`warmup_plan`),
    logging what it compiles (module docstring) and the time it took."""
    plan = warmup_plan(formats, shapes)
    if not plan:
        return
    what = ", ".join(map(str, plan))
    log.info(
        f"warming up the kernels: {what} (a decode step and a prefill chunk each)",
        extra={"kernel_families": len(plan)},
    )
    pipelines = engine.ctx.pipelines
    try:
        start = time.monotonic()
        for i, warm in enumerate(plan, 1):
            pipelines.warming = str(warm)  # its compiles are logged as this session's
            t0, before = time.monotonic(), len(engine.ctx.pipelines)
            await _run_once(engine, warm)
            seconds = round(time.monotonic() - t0, 2)
            new = len(engine.ctx.pipelines) - before
            log.info(
                f"kernels warm: {warm} in {seconds} s ({i}/{len(plan)}; "
                f"{new} pipeline{'' if new == 1 else 's'} compiled)",
                extra={
                    "kv_format": warm.kv_format,
                    "shape": shape_text(warm.shape),
                    "sinks": warm.sinks,
                    "window": warm.window,
                    "seconds": seconds,
                    "pipelines_compiled": new,
                },
            )
    finally:
        pipelines.warming = None  # a later compile is a request's first use
    seconds = round(time.monotonic() - start, 2)
    log.info(
        f"kernel warm-up done in {seconds} s",
        extra={"seconds": seconds, "pipelines": len(engine.ctx.pipelines)},
    )


async def _run_once(engine: Engine, warm: Warm) -> None:
    """A decode step and a prefill chunk of a one-layer session of ``warm``."""
    h, hkv, d = warm.shape
    n = engine.policy.split_max_queries + 1  # the policy's prefill kernels (by default) take more rows
    rows = n + warm.sinks + warm.window  # with exact rows: more than they hold, so the attends read codes too
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((rows, hkv, d), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((n, h, d), dtype=np.float32)
    config = SessionConfig(1, h, hkv, d, warm.kv_format, rows, seed=0, sinks=warm.sinks, window=warm.window)
    session = engine.session_kv(config)
    layer = session.layers[0]
    try:
        await asyncio.wrap_future(engine.append(layer, k, v))
        await asyncio.wrap_future(engine.attend(layer, q[-1:]))  # decode: one query row, the last
        await asyncio.wrap_future(engine.attend(layer, q))  # prefill: the last n rows, causal
    finally:
        await asyncio.wrap_future(engine.release(session))
