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
>>> Requests.between(step(30), step(31), 30).largest(30, 500, 64 * 2**20, AllocatorConfig())
102

At 102 samples each block is 29.9 MiB, a 30 MiB segment (the allocator rounds a large
block to 2 MiB): 60 MiB and the 1 MiB block's 2 MiB segment fit 64 MiB; at 103 they are
32 MiB each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vramctl.estimator._allocator import AllocatorConfig, AllocatorOutOfMemory
from vramctl.estimator._trace import Trace
from vramctl.estimator._verdict import replay

__all__ = ["MAX_REPLAYS", "Requests"]

#: The most sizes replayed in one search (a step of a large model has many requests:
#: the count is cut so that the replays stay a fraction of a trace's time).
MAX_REPLAYS = 96
#: Requests replayed in one search, over all sizes.
_WORK = 3_000_000


@dataclass(frozen=True)
class Requests:
    """A step's requests as a function of its batch size: storage ``i`` of a batch of ``b``
    samples takes ``fixed[i] + per[i] * b`` bytes, in the order of ``trace``'s events."""

    trace: Trace
    fixed: list[int]
    per: list[int]

    @classmethod
    def between(cls, at_b: Trace, at_next: Trace, b: int) -> Requests | None:
        """From traces of ``b`` and ``b + 1`` samples; None where their requests differ in
        number, order or sign of growth, or do not grow."""
        if at_b.events != at_next.events or len(at_b.records) != len(at_next.records):
            return None
        base = [r.nbytes for r in at_b.records]
        per = [r1.nbytes - r0 for r0, r1 in zip(base, at_next.records, strict=True)]
        if any(k < 0 for k in per) or not any(per):
            return None
        return cls(at_b, [s - k * b for s, k in zip(base, per, strict=True)], per)

    def sizes(self, b: int, scale: float = 1.0) -> list[int]:
        """Each storage's bytes at ``b`` samples, its per-sample part times ``scale``."""
        return [max(0, c + int(scale * k * b)) for c, k in zip(self.fixed, self.per, strict=True)]

    def live_peak(self, b: int, scale: float = 1.0) -> int:
        """The most bytes live at once at ``b`` samples (the allocated peak)."""
        sizes = self.sizes(b, scale)
        live = peak = 0
        for e in self.trace.events:
            live += sizes[e] if e >= 0 else -sizes[~e]
            peak = max(peak, live)
        return peak

    def largest(
        self,
        lo: int,
        ceiling: int,
        capacity: int,
        config: AllocatorConfig,
        scale: float = 1.0,
        spare: float = 0.0,
    ) -> int | None:
        """The largest size above ``lo + 1`` (to ``ceiling``) whose requests the allocator
        model capped at ``capacity`` (plus ``spare`` bytes per sample) serves; None where
        none does."""
        # Live bytes only grow with the size: where they pass the cap nothing fits.
        live_c = live_k = 0
        top = ceiling
        for e in self.trace.events:
            sid, sign = (e, 1) if e >= 0 else (~e, -1)
            live_c += sign * self.fixed[sid]
            live_k += sign * self.per[sid]
            if scale * live_k > spare:
                top = min(top, math.floor((capacity - live_c) / (scale * live_k - spare)))
        if top < lo + 2:
            return None
        replays = max(1, min(MAX_REPLAYS, _WORK // max(1, len(self.trace.events))))
        stride = max(1, math.ceil((top - lo - 1) / replays))

        def fits(b: int) -> bool:
            try:
                replay(
                    self.trace,
                    capacity + int(spare * b),
                    config,
                    self.sizes(b, scale),
                    steady=True,
                )
            except AllocatorOutOfMemory:
                return False
            return True

        found = next((b for b in range(top, lo + 1, -stride) if fits(b)), None)
        if found is None:
            return None
        # Between the fitting size and the next one replayed above it.
        return next((b for b in range(min(top, found + stride - 1), found, -1) if fits(b)), found)

    def refit(
        self, b: int, allocated: int, ceiling: int, capacity: int, config: AllocatorConfig
    ) -> int | None:
        """The largest size the allocator model serves once the bytes by which the live
        peak at ``b`` differs from the ``allocated`` bytes a real step measured there are
        taken as a tensor of so many bytes per sample, live at the peak, that the real step
        does not have (or has, where it allocated more): the requests are replayed as
        traced, under a cap moved by that tensor. None where no size above ``b + 1`` fits."""
        spare = (self.live_peak(b) - allocated) / b
        return self.largest(b, ceiling, capacity, config, spare=spare)
