"""The OOM guard: recognise an out-of-memory error and finish the step in pieces."""

from __future__ import annotations

from vramctl.device import PeakMeter, available_bytes, total_bytes
from vramctl.guard._guard import (
    Guard,
    GuardedFunction,
    GuardEvent,
    SplitBatchNormWarning,
    StepResult,
    add_listener,
    add_reliever,
    drop_grads,
    guarded,
    relieve,
    remove_listener,
    remove_reliever,
    restore_grads,
    stash_grads,
)
from vramctl.guard._offload import can_offload, offload_activations
from vramctl.guard._oom import OomCounters, is_oom, release, requested_bytes
from vramctl.guard._report import MemoryReport, StepDoesNotFitError, memory_report
from vramctl.guard._split import (
    GuardError,
    batch_size_of,
    merge_outputs,
    piece_sizes,
    slice_batch,
    split_batch,
)

__all__ = [
    "Guard",
    "GuardError",
    "GuardEvent",
    "GuardedFunction",
    "MemoryReport",
    "OomCounters",
    "PeakMeter",
    "SplitBatchNormWarning",
    "StepDoesNotFitError",
    "StepResult",
    "add_listener",
    "add_reliever",
    "available_bytes",
    "batch_size_of",
    "can_offload",
    "drop_grads",
    "guarded",
    "is_oom",
    "memory_report",
    "merge_outputs",
    "offload_activations",
    "piece_sizes",
    "release",
    "relieve",
    "remove_listener",
    "remove_reliever",
    "requested_bytes",
    "restore_grads",
    "slice_batch",
    "split_batch",
    "stash_grads",
    "total_bytes",
]
