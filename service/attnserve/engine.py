"""The compute core's front door: jobs for append and attend on session caches.

``Engine`` owns the :class:`~attnserve.gpu.device.GpuWorker` and turns calls
into GPU jobs. It validates nothing about HTTP (the routes do that, before any
job is queued) but re-checks the invariants the kernels rely on, so a bug above
can never make a kernel read out of bounds.

All methods return ``concurrent.futures.Future`` objects; ``asyncio.wrap_future``
awaits them from the event loop.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, TypedDict, cast

import numpy as np
from prometheus_client import Counter

from .errors import ApiError, InvalidRequest
from .metrics import Bound
from .gpu.device import GpuContext, GpuWorker, PlanFn, open_device
from .gpu.kernels import ELEMENT_KINDS, KernelPolicy, attend_output_bytes, plan_answer, plan_uploads_as
from .gpu.batch import Batch, Items, Seg
from .gpu.step_plan import StepPlans
from .kv.columns import OutOfRange, start_position
from .kv.config import SessionConfig
from .kv.layer import LayerCache
from .kv.session import SessionKV
from .pool import PageLayout, PagePools

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Engine", "AttendResult", "StackedResult", "step_fallbacks_counter", "step_plans_counter"]

log = logging.getLogger("attnserve")


def _as_array(a: np.ndarray) -> np.ndarray:
    """``a`` C-contiguous, in its dtype when it is one a step takes (float32,
    float16, bfloat16: ``kernels.ELEMENT_KINDS``), else as float32."""
    a = np.asarray(a)
    return np.ascontiguousarray(a, dtype=None if a.dtype in ELEMENT_KINDS else "<f4")


def _as_rows(a: np.ndarray, name: str) -> np.ndarray:
    a = _as_array(a)
    if a.ndim != 3:
        raise ValueError(f"{name} must be 3-D [rows, heads, head_dim], got shape {a.shape}")
    return a


class AttendResult(tuple[np.ndarray, int]):
    """An attend's answer: the pair ``(out [n, H, d] float32, length)`` (the layer's
    length it attended over), and beside it ``lse [n, H]`` float32, the log-sum-exp
    of each row's scaled scores (natural log; ``kernels.attend_output_bytes``)."""

    lse: np.ndarray

    def __new__(cls, out: np.ndarray, length: int, lse: np.ndarray) -> "AttendResult":
        self = super().__new__(cls, (out, length))
        self.lse = lse
        return self

    @property
    def out(self) -> np.ndarray:
        return self[0]

    @property
    def length(self) -> int:
        return self[1]


def _plan_item(
    batch: Batch,
    layer: LayerCache,
    q: Seg | None,
    shape: tuple[int, ...],
    out: Seg | None,
    rows: tuple[Seg, Seg, int] | None,
    start_pos: int | None,
    causal: bool,
    scale: float,
) -> int:
    """Plan one item of a step on ``layer`` alone: the append of uploaded ``rows``
    ``(k, v, n_rows)`` if any, then the attend of uploaded queries ``q`` (``shape``
    ``[n, H, d]``; None: an append alone) into ``out`` at ``start_pos`` (default
    ``length - n``); returns the layer's length after it. Atomic: if the job (or
    the item) is rolled back, the layer is put back as it was."""
    batch.on_rollback(functools.partial(layer.restore, layer.state()))
    if rows is not None:
        layer.plan_append_rows(batch, *rows)
    length = layer.length
    if q is None:
        layer._call_done(batch)
        return length
    assert out is not None
    sp = start_position(start_pos, length, shape[0])  # the engine's rule (a service request passed rule 6)
    layer.plan_attend_rows(batch, q, shape, out=out, length=length, start_pos=sp, causal=causal, scale=scale)
    return length


def _one(plan: PlanFn, appended: bool = False) -> PlanFn:
    """A step of one's job giving its item's answer: the new length (``appended``:
    an append alone) or an :class:`AttendResult`; the item's error, raised."""

    def one(batch: Batch) -> Callable[[memoryview | None], object]:
        finish = plan(batch)

        def answer(out: memoryview | None) -> object:
            r = finish(out)
            if r.errors:
                raise r.errors[0]
            if appended:
                return int(r.lengths[0])
            return AttendResult(r.out[0], int(r.lengths[0]), r.lse[0])

        return answer

    return one


