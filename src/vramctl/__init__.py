"""vramctl: see, predict, fit and share GPU memory for PyTorch work.

>>> import vramctl
>>> [d.id for d in vramctl.devices()][-1]
'cpu'
"""

from __future__ import annotations

from vramctl._errors import InvalidSizeError, UnknownDeviceError, VramctlError
from vramctl._na import NA, NotAvailable
from vramctl._units import format_bytes, parse_size
from vramctl._version import __version__
from vramctl.batching import AdaptiveBatcher, BatchingError
from vramctl.cache import TensorCache
from vramctl.device import (
    ComputeCapability,
    Device,
    GpuSpec,
    HealthState,
    MemoryState,
    Policy,
    ProcessMemory,
    Selection,
    SimulatedDevice,
    SimulatedOutOfMemoryError,
    catalog,
    current_device,
    devices,
    get_device,
    gpu_spec,
    gpus,
    rank_devices,
    select_device,
    simulate,
    use_device,
)
from vramctl.estimator import (
    Estimate,
    EstimateError,
    MaxBatch,
    Parallel,
    estimate,
    max_batch_size,
)
from vramctl.fit import FitError, FitResult, fit_batch_size
from vramctl.guard import (
    Guard,
    GuardEvent,
    MemoryReport,
    SplitBatchNormWarning,
    StepDoesNotFitError,
    StepResult,
    guarded,
    is_oom,
)
from vramctl.monitor import Monitor
from vramctl.optimize import OptimizationReport, Plan, PlanResult, doctor, optimize, plan

__all__ = [
    "NA",
    "AdaptiveBatcher",
    "BatchingError",
    "ComputeCapability",
    "Device",
    "Estimate",
    "EstimateError",
    "FitError",
    "FitResult",
    "GpuSpec",
    "Guard",
    "GuardEvent",
    "HealthState",
    "InvalidSizeError",
    "MaxBatch",
    "MemoryReport",
    "MemoryState",
    "Monitor",
    "NotAvailable",
    "OptimizationReport",
    "Parallel",
    "Plan",
    "PlanResult",
    "Policy",
    "ProcessMemory",
    "Selection",
    "SimulatedDevice",
    "SimulatedOutOfMemoryError",
    "SplitBatchNormWarning",
    "StepDoesNotFitError",
    "StepResult",
    "TensorCache",
    "UnknownDeviceError",
    "VramctlError",
    "__version__",
    "catalog",
    "current_device",
    "devices",
    "doctor",
    "estimate",
    "fit_batch_size",
    "format_bytes",
    "get_device",
    "gpu_spec",
    "gpus",
    "guarded",
    "is_oom",
    "max_batch_size",
    "optimize",
    "parse_size",
    "plan",
    "rank_devices",
    "select_device",
    "simulate",
    "use_device",
]
