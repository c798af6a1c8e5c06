"""The trend test on a window of memory readings: a Mann–Kendall test that memory grows, a
Theil–Sen slope of how fast, and a check that the growth goes on to the newest readings (a
cache that filled and stopped, or a one-off jump, does not), with the running window of
readings the leak detector keeps and screens with an O(1) least-squares slope.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Trend", "Window", "mann_kendall", "persistent", "theil_sen", "trend"]

#: Above this many readings the Theil–Sen slope uses an evenly spaced subsample.
_THEIL_SEN_POINTS = 64


@dataclass(frozen=True)
class Trend:
    """The tests on one window of readings."""

    n: int
    slope: float  # Theil–Sen, bytes per step
    z: float  # Mann–Kendall
    p_value: float  # one-sided: memory grows
    persistent: bool  # growth in every quarter, and the newest readings above all older ones


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return float(s[mid]) if n % 2 else (s[mid - 1] + s[mid]) / 2


def persistent(ys: Sequence[int], min_rate: float) -> bool:
    """Growth goes on through the window: quarter medians rise, the newest above the old peak.

    A leak keeps raising memory; a cache that filled and stopped, or a single
    jump, leaves at least one quarter no higher than the one before.
    """
    n = len(ys)
    cuts = [n * i // 4 for i in range(5)]
    meds = [_median(ys[cuts[i] : cuts[i + 1]]) for i in range(4)]
    need = 0.5 * min_rate * n / 4
    if any(b - a < need for a, b in itertools.pairwise(meds)):
        return False
    return meds[3] > max(ys[: n // 2])


def mann_kendall(ys: Sequence[int]) -> tuple[float, float]:
    """Mann–Kendall ``z`` and the one-sided p-value that ``ys`` trends upwards.

    Ties are corrected for; readings that are all equal have no trend (z 0, p 1).
    O(n log n): the sign sum counts, for each reading, the later ones above and below it.
    """
    n = len(ys)
    s = 0
    later: list[int] = []
    for y in reversed(ys):
        s += (len(later) - bisect.bisect_right(later, y)) - bisect.bisect_left(later, y)
        bisect.insort(later, y)
    ties = sum(t * (t - 1) * (2 * t + 5) for t in collections.Counter(ys).values() if t > 1)
    var = (n * (n - 1) * (2 * n + 5) - ties) / 18
    if var <= 0:
        return 0.0, 1.0
    z = (s - (s > 0) + (s < 0)) / math.sqrt(var)  # continuity correction
    return z, 0.5 * math.erfc(z / math.sqrt(2))


def theil_sen(ys: Sequence[int]) -> float:
    """The median of the slopes between all pairs of readings (evenly subsampled when long)."""
    n = len(ys)
    idx = list(range(0, n, math.ceil(n / _THEIL_SEN_POINTS)))
    pts = [(i, ys[i]) for i in idx]
    slopes = [(yj - yi) / (j - i) for a, (i, yi) in enumerate(pts) for (j, yj) in pts[a + 1 :]]
    return _median(slopes) if slopes else 0.0


def trend(readings: Iterable[int], min_rate: float) -> Trend:
    ys = list(readings)
    n = len(ys)
    z, p = mann_kendall(ys)
    return Trend(n, theil_sen(ys), z, p, persistent(ys, min_rate))


class Window:
    """The last ``size`` readings with running integer sums for an O(1) least-squares slope."""

    __slots__ = ("k0", "size", "sky", "sy", "ys")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ys: collections.deque[int] = collections.deque()
        self.k0 = 0  # index of the oldest reading
        self.sy = 0
        self.sky = 0

    def __len__(self) -> int:
        return len(self.ys)

    def push(self, y: int) -> None:
        self.sy += y
        self.sky += (self.k0 + len(self.ys)) * y
        self.ys.append(y)
        if len(self.ys) > self.size:
            old = self.ys.popleft()
            self.sy -= old
            self.sky -= self.k0 * old
            self.k0 += 1

    def ols_slope(self) -> float:
        """The least-squares slope, exact (integer sums); 0 for fewer than two readings."""
        n = len(self.ys)
        if n < 2:
            return 0.0
        sk = n * self.k0 + n * (n - 1) // 2
        return (n * self.sky - sk * self.sy) / (n * n * (n * n - 1) / 12)

    def clear(self) -> None:
        self.ys.clear()
        self.k0 = self.sy = self.sky = 0