def step_fallbacks_counter() -> Counter:
    """The counter of stacked steps planned item by item, by reason."""
    return Counter(
        "attnserve_step_fallbacks_total",
        "Stacked steps planned item by item because their columns gave up, by reason "
        "(binding_limit: past the adapter's binding limit; item_refused: an item refused on the GPU thread, "
        "such as a layer past max_tokens; error: a failure, logged with its traceback).",
        ("reason",),
        registry=None,  # the app's /metrics reads it (Metrics.add_counter)
    )


def step_plans_counter() -> Counter:
    """The counter of what became of stacked steps' plans, by event and reason."""
    return Counter(
        "attnserve_step_plans_total",
        "Stacked steps' plans (made on a step's first layer, run on the later ones), by event: made, run, "
        "or missed (a later layer could not run its step's plan; reason: the field of the plan's basis that "
        "differed, such as lengths or layout, or unrecordable, shared_batch, deferred). Logged at debug.",
        ("event", "reason"),
        registry=None,  # the app's /metrics reads it (Metrics.add_counter)
    )


class _OneByOne(Exception):
    """The columns of a stacked step passed the binding limit: plan it item by item."""


class AttendOptions(TypedDict, total=False):
    """The options of :meth:`Engine.attend` (those of :meth:`Engine.plan_attend`)."""

    k: np.ndarray | None
    v: np.ndarray | None
    start_pos: int | None
    causal: bool
    scale: float | None
    out_dtype: np.dtype[Any] | None


class StackedResult(NamedTuple):
    """What a step's job gives: ``out [B, n, H, d]`` float32 (zeros for a failed
    item; None for appends alone), ``lengths [B]`` (the layer's length each item
    attended over, or appended to; -1 for a failed item), ``errors`` (item index ->
    the exception that failed it while it was planned; the item changed nothing)
    and ``lse [B, n, H]`` (as :class:`AttendResult`'s; zeros for a failed item;
    None for appends alone)."""

    out: np.ndarray | None
    lengths: np.ndarray
    errors: dict[int, BaseException]
    lse: np.ndarray | None


