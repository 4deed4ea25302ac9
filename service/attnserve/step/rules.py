"""Stage 2 of a step: its rules, as columns, and its reservation.

Each rule is written once: it decides a whole step at once (numpy over the
items, or once per session shape and kv format, since a step's items share their
array shapes) and names each refused item's problem exactly as a request of that
one item is answered. An item is refused by the first rule it breaks, in this
order (the order a single attend is checked in):

1. the parse (``parse.py``: the item's members);
2. its session exists (404 session-not-found) and has the layer (404
   layer-not-found), and is in no open step but the one making the call (409
   session-in-step: ``store.step_conflict``);
3. ``q`` fits the session and the adapter (422: shape, the binding limit);
4. ``k``, ``v`` fit it (422: shape, values a kv format cannot store, the binding limit);
5. ``offset`` and ``max_tokens`` (409: ``Store.step_lengths``);
6. ``start_pos + n <= length`` after the fused append (422);
7. the memory budget and the owner's byte quota (507: ``Store.reserve_step``).

The items that pass are reserved as one :class:`~attnserve.store.StepReservation`,
committed here: the step after it (the same request's, or the next request's) is
checked against it. Nothing here awaits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np

from ..codec import wire
from ..engine import Engine
from ..errors import ApiError, InvalidRequest, LayerNotFound
from ..formats import BF16_INF_FROM, F16_MAX, TQ_SPECS
from ..gpu.kernels import rotated_q_bytes
from ..gpu.step_plan import StepPlans
from ..kv.columns import start_positions
from ..kv.config import SessionConfig
from ..store import Owner, Session, StepReservation, Store, step_conflict
from ..turboquant import (
    MAX_NORM,
    MAX_OUTLIER,
    largest_norm,
    largest_outlier_bound,
    outlier_bound,
    outlier_rest_factor,
)
from .parse import Step

__all__ = ["Checked", "check_step", "kv_rows_problem", "kv_values_clear"]


@dataclass(eq=False)
class Checked:
    """A step checked and reserved: ``problems`` (step row -> the problem that
    refused it) and, when any row passed, the rows that did (``passed``, in order),
    their sessions' layers' kv formats and first query positions, and their
    reservation (committed); ``plans``: where the plans of the steps its sessions
    take are kept (a group's, or a lone session's; None for a step of other
    rows)."""

    step: Step
    problems: dict[int, ApiError]
    passed: list[int]
    formats: list[str]
    start_pos: list[int]
    reservation: StepReservation | None
    plans: StepPlans | None = None


def check_step(store: Store, engine: Engine, owner: Owner, step: Step) -> Checked:
    """Every rule of ``step`` (the module's list), then the reservation of the rows
    that pass, committed."""
    problems: dict[int, ApiError] = {}
    group = store.step_group(step.session_ids, owner) if len(step) > 1 else None  # (one id: no group to keep)
    if group is not None:  # the sessions, and what follows from them alone, resolved once per set of ids
        sessions: Sequence[Session | None] = group.sessions
        shapes = group.memo.get(("shapes", step.layer))
        if shapes is None:
            layer_problems: dict[int, ApiError] = {}
            formats: dict[int, str] = {}
            by_shape = _by_shape(sessions, step.layer, range(len(step)), layer_problems, formats)
            shapes = group.memo["shapes", step.layer] = (by_shape, formats, layer_problems)
        by_shape, formats, layer_problems = shapes
        problems.update(layer_problems)
    else:
        sessions = _sessions(store, owner, step, problems)
        formats = {}
        by_shape = _by_shape(
            sessions, step.layer, [i for i in range(len(step)) if i not in problems], problems, formats
        )
    stepped = set(problems) if store.stepped else None  # rule 2's first two parts decided
    for config, fmt, rows in by_shape:
        _check_arrays(engine.max_binding, config, fmt, step, rows, problems)
    if stepped is not None:  # rule 2's last part: before the arrays' (it overrides their problems)
        _in_steps(sessions, step.via, stepped, problems)
    found = cast("Sequence[Session]", sessions)  # a live row's session was found (rule 2)
    if problems:
        live = [i for i in range(len(step)) if i not in problems]
        mine, offsets = [found[i] for i in live], [step.offsets[i] for i in live]
    else:  # every row (the common case): the step's own lists
        live, mine, offsets = list(range(len(step))), list(found), step.offsets
    states = [s.layers[step.layer] for s in mine]
    new_length, refused = store.step_lengths(states, step.rows, offsets)
    start_pos: list[int] = []
    if step.q is not None:
        refused |= _start_positions(step, live, new_length, refused, start_pos)
    if refused:
        for j, problem in refused.items():
            problems[live[j]] = problem
        keep = [j for j in range(len(live)) if j not in refused]
        live, mine, states, new_length = (
            [live[j] for j in keep],
            [mine[j] for j in keep],
            [states[j] for j in keep],
            new_length[keep],
        )
        start_pos = [start_pos[j] for j in keep] if start_pos else start_pos
    if not live:
        return Checked(step, problems, [], [], [], None)
    reservation, over = store.reserve_step(mine, states, step.rows, new_length)
    if over:
        for j, problem in over.items():
            problems[live[j]] = problem
        keep = [j for j in range(len(live)) if j not in over]
        live, start_pos = [live[j] for j in keep], [start_pos[j] for j in keep] if start_pos else start_pos
    if not live:
        return Checked(step, problems, [], [], [], None)
    store.commit_step(reservation)
    plans = group.plans if group is not None else found[0].plans if len(step) == 1 else None
    return Checked(step, problems, live, [formats[i] for i in live], start_pos, reservation, plans)


def _sessions(store: Store, owner: Owner, step: Step, problems: dict[int, ApiError]) -> list[Session | None]:
    """Each row's session (rule 2's first half), one lookup per row."""
    found: list[Session | None] = []
    for i, sid in enumerate(step.session_ids):
        try:
            found.append(store.get(sid, owner))
        except ApiError as e:
            problems[i] = e
            found.append(None)
    return found


def _in_steps(
    sessions: Sequence[Session | None], via: int | None, decided: set[int], problems: dict[int, ApiError]
) -> None:
    """Rule 2's last part: a session in an open step is named only through that
    step (``via``: the step making the call, None for none); rows in ``decided``
    were refused by its first parts."""
    for i, s in enumerate(sessions):
        if s is not None and s.step is not None and i not in decided:
            conflict = step_conflict(s, via)
            if conflict is not None:
                problems[i] = conflict


def _by_shape(
    sessions: Sequence[Session | None],
    layer: int,
    live: Iterable[int],
    problems: dict[int, ApiError],
    formats: dict[int, str],
) -> list[tuple[SessionConfig, str, list[int]]]:
    """Rule 2's second half (the layer is one of the session's), and the rows that
    pass grouped by their session's shape and their layer's kv format (the arrays'
    rules are decided once per group); ``formats`` gets each row's kv format."""
    groups: dict[tuple[Any, str], list[int]] = {}
    configs: dict[tuple[Any, str], SessionConfig] = {}
    for i in live:
        s = sessions[i]
        assert s is not None
        config = s.config
        problem = layer_problem(s, layer)
        if problem is not None:
            problems[i] = problem
            continue
        fmt = formats[i] = config.layer_formats[layer]
        key = ((config.num_qo_heads, config.num_kv_heads, config.head_dim), fmt)
        rows = groups.get(key)
        if rows is None:
            rows = groups[key] = []
            configs[key] = config
        rows.append(i)
    return [(configs[key], key[1], rows) for key, rows in groups.items()]


