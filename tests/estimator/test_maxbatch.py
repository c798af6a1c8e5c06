"""max_batch_size's searches: lengths without a limit, and sizes too big to trace."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

import vramctl
from vramctl.estimator import EstimateError
from vramctl.estimator._maxbatch import LENGTH_BOUND, _confirm, _search_length

BUDGET = 10**9


def fake_at(
    peak: Callable[[float], float], untraceable_above: float | None = None
) -> tuple[Callable[..., Any], list[float]]:
    """An ``at(batch, length)`` whose traces follow ``peak`` of the length (or, with no
    length, of the batch size); the sizes it was asked for."""
    asked: list[float] = []

    def at(b: int, n: float | None = None) -> Any:
        x = b if n is None else n
        asked.append(x)
        if untraceable_above is not None and x > untraceable_above:
            raise EstimateError(f"could not trace the model: {x} is too long")
        p = int(peak(x))
        return SimpleNamespace(peak_device=p, fits=p <= BUDGET, headroom=BUDGET - p)

    return at, asked


def test_length_without_a_limit_is_searched_not_overflowed() -> None:
    # lstm has no max_length: its ceiling was infinity, and rounding it overflowed.
    at, asked = fake_at(lambda n: 10**8 + 4000 * n)  # fits up to 225,000 tokens
    n, curve, at_ceiling = _search_length("lstm", "seq_len", at, BUDGET)
    assert isinstance(n, int) and not at_ceiling
    assert n <= 225_000 < n * 1.05
    assert (n, 10**8 + 4000 * n, True) in curve
    assert len(set(asked)) < 20


def test_length_that_always_fits_stops_at_the_bound_and_says_so() -> None:
    at, asked = fake_at(lambda n: 10**8)
    n, _curve, at_ceiling = _search_length("lstm", "seq_len", at, BUDGET)
    assert n == LENGTH_BOUND["seq_len"] and at_ceiling
    assert len(set(asked)) < 30
    # wav2vec2-base has no limit either: its bound is in seconds.
    at, _ = fake_at(lambda s: 10**8)
    s, _curve, at_ceiling = _search_length("wav2vec2-base", "seconds", at, BUDGET)
    assert s == LENGTH_BOUND["seconds"] and at_ceiling


def test_length_too_long_to_trace_does_not_fit() -> None:
    # Everything that traces fits; past 61 s the trace fails (as a long CTC loss does).
    at, _ = fake_at(lambda s: 10**8 + 1000 * s * s, untraceable_above=61.0)
    s, curve, at_ceiling = _search_length("wav2vec2-base", "seconds", at, BUDGET)
    assert 58.0 <= s <= 61.0 and not at_ceiling
    assert all(x <= 61.0 for x, _p, _f in curve)


def test_length_that_cannot_be_traced_at_its_shortest_is_an_error() -> None:
    at, _ = fake_at(lambda s: 10**8, untraceable_above=0.5)
    with pytest.raises(EstimateError, match="could not trace"):
        _search_length("wav2vec2-base", "seconds", at, BUDGET)


def test_length_that_does_not_fit_at_its_shortest_is_zero() -> None:
    at, _ = fake_at(lambda n: 2 * BUDGET)
    n, _curve, at_ceiling = _search_length("lstm", "seq_len", at, BUDGET)
    assert n == 0 and not at_ceiling


def test_length_with_a_limit_stops_at_it() -> None:
    at, asked = fake_at(lambda n: 10**8)
    n, _curve, at_ceiling = _search_length("gpt2", "seq_len", at, BUDGET)
    assert n == 1024 and at_ceiling and max(asked) == 1024


def test_batch_too_big_to_trace_does_not_fit() -> None:
    at, _ = fake_at(lambda b: 10**8 + 10**6 * b, untraceable_above=50)
    assert _confirm(at, 500, 1 << 16, 10**6, [1, 2, 4]) == 50


def test_max_length_of_a_model_without_a_limit() -> None:
    res = vramctl.max_batch_size("lstm", device="2GiB", mode="infer", lengths=True)
    assert res.length_arg == "seq_len" and not res.length_at_ceiling
    assert isinstance(res.max_length, int) and res.max_length > 256
    fits = [n for n, _p, f in res.length_curve if f]
    assert max(fits) == res.max_length
    assert any(not f and n <= res.max_length * 1.05 + 1 for n, _p, f in res.length_curve)
    assert res.to_dict()["length_at_ceiling"] is False
