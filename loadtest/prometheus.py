"""Prometheus text exposition as the load test reads a server's ``/metrics``: the
samples, their sum over label sets, and what changed between two scrapes.
Standard library only. Installed with the load test (``attnserve.loadtest``); the
checkout's tools and tests import these from ``tools.common``."""

from __future__ import annotations

import math
import re

# name, optional {labels}, value, optional timestamp (Prometheus text exposition)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?)\s+(\S+)(?:\s+-?\d+)?$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> ``{'name{labels}': value}`` (labels as written;
    comments, blank and malformed lines skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            out[m.group(1)] = float(m.group(2))
        except ValueError:
            continue
    return out


def metric_sum(metrics: dict[str, float], name: str) -> float:
    """The sum of every series of ``name`` (all label sets)."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def metric_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What changed between two scrapes (new series count from zero)."""
    delta = {}
    for key, value in after.items():
        d = value - before.get(key, 0.0)
        if d != 0 and not math.isnan(d):
            delta[key] = d
    return delta
