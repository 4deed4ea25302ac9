"""Stages 3 and 4 of a step: its GPU job planned and queued, then awaited.

The steps of one request (one for an operation or the stacked form; one per
layer and shape for the items form) are checked in order (``rules.py``: each
commits its reservation, so the next is checked against it), then queued
together: one GPU submission with one readback. Each step is one job
(``Engine.plan_stacked``), so a request timeout drops a whole step, and a step's
item that fails on the GPU thread fails alone (its reservation given back).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

from ..engine import Engine, StackedResult
from ..errors import ApiError, InternalError, RequestTimeout
from ..gpu.device import PlanFn
from ..kv.layer import LayerCache
from ..runtime import Runtime
from ..store import Owner, StepReservation
from .parse import Parsed
from .rules import Checked, check_step

__all__ = ["Queued", "Outcome", "queue_request", "finish_request"]

log = logging.getLogger("attnserve")


@dataclass(eq=False)
class Queued:
    """A request checked and queued: ``problems`` (item -> the problem that refused
    it so far), its steps' jobs (``checked[j]``'s job is ``futures[j]``) and ``done``,
    the event-loop future that is done when every job is done and settled."""

    request: Parsed
    problems: dict[int, ApiError]
    checked: list[Checked] = field(default_factory=list)
    futures: list[Future[StackedResult]] = field(default_factory=list)
    done: asyncio.Future[None] | None = None


@dataclass(eq=False)
class Outcome:
    """What a request's answer is made of: each item's problem (by position), and
    the jobs that ran: ``(checked, result)`` per step."""

    request: Parsed
    problems: dict[int, ApiError]
    results: list[tuple[Checked, StackedResult]]


def queue_request(rt: Runtime, engine: Engine, owner: Owner, request: Parsed) -> Queued:
    """Check each step of ``request`` in order (each reserving what passes), then
    queue every step with an item that passed, as one group. No ``await``: the
    checks see each other's reservations, and nothing else comes between the first
    check and the queueing."""
    queued = Queued(request, dict(request.errors))
    problems = queued.problems
    for step in request.steps:
        checked = check_step(rt.store, engine, owner, step)
        for i, problem in checked.problems.items():
            problems[step.items[i]] = problem
        if checked.reservation is not None:
            queued.checked.append(checked)
    if not queued.checked:
        return queued
    try:
        plans = [_plan(engine, c) for c in queued.checked]
        queued.futures = engine.worker.submit_plans(plans, [len(c.passed) for c in queued.checked])
    except Exception as e:  # Overloaded (or a bug): nothing was queued; give every reservation back
        if not isinstance(e, ApiError):
            log.exception("a step failed to queue")
        err = e if isinstance(e, ApiError) else InternalError("an internal error occurred; it was logged")
        for c in queued.checked:
            assert c.reservation is not None
            rt.store.finish_step(c.reservation, [e] * len(c.passed))
            for i in c.passed:
                problems[c.step.items[i]] = err
        queued.checked = []
        return queued
    queued.done = rt.watch_all(
        queued.futures,
        cast("list[StepReservation]", [c.reservation for c in queued.checked]),  # a queued step's is set
        [_item_errors(c) for c in queued.checked],
    )
    return queued


def _plan(engine: Engine, c: Checked) -> PlanFn:
    """The job of a checked step: its rows that passed, planned as one."""
    step, b = c.step, len(c.step)
    assert c.reservation is not None
    caches: list[LayerCache | None] = [ls.cache for ls in c.reservation.layers]
    start: list[int | None]
    if len(c.passed) == b:
        layers = caches
        start = list(c.start_pos) if c.start_pos else [None] * b
    else:
        layers, start = [None] * b, [None] * b
        for j, i in enumerate(c.passed):
            layers[i] = caches[j]
            if c.start_pos:
                start[i] = c.start_pos[j]
    return engine.plan_stacked(
        layers, step.q, k=step.k, v=step.v, start_pos=start, causal=step.causal, scale=step.scale, plans=c.plans,
        out_dtype=step.out_dtype, return_lse=step.lse,
    )  # fmt: skip


def _item_errors(c: Checked) -> Callable[[StackedResult], list[BaseException | None] | None]:
    """Each reserved item's error in a step's result (None: none failed)."""
    passed = c.passed

    def errors(result: StackedResult) -> list[BaseException | None] | None:
        return [result.errors.get(i) for i in passed] if result.errors else None

    return errors


async def finish_request(rt: Runtime, queued: Queued, what: str = "item") -> Outcome:
    """Await a queued request: each item's problem, and each job's result (its
    completed items' rows counted). ``what`` names an item in the problem of a job
    the request timeout dropped (a route's one operation: "request")."""
    outcome = Outcome(queued.request, queued.problems, [])
    if queued.done is None:
        return outcome
    await asyncio.shield(queued.done)
    problems = outcome.problems
    for c, fut in zip(queued.checked, queued.futures):
        items = c.step.items
        failed = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or failed is not None:
            problem = failure(rt, fut, failed, what)
            for i in c.passed:
                problems[items[i]] = problem
            continue
        result: StackedResult = fut.result()
        per_format = Counter(c.formats)
        for i, e in result.errors.items():
            problems[items[i]] = failure(rt, fut, e, what)
            per_format[c.formats[c.passed.index(i)]] -= 1
        _count_rows(rt, per_format, c.step.rows, c.step.queries)
        outcome.results.append((c, result))
    return outcome


def _count_rows(rt: Runtime, per_format: dict[str, int], rows: int, queries: int) -> None:
    """The row metrics of a step's completed items (``per_format[fmt]`` of each kv
    format): one increment per format."""
    counted = rt.metrics.rows_by
    for fmt, count in per_format.items():
        if count and rows:
            counted["append", fmt].inc(rows * count)
        if count and queries:
            counted["query", fmt].inc(queries * count)


def failure(rt: Runtime, fut: Future[Any], error: BaseException | None, what: str = "item") -> ApiError:
    """The problem of an item whose job was dropped by the request timeout, or
    that failed with ``error``."""
    if fut.cancelled():  # the request timeout dropped it from the queue: nothing applied
        return RequestTimeout(
            f"the {what} waited more than {rt.settings.request_timeout_s:g} s for the GPU and was dropped; "
            "nothing was applied, so it is safe to retry",
            headers={"Retry-After": "1"},
        )
    if isinstance(error, ApiError):
        return error
    log.error("batch item failed", exc_info=error)
    return InternalError("an internal error occurred in this item; it was logged")
