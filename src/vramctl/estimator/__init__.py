"""The estimator layer: predicting a step's memory without a GPU.

The package is ``vramctl.estimator`` so that the ``vramctl.estimate()``
function does not collide with it (as ``vramctl.devices()`` and the
``vramctl.device`` package do not).
"""

from __future__ import annotations

from vramctl.estimator import zoo
from vramctl.estimator._allocator import (
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocatorModel,
)
from vramctl.estimator._calibrate import calibrate
from vramctl.estimator._calibration import (
    Calibration,
    CalibrationError,
    calibration_dir,
    find_calibration,
    list_calibrations,
    load_calibration,
)
from vramctl.estimator._estimate import (
    Estimate,
    EstimateError,
    StepSpec,
    Target,
    estimate,
    resolve_target,
    run_target,
)
from vramctl.estimator._maxbatch import MaxBatch, max_batch_size

__all__ = [
    "AllocatorConfig",
    "AllocatorOutOfMemory",
    "CachingAllocatorModel",
    "Calibration",
    "CalibrationError",
    "Estimate",
    "EstimateError",
    "MaxBatch",
    "StepSpec",
    "Target",
    "calibrate",
    "calibration_dir",
    "estimate",
    "find_calibration",
    "list_calibrations",
    "load_calibration",
    "max_batch_size",
    "resolve_target",
    "run_target",
    "zoo",
]
