"""An NVML stand-in for machines without a GPU.

It replaces ``pynvml``'s functions (not vramctl's code) and returns the
binding's own ctypes structures and raises the binding's own error classes, so
vramctl's real NVML code paths run. Every CUDA path it stands in for also has a
``cuda``-marked test against a real GPU (``tests/device/test_cuda_real.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pynvml
import pytest

MiB = 2**20
GiB = 2**30


@dataclasses.dataclass
class FakeProcess:
    pid: int
    used: int | None


@dataclasses.dataclass(eq=False)
class FakeGpu:
    name: str
    uuid: str
    total: int
    used: int = 0
    cc: tuple[int, int] = (8, 0)
    temperature: int | None = 40
    power_mw: int | None = 70_000
    util: int | None = 0
    compute_mode: int = 0  # NVML_COMPUTEMODE_DEFAULT
    processes: list[FakeProcess] = dataclasses.field(default_factory=list)
    migs: list[FakeGpu] = dataclasses.field(default_factory=list)
    parent: FakeGpu | None = None
    #: Errors to raise from the next memory readings, one per call.
    failures: list[int] = dataclasses.field(default_factory=list)
    memory_calls: int = 0
    #: Errors to raise from the next calls of one NVML function (by name), one per call.
    errors: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    #: A GPU that fell off the bus: every call on its handle raises GPU_IS_LOST.
    lost: bool = False
    #: Persistence mode (None: not supported, as on Windows).
    persistence: bool | None = True
    #: MIG mode (current, pending); None follows ``migs`` (on when it has instances).
    mig_mode: tuple[bool, bool] | None = None
    #: ECC mode (current, pending); None: the GPU has no ECC (NOT_SUPPORTED).
    ecc_mode: tuple[bool, bool] | None = (True, True)
    ecc_uncorrected_volatile: int = 0
    ecc_uncorrected_aggregate: int = 0
    ecc_corrected_volatile: int = 0
    #: Row remapping (corrected rows, uncorrected rows, pending, failed); None: NOT_SUPPORTED.
    remapped_rows: tuple[int, int, bool, bool] | None = (0, 0, False, False)

    def fail(self, times: int, error: int = pynvml.NVML_ERROR_GPU_IS_LOST) -> None:
        self.failures.extend([error] * times)

    def fail_call(
        self, function: str, times: int = 1, error: int = pynvml.NVML_ERROR_UNKNOWN
    ) -> None:
        """Make the next ``times`` calls of ``function`` (e.g. "nvmlDeviceGetTemperature") raise."""
        self.errors.setdefault(function, []).extend([error] * times)


class FakeNvml:
    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        init_error: int | None = None,
        driver_version: str = "550.54.15",
        cuda_driver_version: int = 12040,
    ) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.init_calls = 0
        self.driver_version = driver_version
        #: As NVML gives it: 1000 * major + 10 * minor (12040 is CUDA 12.4).
        self.cuda_driver_version = cuda_driver_version

    # -- helpers ------------------------------------------------------------------
    @staticmethod
    def _err(code: int) -> pynvml.NVMLError:
        return pynvml.NVMLError(code)

    def _not_supported(self) -> pynvml.NVMLError:
        return self._err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    # -- the pynvml API subset vramctl uses ---------------------------------------
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self._err(self.init_error)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        if not 0 <= i < len(self.gpus):
            raise self._err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        return h.uuid

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        return h.name

    def nvmlDeviceGetMigMode(self, h: FakeGpu) -> list[int]:
        if h.parent is not None:
            raise self._not_supported()
        current, pending = h.mig_mode if h.mig_mode is not None else (bool(h.migs),) * 2
        on, off = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE
        return [on if current else off, on if pending else off]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGpu) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeGpu, j: int) -> FakeGpu:
        if j >= len(h.migs):
            raise self._err(pynvml.NVML_ERROR_NOT_FOUND)
        return h.migs[j]

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: FakeGpu) -> FakeGpu:
        assert h.parent is not None
        return h.parent

    def nvmlDeviceGetCudaComputeCapability(self, h: FakeGpu) -> tuple[int, int]:
        return h.cc

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu, version: Any = None) -> Any:
        h.memory_calls += 1
        if h.failures:
            raise self._err(h.failures.pop(0))
        m = pynvml.c_nvmlMemory_t()
        m.total, m.used, m.free = h.total, h.used, h.total - h.used
        return m

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        if h.parent is not None or h.temperature is None:
            raise self._not_supported()
        return h.temperature

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        if h.parent is not None or h.power_mw is None:
            raise self._not_supported()
        return h.power_mw

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:
        if h.parent is not None or h.util is None:
            raise self._not_supported()
        u = pynvml.c_nvmlUtilization_t()
        u.gpu, u.memory = h.util, 0
        return u

    def nvmlDeviceGetComputeMode(self, h: FakeGpu) -> int:
        return h.compute_mode

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_driver_version

    def nvmlDeviceGetPersistenceMode(self, h: FakeGpu) -> int:
        if h.parent is not None or h.persistence is None:
            raise self._not_supported()
        return pynvml.NVML_FEATURE_ENABLED if h.persistence else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetEccMode(self, h: FakeGpu) -> list[int]:
        if h.parent is not None or h.ecc_mode is None:
            raise self._not_supported()
        on, off = pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_DISABLED
        return [on if h.ecc_mode[0] else off, on if h.ecc_mode[1] else off]

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, error_type: int, counter_type: int) -> int:
        if h.parent is not None or h.ecc_mode is None or not h.ecc_mode[0]:
            raise self._not_supported()
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return h.ecc_corrected_volatile if counter_type == pynvml.NVML_VOLATILE_ECC else 0
        if counter_type == pynvml.NVML_VOLATILE_ECC:
            return h.ecc_uncorrected_volatile
        return h.ecc_uncorrected_aggregate

    def nvmlDeviceGetRemappedRows(self, h: FakeGpu) -> tuple[int, int, int, int]:
        if h.parent is not None or h.remapped_rows is None:
            raise self._not_supported()
        corrected, uncorrected, pending, failed = h.remapped_rows
        return corrected, uncorrected, int(pending), int(failed)

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        out = []
        for p in h.processes:
            info = pynvml.c_nvmlProcessInfo_v2_t()
            info.pid = p.pid
            info.usedGpuMemory = (
                p.used if p.used is not None else pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            )
            out.append(_ProcessView(info))
        return out

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: FakeGpu) -> list[Any]:
        return []

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        return []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in dir(self):
            if name.startswith("nvml"):
                monkeypatch.setattr(pynvml, name, _with_injected_errors(name, getattr(self, name)))


def _with_injected_errors(name: str, fn: Any) -> Any:
    """``fn``, raising first what its handle's ``errors`` (or ``lost``) ask for."""

    def call(*args: Any) -> Any:
        h = args[0] if args else None
        if isinstance(h, FakeGpu):
            if h.lost:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            queued = h.errors.get(name)
            if queued:
                raise pynvml.NVMLError(queued.pop(0))
        return fn(*args)

    return call


class _ProcessView:
    """What pynvml's process queries return: usedGpuMemory is None when NVML cannot tell."""

    def __init__(self, info: Any) -> None:
        self.pid = int(info.pid)
        used = int(info.usedGpuMemory)
        self.usedGpuMemory = (
            None if used == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value else used
        )


def make_gpus() -> list[FakeGpu]:
    """Two A100-80GB-like GPUs and one T4, with a little in use."""
    return [
        FakeGpu(
            "NVIDIA A100-SXM4-80GB",
            "GPU-aaaaaaaa-0000",
            81920 * MiB,
            used=20 * GiB,
            util=80,
            processes=[FakeProcess(4242, 20 * GiB - 500 * MiB)],
        ),
        FakeGpu("NVIDIA A100-SXM4-80GB", "GPU-bbbbbbbb-1111", 81920 * MiB, used=10 * GiB, util=5),
        FakeGpu("Tesla T4", "GPU-cccccccc-2222", 15360 * MiB, used=1 * GiB, cc=(7, 5), util=0),
    ]
