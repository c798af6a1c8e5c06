"""The estimator layer: predicting a step's memory without a GPU (in progress).

The package is ``vramctl.estimator`` so that the planned ``vramctl.estimate()``
function does not collide with it (as ``vramctl.devices()`` and the
``vramctl.device`` package do not).
"""

from __future__ import annotations

from vramctl.estimator._allocator import (
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocatorModel,
)

__all__ = ["AllocatorConfig", "AllocatorOutOfMemory", "CachingAllocatorModel"]
