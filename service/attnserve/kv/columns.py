"""A stacked step's layers as columns (``LayerCache.plan_stacked``): where they are
(:class:`_Where`: each layer's slab, page table and rotation signs, and a windowed
step's recent rows' append and exact rows), what the step's plan is made from
(:meth:`_Where.basis`, which a replay of its plan on a later layer matches,
``gpu/step_plan.py``; :meth:`_Where.tables`, the page tables a replay puts in), and
the checks and helpers the columns share. The layers are named here in annotations
only (this module sits below ``layer.py`` and ``kinds.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from ..gpu.batch import Batch, Items
from ..gpu.step_plan import PlanBasis
from ..pool import Slab

if TYPE_CHECKING:
    from .kinds import PlainLayerCache
    from .layer import LayerCache

__all__ = ["OutOfRange", "start_position", "start_positions"]


class OutOfRange(ValueError):
    """An item's query rows fall outside its layer: refused before it is queued, so
    only an engine's own caller (a tool, a test) gets this far."""


def start_position(start_pos: int | None, length: int, n: int) -> int:
    """The engine's start_pos rule for one item (its owner, with the columns' form
    below): its first query row's timestep (None: its last ``n`` rows), inside its
    layer's ``length`` with its ``n`` rows, else :class:`OutOfRange`. A service
    request never breaks it (``step/rules.py``'s rule 6 refused it on the event
    loop, against the reserved length); a direct engine caller (a tool, a test)
    learns its layer's length only here, on the GPU thread."""
    sp = length - n if start_pos is None else int(start_pos)
    if sp < 0 or sp + n > length:
        raise _out_of_range(sp, n, length)
    return sp


def start_positions(start_pos: np.ndarray | None, after: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The start_pos rule as columns, deciding nothing: each item's first query
    row's timestep (``start_pos[i]`` ``-1``, or ``start_pos`` None: ``after[i] - n``)
    and whether it breaks the rule (``sp < 0`` or ``sp + n > after``). Both owners
    decide with it: ``step/rules.py``'s rule 6 (a request's problem, on the event
    loop) and the engine's (:func:`_start_positions`, on the GPU thread)."""
    if start_pos is None:  # length - n: inside the length unless the layer is shorter than n
        sp = after - n
        return sp, sp < 0
    sp = np.where(start_pos < 0, after - n, start_pos)
    return sp, (sp < 0) | (sp + n > after)


