"""The search alone, against peak-memory curves written down (no device, no timing)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vramctl.fit._search import Probe, Search, scaled

MB = 2**20
CAPACITY = 1000 * MB
BUDGET = 900 * MB
HELD = 100 * MB  # weights and optimizer state, held before every probe


def run(
    peak: Callable[[int], int],
    first: int,
    *,
    hint: float | None = None,
    tolerance: float = 0.0,
    upper: int | None = None,
    limit: int = 12,
) -> tuple[int, list[int]]:
    """Drive a Search as fit_batch_size does; an OOM is a peak past the capacity."""
    s = Search(BUDGET, upper, hint, tolerance)
    b: int | None = first
    while b is not None and len(s.probes) < limit:
        p = peak(b)
        s.probes.append(
            Probe(b, None, False, HELD, CAPACITY + 1)
            if p > CAPACITY
            else Probe(b, p, p <= BUDGET, HELD)
        )
        b = s.next()
    return s.lo, [p.batch_size for p in s.probes]


def truth(peak: Callable[[int], int]) -> int:
    b = 0
    while peak(b + 1) <= BUDGET:
        b += 1
    return b


def affine(fixed: int, per: int) -> Callable[[int], int]:
    return lambda b: HELD + fixed + per * b


@pytest.mark.parametrize("first", [20, 100, 150, 190])
def test_affine_from_below_is_exact_in_3_probes(first: int) -> None:
    peak = affine(50 * MB, 4 * MB)  # answer 187
    best, probes = run(peak, first)
    assert best == truth(peak) == 187
    assert len(probes) <= 3


def test_the_scaled_guess_from_one_point_fits() -> None:
    for fixed in (0, 10 * MB, 200 * MB, 600 * MB):
        for first in (1, 5, 40):
            peak = affine(fixed, 1 * MB)
            s = Search(BUDGET, None, None)
            p = peak(first)
            if p > BUDGET:
                continue
            s.probes.append(Probe(first, p, True, HELD))
            nxt = s.next()
            assert nxt is None or peak(nxt) <= BUDGET


def test_an_oom_above_steps_down_then_back_up() -> None:
    peak = affine(50 * MB, 4 * MB)
    best, probes = run(peak, 400)  # 400 needs 1750 MB: an OOM, nothing measured
    assert best == 187
    assert probes[0] == 400 and len(probes) <= 4


def test_a_measured_miss_steps_down_safely() -> None:
    peak = affine(50 * MB, 4 * MB)
    best, probes = run(peak, 205)  # 970 MB: over the budget, under the capacity
    assert best == 187
    assert len(probes) <= 3


def test_a_kink_is_found_by_bracketing() -> None:
    """Small batches peak in the optimizer step, large ones in the backward."""

    def peak(b: int) -> int:
        return HELD + max(500 * MB + b * MB // 10, 20 * MB + 5 * MB * b)

    best, _ = run(peak, 2, limit=16)
    assert best == truth(peak)


def test_tolerance_saves_a_probe_close_to_the_answer() -> None:
    peak = affine(2 * MB, MB // 4)  # answer 3192
    best, probes = run(peak, 3000, tolerance=0.01)
    exact, exact_probes = run(peak, 3000)
    assert exact == truth(peak)
    assert best >= 0.99 * exact
    assert len(probes) < len(exact_probes)


def test_upper_and_nothing_fits() -> None:
    peak = affine(50 * MB, 4 * MB)
    assert run(peak, 100, upper=120) == (120, [100, 120])
    assert run(peak, 120, upper=120) == (120, [120])
    huge = affine(2000 * MB, MB)
    best, probes = run(huge, 64)
    assert best == 0 and probes[-1] == 1


def test_a_flat_stretch_between_two_fits_halves_the_gap_to_a_known_miss() -> None:
    """The caching allocator makes the peak a staircase: two fitting probes with the same
    peak say nothing about the next step up, so between them and a known miss the search
    halves the gap (where no miss is known it scales up from the larger fit, as before)."""
    s = Search(budget=1000, upper=None, slope_hint=None)
    s.probes += [Probe(73, 500, True, 100), Probe(144, None, False, 100)]
    s.probes += [Probe(108, 900, True, 100), Probe(110, 900, True, 100)]
    assert s.next() == (110 + 144) // 2
    t = Search(budget=1000, upper=None, slope_hint=None)
    t.probes += [Probe(108, 900, True, 100), Probe(110, 900, True, 100)]
    assert t.next() == scaled(t.at(110), 1000)
