"""vramctl: see, predict, fit and share GPU memory for PyTorch work.

>>> import vramctl
>>> [d.id for d in vramctl.devices()][-1]
'cpu'
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from vramctl._errors import InvalidSizeError, UnknownDeviceError, VramctlError
from vramctl._lazy import lazy_names
from vramctl._na import NA, NotAvailable
from vramctl._units import format_bytes, parse_size
from vramctl._version import __version__

if TYPE_CHECKING:
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
        Step,
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
        ("Estimate", "EstimateError", "MaxBatch", "Parallel", "Step", "estimate", "max_batch_size"),
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
        ("OptimizationReport", "Plan", "PlanResult", "optimize", "plan"),
        "vramctl.optimize",
    ),
    "doctor": "vramctl.doctor",
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
    "simulate",
    "use_device",
]


if not TYPE_CHECKING:  # mypy sees the imports above
    __getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)


#: The functions that share their name with their package.
_SHADOWED = ("doctor", "optimize")


class _Package(types.ModuleType):
    """``vramctl.optimize`` and ``vramctl.doctor`` are the functions, not the packages of
    those names.

    Importing a subpackage binds it on its parent; the package ``vramctl.optimize``,
    imported on its own (``from vramctl.optimize import plan``), must not replace
    the function, which :func:`__getattr__` then finds in it (and so for ``doctor``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