def _start_positions(start_pos: np.ndarray, after: np.ndarray, n: int) -> np.ndarray:
    """:func:`start_position` as columns: each item's (``-1``: its last ``n`` rows)
    against its layer's length ``after``; the first item that breaks it is named."""
    sp, bad = start_positions(start_pos, after, n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise _out_of_range(int(sp[i]), n, int(after[i]))
    return sp


def _out_of_range(sp: int, n: int, length: int) -> OutOfRange:
    return OutOfRange(f"start_pos {sp} + {n} rows exceeds the layer length {length}")


def _by_value(keys: Sequence[object]) -> list[np.ndarray]:
    """The indices of ``keys`` grouped by value, in order of first appearance."""
    groups: dict[object, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return [np.asarray(g) for g in groups.values()]


def _words(items: Items, idx: np.ndarray) -> np.ndarray:
    """Word offsets of items ``idx`` of ``items`` in its arena."""
    return (items.base + idx * items.stride) // 4


@dataclass(frozen=True)
class _Where:
    """Where a stacked step's layers are, as columns: each one's slab, page table
    (word offset in the page tables, brought up to date) and rotation signs (word
    offset in the input arena; none for plain layers), and the layers grouped by
    slab (``parts``: indices, one array per slab); windowed layers' recent rows'
    append (``recent``) and exact rows (``exact``)."""

    slabs: list[Slab]
    table_off: np.ndarray
    signs: np.ndarray
    parts: list[np.ndarray]
    recent: "_Recent | None" = None
    exact: "_Exact | None" = None

    @classmethod
    def of(cls, batch: Batch, layers: Sequence[LayerCache]) -> "_Where":
        slabs = [layer.slab for layer in layers]
        # (an invariant: an append took its pages first; an attend's layers passed the
        # start_pos rule, n >= 1 query rows inside their length)
        assert all(slab is not None for slab in slabs), "the layers of a stacked step hold their pages"
        table_off = np.fromiter((layer.table_offset(batch) for layer in layers), np.int64, len(layers))
        signs = np.asarray(type(layers[0]).sign_words(batch, layers), dtype=np.int64)
        ids = [id(slab) for slab in slabs]
        parts = [np.arange(len(ids))] if ids.count(ids[0]) == len(ids) else _by_value(ids)
        return cls(cast("list[Slab]", slabs), table_off, signs, parts)  # none is None (checked above)

    def signs_of(self, idx: np.ndarray) -> Sequence[int]:
        return self.signs[idx] if len(self.signs) else ()

    def tables(self) -> np.ndarray:
        """The page tables' word offsets the step's commands name, one per table (a
        replay puts each layer's own in: ``Batch.replay``)."""
        x = self.exact
        if x is None:  # (a windowed step's recent rows' appends name the tables x.recent_table does)
            return self.table_off
        heads = x.head_table[[h is not None for h in x.heads]]
        return np.concatenate([self.table_off, heads, x.recent_table[[r is not None for r in x.recents]]])

    def placeholders(self) -> tuple[int, ...]:
        """The table offset that stands for "no table" in the commands (a windowed
        layer without sinks or without recent rows: 0), if any."""
        x = self.exact
        if x is None or (all(h is not None for h in x.heads) and all(r is not None for r in x.recents)):
            return ()
        return (0,)

    def basis(
        self,
        batch: Batch,
        layers: Sequence[LayerCache],
        items: np.ndarray,
        q: Items,
        out: Items,
        rows: tuple[Items, Items, int] | None,
        shape: tuple[int, ...],
        after: np.ndarray,
        start_pos: np.ndarray,
        causal: bool,
        scale: float,
    ) -> PlanBasis:
        """What the commands of a stacked step over ``layers`` (placed here) are made
        from, but the page tables' offsets (a run of its plan puts each layer's own
        in): the layers' kind, format and pool, the step's shape, arrays and
        lengths, the kernel policy (by value: an engine's policy may be replaced),
        the slabs, signs and exact rows, and the batch's layout."""
        first = layers[0]
        slabs = [self.slabs[int(idx[0])] for idx in self.parts]
        parts: list[object] = [tuple(idx.tobytes() for idx in self.parts)]
        if self.recent is not None:
            r = self.recent
            slabs += [r.where.slabs[int(idx[0])] for idx in r.where.parts]
            parts += [r.index.tobytes(), r.after.tobytes(), tuple(idx.tobytes() for idx in r.where.parts)]
        if self.exact is not None:
            x = self.exact
            for idx in x.groups:
                i0 = int(idx[0])
                # the caches _attend_state kept hold a slab each
                slabs += cast("list[Slab]", [c.slab for c in (x.heads[i0], x.recents[i0]) if c is not None])
                parts.append((idx.tobytes(), x.heads[i0] is not None, x.recents[i0] is not None))
            parts += [x.sinks.tobytes(), x.exact_from.tobytes(), x.recent_base.tobytes()]
        return PlanBasis(
            kind=(type(first), first.kv_format, id(first.pool)),
            options=(shape, causal, scale, batch.policy),
            arrays=(
                q.base, q.stride, out.base, out.stride,
                None if rows is None else (rows[0].base, rows[0].stride, rows[1].base, rows[1].stride, rows[2]),
            ),
            items=items.tobytes(),
            lengths=after.tobytes(),
            start_pos=start_pos.tobytes(),
            placement=(self.signs.tobytes(), tuple(parts), tuple(slab.rows for slab in slabs)),
            layout=batch.layout(),
            bound=tuple(o for slab in slabs for o in (slab, slab.k, slab.v)),
        )  # fmt: skip


@dataclass(frozen=True)
class _Recent:
    """The recent rows' append of a stacked step's windowed layers (those with a
    window: ``index`` into the step's layers): their caches, new lengths and
    where they are."""

    index: np.ndarray
    caches: list[PlainLayerCache]
    after: np.ndarray
    where: _Where


@dataclass(frozen=True)
class _Exact:
    """What a stacked step's windowed layers' attends read exactly, as columns: each
    one's sinks cache and recent cache (None: none, or no timestep yet), sinks read,
    first timestep read from the recent rows, the recent rows' first timestep, both
    page tables' offsets (0: no table), and the layers grouped by their three slabs."""

    heads: list[PlainLayerCache | None]
    recents: list[PlainLayerCache | None]
    sinks: np.ndarray
    exact_from: np.ndarray
    recent_base: np.ndarray
    head_table: np.ndarray
    recent_table: np.ndarray
    groups: list[np.ndarray]
