"""Full GPU clocks on NVIDIA under Vulkan: hold a CUDA context while serving.

Measured on the H200 (driver 580, ``bench/probes/clock_ramp.py``, docs/benchmarks.md):
with no CUDA context in the process, the driver keeps the SM clock at its idle
345-390 MHz while wgpu's Vulkan compute runs, and a 64 x 4k decode step takes
3.46 ms of GPU time; with a CUDA context open (torch's, or the driver's primary
context retained here, current on no thread) the SM clock is 1980 MHz and the same
step takes 0.79 ms; the context takes 527 MiB of device memory. Clocks are the
driver's decision, not the project's (nothing here changes a device setting): the
service only opens what a CUDA program opens.

:func:`hold` retains the primary context of one CUDA device through the driver
library (``libcuda.so.1``, present wherever the NVIDIA driver is; no toolkit, no
torch) and keeps it until :meth:`Hold.release`. Where there is no NVIDIA driver,
or the adapter is not NVIDIA's, nothing is held.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

__all__ = ["Hold", "hold", "CudaUnavailable"]


class CudaUnavailable(RuntimeError):
    """No CUDA driver, no device, or a driver call failed (the message says which)."""


def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaUnavailable(f"no CUDA driver library (libcuda.so.1): {e}") from None


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise CudaUnavailable(f"{what} failed: {(name.value or b'').decode() or rc}")


@dataclass
class Hold:
    """A retained primary context of CUDA device ``ordinal`` (``name``)."""

    lib: ctypes.CDLL
    device: int
    ordinal: int
    name: str
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.lib.cuDevicePrimaryCtxRelease(self.device)

    def describe(self) -> dict[str, int | str]:
        return {"cuda_device": self.ordinal, "name": self.name}


def hold(ordinal: int | None = None, make_current: bool = False) -> Hold:
    """Retain the primary context of CUDA device ``ordinal`` (``make_current``: also
    make it current on this thread; measured not needed for the clocks); None: the
    only device visible (refused when there are several: which of them is the wgpu
    adapter is not known here, so the caller names it). Raises :class:`CudaUnavailable`."""
    lib = _driver()
    _check(lib, lib.cuInit(0), "cuInit")
    count = ctypes.c_int()
    _check(lib, lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    if count.value == 0:
        raise CudaUnavailable("the CUDA driver sees no device")
    if ordinal is None:
        if count.value > 1:
            raise CudaUnavailable(
                f"{count.value} CUDA devices are visible: name the adapter's one (cuda_device) or set "
                "CUDA_VISIBLE_DEVICES to it"
            )
        ordinal = 0
    if not 0 <= ordinal < count.value:
        raise CudaUnavailable(f"CUDA device {ordinal} does not exist ({count.value} visible)")
    dev = ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    raw = ctypes.create_string_buffer(256)
    _check(lib, lib.cuDeviceGetName(raw, 256, dev), "cuDeviceGetName")
    ctx = ctypes.c_void_p()
    _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    if make_current:
        try:
            _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        except CudaUnavailable:
            lib.cuDevicePrimaryCtxRelease(dev)
            raise
    return Hold(lib, dev.value, ordinal, raw.value.decode(errors="replace"))
