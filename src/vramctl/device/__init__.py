"""The device layer: discovery, readings, health, selection and simulated GPUs."""

from __future__ import annotations

from vramctl.device._base import Device
from vramctl.device._capability import ComputeCapability
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
    select_device,
    use_device,
)
from vramctl.device._simulate import SimulatedDevice, SimulatedOutOfMemoryError, simulate
from vramctl.device.catalog import GpuSpec, catalog, gpu_spec

__all__ = [
    "ComputeCapability",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "DeviceHealth",
    "GpuSpec",
    "HealthPolicy",
    "HealthState",
    "MemoryState",
    "Policy",
    "ProcessMemory",
    "Selection",
    "SimulatedDevice",
    "SimulatedOutOfMemoryError",
    "catalog",
    "current_device",
    "devices",
    "get_device",
    "gpu_spec",
    "gpus",
    "rank_devices",
    "select_device",
    "simulate",
    "use_device",
]
