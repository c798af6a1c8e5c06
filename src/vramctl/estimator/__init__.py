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
from vramctl.estimator._estimate import (
    Estimate,
    EstimateError,
    StepSpec,
    Target,
    estimate,
    resolve_target,
)
from vramctl.estimator._maxbatch import MaxBatch, max_batch_size

__all__ = [
    "AllocatorConfig",
    "AllocatorOutOfMemory",
    "CachingAllocatorModel",
    "Estimate",
    "EstimateError",
    "MaxBatch",
    "StepSpec",
    "Target",
    "estimate",
    "max_batch_size",
    "resolve_target",
    "zoo",
]
