"""Larger batches that fit again above a traced edge: the caching allocator's staircase.

A step's reserved peak is not monotonic in the batch size. A tensor that grows past
the allocator's 10 MiB line gets a segment of its own instead of sharing a 20 MiB one,
and the cache then places the step's other blocks differently. A two-block CNN trained
on an H200 fits at batch 704 and fails at 652-670. A search that stops at the first
edge it traces (the answer fits, one more sample does not) can stop below such a stretch.

Two traces a sample apart with the same requests in the same order give each request's
bytes per sample, so the requests of every larger size follow; the allocator model
replays them in milliseconds, where a trace takes seconds. The largest size whose
replay fits is returned for a trace to confirm.

>>> from vramctl.estimator._trace import StorageRecord, Trace
>>> def step(b):  # a fixed 1 MiB block, then two of 300 KiB per sample
...     r = [StorageRecord(n, "", "", "forward") for n in (2**20, 300 * 2**10 * b, 300 * 2**10 * b)]
...     return Trace(events=[0, 1, 2, ~1, ~2], records=r)
>>> from vramctl.estimator._allocator import AllocatorConfig
>>> larger_fit(step(30), step(31), 30, 64 * 2**20, AllocatorConfig(), ceiling=500)
102

At 102 samples each block is 29.9 MiB, a 30 MiB segment (the allocator rounds a large
block to 2 MiB): 60 MiB and the 1 MiB block's 2 MiB segment fit 64 MiB; at 103 they are
32 MiB each.
"""

from __future__ import annotations

import math

from vramctl.estimator._allocator import AllocatorConfig, AllocatorOutOfMemory
from vramctl.estimator._trace import Trace
from vramctl.estimator._verdict import replay

__all__ = ["MAX_REPLAYS", "larger_fit"]

#: The most sizes replayed in one search (a step of a large model has many requests:
#: the count is cut so that the replays stay a fraction of a trace's time).
MAX_REPLAYS = 96
#: Requests replayed in one search, over all sizes.
_WORK = 3_000_000


def larger_fit(
    at_b: Trace,
    at_next: Trace,
    b: int,
    capacity: int,
    config: AllocatorConfig,
    ceiling: int,
) -> int | None:
    """The largest size above ``b + 1`` (to ``ceiling``) whose requests, extrapolated from
    ``at_b`` and ``at_next`` (traces of ``b`` and ``b + 1`` samples), the allocator model
    capped at ``capacity`` can serve; None where none can, or where the traces' requests
    differ in number, order or sign of growth."""
    if at_b.events != at_next.events or len(at_b.records) != len(at_next.records):
        return None
    base = [r.nbytes for r in at_b.records]
    per = [r1.nbytes - r0 for r0, r1 in zip(base, at_next.records, strict=True)]
    if any(k < 0 for k in per) or not any(per):
        return None
    # Live bytes only grow with the size: the largest size whose live bytes fit
    # ``capacity`` bounds every size the allocator could serve.
    live0 = live_k = 0
    top = ceiling - b
    for e in at_b.events:
        sid = e if e >= 0 else ~e
        sign = 1 if e >= 0 else -1
        live0 += sign * base[sid]
        live_k += sign * per[sid]
        if live_k > 0:
            top = min(top, (capacity - live0) // live_k)
    if top < 2:
        return None
    replays = max(1, min(MAX_REPLAYS, _WORK // max(1, len(at_b.events))))
    stride = max(1, math.ceil((top - 1) / replays))

    def fits(d: int) -> bool:
        try:
            replay(at_b, capacity, config, [s + d * k for s, k in zip(base, per, strict=True)])
        except AllocatorOutOfMemory:
            return False
        return True

    found = next((d for d in range(top, 1, -stride) if fits(d)), None)
    if found is None:
        return None
    # Between the fitting size and the next one replayed above it.
    for d in range(min(top, found + stride - 1), found, -1):
        if fits(d):
            return b + d
    return b + found