def layer_problem(session: Session, layer: int) -> LayerNotFound | None:
    """Rule 2's second half for one session (a route's path names the layer)."""
    num_layers = session.config.num_layers
    if 0 <= layer < num_layers:
        return None
    return LayerNotFound(
        f"layer {layer} is outside 0..{num_layers - 1} of session {session.id!r}", num_layers=num_layers
    )


def _check_arrays(
    max_binding: int, config: SessionConfig, fmt: str, step: Step, rows: list[int], problems: dict[int, ApiError]
) -> None:
    """Rules 3 and 4 for ``rows``, the step's rows of one session shape and kv format."""
    q, k, v = step.q, step.k, step.v
    if q is not None:
        problem = _query_problem(max_binding, config, q.shape[1:], fmt)
        if problem is not None:
            for i in rows:
                problems[i] = problem
            return
    if k is None or v is None:
        return
    item_shape = k.shape[1:]
    problem = _kv_shape_problem(config, item_shape, v.shape[1:])
    if problem is None:
        # the formats whose values have a range (float16 rows always fit a float16
        # layer; float16 and bfloat16 rows always fit a bfloat16 one)
        if fmt in TQ_SPECS or fmt == "f16" and k.dtype != np.float16 or fmt == "bf16" and k.dtype == np.float32:
            if k.dtype == wire.BFLOAT16:  # its range is float32's: judged on its values
                k, v = wire.to_float32(k), wire.to_float32(v)
            whole = len(rows) == len(k)  # every row of the step: no gather
            idx = np.asarray(rows)
            clear = kv_values_clear(k if whole else k[idx], v if whole else v[idx], fmt)
            for j in [] if clear.all() else np.flatnonzero(~clear).tolist():
                i = rows[j]
                values = _kv_values_problem(config, k[i], v[i], fmt)
                if values is not None:
                    problems[i] = values
        # the rows as received (the wire arena) and as the layer takes them (the input arena)
        problem = _kv_binding_problem(max_binding, item_shape, max(k.itemsize, 2 if fmt == "f16" else 4))
    if problem is not None:
        for i in rows:
            problems.setdefault(i, problem)


