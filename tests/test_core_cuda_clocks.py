"""The CUDA context held for full clocks on NVIDIA (gpu/cuda_clocks.py, device.py):
which adapters get one, what each setting does where the driver is absent, has
several devices or fails, and that a held context is released once. The driver
library is a fake here (no CUDA on CI); the H200 run is in docs/benchmarks.md."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from attnserve.config import Settings
from attnserve.gpu import cuda_clocks
from attnserve.gpu import device as DEV

NVIDIA = {"vendor_id": 0x10DE, "vendor": "NVIDIA", "device": "NVIDIA H200"}
LAVAPIPE = {"vendor_id": 0x10005, "vendor": "llvmpipe", "device": "llvmpipe (LLVM 15.0.6, 256 bits)"}


class FakeDriver:
    """What hold() calls of libcuda.so.1, writing through byref() out-parameters."""

    def __init__(self, devices: int = 1, fail: str | None = None):
        self.devices = devices
        self.fail = fail
        self.calls: list[str] = []
        self.retained = 0

    def _rc(self, name: str) -> int:
        self.calls.append(name)
        return 999 if name == self.fail else 0

    def cuInit(self, flags):
        return self._rc("cuInit")

    def cuDeviceGetCount(self, out):
        out._obj.value = self.devices
        return self._rc("cuDeviceGetCount")

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = 100 + ordinal
        return self._rc("cuDeviceGet")

    def cuDeviceGetName(self, buf, n, dev):
        buf.value = b"NVIDIA H200"
        return self._rc("cuDeviceGetName")

    def cuDevicePrimaryCtxRetain(self, out, dev):
        rc = self._rc("cuDevicePrimaryCtxRetain")
        if rc == 0:
            self.retained += 1
            out._obj.value = 0xC0
        return rc

    def cuCtxSetCurrent(self, ctx):
        return self._rc("cuCtxSetCurrent")

    def cuDevicePrimaryCtxRelease(self, dev):
        self.calls.append("cuDevicePrimaryCtxRelease")
        self.retained -= 1
        return 0

    def cuGetErrorName(self, rc, out):
        out._obj.value = b"CUDA_ERROR_FAKE"
        return 0


@pytest.fixture
def driver(monkeypatch):
    box: list[FakeDriver | None] = [FakeDriver()]

    def load():
        if box[0] is None:
            raise cuda_clocks.CudaUnavailable("no CUDA driver library (libcuda.so.1): not here")
        return box[0]

    monkeypatch.setattr(cuda_clocks, "_driver", load)
    return box


def test_an_nvidia_adapter_holds_the_only_device_and_releases_it_once(driver, caplog):
    caplog.set_level(logging.INFO, "attnserve.gpu")
    held = DEV.hold_cuda_context(NVIDIA, "auto")
    assert caplog.records[-1].cuda_device == 0 and caplog.records[-1].cuda_name == "NVIDIA H200"
    assert held is not None and held.describe() == {"cuda_device": 0, "name": "NVIDIA H200"}
    assert driver[0].retained == 1 and "cuCtxSetCurrent" not in driver[0].calls  # retained is enough
    held.release()
    held.release()
    assert driver[0].retained == 0 and driver[0].calls.count("cuDevicePrimaryCtxRelease") == 1


def test_other_adapters_and_off_never_load_the_driver(driver):
    assert DEV.hold_cuda_context(LAVAPIPE, "auto") is None
    assert DEV.hold_cuda_context(NVIDIA, "off") is None
    assert driver[0].calls == []


def test_auto_warns_and_serves_without_one_where_it_cannot_hold(driver, caplog):
    caplog.set_level(logging.WARNING, "attnserve.gpu")
    driver[0] = FakeDriver(devices=2)
    assert DEV.hold_cuda_context(NVIDIA, "auto") is None  # which of two is the adapter is not known
    assert "2 CUDA devices are visible" in caplog.records[-1].reason
    driver[0] = None
    assert DEV.hold_cuda_context(NVIDIA, "auto") is None
    assert "libcuda.so.1" in caplog.records[-1].reason


def test_an_ordinal_holds_that_device_or_stops_the_start(driver):
    driver[0] = FakeDriver(devices=2)
    held = DEV.hold_cuda_context(LAVAPIPE, "1")  # asked for: held whatever the adapter says
    assert held is not None and held.ordinal == 1 and held.device == 101
    held.release()
    with pytest.raises(DEV.DeviceError, match="CUDA device 5 does not exist"):
        DEV.hold_cuda_context(NVIDIA, "5")
    driver[0] = FakeDriver(fail="cuDevicePrimaryCtxRetain")
    with pytest.raises(DEV.DeviceError, match="cuDevicePrimaryCtxRetain failed: CUDA_ERROR_FAKE"):
        DEV.hold_cuda_context(NVIDIA, "0")


def test_a_context_made_current_is_let_go_when_that_fails(driver):
    driver[0] = FakeDriver(fail="cuCtxSetCurrent")
    with pytest.raises(cuda_clocks.CudaUnavailable, match="cuCtxSetCurrent failed"):
        cuda_clocks.hold(0, make_current=True)
    assert driver[0].retained == 0


def test_the_setting_takes_auto_off_or_an_ordinal():
    assert Settings(cuda_context=" OFF ").cuda_context == "off"
    assert Settings(cuda_context="3").cuda_context == "3"
    for bad in ("yes", "-1", "gpu0"):
        with pytest.raises(ValidationError):
            Settings(cuda_context=bad)
