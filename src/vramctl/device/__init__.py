"""The device layer: discovery, readings, health, selection and simulated GPUs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramctl._lazy import lazy_names
from vramctl.device._base import Device
from vramctl.device._capability import ComputeCapability
from vramctl.device._catalog import GpuSpec, catalog, gpu_spec, match_gpu_name
from vramctl.device._cpu import CpuDevice
from vramctl.device._cuda import CudaDevice
from vramctl.device._discover import devices, get_device, gpus
from vramctl.device._health import DeviceHealth, HealthPolicy, HealthState

# The host's limits (cgroup memory, CPU quota, affinity), read here once for the packages
# above; internal: not in the documented surface.
from vramctl.device._host import affinity_cpus, cgroup_memory, cpu_quota
from vramctl.device._memory import MemoryState, ProcessMemory
from vramctl.device._select import (
    Policy,
    Selection,
    current_device,
    rank_devices,
    resolve,
    select_device,
    sort_devices,
    use_device,
)
from vramctl.device._settings import DriverInfo, GpuSettings, driver_info, gpu_settings

if TYPE_CHECKING:
    from vramctl.device._meter import PeakMeter, available_bytes, total_bytes
    from vramctl.device._simulate import (
        SimulatedDevice,
        SimulatedOutOfMemoryError,
        active_simulation,
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
    "active_simulation": "vramctl.device._simulate",
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
    "active_simulation",
    "affinity_cpus",
    "available_bytes",
    "catalog",
    "cgroup_memory",
    "cpu_quota",
    "current_device",
    "devices",
    "driver_info",
    "get_device",
    "gpu_settings",
    "gpu_spec",
    "gpus",
    "match_gpu_name",
    "rank_devices",
    "resolve",
    "select_device",
    "simulate",
    "sort_devices",
    "total_bytes",
    "use_device",
]


if not TYPE_CHECKING:  # mypy sees the imports above
    __getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
