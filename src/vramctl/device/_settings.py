"""What NVML says about the driver and each GPU's settings (for ``vramctl doctor``).

Readings only: nothing here changes a setting. A reading the GPU or the driver does
not give (ECC on a consumer GPU, MIG before Ampere, a permission a container lacks)
is ``NA``, as everywhere in the device layer.

>>> from vramctl.device import driver_info
>>> info = driver_info()
>>> isinstance(info.nvml, bool) and isinstance(info.to_dict(), dict)
True
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import pynvml

from vramctl._na import NA, NotAvailable
from vramctl.device._base import Device
from vramctl.device._cuda import CudaDevice
from vramctl.device._nvml import nvml_available, nvml_error, nvml_reason

__all__ = ["DriverInfo", "GpuSettings", "driver_info", "gpu_settings"]

log = logging.getLogger("vramctl.device")

# nvmlInit's errors, by what they mean for the user.
_ERROR_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (pynvml.NVMLError_LibraryNotFound, "library_not_found"),
    (pynvml.NVMLError_DriverNotLoaded, "driver_not_loaded"),
    (pynvml.NVMLError_NoPermission, "no_permission"),
    (pynvml.NVMLError_LibRmVersionMismatch, "version_mismatch"),
    (pynvml.NVMLError_FunctionNotFound, "function_not_found"),
)

_COMPUTE_MODES = {
    pynvml.NVML_COMPUTEMODE_DEFAULT: "default",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD: "exclusive_thread",
    pynvml.NVML_COMPUTEMODE_PROHIBITED: "prohibited",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "exclusive_process",
}


def _reading(fn: Callable[..., Any], *args: Any) -> Any:
    """One NVML query; ``NA`` on any NVML error (a setting that cannot be read is unknown)."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        log.debug("%s failed: %s: %s", getattr(fn, "__name__", fn), type(exc).__name__, exc)
        return NA


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _flag(value: Any) -> bool | NotAvailable:
    return NA if value is NA else bool(value == pynvml.NVML_FEATURE_ENABLED)


def _json(value: object) -> object:
    if value is NA:
        return None
    if isinstance(value, tuple):
        return list(value)
    return value


@dataclass(frozen=True)
class DriverInfo:
    """The NVIDIA driver as NVML reports it, or why NVML cannot run here."""

    #: Whether NVML initialised.
    nvml: bool
    #: Why it did not (empty when it did).
    reason: str = ""
    #: What kept it from initialising: "library_not_found" (no driver installed),
    #: "driver_not_loaded", "no_permission", "version_mismatch" (the library and the
    #: kernel module differ), "function_not_found", "other"; empty when it runs.
    error: str = ""
    #: The driver's version, e.g. "550.54.15".
    driver_version: str | NotAvailable = NA
    #: The newest CUDA version the driver supports, as (major, minor).
    cuda_driver_version: tuple[int, int] | NotAvailable = NA
    #: The physical GPUs NVML counts (before ``CUDA_VISIBLE_DEVICES``).
    gpu_count: int | NotAvailable = NA

    @property
    def cuda_version_text(self) -> str | NotAvailable:
        """The driver's CUDA version as text ("12.4")."""
        v = self.cuda_driver_version
        return NA if v is NA else f"{v[0]}.{v[1]}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``NA`` is ``None``)."""
        return {f.name: _json(getattr(self, f.name)) for f in fields(self)}


