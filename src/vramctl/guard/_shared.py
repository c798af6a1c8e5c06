"""For vramctl's other packages only: the guard's helpers that other vramctl packages use (the
integrations' own guarded steps, the fit's OOM reading).

Not the public surface (that is ``vramctl.guard``); the import contracts let sibling
packages import this module and no other private one of ``vramctl.guard``.
"""

from __future__ import annotations

from vramctl.guard._guard import drop_grads, restore_grads, stash_grads
from vramctl.guard._oom import OomCounters, requested_bytes
from vramctl.guard._split import batch_size_of, slice_batch

__all__ = [
    "OomCounters",
    "batch_size_of",
    "drop_grads",
    "requested_bytes",
    "restore_grads",
    "slice_batch",
    "stash_grads",
]
