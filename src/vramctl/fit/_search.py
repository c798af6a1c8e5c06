"""Where to probe next, from the probes made so far (pure arithmetic, no device).

A step's peak memory is, to a good approximation, a convex and piecewise-affine
function of the batch size whose intercepts are not negative: what is already
held, plus the largest of the phases' costs (a fixed part and a per-sample
part each). Two facts follow, and the search leans on them:

- *scaling*: the bytes a probe added over what was held before it, divided by
  its samples, are at least the true cost of one more sample, so the size those
  bytes-per-sample reach the budget at fits (a safe guess up from a real point);
- *bracketing*: between a size that fits and a measured one that does not, the
  chord lies above the curve, so where the chord meets the budget fits too.

Beyond the largest fitting size, the line through the two largest fitting
probes is exact when the curve is affine there (the usual case near the answer).

>>> from vramctl.fit._search import Probe, Search
>>> peak = lambda b: 1000 + 100 + 10 * b        # held 1000, step 100 + 10 per sample
>>> s = Search(budget=2000, upper=None, slope_hint=None)
>>> s.probes.append(Probe(40, peak(40), True, 1000))
>>> s.next()                                     # scaling: 40 * 1000 / 500
80
>>> s.probes.append(Probe(80, peak(80), True, 1000))
>>> s.next()                                     # the line: (2000 - 1100) / 10
90
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Probe", "Search", "scaled"]


@dataclass(frozen=True)
class Probe:
    """One real probe."""

    batch_size: int
    #: Measured peak device-level used bytes; None when it ran out of memory.
    peak: int | None
    fits: bool
    #: Device-level used bytes just before the probe.
    base: int
    #: At an OOM: the peak reached plus the refused request (a lower bound of the peak).
    floor: int | None = None
    #: Peak allocated bytes (the tensors alone, not the allocator's segments); None where
    #: not measured or out of memory.
    allocated: int | None = None


def scaled(p: Probe, budget: int) -> int:
    """The size at which the bytes ``p`` added, per sample, reach ``budget``."""
    assert p.peak is not None
    added = p.peak - p.base
    if added <= 0:
        return 2 * p.batch_size
    return math.floor(p.batch_size * (budget - p.base) / added)


class Search:
    """Chooses the next probe: up from what fits, inside a bracket, or down until one fits."""

    def __init__(
        self,
        budget: int,
        upper: int | None,
        slope_hint: float | None,
        tolerance: float = 0.0,
        ceiling: int | None = None,
    ) -> None:
        self.budget = budget
        #: Largest size allowed (``max``), or None.
        self.upper = upper
        #: Bytes per sample from the estimator, used only to step down from a miss.
        self.slope_hint = slope_hint
        #: Stop when the next probe would add less than this share to the largest fit.
        self.tolerance = tolerance
        #: No size above this can fit (``upper``, or the room over one sample's input bytes).
        self.ceiling = upper if ceiling is None else ceiling
        self.probes: list[Probe] = []
        #: A size known not to fit without a probe (the estimate's edge, once a probe
        #: confirmed the estimate below it), or None.
        self.edge: int | None = None

    @property
    def lo(self) -> int:
        """Largest size that fitted (0: none yet)."""
        return max((p.batch_size for p in self.probes if p.fits), default=0)

    @property
    def hi(self) -> int | None:
        """Smallest size that did not fit, or is known not to (None: none yet)."""
        misses = [p.batch_size for p in self.probes if not p.fits]
        if self.edge is not None:
            misses.append(self.edge)
        return min(misses, default=None)

    def at(self, b: int) -> Probe:
        return next(p for p in self.probes if p.batch_size == b)

    def misses_before_fit(self) -> int:
        """Probes made before the first that fitted."""
        for i, p in enumerate(self.probes):
            if p.fits:
                return i
        return len(self.probes)

    def next(self) -> int | None:
        """The next size to probe, or None when the answer is settled."""
        lo, hi = self.lo, self.hi
        if self.ceiling is not None and lo >= self.ceiling:
            return None
        if hi is not None and hi <= lo + 1:
            return None
        guess = self._up(lo) if lo else self._down(hi)
        if hi is not None and guess >= hi:  # the line crosses a size known not to fit
            guess = math.isqrt(lo * hi) if lo and hi > 4 * lo else (lo + hi) // 2
        if self.ceiling is not None:
            guess = min(guess, self.ceiling)
        if guess <= lo or (lo and guess - lo < self.tolerance * lo):
            return None
        if any(p.batch_size == guess for p in self.probes):
            return None
        return max(1, guess)

    def _up(self, lo: int) -> int:
        a = self.at(lo)
        assert a.peak is not None
        above = [p for p in self.probes if p.peak is not None and not p.fits and p.batch_size > lo]
        below = [p for p in self.probes if p.fits and p.batch_size < lo]
        if above:  # bracket: the chord is above a convex curve, so its answer fits
            c = min(above, key=lambda p: p.batch_size)
        elif below:  # the line through the two largest that fit
            c = max(below, key=lambda p: p.batch_size)
        else:
            return scaled(a, self.budget)
        assert c.peak is not None
        slope = (c.peak - a.peak) / (c.batch_size - a.batch_size)
        if slope <= 0:
            # A flat stretch: the caching allocator's segments make the peak a staircase,
            # where a line says nothing; between a fit and a known miss, halve the gap.
            hi = self.hi
            if hi is not None and not above:
                return (lo + hi) // 2
            return scaled(a, self.budget)
        return a.batch_size + math.floor((self.budget - a.peak) / slope)

    def _down(self, hi: int | None) -> int:
        assert hi is not None
        c = self.at(hi)
        # An OOM measured nothing: step well down, then scale back up from a real point.
        # Scaling down from a measured miss is an upper bound (the fixed bytes scale too):
        # take twice its step.
        candidates = [hi // 3 if c.peak is None else hi - 2 * (hi - scaled(c, self.budget))]
        peak = c.peak if c.peak is not None else c.floor
        if self.slope_hint and peak is not None and peak > self.budget:
            candidates.append(hi - math.ceil((peak - self.budget) / self.slope_hint))
        return max(1, min(candidates))
