"""A stacked step's plan: made on its first layer, run on every later one.

An engine sends one step per layer, each naming the same sessions at the same
lengths, so what the GPU is told to do is the same on every layer but for the
layers' page tables (FlashInfer's ``plan()`` once per step, ``run()`` per
layer). The first layer's commands are recorded (:meth:`Batch.record`) into a
:class:`StepPlan`, held by the step's sessions (``StepPlans``: the store keeps
one per group of sessions a client steps together, and one per lone session);
each later layer's step runs it with that layer's own page tables
(:meth:`Batch.replay`) when its :class:`PlanBasis` is the plan's, and plans its
own commands otherwise. A later layer that cannot run its step's plan says why
(:meth:`PlanBasis.differs`): the engine counts it, by reason, and logs it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, cast

from .batch import Recorded

__all__ = ["PlanBasis", "StepPlan", "StepPlans", "PlanEvent", "PLAN_REASONS"]


@dataclass(frozen=True, eq=False)
class PlanBasis:
    """What the commands of a stacked step over a group of layers are made from,
    but the layers' page tables (a run puts each layer's own in). Two bases with
    the same fields make the same commands; ``bound`` (the slabs and buffers the
    commands bind) is compared by identity, every other field by value."""

    #: the layers' class, kv format and pool (by id: its buffers are in ``bound``)
    kind: tuple[object, ...]
    #: the queries' shape, ``causal``, ``scale`` and the kernel policy
    options: tuple[object, ...]
    #: where the step's queries, outputs and fused rows are in the arenas
    arrays: tuple[object, ...]
    #: the step's items (positions) this group of layers takes
    items: bytes
    #: each item's length after its append, and first query position
    lengths: bytes
    start_pos: bytes
    #: rotation signs, slabs grouped, windowed layers' exact rows and slabs' sizes
    placement: tuple[object, ...]
    #: the batch's layout when planning starts (arena sizes, input runs, write epoch)
    layout: tuple[object, ...]
    bound: tuple[object, ...]

    def differs(self, other: PlanBasis) -> str | None:
        """The first field (its name) in which ``other`` is not this basis, or None."""
        for f in _COMPARED:
            if getattr(self, f) != getattr(other, f):
                return f
        mine, theirs = self.bound, other.bound
        if len(mine) != len(theirs) or any(a is not b for a, b in zip(mine, theirs)):
            return "bound"
        return None


_COMPARED = tuple(f.name for f in fields(PlanBasis) if f.name != "bound")
#: Why a later layer of a step did not run the step's plan: a field of
#: :class:`PlanBasis` that differs; or its first layer's commands were not
#: recorded to be run again: ``unrecordable`` (they did what a run cannot repeat:
#: :meth:`Batch.recorded`), ``shared_batch`` (another job came first in its GPU
#: batch: only a batch's first job records), ``deferred`` (other jobs' deferred
#: kernels waited in the batch, whose commands come first).
PLAN_REASONS = (*_COMPARED, "bound", "unrecordable", "shared_batch", "deferred")


@dataclass(frozen=True, eq=False)
class StepPlan:
    """The commands a step's layer ``layer`` recorded, made from ``basis``; or, with
    no commands, why that layer recorded none (``unusable``, one of
    :data:`PLAN_REASONS`; its ``basis`` None when it could not be made)."""

    layer: int
    basis: PlanBasis | None
    recorded: Recorded | None
    unusable: str = ""


#: What became of a group of layers' plan: ``(event, reason, layer)``, event one of
#: ``made`` (a layer's commands recorded as its step's plan), ``run`` (a later
#: layer ran its step's plan), ``missed`` (a later layer could not: ``reason``, one
#: of :data:`PLAN_REASONS`).
PlanEvent = Callable[[str, str, int], None]


class StepPlans:
    """The plans of the steps one set of sessions takes, one per group of layers of
    a step (a pool and layer kind). Touched only on the GPU thread; holding a plan
    holds no GPU memory (its buffers are compared by identity before a run)."""

    __slots__ = ("_plans",)

    def __init__(self) -> None:
        self._plans: dict[object, StepPlan] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def find(self, group: object, layer: int, basis: PlanBasis | None, event: PlanEvent) -> Recorded | None:
        """The commands to run for ``group`` on ``layer`` (made from ``basis``; None:
        deferred kernels wait in the batch, so none can run): its step's plan if one
        was made on an earlier layer from the same basis, else None (the caller
        plans them, and may record them: :meth:`keep`). A layer at or before the
        plan's starts a step (nothing is missed); a later one that cannot run it
        is a ``missed`` event with the reason."""
        plan = self._plans.get(group)
        if plan is None or layer <= plan.layer:
            return None
        reason = plan.unusable or ("deferred" if basis is None else cast(PlanBasis, plan.basis).differs(basis))
        if reason:
            event("missed", reason, layer)
            return None
        event("run", "", layer)
        return plan.recorded

    def keep(self, group: object, plan: StepPlan, event: PlanEvent) -> None:
        """Keep ``plan`` as its step's plan for ``group``; one with no commands only
        where it starts a step (a later layer's step keeps the plan it could not
        run: the layers after it may)."""
        held = self._plans.get(group)
        if plan.recorded is None and held is not None and plan.layer > held.layer:
            return
        self._plans[group] = plan
        if plan.recorded is not None:
            event("made", "", plan.layer)
