"""Stage 5 of a step: the answer, in the form the request was sent in.

* one operation (a route, a stream frame): an attend's ``{"out", "length"}`` (with
  ``lse`` when asked), an append's ``{"length"}``, or its problem (raised);
* the items form: ``{"results": [...]}``, per item its answer or ``{"error"}``;
* the stacked form: ``out [B, n, H, d]`` (zeros in the rows of a failed item),
  ``lengths`` (null for a failed item), ``errors`` (each with ``item``) and ``lse``
  when asked; a step's layer call answers this form too (``out [B, H, d]`` when
  its ``q`` came without the rows axis).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..codec import MediaKind, array_out, encode
from ..errors import ApiError
from ..runtime import Runtime
from .plan import Outcome

__all__ = ["answer_document", "encode_answer", "count_problems", "whole_arrays"]


def answer_document(outcome: Outcome, kind: MediaKind, instance: str) -> dict[str, Any]:
    """The answer to a request (the module's list). A refused operation of one
    raises its problem."""
    form = outcome.request.form
    if form == "stacked":
        return _stacked_document(outcome, kind, instance)
    answers = _answers(outcome)
    want_lse = outcome.request.want_lse
    if form == "one":
        if 0 in outcome.problems:
            raise outcome.problems[0]
        return _item_document(answers[0], kind, want_lse[0])
    results: list[dict[str, Any]] = []
    for i in range(outcome.request.size):
        problem = outcome.problems.get(i)
        if problem is not None:
            results.append({"error": _problem(problem, i, instance)})
        else:
            results.append(_item_document(answers[i], kind, want_lse[i]))
    return {"results": results}


def encode_answer(outcome: Outcome, kind: MediaKind, instance: str) -> bytes | memoryview:
    return encode(answer_document(outcome, kind, instance), kind)


def _answers(outcome: Outcome) -> dict[int, tuple[np.ndarray | None, int, np.ndarray | None]]:
    """Each answered item's ``(out, length, lse)`` rows, by position."""
    answers = {}
    for c, result in outcome.results:
        items = c.step.items
        lengths = result.lengths
        for i in c.passed:
            if i in result.errors:
                continue
            out = None if result.out is None else result.out[i]
            lse = None if result.lse is None else result.lse[i]
            answers[items[i]] = (out, int(lengths[i]), lse)
    return answers


def _item_document(
    answer: tuple[np.ndarray | None, int, np.ndarray | None], kind: MediaKind, want_lse: bool
) -> dict[str, Any]:
    out, length, lse = answer
    if out is None:  # an append
        return {"length": length}
    doc = {"out": array_out(out, kind), "length": length}
    if want_lse:
        assert lse is not None
        doc["lse"] = array_out(np.ascontiguousarray(lse), kind)
    return doc


def _problem(err: ApiError, i: int, instance: str) -> dict[str, Any]:
    return err.problem(instance) | {"item": i}


def whole_arrays(outcome: Outcome) -> tuple[np.ndarray, np.ndarray] | None:
    """A stacked request's ``out`` and ``lse`` as the GPU gave them back
    (``[B, n, H, d]``, ``[B, n, H]``), when it ran as one step of every item in
    order and every item applied; else None (its answer is a document)."""
    if outcome.problems or not _whole(outcome):
        return None
    result = outcome.results[0][1]
    assert result.out is not None and result.lse is not None  # the stacked form attends (q)
    return result.out, result.lse


def _whole(outcome: Outcome) -> bool:
    """Whether a stacked request ran as one step of every item, in order."""
    return len(outcome.results) == 1 and len(outcome.results[0][0].step) == outcome.request.size


def _stacked_document(outcome: Outcome, kind: MediaKind, instance: str) -> dict[str, Any]:
    request, problems = outcome.request, outcome.problems
    b, shape = request.size, request.out_shape
    if _whole(outcome):  # one step of every item, in order: its arrays as they came back
        c, result = outcome.results[0]
        out, lse = result.out, result.lse
        lengths: list[int | None] = result.lengths.tolist()
    else:
        out = np.zeros((b, *shape), dtype=request.out_dtype)
        lse = np.zeros((b, *shape[:2]), dtype="<f4")
        lengths = [None] * b
        for c, result in outcome.results:
            r_out, r_lse = result.out, result.lse
            assert r_out is not None and r_lse is not None  # the stacked form attends (q)
            for i in c.passed:
                if i not in result.errors:
                    p = c.step.items[i]
                    out[p], lse[p], lengths[p] = r_out[i], r_lse[i], int(result.lengths[i])
    for p in problems:
        lengths[p] = None
    if request.squeeze:  # q came without its rows axis (one row): so does the answer
        out = None if out is None else out.reshape(b, *shape[1:])
        lse = None if lse is None else lse.reshape(b, *shape[1:2])
    doc = {
        "out": array_out(np.ascontiguousarray(out), kind),
        "lengths": lengths,
        "errors": [_problem(problems[p], p, instance) for p in sorted(problems)],
    }
    if request.want_lse and request.want_lse[0]:
        doc["lse"] = array_out(np.ascontiguousarray(lse), kind)
    return doc


def count_problems(rt: Runtime, outcome: Outcome) -> None:
    """Count a finished batch's failed items by problem."""
    for problem in outcome.problems.values():
        rt.metrics.errors_by[problem.slug].inc()
