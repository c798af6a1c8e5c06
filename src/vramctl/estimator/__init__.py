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
    DeviceEvidence,
    calibration_dir,
    find_calibration,
    list_calibrations,
    load_calibration,
)
from vramctl.estimator._cuda_model import builtin as builtin_calibration
from vramctl.estimator._estimate import estimate
from vramctl.estimator._hub import TASKS
from vramctl.estimator._maxbatch import MaxBatch, max_batch_size
from vramctl.estimator._parallel import STRATEGIES, Parallel, ParallelError, parallelize
from vramctl.estimator._quant import QUANT_FORMATS, QuantSpec
from vramctl.estimator._request import Step
from vramctl.estimator._result import Estimate
from vramctl.estimator._serve import (
    ENGINES,
    KV_DTYPES,
    EngineBudget,
    KVShape,
    ServePlan,
    serve_plan,
)
from vramctl.estimator._spec import MODES, PRECISIONS, EstimateError
from vramctl.estimator._timing import GPU_EFFICIENCY, StepTime, Throughput

__all__ = [
    "ENGINES",
    "GPU_EFFICIENCY",
    "KV_DTYPES",
    "MODES",
    "PRECISIONS",
    "QUANT_FORMATS",
    "STRATEGIES",
    "TASKS",
    "AllocatorConfig",
    "AllocatorOutOfMemory",
    "CachingAllocatorModel",
    "Calibration",
    "CalibrationError",
    "DeviceEvidence",
    "EngineBudget",
    "Estimate",
    "EstimateError",
    "KVShape",
    "MaxBatch",
    "Parallel",
    "ParallelError",
    "QuantSpec",
    "ServePlan",
    "Step",
    "StepTime",
    "Throughput",
    "builtin_calibration",
    "calibrate",
    "calibration_dir",
    "estimate",
    "find_calibration",
    "list_calibrations",
    "load_calibration",
    "max_batch_size",
    "parallelize",
    "serve_plan",
    "zoo",
]
