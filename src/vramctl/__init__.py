"""vramctl: see, predict, fit and share GPU memory for PyTorch work.

>>> import vramctl
>>> [d.id for d in vramctl.devices()][-1]
'cpu'
"""

from __future__ import annotations

import importlib
import typing

from vramctl import _lazy
from vramctl._errors import InvalidSizeError, UnknownDeviceError, VramctlError
from vramctl._na import NA, NotAvailable
from vramctl._units import format_bytes, parse_size
from vramctl._version import __version__

if typing.TYPE_CHECKING:
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
    from vramctl.doctor import doctor
    from vramctl.estimator import (
        Estimate,
        EstimateError,
        MaxBatch,
        Parallel,
        ServePlan,
        Step,
        estimate,
        max_batch_size,
        serve_plan,
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
    from vramctl.optimize import OptimizationReport, Plan, PlanResult, optimize, plan

# Each public name's package, imported on first use (PEP 562): ``import vramctl`` takes
# milliseconds, and PyTorch is imported by what needs it, not by ``vramctl --help``.
_LAZY = {
    **dict.fromkeys(("AdaptiveBatcher", "BatchingError"), "vramctl.batching"),
    "TensorCache": "vramctl.cache",
    **dict.fromkeys(
        (
            "ComputeCapability",
            "Device",
            "GpuSpec",
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
        ),
        "vramctl.device",
    ),
    **dict.fromkeys(
        (
            "Estimate",
            "EstimateError",
            "MaxBatch",
            "Parallel",
            "ServePlan",
            "Step",
            "estimate",
            "max_batch_size",
            "serve_plan",
        ),
        "vramctl.estimator",
    ),
    **dict.fromkeys(("FitError", "FitResult", "fit_batch_size"), "vramctl.fit"),
    **dict.fromkeys(
        (
            "Guard",
            "GuardEvent",
            "MemoryReport",
            "SplitBatchNormWarning",
            "StepDoesNotFitError",
            "StepResult",
            "guarded",
            "is_oom",
        ),
        "vramctl.guard",
    ),
    "Monitor": "vramctl.monitor",
    **dict.fromkeys(
        ("OptimizationReport", "Plan", "PlanResult", "plan"),
        "vramctl.optimize",
    ),
}

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
    "ServePlan",
    "SimulatedDevice",
    "SimulatedOutOfMemoryError",
    "SplitBatchNormWarning",
    "Step",
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
    "serve_plan",
    "simulate",
    "use_device",
]


if not typing.TYPE_CHECKING:  # mypy sees the imports above (the functions)
    _names, __dir__ = _lazy.lazy_names(__name__, _LAZY, __all__)

    def __getattr__(name: str) -> typing.Any:
        # ``doctor`` and ``optimize`` are packages that are called as their function
        # (``vramctl.optimize(model)``, ``vramctl.optimize.find_blocks``): importing one
        # binds it here.
        if name in _lazy.CALLABLE_PACKAGES:
            return importlib.import_module(f"{__name__}.{name}")
        return _names(name)
