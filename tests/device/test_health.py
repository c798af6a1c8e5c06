"""Health transitions, against NVML's real error classes raised by the stand-in."""

from __future__ import annotations

import logging

import pynvml
import pytest

import vramctl
from tests.fake_nvml import FakeGpu
from vramctl import NA, HealthState
from vramctl.device import DeviceHealth, HealthPolicy
from vramctl.device._health import ReadingFailed


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def lost() -> None:
    raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)


def test_retries_with_exponential_backoff_then_succeeds() -> None:
    clock = Clock()
    h = DeviceHealth("cuda:0", HealthPolicy(attempts=4), clock=clock, sleep=clock.sleep)
    calls = iter([lost, lost, lost, lambda: 7])
    assert h.call(lambda: next(calls)()) == 7
    assert clock.sleeps == [0.05, 0.1, 0.2]
    assert h.state is HealthState.AVAILABLE and h.failures == 0


def test_backoff_is_capped() -> None:
    clock = Clock()
    policy = HealthPolicy(attempts=6, backoff_initial=0.5, backoff_max=1.0)
    h = DeviceHealth("cuda:0", policy, clock=clock, sleep=clock.sleep)
    with pytest.raises(ReadingFailed):
        h.call(lost)
    assert clock.sleeps == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_error_then_disabled_then_recovers(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    policy = HealthPolicy(attempts=2, disable_after=3, recheck_after=30.0)
    h = DeviceHealth("cuda:0", policy, clock=clock, sleep=clock.sleep)
    caplog.set_level(logging.INFO, "vramctl.device")

    with pytest.raises(ReadingFailed):
        h.call(lost)
    assert h.state is HealthState.ERROR and "GPU is lost" in h.reason
    with pytest.raises(ReadingFailed):
        h.call(lost)
    assert h.state is HealthState.ERROR
    with pytest.raises(ReadingFailed):
        h.call(lost)
    assert h.state is HealthState.DISABLED and "GPU is lost" in h.reason

    # While disabled, readings are skipped without touching the device.
    touched: list[int] = []
    with pytest.raises(ReadingFailed, match="disabled"):
        h.call(lambda: touched.append(1))
    assert touched == []

    # After recheck_after, one attempt is made; success brings it back.
    clock.now += 31
    assert h.call(lambda: "ok") == "ok"
    assert h.state is HealthState.AVAILABLE and h.reason == ""
    assert any("recovered" in r.message for r in caplog.records)


def test_failed_recheck_stays_disabled_with_one_attempt() -> None:
    clock = Clock()
    policy = HealthPolicy(attempts=3, disable_after=1, recheck_after=10.0)
    h = DeviceHealth("cuda:0", policy, clock=clock, sleep=clock.sleep)
    with pytest.raises(ReadingFailed):
        h.call(lost)
    assert h.state is HealthState.DISABLED
    clock.now += 11
    attempts: list[int] = []

    def fail_once_more() -> None:
        attempts.append(1)
        lost()

    with pytest.raises(ReadingFailed):
        h.call(fail_once_more)
    assert attempts == [1] and h.state is HealthState.DISABLED


def test_busy_and_back() -> None:
    h = DeviceHealth("cuda:0")
    h.observe(busy_reason="memory 99% used")
    assert h.state is HealthState.BUSY and h.state.usable
    h.observe(busy_reason=None)
    assert h.state is HealthState.AVAILABLE


def test_device_readings_never_raise_and_disable_a_failing_gpu(gpus: list[FakeGpu]) -> None:
    dev = vramctl.get_device("cuda:1")
    dev.health._sleep = lambda s: None  # no real waiting in tests
    gpus[1].fail(100)
    for _ in range(dev.health.policy.disable_after):
        mem = dev.memory()
        assert mem.total is NA and mem.free is NA  # explicit, not zero, not an exception
    assert dev.health.state is HealthState.DISABLED
    calls = gpus[1].memory_calls
    dev.memory()
    assert gpus[1].memory_calls == calls  # skipped while disabled
    # The other GPUs are unaffected.
    assert vramctl.get_device("cuda:0").memory().total == gpus[0].total


def test_busy_gpu_when_memory_is_full(gpus: list[FakeGpu]) -> None:
    gpus[2].used = gpus[2].total - 2**20
    dev = vramctl.get_device("cuda:2")
    dev.memory()
    assert dev.health.state is HealthState.BUSY and "used" in dev.health.reason


def test_exclusive_process_gpu_held_by_another_is_busy(gpus: list[FakeGpu]) -> None:
    gpus[0].compute_mode = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    dev = vramctl.get_device(0)
    dev.memory()
    assert dev.health.state is HealthState.BUSY and "4242" in dev.health.reason
