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
    constant_rows,
    find_calibration,
    list_calibrations,
    load_calibration,
)
from vramctl.estimator._cuda_model import builtin as builtin_calibration
from vramctl.estimator._estimate import estimate
from vramctl.estimator._hub import TASKS, ConfigModel, config_model
from vramctl.estimator._maxbatch import (
    BATCH_BOUND,
    LENGTH_BOUND,
    SEARCH_INPUT_BYTES,
    MaxBatch,
    max_batch_size,
)
from vramctl.estimator._parallel import STRATEGIES, Parallel, ParallelError, parallelize
from vramctl.estimator._rates import (
    cpu_profile_path,
    cpu_throughput,
    measure_throughput,
    target_throughput,
)
from vramctl.estimator._request import Step
from vramctl.estimator._result import Estimate
from vramctl.estimator._spec import (
    MODES,
    PRECISIONS,
    EstimateError,
    ResolvedSource,
    StepSpec,
    load_model_source,
    prepare_model,
    resolve_source,
    run_step,
    warm_optimizer,
)
from vramctl.estimator._target import Target, resolve_target, run_target
from vramctl.estimator._timing import (
    GPU_EFFICIENCY,
    StepTime,
    Throughput,
    gpu_throughput,
)

__all__ = [
    "BATCH_BOUND",
    "GPU_EFFICIENCY",
    "LENGTH_BOUND",
    "MODES",
    "PRECISIONS",
    "SEARCH_INPUT_BYTES",
    "STRATEGIES",
    "TASKS",
    "AllocatorConfig",
    "AllocatorOutOfMemory",
    "CachingAllocatorModel",
    "Calibration",
    "CalibrationError",
    "ConfigModel",
    "Estimate",
    "EstimateError",
    "MaxBatch",
    "Parallel",
    "ParallelError",
    "ResolvedSource",
    "Step",
    "StepSpec",
    "StepTime",
    "Target",
    "Throughput",
    "builtin_calibration",
    "calibrate",
    "calibration_dir",
    "config_model",
    "constant_rows",
    "cpu_profile_path",
    "cpu_throughput",
    "estimate",
    "find_calibration",
    "gpu_throughput",
    "list_calibrations",
    "load_calibration",
    "load_model_source",
    "max_batch_size",
    "measure_throughput",
    "parallelize",
    "prepare_model",
    "resolve_source",
    "resolve_target",
    "run_step",
    "run_target",
    "target_throughput",
    "warm_optimizer",
    "zoo",
]
