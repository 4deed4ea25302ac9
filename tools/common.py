"""One copy of the small helpers the tools and tests all need: a free loopback
port, Prometheus text parsing (loadtest/prometheus.py's), the relative error of a result against a
float64 reference, latency percentiles. Standard library and numpy only."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import statistics
from pathlib import Path

import numpy as np

# Prometheus text: the load test's, installed with it (the checkout's package loadtest)
from loadtest.prometheus import metric_delta, metric_sum, parse_prometheus  # noqa: F401


def as_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``a`` as an engine of ``dtype`` sends it: ``f32`` as it is, ``f16``
    (numpy's float16) or ``bf16`` (``wire.BFLOAT16``), rounded to nearest even
    (``attnserve_client.tensors.to_wire_dtype``)."""
    from attnserve_client import tensors  # (the client package: the tools that send arrays have it)

    names = {"f32": "<f4", "f16": "<f2", "bf16": "bfloat16"}
    if dtype not in names:
        raise ValueError(f"dtype: expected f32, f16 or bf16, got {dtype!r}")
    return tensors.to_wire_dtype(a, names[dtype])


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """Stop ``proc`` as a supervisor does: SIGTERM if it runs, SIGKILL after
    ``timeout`` seconds; returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|, in float64."""
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def percentiles(lat: list[float]) -> dict[str, float]:
    """p50, p99 and mean of latencies in seconds, as milliseconds (3 decimals)."""
    ms = sorted(1e3 * x for x in lat)
    pick = lambda f: ms[min(len(ms) - 1, int(f * len(ms)))]  # noqa: E731
    return {"p50_ms": round(pick(0.5), 3), "p99_ms": round(pick(0.99), 3), "mean_ms": round(statistics.mean(ms), 3)}


def write_result(path: Path | None, doc: object, *, indent: int = 2) -> None:
    """A benchmark's result as JSON at ``path`` (its folder made), when one is given."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")


def window_setting(spec: str) -> tuple[str, int, int]:
    """A bench setting ``NAME/s4w128`` -> (NAME, 4 exact sinks, an exact window of
    128: a session's ``sinks`` and ``window``); anything else -> (it, 0, 0)."""
    import re

    m = re.fullmatch(r"(.+)/s(\d+)w(\d+)", spec)
    return (spec, 0, 0) if m is None else (m[1], int(m[2]), int(m[3]))
