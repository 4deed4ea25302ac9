"""Adapter choice, limits, and the single thread that owns the device.

wgpu-py is not safe to drive from several threads, and a blocking readback must
never run on the event loop. So one :class:`GpuWorker` thread owns the device
and its queue; everything else hands it jobs and waits on a
``concurrent.futures.Future`` (``asyncio.wrap_future`` on the event loop).

Jobs that arrive while the worker is busy are coalesced: the worker drains the
queue, lets each job plan its dispatches into one :class:`~.batch.Batch`, and
submits once with one readback. Batches are pipelined: the next batch is planned,
encoded and submitted while the GPU runs the one before, which is read back after
(two in flight at most, each with its own readback buffer).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import wgpu

from ..errors import GpuError, Overloaded
from . import cuda_clocks
from .batch import STAGING_SLOTS, Arenas, Batch
from .kernels import KernelPolicy
from .shaders import PipelineCache

__all__ = ["GpuContext", "open_device", "list_adapters", "GpuWorker", "DeviceError"]

log = logging.getLogger("attnserve.gpu")

# What the kernels need at least: 7 storage buffers in a stage (flash_attention_tqx),
# 6 KiB of workgroup memory, 256 invocations, and room for a useful cache.
MIN_LIMITS = {
    "max-storage-buffers-per-shader-stage": 7,
    # the largest kernel's workgroup memory (attention_prefill_rb: 32 KiB; the plain
    # split kernels ~21 KiB)
    "max-compute-workgroup-storage-size": 32768,
    "max-compute-invocations-per-workgroup": 256,
    "max-compute-workgroup-size-x": 256,
    "max-storage-buffer-binding-size": 16 << 20,
}
# Limits requested at the adapter's own value (the largest caches it can bind).
REQUESTED_FROM_ADAPTER = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-storage-buffers-per-shader-stage",
    "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroups-per-dimension",
)


OPTIONAL_FEATURES: tuple[str, ...] = ()


class DeviceError(RuntimeError):
    """No usable adapter: raised at start with a message saying why."""


@dataclass
class GpuContext:
    adapter: wgpu.GPUAdapter
    device: wgpu.GPUDevice
    info: dict[str, Any]
    limits: dict[str, int]
    features: frozenset[str]
    # the CUDA context held for full clocks (NVIDIA adapters: gpu/cuda_clocks.py)
    cuda: cuda_clocks.Hold | None = None
    pipelines: PipelineCache = field(init=False)

    def __post_init__(self) -> None:
        self.pipelines = PipelineCache(self.device)

    def close(self) -> None:
        """Release what the context holds besides the device (the CUDA context)."""
        if self.cuda is not None:
            self.cuda.release()

    @property
    def name(self) -> str:
        return str(self.info.get("device") or self.info.get("description") or "unknown")

    @property
    def backend(self) -> str:
        return str(self.info.get("backend_type", "unknown"))

    @property
    def max_binding(self) -> int:
        return int(self.limits["max-storage-buffer-binding-size"])

    @property
    def offset_align(self) -> int:
        return int(self.limits.get("min-storage-buffer-offset-alignment", 256))

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.backend,
            "adapter_type": str(self.info.get("adapter_type", "")),
            "vendor": str(self.info.get("vendor", "")),
            "description": str(self.info.get("description", "")),
            "max_storage_buffer_binding_size": self.max_binding,
            "max_buffer_size": int(self.limits["max-buffer-size"]),
            "cuda_context": self.cuda.describe() if self.cuda is not None else None,
        }


def list_adapters() -> list[wgpu.GPUAdapter]:
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # silences a harmless Mesa warning
    return list(wgpu.gpu.enumerate_adapters_sync())


def _select(adapters: list[wgpu.GPUAdapter], selector: str | None) -> wgpu.GPUAdapter:
    if not adapters:
        raise DeviceError(
            "no wgpu adapter found: install a GPU driver with Vulkan/Metal/DX12 support, "
            "or Mesa's software Vulkan driver (Debian: apt-get install mesa-vulkan-drivers)"
        )
    if not selector:
        return adapters[0]
    sel = selector.strip().lower()
    if sel.isdigit():
        i = int(sel)
        if i < len(adapters):
            return adapters[i]
    for a in adapters:
        info = a.info
        backend = str(info.get("backend_type", "")).lower()
        kind = str(info.get("adapter_type", "")).lower()
        names = f"{info.get('device', '')} {info.get('vendor', '')} {info.get('description', '')}".lower()
        if sel in (backend, kind) or sel in names:
            return a
    avail = "; ".join(f"[{i}] {a.summary}" for i, a in enumerate(adapters))
    raise DeviceError(f"no adapter matches {selector!r}; available: {avail}")


def is_nvidia(info: dict[str, Any]) -> bool:
    """Whether an adapter's info names NVIDIA's driver (PCI vendor 0x10de)."""
    if info.get("vendor_id") == 0x10DE:
        return True
    names = f"{info.get('vendor', '')} {info.get('device', '')}".lower()
    return "nvidia" in names


def hold_cuda_context(info: dict[str, Any], cuda_context: str) -> cuda_clocks.Hold | None:
    """The CUDA context that keeps an NVIDIA GPU at full clocks under Vulkan
    (``gpu/cuda_clocks.py``): ``cuda_context`` "off" (none), "auto" (on an NVIDIA
    adapter, the only CUDA device visible; none, with a warning saying why, where
    that fails) or a CUDA device ordinal (that one; DeviceError where it fails)."""
    if cuda_context == "off" or (cuda_context == "auto" and not is_nvidia(info)):
        return None
    ordinal = None if cuda_context == "auto" else int(cuda_context)
    try:
        held = cuda_clocks.hold(ordinal)
    except cuda_clocks.CudaUnavailable as e:
        if ordinal is not None:
            raise DeviceError(f"cannot hold a context on CUDA device {ordinal}: {e}") from None
        log.warning(
            "no CUDA context held: the driver may keep the GPU at idle clocks under Vulkan "
            "(a 64 x 4k decode step measured 4x slower on the H200); set cuda_context to the adapter's "
            "CUDA device, or 'off' to silence this",
            extra={"reason": str(e)},
        )
        return None
    log.info("cuda context held for full clocks", extra={"cuda_device": held.ordinal, "cuda_name": held.name})
    return held


def open_device(selector: str | None = None, cuda_context: str = "auto") -> GpuContext:
    """Open the first adapter (or the one ``selector`` names: an index, a backend
    such as ``vulkan``, an adapter type such as ``cpu``, or part of its name) and
    request the limits the kernels need from it; on NVIDIA, hold a CUDA context
    (:func:`hold_cuda_context`). Raises :class:`DeviceError`."""
    adapter = _select(list_adapters(), selector)
    alimits = {k: int(v) for k, v in adapter.limits.items() if isinstance(v, int)}
    short = [f"{k} = {alimits.get(k)} (need >= {v})" for k, v in MIN_LIMITS.items() if alimits.get(k, 0) < v]
    if short:
        raise DeviceError(f"adapter {adapter.summary} is too small for attnserve: " + ", ".join(short))
    required = {k: alimits[k] for k in REQUESTED_FROM_ADAPTER if k in alimits}
    # Optional features a kernel may declare (shaders.KERNELS); none of the shipped ones does.
    features = [f for f in OPTIONAL_FEATURES if f in adapter.features]
    try:
        device = adapter.request_device_sync(label="attnserve", required_limits=required, required_features=features)
    except Exception as e:  # pragma: no cover - depends on the driver
        raise DeviceError(f"cannot open a device on {adapter.summary}: {e}") from e
    dlimits = {k: int(v) for k, v in device.limits.items() if isinstance(v, int)}
    info = dict(adapter.info)
    ctx = GpuContext(
        adapter=adapter,
        device=device,
        info=info,
        limits=dlimits,
        features=frozenset(device.features),
        cuda=hold_cuda_context(info, cuda_context),
    )
    ctx.pipelines.warm_up()
    log.info("gpu device open", extra={"adapter": adapter.summary})
    return ctx


# ── the owner thread ─────────────────────────────────────────────────────────

# a plan's finish: what its job returns, from the batch's output bytes
FinishFn = Callable[[memoryview | None], Any]
PlanFn = Callable[[Batch], FinishFn]
CallFn = Callable[[GpuContext], Any]


class _Job:
    __slots__ = ("kind", "fn", "future", "enqueued", "started", "taken", "group", "weight")

    def __init__(
        self, kind: str, fn: Callable[..., Any], future: Future[Any], group: object = None, weight: int = 1
    ) -> None:
        self.kind = kind
        self.weight = weight  # what it counts against max_queue: a stacked step's items
        self.fn = fn  # a PlanFn (kind "plan") or a CallFn ("call")
        self.future = future
        self.enqueued = time.perf_counter()  # submitted (the request parsed)
        self.started = False  # its future is RUNNING (a job pushed back keeps it)
        self.group = group  # jobs of one submit_plans call share it: taken together
        self.taken = False  # the worker took it once (its queue wait is counted)


class GpuWorker:
    """The one thread that drives the device.

    * ``submit_plan(plan)``: ``plan(batch)`` records dispatches and returns
      ``finish(outputs)``, which turns the batch's output bytes into the job's
      result. Plans run in submission order; a plan that raises is rolled back
      and fails only its own future.
    * ``submit_call(fn)``: ``fn(ctx)`` runs alone on the worker (after the
      batch in progress), for readbacks of whole caches, restores and frees.

    ``max_queue`` bounds the backlog: past it, submits raise ``Overloaded``.
    ``on_batch(n_jobs, n_dispatches, seconds)`` is called after each submit, and
    ``on_job_start(kind, waited)`` as the worker takes each job, with the seconds
    it waited since it was submitted and its kind (``batch``: a plan coalesced into
    a submission; ``call``) (metrics). Both run on the worker thread.
    """

    def __init__(
        self,
        ctx: GpuContext,
        *,
        max_batch_jobs: int = 256,
        max_queue: int = 4096,
        arena_budget: int | None = None,
        on_batch: Callable[[int, int, float], None] | None = None,
        on_job_start: Callable[[str, float], None] | None = None,
        policy: KernelPolicy | None = None,
        after_run: Callable[[], None] | None = None,
    ):
        self.ctx = ctx
        self.after_run = after_run  # after every batch or call (the pool frees dropped pages)
        self.max_batch_jobs = max_batch_jobs
        self.max_queue = max_queue
        self.on_batch = on_batch
        self.on_job_start = on_job_start
        self.arenas = Arenas(ctx.device, ctx.max_binding, arena_budget)
        self.policy = policy if policy is not None else KernelPolicy()  # the engine's; read per batch
        self._jobs: collections.deque[_Job] = collections.deque()
        self._queued = 0  # the weights of the jobs in _jobs
        self._cv = threading.Condition()
        self._stop = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="attnserve-gpu", daemon=True)
        self.batches = 0
        self.dispatches = 0
        self.overlapped = 0  # batches submitted while the one before was still in flight

    # ── public ──────────────────────────────────────────────────────────────

    def start(self) -> "GpuWorker":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish every queued job, then end the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self._jobs) + (1 if self._busy else 0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def submit_plan(self, plan: PlanFn, weight: int = 1) -> Future[Any]:
        """Queue ``plan``; it counts ``weight`` against ``max_queue`` (a stacked step:
        its items, as if they were queued one by one)."""
        return self._enqueue([_Job("plan", plan, Future(), weight=weight)])[0]

    def submit_plans(self, plans: list[PlanFn], weights: list[int] | None = None) -> list[Future[Any]]:
        """Queue ``plans`` as one group: all at once (or none: Overloaded), taken into
        one batch together even past ``max_batch_jobs`` (a batched step is one
        submission with one readback; only the binding limit can split it). Plan
        ``i`` counts ``weights[i]`` against ``max_queue`` (default 1; a step: its items)."""
        group = object()
        if weights is None:
            weights = [1] * len(plans)
        return self._enqueue([_Job("plan", plan, Future(), group, w) for plan, w in zip(plans, weights, strict=True)])

    def submit_call(self, fn: CallFn) -> Future[Any]:
        return self._enqueue([_Job("call", fn, Future())])[0]

    def run(self, fn: CallFn, timeout: float | None = None) -> Any:
        """``submit_call`` and wait (for tools, tests and start-up)."""
        return self.submit_call(fn).result(timeout)

    # ── internals ───────────────────────────────────────────────────────────

    def _enqueue(self, jobs: list[_Job]) -> list[Future[Any]]:
        """Queue ``jobs`` all at once, or none (Overloaded: the worker is stopping, or
        they do not all fit in ``max_queue``)."""
        with self._cv:
            if self._stop:
                raise Overloaded("the GPU worker is shutting down", headers={"Retry-After": "1"})
            n = sum(j.weight for j in jobs)
            if self._queued + n > self.max_queue:
                more = "" if n == 1 else f"; {self._queued} are, and this batch has {n}"
                raise Overloaded(
                    f"the GPU queue is full ({self.max_queue} jobs waiting{more})", headers={"Retry-After": "1"}
                )
            self._jobs.extend(jobs)
            self._queued += n
            self._cv.notify()
        return [j.future for j in jobs]

    def _take(self, block: bool) -> list[_Job] | None:
        """The next jobs to run: a call alone, or queued plans for one batch. None
        when there are none: with ``block``, only once the worker is stopping."""
        with self._cv:
            while not self._jobs:
                if self._stop or not block:
                    return None
                self._cv.wait()
            first = self._jobs.popleft()
            self._queued -= first.weight
            jobs = [first]
            if first.kind == "plan":
                while (
                    self._jobs
                    and self._jobs[0].kind == "plan"
                    and (
                        len(jobs) < self.max_batch_jobs
                        or (jobs[-1].group is not None and self._jobs[0].group is jobs[-1].group)
                    )
                ):
                    jobs.append(self._jobs.popleft())
                    self._queued -= jobs[-1].weight
            self._busy = True
            return jobs

    def _count_waits(self, jobs: list[_Job]) -> None:
        """Each job's queue wait, once (a job pushed back to the next batch is taken again)."""
        now = time.perf_counter()
        hook = self.on_job_start
        for job in jobs:
            if job.taken:
                continue
            job.taken = True
            if hook is not None:
                try:
                    hook("batch" if job.kind == "plan" else "call", now - job.enqueued)
                except Exception:  # pragma: no cover
                    log.exception("on_job_start hook failed")

    def _run(self) -> None:
        """Take jobs and run them. Batches are pipelined: batch ``i`` is submitted,
        then the next one is planned, encoded and submitted while the GPU runs it,
        and only then is ``i`` read back and its futures set (at once when nothing
        else is queued). So at most two batches are in flight, each with its own
        readback buffer. A call runs alone, after the batch in flight is read back."""
        in_flight: _InFlight | None = None
        while True:
            jobs = self._take(block=in_flight is None)
            if jobs is None:
                if in_flight is None:
                    return  # stopping, and everything is done
                self._settle(in_flight)
                in_flight = None
                with self._cv:
                    self._busy = False
                continue
            self._count_waits(jobs)
            try:
                if jobs[0].kind == "call":
                    if in_flight is not None:
                        self._settle(in_flight)
                        in_flight = None
                    self._run_call(jobs[0])
                else:
                    submitted = self._submit_batch(jobs, slot=self.batches % STAGING_SLOTS)
                    if in_flight is not None:
                        self.overlapped += submitted is not None
                        self._settle(in_flight)
                    in_flight = submitted
            except BaseException as e:  # pragma: no cover - last-resort guard
                log.exception("gpu worker error")
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(GpuError(f"GPU worker failure: {e}"))
            finally:
                if self.after_run is not None:
                    try:
                        self.after_run()
                    except Exception:  # pragma: no cover
                        log.exception("after_run hook failed")
                with self._cv:
                    self._busy = in_flight is not None
            # the jobs' plans hold their requests' arrays (a shared-memory client's
            # are views of its region): none is kept while the thread waits for more
            jobs = submitted = None

    def _run_call(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn(self.ctx))
        except BaseException as e:
            job.future.set_exception(e)

    def _submit_batch(self, jobs: list[_Job], slot: int) -> _InFlight | None:
        """Plan ``jobs`` into one batch, encode it and submit it, reading back
        through staging ``slot``; returns it in flight (None if nothing was
        submitted). Runs before the previous batch is read back: the GPU runs that
        one meanwhile. The queue orders the two submissions, so this batch's writes
        land after every read the previous one makes."""
        t0 = time.perf_counter()
        if self.arenas.trim():
            log.debug(
                "arenas grown past batch_arena_bytes for a large job let go", extra={"budget": self.arenas.budget}
            )
        batch = Batch(self.ctx.device, self.ctx.pipelines, self.arenas, self.ctx.offset_align, self.policy)
        planned: list[tuple[_Job, FinishFn]] = []
        # A coalesced batch keeps each arena within the arena budget (the device memory
        # in-flight work holds), and a job of the group before it (one batched step)
        # within the binding limit (an arena is bound whole-or-in-part): a job that would
        # pass it goes back to the front of the queue for the next batch (a job alone
        # may use up to the binding limit).
        for i, job in enumerate(jobs):
            if not job.started:
                job.started = True
                if not job.future.set_running_or_notify_cancel():
                    continue
            mark = batch.mark()
            try:
                finish = job.fn(batch)
            except BaseException as e:
                batch.rollback(mark)
                job.future.set_exception(e)
                continue
            same_step = bool(planned) and job.group is not None and job.group is planned[-1][0].group
            cap = self.ctx.max_binding if same_step else min(self.arenas.budget, self.ctx.max_binding)
            if planned and batch.largest_arena > cap:
                batch.rollback(mark)
                with self._cv:
                    self._jobs.extendleft(reversed(jobs[i:]))
                    self._queued += sum(j.weight for j in jobs[i:])
                break
            planned.append((job, finish))
        try:
            encoded = batch.encode(slot, submit=True)
        except BaseException as e:
            log.exception("gpu submit failed")
            for job, _ in planned:
                job.future.set_exception(GpuError(f"GPU submission failed: {e}"))
            return None
        self.batches += 1
        self.dispatches += batch.n_dispatches
        return _InFlight(batch, encoded, planned, t0)

    def _settle(self, flight: _InFlight) -> None:
        """Read a submitted batch back and set its jobs' futures."""
        try:
            out = flight.batch.read_back(flight.encoded)
        except BaseException as e:
            log.exception("gpu readback failed")
            for job, _ in flight.planned:
                job.future.set_exception(GpuError(f"GPU submission failed: {e}"))
            return
        if self.on_batch is not None:
            try:
                self.on_batch(len(flight.planned), flight.batch.n_dispatches, time.perf_counter() - flight.t0)
            except Exception:  # pragma: no cover
                log.exception("on_batch hook failed")
        for job, finish in flight.planned:
            try:
                job.future.set_result(finish(out))
            except BaseException as e:
                job.future.set_exception(e)


@dataclass(eq=False)
class _InFlight:
    """A batch submitted and not yet read back."""

    batch: Batch
    encoded: Any
    planned: list[tuple[_Job, FinishFn]]
    t0: float
