"""The serving process's garbage-collector policy (``gc_threshold``).

A batched step makes and drops thousands of short-lived objects (frames, arrays,
futures), and CPython runs a collection of the youngest generation every 700 net
allocations (3.12; 2,000 from 3.13), each one also walking the objects that start-up
left behind (the app, the routes, the pipelines and every session's state) whenever
it reaches the older generations. The policy, applied once the server has started:
collect once, move every object alive then into the permanent generation
(:func:`gc.freeze`: never walked again, never freed by the collector, which is right
for what lives as long as the process), and collect the youngest generation every
``threshold`` allocations. Reference counting still frees everything that is not in
a cycle at once; only cycles wait longer.

Only ``attnserve serve`` (and the benchmarks that stand in for it) apply it: it is a
decision for a whole process, not for an app object that tests make by the dozen.
"""

from __future__ import annotations

import gc

__all__ = ["apply_gc_policy"]


def apply_gc_policy(threshold: int) -> tuple[int, int, int]:
    """Freeze what is alive and collect the youngest generation every ``threshold``
    allocations (the older generations' thresholds are kept); ``threshold`` 0 leaves
    the collector as Python set it. Returns the thresholds now in force."""
    if threshold > 0:
        gc.collect()
        gc.freeze()
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(threshold, older, oldest)
    return gc.get_threshold()
