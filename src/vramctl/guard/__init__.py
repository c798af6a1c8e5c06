"""The OOM guard: recognise an out-of-memory error and finish the step in pieces."""

from __future__ import annotations

from vramctl.device import available_bytes, total_bytes
from vramctl.guard._guard import (
    Guard,
    GuardedFunction,
    GuardEvent,
    SplitBatchNormWarning,
    StepResult,
    add_listener,
    add_reliever,
    guarded,
    relieve,
    remove_listener,
    remove_reliever,
)
from vramctl.guard._offload import can_offload, offload_activations
from vramctl.guard._oom import is_oom, release
from vramctl.guard._report import MemoryReport, StepDoesNotFitError, memory_report
from vramctl.guard._split import GuardError

__all__ = [
    "Guard",
    "GuardError",
    "GuardEvent",
    "GuardedFunction",
    "MemoryReport",
    "SplitBatchNormWarning",
    "StepDoesNotFitError",
    "StepResult",
    "add_listener",
    "add_reliever",
    "available_bytes",
    "can_offload",
    "guarded",
    "is_oom",
    "memory_report",
    "offload_activations",
    "release",
    "relieve",
    "remove_listener",
    "remove_reliever",
    "total_bytes",
]
