"""The app's runtime state: what lives as long as the app.

``Runtime`` holds the settings, the session store, metrics, the API keys, the
engine once the device is open, the snapshot directory, and the lifecycle flags
(ready, draining, requests in flight); it deletes sessions (and expires idle
ones), offloads large work to threads, and settles each queued job's reservation
when the job is done, with its request timeout (:meth:`Runtime.watch_all`).

The owner (tenant) of a request is the key id the app's middleware found for its
bearer token (``None`` without API keys), kept in the ASGI scope under
:data:`OWNER_KEY`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Callable

from . import __version__
from .auth import KeyRing
from .codec import offload
from .config import Settings
from .engine import Engine, step_fallbacks_counter, step_plans_counter
from .errors import NotReady
from .formats import KV_FORMATS
from .metrics import SHM_EVENTS, STEP_CALL_OUTCOMES, Metrics
from .step_registry import CLOSE_REASONS, StepRegistry
from .store import Session, StepReservation, Store

__all__ = ["Runtime", "RequestState", "OWNER_KEY", "current_request", "install_gauges"]

log = logging.getLogger("attnserve")

OWNER_KEY = "attnserve.owner"  # the request's owner (key id), in the ASGI scope


class RequestState:
    """Per-request facts the middleware needs back from deeper code."""

    __slots__ = ("timed_out",)

    def __init__(self) -> None:
        self.timed_out = False


current_request: contextvars.ContextVar[RequestState | None] = contextvars.ContextVar("attnserve_request", default=None)


class Runtime:
    def __init__(self, settings: Settings, engine: Engine | None = None):
        self.settings = settings
        self.metrics = Metrics()
        self.keys = KeyRing(settings.api_key_list())
        self.store = Store(
            max_sessions=settings.max_sessions,
            memory_budget_bytes=settings.memory_budget_bytes,
            quota_sessions_per_key=settings.quota_sessions_per_key,
            quota_bytes_per_key=settings.quota_bytes_per_key,
            on_quota=lambda quota: self.metrics.quota_rejections.labels(quota).inc(),
        )
        self.steps = StepRegistry(
            self.store, settings.max_sessions, on_close=lambda reason: self.metrics.steps_closed.labels(reason).inc()
        )
        for reason in CLOSE_REASONS:  # exposed from the start, at 0
            self.metrics.steps_closed.labels(reason)
        for outcome in STEP_CALL_OUTCOMES:
            self.metrics.step_calls_by[outcome]
        for reason in ("missing", "invalid"):  # exposed from the start, at 0
            self.metrics.auth_failures.labels(reason)
        for quota in ("sessions", "bytes"):
            self.metrics.quota_rejections.labels(quota)
        if settings.shm_socket is not None:  # exposed from the start, at 0
            for event in SHM_EVENTS:
                self.metrics.shm_events.labels(event)
        self.persistence: Any = None  # a persistence.SnapshotDir when snapshot_dir is set
        self.engine: Engine | None = engine
        self.ready = False
        self.warming_up = False  # the kernels are being compiled (app.py's lifespan; not ready yet)
        self.draining = False
        self.in_flight = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.frames_port: int | None = None  # where the frame transport listens, once it does
        self.shm_socket: str | None = None  # where the shared-memory transport listens, once it does
        self._idle: asyncio.Event | None = None
        self._when_ready: list[Callable[[], None]] = []

    # ── lifecycle ───────────────────────────────────────────────────────────

    def begin_drain(self) -> None:
        """Stop being ready: /readyz answers 503 and new /v1 requests are refused."""
        if not self.draining:
            log.info("draining", extra={"in_flight": self.in_flight})
        self.draining = True

    def mark_ready(self) -> None:
        """The start is done (device open, sessions restored, kernels warm): take work
        from now on, and call what :meth:`when_ready` was given."""
        self.ready = True
        waiting, self._when_ready = self._when_ready, []
        for fn in waiting:
            fn()

    def when_ready(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the event loop once the server is ready (now, if it is)."""
        if self.ready:
            fn()
        else:
            self._when_ready.append(fn)

    def not_ready_reason(self) -> str | None:
        """Why the server takes no work now, or None when it does."""
        if self.draining:
            return "the server is draining"
        if self.warming_up:
            return "the kernels are warming up (the warmup setting)"
        if self.engine is None or not self.ready:
            return "the GPU device is not ready"
        return None

    def ready_engine(self) -> Engine:
        """The engine, if the server takes work now (else 503 not-ready)."""
        reason = self.not_ready_reason()
        if reason is not None:
            raise NotReady(reason)
        assert self.engine is not None  # not_ready_reason says so
        return self.engine

    def request_started(self) -> None:
        self.in_flight += 1

    def request_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float, *, leave: int = 0) -> bool:
        """Wait until at most ``leave`` requests are in flight; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight > leave:
            self._idle = asyncio.Event()
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._idle.wait(), min(left, 0.05))
            except asyncio.TimeoutError:
                pass
        return True

    # ── sessions ────────────────────────────────────────────────────────────

    def drop_session(self, session: Session, engine: Engine) -> Future[None]:
        """Delete a session: queue the release of its GPU memory (after its jobs),
        drop it from the store and its snapshot file from the snapshot directory.
        Returns the release's future. Raises Overloaded (queue full): nothing changed."""
        fut = engine.release(session.kv)
        freed = self.store.remove(session)
        loop = self.loop or asyncio.get_running_loop()

        def released(_f: Future[None]) -> None:
            try:
                loop.call_soon_threadsafe(self.store.released, freed, session.family)
            except RuntimeError:  # pragma: no cover - the loop is gone (shutdown)
                pass

        fut.add_done_callback(released)
        if self.persistence is not None:
            self.persistence.forget(session)
        return fut

    async def expire_idle(self) -> None:
        """Background task: close the steps opened over HTTP that no call used for
        ``step_idle_timeout_s``, and delete sessions idle for ``session_ttl_seconds``
        (when set; a session in an open step does not expire)."""
        ttl, step_ttl = self.settings.session_ttl_seconds, self.settings.step_idle_timeout_s
        interval = min(max(min(t for t in (ttl, step_ttl) if t > 0) / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            if self.draining:
                continue
            self.expire_steps(step_ttl)
            engine = self.engine
            if engine is None or ttl <= 0:
                continue
            for session in self.store.idle(ttl):
                try:
                    self.drop_session(session, engine)
                except Exception as e:  # Overloaded: the queue is full; try again next round
                    log.warning("cannot expire a session yet", extra={"session_id": session.id, "error": str(e)})
                    continue
                self.metrics.expired.inc()
                log.info("session expired", extra={"session_id": session.id, "tenant": session.owner, "idle_s": ttl})

    def expire_steps(self, timeout: float) -> None:
        """Close the steps not bound to a connection that no call used for ``timeout`` seconds."""
        for step in self.steps.idle(timeout):
            self.steps.close(step, "idle")
            log.info("step expired", extra={"step": step.handle, "tenant": step.owner, "idle_s": timeout})

    # ── work ────────────────────────────────────────────────────────────────

    async def offload(self, fn: Callable[..., Any], *args: Any, size: int) -> Any:
        return await offload(fn, *args, size=size, threshold=self.settings.offload_bytes)

    def watch_all(
        self,
        futs: list[Future[Any]],
        reservations: list[StepReservation],
        item_errors: list[Callable[[Any], Sequence[BaseException | None] | None]],
    ) -> asyncio.Future[None]:
        """Settle the reservations of jobs queued together (a request's steps, each
        committed as it was checked, so the next was checked against it) in the
        store on the event loop as soon as they are done (independently of the
        request that queued them), and arm the request timeout. ``reservations[i]``
        is job ``i``'s; ``item_errors[i](result)`` gives each of its items its error
        (None where it succeeded), or None when every item succeeded. One wake-up of
        the event loop settles them all when the last is done (a job that the timeout
        cancels settles at once); the returned future is done then.

        Timeout (``request_timeout_s``): it bounds the wait in the GPU queue. When it
        passes and a job has not started, the job is cancelled (the GPU thread skips
        it: nothing is applied) if that changes nothing another queued job was
        checked against (``Store.cancellable``); otherwise the check repeats shortly
        (jobs queued after it time out first, from the tail). A job that has started
        always completes, and its items answer normally.
        """
        loop = self.loop or asyncio.get_running_loop()
        all_done: asyncio.Future[None] = loop.create_future()
        jobs = [_Watched(f, r, e) for f, r, e in zip(futs, reservations, item_errors, strict=True)]
        remaining = len(jobs)
        lock = threading.Lock()
        timer: asyncio.TimerHandle | None = None

        def settle(job: _Watched) -> None:  # on the event loop
            if not job.settled:
                job.settled = True
                f = job.fut
                assert f is not None
                # the future holds done's partial, which holds the job: let go of the
                # future (and its result, the reply's arrays) so that it is freed as soon
                # as its request is, not at the collector's next run (a cycle)
                job.fut = None
                error = asyncio.CancelledError() if f.cancelled() else f.exception()
                errors: Sequence[BaseException | None] | None
                if error is None:
                    errors = job.item_errors(f.result())
                else:
                    errors = [error] * len(job.res)
                self.store.finish_step(job.res, errors)

        def settle_all() -> None:  # on the event loop
            if timer is not None:
                timer.cancel()  # drops the closure (and the jobs' results) at once, not after the timeout
            for job in jobs:
                settle(job)
            jobs.clear()  # the closures (done's, in the futures; expire's, its own) hold no job past here
            if not all_done.done():
                all_done.set_result(None)

        def done(job: _Watched, f: Future[Any]) -> None:  # on the GPU thread, or on the loop for our cancel
            nonlocal remaining
            ours = job.cancelling and f.cancelled()
            if ours:  # settle now, before any other check
                settle(job)
            with lock:
                remaining -= 1
                last = remaining == 0
            if not last:
                return
            if ours:
                settle_all()
                return
            try:
                loop.call_soon_threadsafe(settle_all)
            except RuntimeError:  # pragma: no cover - the loop is gone (shutdown)
                pass

        timeout = self.settings.request_timeout_s
        if timeout > 0:
            state = current_request.get()

            def expire() -> None:
                nonlocal timer
                timer = None
                again = False
                for job in reversed(jobs):  # the tail first: it frees the checks of those before it
                    f = job.fut
                    if f is None or f.done() or f.running():  # None: settled
                        continue
                    if not self.store.cancellable(job.res):
                        again = True
                        continue
                    job.cancelling = True
                    try:
                        cancelled = f.cancel()  # False once the GPU thread has started it
                    finally:
                        job.cancelling = False
                    if cancelled:
                        if state is not None:
                            state.timed_out = True
                        self.metrics.timeouts.inc(len(job.res))  # a stacked step: each item
                if again and not all_done.done():
                    timer = loop.call_later(min(0.05, timeout), expire)

            timer = loop.call_later(timeout, expire)

        for f, job in zip(futs, list(jobs)):
            f.add_done_callback(functools.partial(done, job))
        if not jobs:
            settle_all()
        return all_done


class _Watched:
    """One job of :meth:`Runtime.watch_all`."""

    __slots__ = ("fut", "res", "item_errors", "cancelling", "settled")

    def __init__(
        self,
        fut: Future[Any],
        res: StepReservation,
        item_errors: Callable[[Any], Sequence[BaseException | None] | None],
    ):
        self.fut: Future[Any] | None = fut  # None once settled
        self.res = res
        self.item_errors = item_errors
        self.cancelling = False
        self.settled = False


# ── metrics that describe state (computed when scraped) ─────────────────────


def install_gauges(rt: Runtime) -> None:
    """The gauges that describe state, computed when /metrics is scraped."""
    m, s = rt.metrics, rt.settings

    def by_format(i: int) -> list[tuple[tuple[str, ...], float]]:
        counts = rt.store.by_format()
        return [((fmt,), counts.get(fmt, (0, 0))[i]) for fmt in KV_FORMATS]

    m.add_gauge("attnserve_sessions", "Sessions held, by kv format.", ("kv_format",), lambda: by_format(0))
    fallbacks, plans = step_fallbacks_counter(), step_plans_counter()  # read while there is no engine
    m.add_counter(lambda: rt.engine.step_fallbacks if rt.engine is not None else fallbacks)
    m.add_counter(lambda: rt.engine.step_plans if rt.engine is not None else plans)
    m.add_gauge(
        "attnserve_kv_bytes", "GPU bytes the sessions' caches hold, by kv format.", ("kv_format",), lambda: by_format(1)
    )
    m.add_gauge(
        "attnserve_memory_used_bytes",
        "GPU bytes held or reserved by queued work (what the budget counts).",
        (),
        lambda: [((), rt.store.used_bytes)],
    )
    m.add_gauge(
        "attnserve_memory_budget_bytes",
        "The GPU memory budget (0: none).",
        (),
        lambda: [((), rt.settings.memory_budget_bytes)],
    )
    m.add_gauge(
        "attnserve_gpu_queue_depth",
        "Jobs waiting for or running on the GPU thread.",
        (),
        lambda: [((), rt.engine.worker.queue_depth if rt.engine is not None else 0)],
    )
    m.add_gauge("attnserve_requests_in_flight", "HTTP requests being handled now.", (), lambda: [((), rt.in_flight)])
    m.add_gauge(
        "attnserve_steps_open", "Steps open now (each session is in one at most).", (), lambda: [((), len(rt.steps))]
    )
    m.add_gauge(
        "attnserve_ready",
        "1 when the device is open and the server is not draining.",
        (),
        lambda: [((), int(rt.ready and not rt.draining))],
    )
    m.add_gauge(
        "attnserve_gpu_queue_limit",
        "Most jobs that may wait for the GPU (503 overloaded past it).",
        (),
        lambda: [((), rt.engine.worker.max_queue if rt.engine is not None else s.max_queue)],
    )
    # The configured limits (0: none), one metric per unit.
    m.add_gauge(
        "attnserve_limit_sessions",
        "Configured session limits (0: none), by name.",
        ("name",),
        lambda: [(("max_sessions",), s.max_sessions), (("quota_sessions_per_key",), s.quota_sessions_per_key)],
    )
    m.add_gauge(
        "attnserve_limit_bytes",
        "Configured byte limits (0: none), by name.",
        ("name",),
        lambda: [(("quota_bytes_per_key",), s.quota_bytes_per_key)],
    )
    m.add_gauge(
        "attnserve_limit_seconds",
        "Configured time limits (0: none), by name.",
        ("name",),
        lambda: [
            (("request_timeout",), s.request_timeout_s),
            (("session_ttl",), s.session_ttl_seconds),
            (("step_idle_timeout",), s.step_idle_timeout_s),
        ],
    )

    def tenants(i: int) -> list[tuple[tuple[str, ...], float]]:
        return [((owner or "",), v[i]) for owner, v in rt.store.by_tenant().items()]

    m.add_gauge(
        "attnserve_tenant_sessions",
        "Sessions each tenant holds (tenant: its API key id; empty without keys).",
        ("tenant",),
        lambda: tenants(0),
    )
    m.add_gauge(
        "attnserve_tenant_bytes",
        "GPU bytes each tenant's sessions hold or have reserved (what its quota counts).",
        ("tenant",),
        lambda: tenants(1),
    )

    def info() -> list[tuple[tuple[str, ...], float]]:
        d = rt.engine.describe() if rt.engine is not None else {}
        return [((__version__, d.get("name", ""), d.get("backend", "")), 1)]

    m.add_gauge("attnserve_build_info", "Version and GPU adapter.", ("version", "adapter", "backend"), info)
