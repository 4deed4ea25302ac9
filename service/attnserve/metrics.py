"""Prometheus metrics on ``prometheus_client``'s own classes: the counters and
histograms of one app (:class:`Metrics`) are ``prometheus_client.Counter`` and
``Histogram`` on a registry of the app's own (so several apps in one process do
not clash), next to ``prometheus_client``'s process and platform collectors
(``process_*``, ``python_info``). Gauges that describe state (sessions, bytes,
queue depth) are computed when scraped, from the store and the GPU worker: a
collector of ``GaugeMetricFamily`` (:meth:`Metrics.add_gauge`), which also reads
counters another object owns (the engine's, :meth:`Metrics.add_counter`).

The exposition stays what it was before these classes: no ``_created`` series
(``disable_created_metrics()``, which is process-wide: importing this module turns
them off for every ``prometheus_client`` metric of the process), and histogram
bounds written as before (``le="1"``, where ``prometheus_client`` writes ``"1.0"``).

Hot paths (each request, GPU submission and job, a step's rows) use children bound
once per label set (:class:`Bound`), not ``.labels()`` per call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["Bound", "Metrics", "CONTENT_TYPE", "SHM_EVENTS", "STEP_CALL_OUTCOMES", "counted"]

# What generate_latest writes: the text exposition format, version 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

disable_created_metrics()  # type: ignore[no-untyped-call]

M = TypeVar("M", Counter, Histogram)
#: a gauge's samples when scraped: (label values, value) pairs
Samples = Callable[[], Iterable[tuple[tuple[str, ...], float]]]


class Bound(dict[str | tuple[str, ...], M]):
    """A labelled metric's children by label values (one label: a string), each
    bound with ``labels()`` on first use: ``bound["append", "f32"].inc(4)``."""

    def __init__(self, metric: M):
        super().__init__()
        self.metric: M = metric

    def __missing__(self, key: str | tuple[str, ...]) -> M:
        child: M = self.metric.labels(*key) if isinstance(key, tuple) else self.metric.labels(key)
        self[key] = child
        return child


def counted(counter: Counter, *labelvalues: str) -> float:
    """``counter``'s value for ``labelvalues`` (in its label names' order; none for
    a counter without labels): 0 before the first increment of that label set."""
    (family,) = counter.collect()
    for sample in family.samples:
        if sample.name.endswith("_total") and tuple(sample.labels.values()) == labelvalues:
            return float(sample.value)
    return 0.0


class _Bounds(Collector):
    """A histogram, its bucket bounds written as before: ``1``, not ``1.0``."""

    def __init__(self, histogram: Histogram):
        self.histogram = histogram

    def collect(self) -> Iterator[Metric]:
        for family in self.histogram.collect():
            family.samples = [
                s._replace(labels={**s.labels, "le": s.labels["le"].removesuffix(".0")}) if "le" in s.labels else s
                for s in family.samples
            ]
            yield family


class _Scraped(Collector):
    """The metrics computed when scraped, in the order they were added."""

    def __init__(self) -> None:
        self.sources: list[Callable[[], Iterable[Metric]]] = []

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            yield from source()


#: The events ``attnserve_shm_events_total`` counts: a region mapped at a hello, and
#: unmapped once its connection ended and its operations finished; an unmap deferred
#: because an array still viewed the region (the mapping goes with the last view); a
#: peer of another user refused; a reply's arrays sent in the frame because its
#: ``reply_at`` could not hold them after all (logged as an error).
SHM_EVENTS = ("mapped", "unmapped", "unmap_deferred", "peer_refused", "reply_in_frame")
#: The outcomes ``attnserve_step_calls_total`` counts (step_registry.OpenStep.settle's, and refused).
STEP_CALL_OUTCOMES = ("applied", "partial", "failed", "refused")


class Metrics:
    """Every metric of one app, and the registry ``render()`` exposes them from (in
    the order they are registered: the scrape-time gauges first).
    ``add_gauge`` adds the scrape-time gauges (runtime.py wires them to the store)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._scraped = _Scraped()
        self.registry.register(self._scraped)
        counter, histogram = self._counter, self._histogram
        self.requests = counter(
            "attnserve_requests_total",
            "HTTP requests answered, by route template, method and status.",
            ("route", "method", "status"),
        )
        self.latency = histogram(
            "attnserve_request_duration_seconds",
            "HTTP request latency in seconds, by route template and method.",
            ("route", "method"),
        )
        self.errors = counter("attnserve_errors_total", "Problem answers, by problem type slug.", ("type",))
        self.rows = counter(
            "attnserve_rows_total",
            "Rows processed: appended K/V timesteps and attended query rows.",
            ("kind", "kv_format"),
        )
        self.gpu_batches = counter("attnserve_gpu_batches_total", "GPU submissions (one readback each).")
        self.gpu_dispatches = counter("attnserve_gpu_dispatches_total", "Compute dispatches submitted.")
        self.gpu_jobs = counter("attnserve_gpu_jobs_total", "Jobs (appends and attends) run in submissions.")
        self.gpu_dispatches_per = histogram(
            "attnserve_gpu_dispatches_per_submission",
            "Compute dispatches in one GPU submission.",
            buckets=COUNT_BUCKETS,
        )
        self.gpu_jobs_per = histogram(
            "attnserve_gpu_jobs_per_submission", "Jobs coalesced into one GPU submission.", buckets=COUNT_BUCKETS
        )
        self.gpu_seconds = histogram(
            "attnserve_gpu_submission_seconds", "Time to plan, submit and read back one GPU submission."
        )
        self.queue_wait = histogram(
            "attnserve_queue_wait_seconds",
            "Time a GPU job waited in the queue, from its submission (the request parsed) to the GPU "
            "thread taking it, by kind (batch: appends and attends; call: whole-cache reads and writes).",
            ("kind",),
        )
        # tenants, quotas, overload, expiry, persistence
        self.auth_failures = counter(
            "attnserve_auth_failures_total", "Requests refused with 401, by reason (missing, invalid).", ("reason",)
        )
        self.quota_rejections = counter(
            "attnserve_quota_rejections_total",
            "Requests refused by a per-key quota, by quota (sessions, bytes).",
            ("quota",),
        )
        self.timeouts = counter(
            "attnserve_request_timeouts_total",
            "Appends and attends dropped unapplied after waiting past the request timeout in the GPU queue.",
        )
        self.expired = counter(
            "attnserve_sessions_expired_total", "Sessions deleted after being idle for the session TTL."
        )
        self.steps_opened = counter("attnserve_steps_opened_total", "Steps opened (POST /v1/steps, step_open).")
        self.steps_closed = counter(
            "attnserve_steps_closed_total",
            "Steps closed, by reason (closed: DELETE or step_close; connection: their connection ended; idle: "
            "the step idle timeout; shutdown).",
            ("reason",),
        )
        self.step_calls = counter(
            "attnserve_step_calls_total",
            "Layer calls of steps, by outcome (applied: every item; partial: some items failed and the step "
            "broke; failed: no item applied, the layer may be called again; refused: the call was refused whole "
            "with a problem, nothing queued).",
            ("outcome",),
        )
        self.snapshot_writes = counter(
            "attnserve_snapshot_writes_total",
            "Session snapshots written to the snapshot directory, by result.",
            ("result",),
        )
        self.snapshot_restores = counter(
            "attnserve_snapshot_restores_total",
            "Snapshot files read at start, by result (ok, invalid: moved aside as .bad, skipped: kept).",
            ("result",),
        )
        self.shm_events = counter(
            "attnserve_shm_events_total",
            "Events of the shared-memory transport, by event (regions mapped and unmapped, unmaps deferred "
            "until the last view of a region is gone, peers refused for their user, replies sent in the frame "
            "for want of room in the region).",
            ("event",),
        )
        self.snapshot_seconds = histogram(
            "attnserve_snapshot_seconds",
            "Time to save (at shutdown) or restore (at start) every session.",
            ("phase",),
        )
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        # the hot paths' children, bound once per label set
        self.errors_by, self.rows_by, self.queue_wait_by = Bound(self.errors), Bound(self.rows), Bound(self.queue_wait)
        self.step_calls_by = Bound(self.step_calls)
        self._by_request: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}

    def _counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return Counter(name, help, labelnames, registry=self.registry)

    def _histogram(
        self, name: str, help: str, labelnames: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS
    ) -> Histogram:
        h = Histogram(name, help, labelnames, registry=None, buckets=buckets)
        self.registry.register(_Bounds(h))
        return h

    def on_batch(self, n_jobs: int, n_dispatches: int, seconds: float) -> None:
        """The GPU worker's hook (called on the GPU thread after each submission)."""
        self.gpu_batches.inc()
        self.gpu_dispatches.inc(n_dispatches)
        self.gpu_jobs.inc(n_jobs)
        self.gpu_dispatches_per.observe(n_dispatches)
        self.gpu_jobs_per.observe(n_jobs)
        self.gpu_seconds.observe(seconds)

    def on_job_start(self, kind: str, waited: float) -> None:
        """The GPU worker's hook (called on the GPU thread as it takes each job)."""
        self.queue_wait_by[kind].observe(waited)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        bound = self._by_request.get((route, method, status))
        if bound is None:
            bound = self._by_request[route, method, status] = (
                self.requests.labels(route, method, str(status)),
                self.latency.labels(route, method),
            )
        bound[0].inc()
        bound[1].observe(seconds)

    def add_gauge(self, name: str, help: str, labelnames: Sequence[str], fn: Samples) -> None:
        """A gauge whose samples ``fn`` gives when scraped."""

        def family() -> list[Metric]:
            f = GaugeMetricFamily(name, help, labels=labelnames)
            for key, value in sorted(fn()):
                f.add_metric(key, value)
            return [f]

        self._scraped.sources.append(family)

    def add_counter(self, owner: Callable[[], Counter]) -> None:
        """A counter another object owns (the engine's), which ``owner()`` gives when
        scraped (one created with ``registry=None``)."""
        self._scraped.sources.append(lambda: owner().collect())

    def render(self) -> str:
        """Every metric of the registry in the text exposition format (version 0.0.4)."""
        return generate_latest(self.registry).decode("utf-8")
