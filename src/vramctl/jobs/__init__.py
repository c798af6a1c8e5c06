"""Sharing GPUs among jobs: job specs, admission and placement by memory, the queue.

The layer between the run-time layers (``fit``, ``batching``, ``monitor``, ``guard``,
``estimator``) and the interfaces (``server``, ``cli``).
"""

from __future__ import annotations

from vramctl.jobs._need import (
    BATCH_SIZE_ENV,
    GRAD_ACCUM_ENV,
    batch_plan,
    check_placeable,
    job_env,
    matching_devices,
    price,
)
from vramctl.jobs._spec import (
    MAX_SIZE,
    DeviceConstraints,
    JobSpec,
    JobSpecError,
    MemoryNeed,
    ModelNeed,
    load_spec,
)

__all__ = [
    "BATCH_SIZE_ENV",
    "GRAD_ACCUM_ENV",
    "MAX_SIZE",
    "DeviceConstraints",
    "JobSpec",
    "JobSpecError",
    "MemoryNeed",
    "ModelNeed",
    "batch_plan",
    "check_placeable",
    "job_env",
    "load_spec",
    "matching_devices",
    "price",
]
