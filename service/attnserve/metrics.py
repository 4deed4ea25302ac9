"""Prometheus metrics: the values live in a few small thread-safe primitives
(counter, gauge, histogram with labels) held by the :class:`Metrics` of one app;
a ``prometheus_client`` collector reads them at scrape time, on a registry of
the app's own (so several apps in one process do not clash), next to
``prometheus_client``'s process and platform collectors (``process_*``,
``python_info``). Gauges that describe state (sessions, bytes, queue depth) are
computed when scraped, from the store and the GPU worker.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["Borrowed", "Counter", "Gauge", "Histogram", "Metrics", "CONTENT_TYPE"]

# What generate_latest writes: the text exposition format, version 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _Metric:
    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def family(self) -> Metric:  # pragma: no cover - every kind overrides it
        raise NotImplementedError


class Counter(_Metric):
    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, amount: float = 1) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0)

    def family(self) -> Metric:
        with self._lock:
            items = sorted(self._values.items())
        if not items and not self.labelnames:
            items = [((), 0)]
        f = CounterMetricFamily(self.name, self.help, labels=self.labelnames)
        for key, v in items:
            f.add_metric(key, v)
        return f


class Gauge(_Metric):
    """A gauge whose samples a callback gives at scrape time (or set by hand)."""

    def __init__(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        fn: Callable[[], Iterable[tuple[tuple[str, ...], float]]] | None = None,
    ):
        super().__init__(name, help, labelnames)
        self.fn = fn
        self._values: dict[tuple[str, ...], float] = {}

    def set(self, value: float, *labels: str) -> None:
        with self._lock:
            self._values[labels] = value

    def family(self) -> Metric:
        if self.fn is not None:
            items = sorted(self.fn())
        else:
            with self._lock:
                items = sorted(self._values.items())
        f = GaugeMetricFamily(self.name, self.help, labels=self.labelnames)
        for key, v in items:
            f.add_metric(key, v)
        return f


class Borrowed(_Metric):
    """A counter another object owns (the GPU engine's), read when scraped:
    ``owner()`` gives it, or None while there is none (then ``empty`` is read)."""

    def __init__(self, empty: Counter, owner: Callable[[], Counter | None]):
        super().__init__(empty.name, empty.help, empty.labelnames)
        self.empty, self.owner = empty, owner

    def family(self) -> Metric:
        return (self.owner() or self.empty).family()


class Histogram(_Metric):
    def __init__(
        self, name: str, help: str, labelnames: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS
    ):
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(buckets))
        # labels -> [bucket counts (non-cumulative) ..., +Inf count], sum
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *labels: str) -> None:
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            s = self._series.get(labels)
            if s is None:
                s = self._series[labels] = ([0] * (len(self.buckets) + 1), [0.0])
            s[0][i] += 1
            s[1][0] += value

    def snapshot(self, *labels: str) -> tuple[list[int], float]:
        """(cumulative counts per bucket incl. +Inf, sum)."""
        with self._lock:
            counts, total = self._series.get(labels, ([0] * (len(self.buckets) + 1), [0.0]))
            counts = list(counts)
            total_sum = total[0]
        cum, acc = [], 0
        for c in counts:
            acc += c
            cum.append(acc)
        return cum, total_sum

    def family(self) -> Metric:
        with self._lock:
            keys = sorted(self._series)
        if not keys and not self.labelnames:
            keys = [()]
        f = HistogramMetricFamily(self.name, self.help, labels=self.labelnames)
        bounds = [*self.buckets, math.inf]
        for key in keys:
            cum, total = self.snapshot(*key)
            f.add_metric(list(key), [(_le(b), c) for b, c in zip(bounds, cum)], total)
        return f


def _le(bound: float) -> str:
    if bound == math.inf:
        return "+Inf"
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))


class _AppCollector(Collector):
    """Reads the values of one app's :class:`Metrics` at scrape time."""

    def __init__(self, metrics: "Metrics"):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for m in self.metrics.all():
            yield m.family()


class Metrics:
    """Every metric of one app, and the registry ``render()`` exposes them from.
    ``add_gauge`` adds the scrape-time gauges (app.py wires them to the store)."""

    def __init__(self) -> None:
        self.requests = Counter(
            "attnserve_requests_total",
            "HTTP requests answered, by route template, method and status.",
            ("route", "method", "status"),
        )
        self.latency = Histogram(
            "attnserve_request_duration_seconds",
            "HTTP request latency in seconds, by route template and method.",
            ("route", "method"),
        )
        self.errors = Counter("attnserve_errors_total", "Problem answers, by problem type slug.", ("type",))
        self.gpu_batches = Counter("attnserve_gpu_batches_total", "GPU submissions (one readback each).")
        self.gpu_dispatches = Counter("attnserve_gpu_dispatches_total", "Compute dispatches submitted.")
        self.gpu_jobs = Counter("attnserve_gpu_jobs_total", "Jobs (appends and attends) run in submissions.")
        self.gpu_dispatches_per = Histogram(
            "attnserve_gpu_dispatches_per_submission",
            "Compute dispatches in one GPU submission.",
            buckets=COUNT_BUCKETS,
        )
        self.gpu_jobs_per = Histogram(
            "attnserve_gpu_jobs_per_submission", "Jobs coalesced into one GPU submission.", buckets=COUNT_BUCKETS
        )
        self.gpu_seconds = Histogram(
            "attnserve_gpu_submission_seconds", "Time to plan, submit and read back one GPU submission."
        )
        self.queue_wait = Histogram(
            "attnserve_queue_wait_seconds",
            "Time a GPU job waited in the queue, from its submission (the request parsed) to the GPU "
            "thread taking it, by kind (batch: appends and attends; call: whole-cache reads and writes).",
            ("kind",),
        )
        self.rows = Counter(
            "attnserve_rows_total",
            "Rows processed: appended K/V timesteps and attended query rows.",
            ("kind", "kv_format"),
        )
        # tenants, quotas, overload, expiry, persistence
        self.auth_failures = Counter(
            "attnserve_auth_failures_total", "Requests refused with 401, by reason (missing, invalid).", ("reason",)
        )
        self.quota_rejections = Counter(
            "attnserve_quota_rejections_total",
            "Requests refused by a per-key quota, by quota (sessions, bytes).",
            ("quota",),
        )
        self.timeouts = Counter(
            "attnserve_request_timeouts_total",
            "Appends and attends dropped unapplied after waiting past the request timeout in the GPU queue.",
        )
        self.expired = Counter(
            "attnserve_sessions_expired_total", "Sessions deleted after being idle for the session TTL."
        )
        self.snapshot_writes = Counter(
            "attnserve_snapshot_writes_total",
            "Session snapshots written to the snapshot directory, by result.",
            ("result",),
        )
        self.snapshot_restores = Counter(
            "attnserve_snapshot_restores_total",
            "Snapshot files read at start, by result (ok, invalid: moved aside as .bad, skipped: kept).",
            ("result",),
        )
        self.snapshot_seconds = Histogram(
            "attnserve_snapshot_seconds",
            "Time to save (at shutdown) or restore (at start) every session.",
            ("phase",),
        )
        self._gauges: list[Gauge | Borrowed] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_AppCollector(self))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def on_batch(self, n_jobs: int, n_dispatches: int, seconds: float) -> None:
        """The GPU worker's hook (called on the GPU thread after each submission)."""
        self.gpu_batches.inc()
        self.gpu_dispatches.inc(amount=n_dispatches)
        self.gpu_jobs.inc(amount=n_jobs)
        self.gpu_dispatches_per.observe(n_dispatches)
        self.gpu_jobs_per.observe(n_jobs)
        self.gpu_seconds.observe(seconds)

    def on_job_start(self, kind: str, waited: float) -> None:
        """The GPU worker's hook (called on the GPU thread as it takes each job)."""
        self.queue_wait.observe(waited, kind)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.inc(route, method, str(status))
        self.latency.observe(seconds, route, method)

    def add_gauge(self, gauge: Gauge | Borrowed) -> None:
        self._gauges.append(gauge)

    def all(self) -> list[_Metric]:
        return [
            *self._gauges,
            self.requests,
            self.latency,
            self.errors,
            self.rows,
            self.gpu_batches,
            self.gpu_dispatches,
            self.gpu_jobs,
            self.gpu_dispatches_per,
            self.gpu_jobs_per,
            self.gpu_seconds,
            self.queue_wait,
            self.auth_failures,
            self.quota_rejections,
            self.timeouts,
            self.expired,
            self.snapshot_writes,
            self.snapshot_restores,
            self.snapshot_seconds,
        ]

    def render(self) -> str:
        """Every metric of the registry in the text exposition format (version 0.0.4)."""
        return generate_latest(self.registry).decode("utf-8")