def driver_info() -> DriverInfo:
    """The driver's version, the CUDA version it supports, and the GPUs NVML counts.

    On a machine where NVML cannot run, ``nvml`` is False and ``error`` says why.
    """
    if not nvml_available():
        exc = nvml_error()
        kind = next((k for cls, k in _ERROR_KINDS if isinstance(exc, cls)), "other")
        return DriverInfo(nvml=False, reason=nvml_reason(), error=kind if exc else "other")
    driver = _text(_reading(pynvml.nvmlSystemGetDriverVersion))
    raw = _reading(pynvml.nvmlSystemGetCudaDriverVersion)
    cuda: tuple[int, int] | NotAvailable = NA
    if raw is not NA and int(raw) > 0:
        cuda = (int(raw) // 1000, int(raw) % 1000 // 10)
    count = _reading(pynvml.nvmlDeviceGetCount)
    return DriverInfo(
        nvml=True,
        driver_version=driver if isinstance(driver, str) else NA,
        cuda_driver_version=cuda,
        gpu_count=NA if count is NA else int(count),
    )


@dataclass(frozen=True)
class GpuSettings:
    """One GPU's settings and error counters, for a CUDA device (a MIG instance's are
    its GPU's)."""

    #: The device these settings were read for ("cuda:0").
    device: str
    #: The physical GPU: its name, UUID and NVML index (``nvidia-smi -i``).
    name: str
    uuid: str
    nvml_index: int
    #: Whether ``device`` is a MIG instance of that GPU.
    mig_instance: bool = False
    persistence_mode: bool | NotAvailable = NA
    #: MIG mode now, and after the next GPU reset.
    mig_mode: bool | NotAvailable = NA
    mig_pending: bool | NotAvailable = NA
    #: MIG instances on the GPU (``NA`` unless MIG is on).
    mig_instances: int | NotAvailable = NA
    #: ECC now, and after the next reboot.
    ecc_mode: bool | NotAvailable = NA
    ecc_pending: bool | NotAvailable = NA
    #: Uncorrected ECC errors since the driver loaded (volatile) and over the GPU's life
    #: (aggregate); corrected ones since the driver loaded.
    ecc_uncorrected_volatile: int | NotAvailable = NA
    ecc_uncorrected_aggregate: int | NotAvailable = NA
    ecc_corrected_volatile: int | NotAvailable = NA
    #: Row remapping (A100 and later): a remap waits for a GPU reset; a remap failed.
    remap_pending: bool | NotAvailable = NA
    remap_failed: bool | NotAvailable = NA
    #: "default", "exclusive_process", "prohibited" (or "exclusive_thread").
    compute_mode: str | NotAvailable = NA
    #: GPU (SM) utilization over NVML's last sample period, percent.
    gpu_utilization: float | NotAvailable = NA

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``NA`` is ``None``)."""
        return {f.name: _json(getattr(self, f.name)) for f in fields(self)}


def _count(value: Any) -> int | NotAvailable:
    return NA if value is NA else int(value)


def _mig_instances(handle: Any) -> int | NotAvailable:
    top = _count(_reading(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle))
    if top is NA:
        return NA
    found = 0
    for j in range(top):
        if _reading(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, j) is not NA:
            found += 1
    return found


def gpu_settings(device: Device) -> GpuSettings | None:
    """Persistence, MIG and ECC modes, ECC error counts, row remapping, compute mode and
    utilization of the GPU behind ``device``.

    None for a device NVML does not read: the CPU, a simulated GPU, or a CUDA device
    found through ``torch.cuda`` alone (no NVML library, or ROCm).
    """
    if not isinstance(device, CudaDevice) or device._nvml is None:
        return None
    gpu = device._nvml
    handle, name, uuid = gpu.handle, gpu.name, gpu.uuid
    if gpu.mig_index is not None:
        handle = _reading(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, gpu.handle)
        if handle is NA:
            return GpuSettings(device.id, name, uuid, gpu.nvml_index, mig_instance=True)
        name = str(_text(_reading(pynvml.nvmlDeviceGetName, handle)) or name)
        read_uuid = _text(_reading(pynvml.nvmlDeviceGetUUID, handle))
        uuid = read_uuid if isinstance(read_uuid, str) else uuid
    mig = _reading(pynvml.nvmlDeviceGetMigMode, handle)
    ecc = _reading(pynvml.nvmlDeviceGetEccMode, handle)
    uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    corrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    total_ecc = pynvml.nvmlDeviceGetTotalEccErrors
    remap = _reading(pynvml.nvmlDeviceGetRemappedRows, handle)
    mode = _reading(pynvml.nvmlDeviceGetComputeMode, handle)
    util = _reading(pynvml.nvmlDeviceGetUtilizationRates, handle)
    mig_on = NA if mig is NA else bool(mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE)
    return GpuSettings(
        device=device.id,
        name=name,
        uuid=uuid,
        nvml_index=gpu.nvml_index,
        mig_instance=gpu.mig_index is not None,
        persistence_mode=_flag(_reading(pynvml.nvmlDeviceGetPersistenceMode, handle)),
        mig_mode=mig_on,
        mig_pending=NA if mig is NA else bool(mig[1] == pynvml.NVML_DEVICE_MIG_ENABLE),
        mig_instances=_mig_instances(handle) if mig_on is True else NA,
        ecc_mode=NA if ecc is NA else _flag(ecc[0]),
        ecc_pending=NA if ecc is NA else _flag(ecc[1]),
        ecc_uncorrected_volatile=_count(
            _reading(total_ecc, handle, uncorrected, pynvml.NVML_VOLATILE_ECC)
        ),
        ecc_uncorrected_aggregate=_count(
            _reading(total_ecc, handle, uncorrected, pynvml.NVML_AGGREGATE_ECC)
        ),
        ecc_corrected_volatile=_count(
            _reading(total_ecc, handle, corrected, pynvml.NVML_VOLATILE_ECC)
        ),
        remap_pending=NA if remap is NA else bool(remap[2]),
        remap_failed=NA if remap is NA else bool(remap[3]),
        compute_mode=NA if mode is NA else _COMPUTE_MODES.get(int(mode), str(mode)),
        gpu_utilization=NA if util is NA else float(util.gpu),
    )
