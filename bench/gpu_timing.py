"""GPU timestamps for the benchmarks (the device feature ``timestamp-query``):
the GPU time of a whole command buffer (:class:`GpuTimer`) and of each dispatch of a
batch (:func:`dispatch_times`). ``request_timestamps()`` before ``Engine.open`` asks
for the feature when the adapter has it."""

from __future__ import annotations

import numpy as np
import wgpu

from attnserve.gpu import device as DEV
from attnserve.gpu.batch import Batch

__all__ = ["GpuTimer", "dispatch_times", "request_timestamps", "timestamp_period"]


def request_timestamps() -> None:
    """Have ``open_device`` ask for ``timestamp-query`` where the adapter has it."""
    if "timestamp-query" not in DEV.OPTIONAL_FEATURES:
        DEV.OPTIONAL_FEATURES = (*DEV.OPTIONAL_FEATURES, "timestamp-query")


def timestamp_period(device) -> float:
    """Nanoseconds per timestamp tick (1 where wgpu-native does not say)."""
    try:
        from wgpu.backends.wgpu_native._api import lib

        return float(lib.wgpuQueueGetTimestampPeriod(device.queue._internal)) or 1.0
    except Exception:
        return 1.0


class GpuTimer:
    """GPU time of a command buffer: timestamps of two empty compute passes
    submitted before and after it."""

    def __init__(self, device):
        self.device = device
        self.qs = device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
        self.buf = device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
        self.period = timestamp_period(device)

    def _mark(self, index: int, resolve: bool):
        enc = self.device.create_command_encoder()
        key = "beginning_of_pass_write_index" if index == 0 else "end_of_pass_write_index"
        cpass = enc.begin_compute_pass(timestamp_writes={"query_set": self.qs, key: index})
        cpass.end()
        if resolve:
            enc.resolve_query_set(self.qs, 0, 2, self.buf, 0)
        return enc.finish()

    def run(self, cmd) -> float:
        """Submit ``cmd`` between the marks, wait; GPU milliseconds."""
        self.device.queue.submit([self._mark(0, False), cmd, self._mark(1, True)])
        t = np.frombuffer(self.device.queue.read_buffer(self.buf), np.uint64)
        return float(t[1] - t[0]) * self.period / 1e6


def dispatch_times(batch: Batch, slot: int = 0) -> tuple[list[dict], memoryview | None]:
    """Encode, submit and read back ``batch`` with each dispatch a compute pass of
    its own between two timestamps; returns one row per dispatch (kernel, grid, GPU
    start and duration in µs from the first dispatch's start) and the output bytes."""
    batch.flush()
    dispatches = [op for op in batch.ops if op[0] == "dispatch"]
    device = batch.device
    n = 2 * max(len(dispatches), 1)
    qs = device.create_query_set(type=wgpu.QueryType.timestamp, count=n)
    resolved = device.create_buffer(size=8 * n, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    encoded = batch.encode(slot, timestamps=qs)
    enc = device.create_command_encoder()
    enc.resolve_query_set(qs, 0, n, resolved, 0)
    device.queue.submit([encoded[0], enc.finish()] if encoded is not None else [enc.finish()])
    out = batch.read_back(encoded)
    ticks = np.frombuffer(device.queue.read_buffer(resolved), np.uint64).astype(np.float64)
    ns = (ticks - ticks[0]) * timestamp_period(device)
    rows = [
        {"kernel": op[1], "grid": list(op[3]), "start_us": round(ns[2 * i] / 1e3, 2),
         "gpu_us": round((ns[2 * i + 1] - ns[2 * i]) / 1e3, 2)}
        for i, op in enumerate(dispatches)
    ]  # fmt: skip
    return rows, out