class Engine:
    def __init__(
        self,
        ctx: GpuContext,
        *,
        max_batch_jobs: int = 256,
        max_queue: int = 4096,
        batch_arena_bytes: int | None = None,
        policy: KernelPolicy | None = None,
        page_tokens: int = 64,
        pool_slab_bytes: int = 0,
        on_batch: Callable[[int, int, float], None] | None = None,
        on_job_start: Callable[[str, float], None] | None = None,
    ):
        self.ctx = ctx
        #: stacked steps the columns gave up on, planned item by item, by reason
        #: (binding_limit, error): /metrics' attnserve_step_fallbacks_total
        self.step_fallbacks = step_fallbacks_counter()
        #: what became of stacked steps' plans: /metrics' attnserve_step_plans_total
        self.step_plans = step_plans_counter()
        self._plan_events = Bound(self.step_plans)  # its children, bound once (a step's every layer counts)
        limit = min(ctx.max_binding, int(ctx.limits.get("max-buffer-size", ctx.max_binding)))
        # every session's pages, per layout, and their page tables (touched only on the GPU
        # thread); pool_slab_bytes bounds the slabs, the binding limit the tables
        self.pools = PagePools(
            page_tokens, min(limit, pool_slab_bytes) if pool_slab_bytes else limit, max_table_bytes=limit
        )
        self.worker = GpuWorker(
            ctx,
            max_batch_jobs=max_batch_jobs,
            max_queue=max_queue,
            arena_budget=batch_arena_bytes,
            on_batch=on_batch,
            on_job_start=on_job_start,
            policy=policy,
            after_run=self.pools.settle,
        )
        self.worker.start()

    @property
    def policy(self) -> KernelPolicy:
        """Which attention kernels this engine's jobs use (a value; set a new one to
        change it: every batch planned after that uses it)."""
        return self.worker.policy

    @policy.setter
    def policy(self, policy: KernelPolicy) -> None:
        self.worker.policy = policy

    @classmethod
    def open(cls, adapter: str | None = None, cuda_context: str = "auto", **kw: Any) -> "Engine":
        return cls(open_device(adapter, cuda_context), **kw)

    def close(self) -> None:
        self.worker.stop()
        self.ctx.close()

    # ── the device ──────────────────────────────────────────────────────────

    def describe(self) -> dict[str, Any]:
        """The adapter: name, backend, type, vendor, binding limits."""
        return self.ctx.describe()

    @property
    def max_binding(self) -> int:
        """Largest buffer binding the adapter allows (bytes)."""
        return self.ctx.max_binding

    # ── limits ──────────────────────────────────────────────────────────────

    def max_tokens_limit(self, kv_format: str | Sequence[str], num_kv_heads: int, head_dim: int) -> int:
        """Most timesteps a layer may hold: its pages live in one pool slab, which
        the adapter binds whole (``kv_format``: a format, or several: the least of them)."""
        limits = []
        for fmt in {kv_format} if isinstance(kv_format, str) else set(kv_format):
            pool = self.pools.get(PageLayout(fmt, num_kv_heads, head_dim))
            limits.append(pool.max_slab_pages * pool.page_tokens)
        return min(limits)

    def session_kv(self, config: SessionConfig) -> SessionKV:
        """A session's layers over this engine's pools (no GPU memory until appends)."""
        return SessionKV(config, self.pools)

    # ── jobs ────────────────────────────────────────────────────────────────

    def append(self, layer: LayerCache, k: np.ndarray, v: np.ndarray) -> Future[int]:
        """Append rows ``k, v [n, Hkv, d]``; the future gives the new length."""
        return self.worker.submit_plan(self.plan_append(layer, k, v))

    def plan_append(self, layer: LayerCache, k: np.ndarray, v: np.ndarray) -> PlanFn:
        """The job of :meth:`append`, checked but not queued (see :meth:`submit_group`):
        a step of one (:meth:`plan_stacked`)."""
        k, v = _as_rows(k, "k"), _as_rows(v, "v")
        return _one(self.plan_stacked([layer], None, k=k[None], v=v[None], start_pos=[None]), appended=True)

    def attend(self, layer: LayerCache, q: np.ndarray, **options: Unpack[AttendOptions]) -> Future[AttendResult]:
        """Optionally append ``k, v`` first (fused step), then attend ``q [n, H, d]``;
        ``options`` are those of :meth:`plan_attend` (``k``, ``v``, ``start_pos``,
        ``causal``, ``scale``).

        The future gives an :class:`AttendResult` ``(out [n, H, d] float32, length)``.
        ``start_pos`` defaults to ``length - n`` after the fused append.
        """
        return self.worker.submit_plan(self.plan_attend(layer, q, **options))

    def plan_attend(
        self,
        layer: LayerCache,
        q: np.ndarray,
        *,
        k: np.ndarray | None = None,
        v: np.ndarray | None = None,
        start_pos: int | None = None,
        causal: bool = True,
        scale: float | None = None,
        out_dtype: np.dtype[Any] | None = None,
    ) -> PlanFn:
        """The job of :meth:`attend`, checked but not queued (see :meth:`submit_group`):
        a step of one (:meth:`plan_stacked`)."""
        q = _as_rows(q, "q")
        if (k is None) != (v is None):
            raise ValueError("k and v go together")
        ks = vs = None
        if k is not None and v is not None:  # (both or neither: checked above)
            ks, vs = _as_rows(k, "k")[None], _as_rows(v, "v")[None]
        if q.shape[2] != layer.head_dim:
            raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {layer.head_dim}")
        return _one(
            self.plan_stacked(
                [layer], q[None], k=ks, v=vs, start_pos=[start_pos], causal=causal, scale=scale, out_dtype=out_dtype
            )
        )

    def plan_stacked(
        self,
        layers: Sequence[LayerCache | None],
        q: np.ndarray | None,
        *,
        k: np.ndarray | None = None,
        v: np.ndarray | None = None,
        start_pos: Sequence[int | None],
        causal: bool = True,
        scale: float | None = None,
        plans: StepPlans | None = None,
        out_dtype: np.dtype[Any] | None = None,
        return_lse: bool = True,
    ) -> PlanFn:
        """One job for a step: item ``i`` is the attend of ``q[i]`` ``[n, H, d]``
        (None: appends alone) after the fused append of ``k[i]``, ``v[i]`` if given,
        on ``layers[i]`` at ``start_pos[i]`` (an item whose layer is None is skipped:
        one refused before), the items planned in order into one batch. The arrays
        are uploaded once (an aligned segment per item) and the outputs are one
        array; an item that fails to plan is rolled back alone. ``plans``: where
        the plans of the steps these layers' sessions take are kept (a step's
        first layer makes one, the later layers run it: ``gpu/step_plan.py``). The
        future gives a :class:`StackedResult` (``out [B, n, H, d]``, ``lengths``,
        ``errors``).

        ``q``, ``k``, ``v`` may be float32, float16 or bfloat16 (``wire.BFLOAT16``),
        converted on the GPU (``kernels.plan_upload_as``); ``out`` is in
        ``out_dtype`` (default: ``q``'s), converted on the GPU unless float32, and
        then with its log-sum-exp only when ``return_lse``."""
        if q is None and k is None:
            raise ValueError("a step attends (q), appends (k, v), or both")
        if q is not None:
            q = _as_array(q)
        answer_dtype = np.dtype(out_dtype if out_dtype is not None else "<f4" if q is None else q.dtype)
        if answer_dtype not in ELEMENT_KINDS:
            raise ValueError(f"out_dtype: expected float32, float16 or bfloat16, got {answer_dtype}")
        narrowed = answer_dtype != np.dtype("<f4")
        b = len(layers)
        if len(start_pos) != b or (k is None) != (v is None) or (q is not None and q.shape[0] != b):
            raise ValueError("one layer and start_pos per stacked item, and k and v together")
        taking = [layer for layer in layers if layer is not None]
        if k is not None:
            k, v = _as_array(k), _as_array(cast(np.ndarray, v))
            if k.shape[0] != b or v.shape != k.shape:
                raise ValueError(f"k/v must both be [{b}, m, Hkv, d], got {k.shape} and {v.shape}")
            for layer in {(l.n_kv_heads, l.head_dim): l for l in taking}.values():  # once per layer shape
                self._check_rows(layer, k[0], v[0])
        d = q.shape[3] if q is not None else cast(np.ndarray, k).shape[3]  # (q None: k is given, checked above)
        if any(layer.head_dim != d for layer in taking):
            raise ValueError(f"q head_dim {d} != a cache's head_dim")
        sc = float(scale) if scale is not None else 1.0 / math.sqrt(d)
        shape: tuple[int, ...] = () if q is None else q.shape[1:]

        def plan(batch: Batch) -> Callable[[memoryview | None], StackedResult]:
            batch.records = batch.empty  # only a batch's first job records its plan (Batch.record)
            # the queries, and the fused rows once per row dtype the layers take, in the
            # input arena as the kernels read them (before any item can roll back)
            row_dtypes = list(dict.fromkeys(layer.row_dtype for layer in taking)) if k is not None else []
            arrays: list[tuple[np.ndarray, str]] = [] if q is None else [(q, "<f4")]
            arrays += [(cast(np.ndarray, a), dtype) for dtype in row_dtypes for a in (k, v)]  # (k, v: given then)
            uploaded = plan_uploads_as(batch, arrays)
            qs = outs = None
            if q is not None:
                qs = uploaded.pop(0)
                outs = batch.output_items(b, attend_output_bytes(*shape), read=not narrowed)
            rows: dict[str, tuple[Items, Items]] = {
                dtype: (uploaded[2 * i], uploaded[2 * i + 1]) for i, dtype in enumerate(row_dtypes)
            }
            lengths = np.full(b, -1, dtype=np.int64)
            errors: dict[int, BaseException] = {}
            cap = self.ctx.max_binding  # an arena is bound whole: the step's items must fit in one
            mark = batch.mark()
            try:  # the common case as columns; anything unusual is planned item by item below
                one_by_one = self._plan_columns(
                    batch, layers, qs, outs, rows, k, shape, start_pos, causal, sc, lengths, plans
                )
                if batch.largest_arena > cap:
                    raise _OneByOne
            except Exception as e:  # never silent: counted, and logged (a failure with its traceback)
                batch.rollback(mark)
                lengths[:] = -1
                one_by_one = [i for i, layer in enumerate(layers) if layer is not None]
                self._fell_back(e, len(one_by_one))
            full: InvalidRequest | None = None
            for i in one_by_one:
                layer = layers[i]
                if full is not None:
                    errors[i] = full
                    continue
                mark = batch.mark()
                try:
                    assert layer is not None  # one_by_one names the items with a layer
                    item_rows: tuple[Seg, Seg, int] | None = None
                    if k is not None:
                        k_items, v_items = rows[layer.row_dtype]
                        item_rows = (k_items.seg(i), v_items.seg(i), k.shape[1])
                    length = _plan_item(
                        batch, layer, None if qs is None else qs.seg(i), shape, None if outs is None else outs.seg(i),
                        item_rows, start_pos[i], causal, sc,
                    )  # fmt: skip
                    if batch.largest_arena > cap and (lengths >= 0).any():  # the first item may use it all
                        full = InvalidRequest(
                            f"this batched step's GPU buffers pass the adapter's binding limit ({cap} bytes) at "
                            f"item {i}: it and the items after it were not applied; send them in a later step"
                        )
                        raise full
                    lengths[i] = length
                except Exception as e:  # this item alone: its commands and host state are undone
                    batch.rollback(mark)
                    errors[i] = e
            answer: tuple[Seg, Seg | None] | None = None
            if outs is not None and narrowed and (lengths >= 0).any():
                answer = plan_answer(batch, outs, shape, answer_dtype, return_lse)

            def finish(out: memoryview | None) -> StackedResult:
                if outs is None:
                    return StackedResult(None, lengths, errors, None)
                if not (lengths >= 0).any():  # nothing answered (nothing may have been read back)
                    return StackedResult(
                        np.zeros((b, *shape), answer_dtype), lengths, errors, np.zeros((b, *shape[:2]), "<f4")
                    )
                assert out is not None  # an item answered: its outputs were read back
                if answer is None:
                    arr = outs.view(out, "<f4", shape)
                    lse = outs.view(out, "<f4", shape[:2], start=4 * math.prod(shape))
                else:  # converted into the answer arena, items back to back
                    at, (out_seg, lse_seg) = batch.answer_at, answer
                    arr = np.frombuffer(out, answer_dtype, b * math.prod(shape), at + out_seg.offset).reshape(b, *shape)
                    rows_lse = (b, *shape[:2])
                    lse = (
                        np.zeros(rows_lse, "<f4") if lse_seg is None
                        else np.frombuffer(out, "<f4", math.prod(rows_lse), at + lse_seg.offset).reshape(rows_lse)
                    )  # fmt: skip
                unanswered = lengths < 0  # skipped or failed: their rows of the arena hold no output
                if unanswered.any():
                    arr, lse = arr.copy(), lse.copy()
                    arr.view(np.uint8).reshape(b, -1)[unanswered] = 0  # (any dtype: bfloat16 is void)
                    lse[unanswered] = 0.0
                return StackedResult(arr, lengths, errors, lse)

            return finish

        return plan

    def _fell_back(self, e: Exception, items: int) -> None:
        """A stacked step planned item by item after its columns gave up (``e``)."""
        if isinstance(e, _OneByOne):
            self.step_fallbacks.labels("binding_limit").inc()
            log.debug("a stacked step's columns pass the binding limit: planned item by item", extra={"items": items})
        elif isinstance(e, (ApiError, OutOfRange)):
            self.step_fallbacks.labels("item_refused").inc()
            log.debug(
                "a stacked step's item was refused on the GPU thread: planned item by item to name it",
                extra={"items": items, "problem": str(e)},
            )
        else:
            self.step_fallbacks.labels("error").inc()
            log.warning(
                "a stacked step's columns failed: planned item by item (the answers are the same, slower)",
                exc_info=e,
                extra={"items": items},
            )

    def _plan_event(self, event: str, reason: str, layer: int) -> None:
        """What became of a step's plan on ``layer`` (``gpu/step_plan.py``): counted;
        a plan a later layer could not run, logged too (debug) with the reason."""
        self._plan_events[event, reason].inc()
        if event == "missed":
            log.debug("a layer's step did not run its step's plan", extra={"layer": layer, "reason": reason})

    def _plan_columns(
        self,
        batch: Batch,
        layers: Sequence[LayerCache | None],
        qs: Items | None,
        outs: Items | None,
        rows: dict[str, tuple[Items, Items]],
        k: np.ndarray | None,
        shape: tuple[int, ...],
        start_pos: Sequence[int | None],
        causal: bool,
        scale: float,
        lengths: np.ndarray,
        plans: StepPlans | None,
    ) -> list[int]:
        """Plan a stacked step's items as columns where it can: when its layers are
        distinct, every item whose layer's kind takes the split path, in one group per
        pool (``LayerCache.plan_stacked``); sets their ``lengths`` and returns the
        items left to plan one by one (every item, if a layer appears twice: items of
        one layer apply in order, each against the one before)."""
        taking = [i for i, layer in enumerate(layers) if layer is not None]
        if len(taking) == 1 and not layers[taking[0]].format_follows and not plans:  # type: ignore[union-attr]
            return taking  # one item, no later layer to run a plan on, none made: planned alone is cheaper
        if len({id(layers[i]) for i in taking}) != len(taking):
            return taking
        present = cast("Sequence[LayerCache]", layers)  # at the indices in taking, which alone are read below
        groups: dict[tuple[int, type[LayerCache]], list[int]] = {}
        for i in taking:
            groups.setdefault((id(present[i].pool), type(present[i])), []).append(i)
        left: list[int] = []
        sp_all = np.fromiter((-1 if p is None else p for p in start_pos), np.int64, len(start_pos))
        for idx in groups.values():
            first = present[idx[0]]
            if qs is not None and not first.attends_split(batch.policy, shape[0], shape[1]):
                left += idx
                continue
            items = np.asarray(idx)
            group = [present[i] for i in idx]
            item_rows = None if k is None else (*rows[first.row_dtype], k.shape[1])
            lengths[items] = first.plan_stacked(
                batch, group, items, qs, outs, item_rows, shape, sp_all[items], causal, scale, plans, self._plan_event
            )
        return sorted(left)

    def submit_group(self, plans: list[PlanFn]) -> list[Future[Any]]:
        """Queue ``plans`` together: they run in order in one GPU submission with one
        readback (a batched step). All or none are queued (Overloaded: none)."""
        return self.worker.submit_plans(plans)

    def call(self, fn: Callable[[GpuContext], object]) -> Future[Any]:
        """Run ``fn(ctx)`` alone on the GPU thread (readbacks, restores, frees)."""
        return self.worker.submit_call(fn)

    def fork(self, src: SessionKV, kv: SessionKV, lengths: list[int]) -> Future[None]:
        """Make ``kv`` (a new session of ``src``'s config) share ``src``'s first
        ``lengths[i]`` timesteps of each layer, after every job queued on ``src``."""
        return self.worker.submit_call(lambda ctx: kv.fork_from(ctx.device, src, lengths))

    def release(self, session: SessionKV) -> Future[None]:
        return self.worker.submit_call(lambda ctx: session.release())

    @staticmethod
    def _check_rows(layer: LayerCache, k: np.ndarray, v: np.ndarray) -> None:
        want = (layer.n_kv_heads, layer.head_dim)
        if k.shape != v.shape or k.shape[1:] != want or k.shape[0] < 1:
            raise ValueError(f"k/v must both be [n>=1, {want[0]}, {want[1]}], got {k.shape} and {v.shape}")
