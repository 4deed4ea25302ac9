"""Reading a prometheus_client counter's value in tests."""

from __future__ import annotations

from prometheus_client import Counter


def count(counter: Counter, *labelvalues: str) -> float:
    """``counter``'s value for ``labelvalues`` (in its label names' order; none for
    a counter without labels): 0 before the first increment of that label set."""
    for sample in counter.collect()[0].samples:
        if sample.name.endswith("_total") and tuple(sample.labels.values()) == labelvalues:
            return sample.value
    return 0.0