def _query_problem(max_binding: int, config: SessionConfig, shape: tuple[int, ...], fmt: str) -> ApiError | None:
    """Rule 3: query rows of ``shape`` ``[n, H, d]`` on a layer of ``fmt``."""
    want = (config.num_qo_heads, config.head_dim)
    if shape[0] < 1 or tuple(shape[1:]) != want:
        return InvalidRequest(f"q: expected shape [n >= 1, {want[0]}, {want[1]}], got {list(shape)}")
    n = shape[0]
    nbytes = n * want[0] * want[1] * 4
    need = max(nbytes, rotated_q_bytes(n, *want) if fmt in TQ_SPECS else 0)
    if need > max_binding:
        rows = max_binding // (need // n)
        return InvalidRequest(
            f"q: {n} rows are more than this adapter takes in one request (at most {rows}); split the attend"
        )
    return None


def _kv_shape_problem(config: SessionConfig, k_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> ApiError | None:
    """Rule 4's shapes: ``k``, ``v`` ``[m, Hkv, d]``."""
    want = (config.num_kv_heads, config.head_dim)
    if k_shape[0] < 1 or tuple(k_shape[1:]) != want:
        return InvalidRequest(f"k: expected shape [n >= 1, {want[0]}, {want[1]}], got {list(k_shape)}")
    if v_shape != k_shape:
        return InvalidRequest(f"v: expected the shape of k {list(k_shape)}, got {list(v_shape)}")
    return None


def _kv_binding_problem(max_binding: int, shape: tuple[int, ...], itemsize: int) -> ApiError | None:
    """Rule 4's binding limit: the rows of one item fit one binding."""
    row = math.prod(shape[1:]) * itemsize
    if shape[0] * row > max_binding:
        return InvalidRequest(
            f"k, v: {shape[0]} rows are more than this adapter takes in one request (at most {max_binding // row}); "
            "split the append"
        )
    return None


def kv_values_clear(k: np.ndarray, v: np.ndarray, kv_format: str) -> np.ndarray:
    """Rule 4's values, as columns: for rows ``k, v [B, m, Hkv, d]``, per item,
    whether its values clearly fit ``kv_format`` (with a margin, so float rounding
    cannot disagree with :func:`kv_rows_problem`; an item that is not clear is
    judged by it, which names its bad row)."""
    b = k.shape[0]
    clear = np.ones(b, dtype=bool)
    margin = 1.0 - 1e-5
    if kv_format in TQ_SPECS:
        spec = TQ_SPECS[kv_format]
        for a, n, bits in ((k, spec.key_outliers, spec.key_bits), (v, spec.value_outliers, spec.value_bits)):
            norms = np.sqrt(np.einsum("...d,...d->...", a, a, dtype=np.float64)).reshape(b, -1)
            clear &= norms.max(axis=1) <= MAX_NORM * margin
            if n:
                clear &= outlier_bound(a, n, bits).reshape(b, -1).max(axis=1) <= MAX_OUTLIER * margin
    elif kv_format in _HALF_RANGE:
        for a in (k, v):
            clear &= ~_past_half_range(a, kv_format).reshape(b, -1).any(axis=1)
    return clear


def _kv_values_problem(config: SessionConfig, k: np.ndarray, v: np.ndarray, kv_format: str) -> ApiError | None:
    """Rule 4's values for one item's rows ``[m, Hkv, d]``: a value the format would
    store as inf (past float16's range: a norm, an outlier channel, an f16 value)."""
    if kv_format in TQ_SPECS:
        for name, a in (("k", k), ("v", v)):
            norm, (i, h) = largest_norm(a)
            if not norm <= MAX_NORM:
                return InvalidRequest(
                    f"{name}[{i}, {h}]: norm {norm:.6g} is over {MAX_NORM:g}, the largest norm "
                    f"{kv_format} stores (float16); scale the rows down"
                )
        spec = TQ_SPECS[kv_format]
        for name, a, n, bits in (
            ("k", k, spec.key_outliers, spec.key_bits),
            ("v", v, spec.value_outliers, spec.value_bits),
        ):
            if not n:
                continue
            bound, (i, h) = largest_outlier_bound(a, n, bits)
            if not bound <= MAX_OUTLIER:
                factor = outlier_rest_factor(config.head_dim, bits)
                return InvalidRequest(
                    f"{name}[{i}, {h}]: {kv_format} keeps its {n} largest channels as float16, and one "
                    f"of them could be stored as up to {bound:.6g} (its largest |value| + {factor:.4g} x "
                    f"the norm of the rest of the row), over {MAX_OUTLIER:g}; scale the rows down"
                )
    elif kv_format in _HALF_RANGE:
        for name, a in (("k", k), ("v", v)):
            big = _past_half_range(a, kv_format)
            if big.any():
                i, h, j = (int(x) for x in np.argwhere(big)[0])
                return InvalidRequest(
                    f"{name}[{i}, {h}, {j}]: {float(a[i, h, j]):.7g} {_HALF_RANGE[kv_format]}; "
                    "scale the rows down or use f32"
                )
    return None


#: The plain half formats' range, as a refusal says it (the values past it would be stored as inf).
_HALF_RANGE = {
    "f16": f"is past {F16_MAX:g}, the largest value f16 stores",
    "bf16": "rounds to infinity in bfloat16 (as every value of magnitude 2^128 - 2^119, about 3.396e38, or more)",
}


def _past_half_range(a: np.ndarray, kv_format: str) -> np.ndarray:
    """Where ``a``'s values would be stored as inf by the plain half format ``kv_format``
    (float16 and bfloat16 input always fits bf16; float32 past its range does not)."""
    past: np.ndarray = np.abs(a) > F16_MAX if kv_format == "f16" else np.abs(a) >= BF16_INF_FROM
    return past


def kv_rows_problem(
    max_binding: int, config: SessionConfig, k: np.ndarray, v: np.ndarray, kv_format: str
) -> ApiError | None:
    """Rule 4 for one item's rows ``k, v [m, Hkv, d]`` (tools and tests that check
    rows the way an append is checked)."""
    return (
        _kv_shape_problem(config, k.shape, v.shape)
        or _kv_values_problem(config, k, v, kv_format)
        or _kv_binding_problem(max_binding, k.shape, k.itemsize)
    )


def _start_positions(
    step: Step, live: list[int], new_length: np.ndarray, refused: dict[int, ApiError], out: list[int]
) -> dict[int, ApiError]:
    """Rule 6: each row's first query position (``start_pos``, default ``length -
    n``) with its ``n`` query rows inside the layer's length after the fused
    append; fills ``out`` (aligned with ``live``), returns the problems by position
    in ``live`` (rows already ``refused`` are skipped)."""
    n = step.queries
    given = [step.start_pos[i] for i in live]
    g = None  # every row's default, length - n
    if any(p is not None for p in given):  # (past int64 is past any length: held at 2^62 to compare)
        g = np.fromiter((-1 if p is None else min(p, 1 << 62) for p in given), np.int64, len(live))
    sp, bad = start_positions(g, new_length, n)  # the rule's arithmetic, the engine's too
    out.extend(sp.tolist())
    problems: dict[int, ApiError] = {}
    for j in np.flatnonzero(bad).tolist() if bad.any() else ():
        if j in refused:
            continue
        length, start = int(new_length[j]), int(sp[j]) if given[j] is None else given[j]
        if given[j] is None:
            detail = (
                f"start_pos: q has {n} rows but the layer holds {length} timesteps (the default "
                f"start_pos, length - n, would be {start}); give start_pos or fewer rows"
            )
        else:
            detail = (
                f"start_pos: {n} query rows from start_pos {start} pass the layer's length "
                f"{length} (start_pos + n <= length is required)"
            )
        problems[j] = InvalidRequest(detail, length=length)
    return problems
