"""The device layer: discovery, readings, health, selection and simulated GPUs."""

from __future__ import annotations

import typing

from vramctl import _lazy
from vramctl.device._base import Device
from vramctl.device._capability import ComputeCapability
from vramctl.device._catalog import GpuSpec, catalog, gpu_spec
from vramctl.device._cpu import CpuDevice
from vramctl.device._cuda import CudaDevice
from vramctl.device._discover import devices, get_device, gpus
from vramctl.device._health import DeviceHealth, HealthPolicy, HealthState
from vramctl.device._memory import MemoryState, ProcessMemory
from vramctl.device._select import (
    Policy,
    Selection,
    current_device,
    rank_devices,
    resolve,
    select_device,
    use_device,
)
from vramctl.device._settings import DriverInfo, GpuSettings, driver_info, gpu_settings

if typing.TYPE_CHECKING:
    from vramctl.device._meter import PeakMeter, available_bytes, total_bytes
    from vramctl.device._simulate import (
        SimulatedDevice,
        SimulatedOutOfMemoryError,
        simulate,
    )

# The names whose modules import PyTorch, imported on first use (PEP 562): listing the
# devices and reading their memory need no PyTorch.
_LAZY = {
    "PeakMeter": "vramctl.device._meter",
    "available_bytes": "vramctl.device._meter",
    "total_bytes": "vramctl.device._meter",
    "SimulatedDevice": "vramctl.device._simulate",
    "SimulatedOutOfMemoryError": "vramctl.device._simulate",
    "simulate": "vramctl.device._simulate",
}

__all__ = [
    "ComputeCapability",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "DeviceHealth",
    "DriverInfo",
    "GpuSettings",
    "GpuSpec",
    "HealthPolicy",
    "HealthState",
    "MemoryState",
    "PeakMeter",
    "Policy",
    "ProcessMemory",
    "Selection",
    "SimulatedDevice",
    "SimulatedOutOfMemoryError",
    "available_bytes",
    "catalog",
    "current_device",
    "devices",
    "driver_info",
    "get_device",
    "gpu_settings",
    "gpu_spec",
    "gpus",
    "rank_devices",
    "resolve",
    "select_device",
    "simulate",
    "total_bytes",
    "use_device",
]


if not typing.TYPE_CHECKING:  # mypy sees the imports above
    __getattr__, __dir__ = _lazy.lazy_names(__name__, _LAZY, __all__)
